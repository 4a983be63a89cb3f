"""The sharded optimizer's saved state: one rank's shard, named so that any layout can load it.

A rank's state lists, per space, *pieces*: (parameter name, first element in the full unsharded
parameter, length, position in the saved shard) with the saved fp32 master weights and Adam moments.
Loading intersects the pieces of the saved ranks with the runs this rank now owns, so a checkpoint
written on one data/expert-parallel layout resumes on another (pure PyTorch).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .spaces import ShardedOptimizerError, Space

STATE_FORMAT = "ds_optimus.sharded/1"
MOMENTS = ("master", "exp_avg", "exp_avg_sq")


def shard_state(spaces: list[Space]) -> list[dict[str, Any]]:
    """Per space, this rank's pieces and the tensors they index (on the CPU). With hybrid sharding only
    the first replica of a shard saves it (the others hold the same values): every element is saved once."""
    saved = []
    for space in spaces:
        if space.replica_rank > 0:
            saved.append({"key": space.key, "pieces": [], **{key: torch.zeros(0) for key in MOMENTS}})
            continue
        pieces = [(space.names[i], space.offsets[i] + start, length, pos) for i, start, length, pos in space.own_runs()]
        saved.append({"key": space.key, "pieces": pieces, **{key: getattr(space, key).cpu() for key in MOMENTS}})
    return saved


def held_ranges(state: dict[str, Any]) -> list[list]:
    """What a saved `state_dict()` holds, as [parameter name, first element, length] runs: the
    checkpoint manifest keeps them for every optimizer file, so a rank opens only the files it needs."""
    return [[name, start, length] for saved in state["spaces"] for name, start, length, _ in saved["pieces"]]


def files_holding(held: dict[str, list | None], spaces: list[Space]) -> list[str]:
    """The files of `held` ({file: its `held_ranges`, or None where a manifest predates them}) that hold
    some element of this rank's shard; every file when one is unknown. At 12,288 ranks a rank then
    opens the one to few files its elements came from, instead of all 12,288."""
    if any(runs is None for runs in held.values()):
        return list(held)
    wanted = _wanted(spaces)
    return [file for file, runs in held.items()
            if any(lo < start + length and start < lo + n for name, start, length in runs
                   for lo, n, _, _ in wanted.get(name, ()))]


def _wanted(spaces: list[Space]) -> dict[str, list[tuple[int, int, Space, int]]]:
    # this rank's runs by parameter: (first element in the full parameter, length, space, position)
    wanted: dict[str, list[tuple[int, int, Space, int]]] = {}
    for space in spaces:
        for i, start, length, pos in space.own_runs():
            wanted.setdefault(space.names[i], []).append((space.offsets[i] + start, length, space, pos))
    return wanted


@torch.no_grad()
def load_spaces(spaces: list[Space], sources: Iterable[dict[str, Any]]) -> None:
    """Fill this rank's shard of every space from the saved states of any layout (every rank's, or
    at least those holding this rank's elements); a one-line error when some element is missing."""
    wanted = _wanted(spaces)
    covered = dict.fromkeys(wanted, 0)
    for source in sources:
        if source.get("format") != STATE_FORMAT:
            raise ShardedOptimizerError(f"not a sharded-optimizer state (format {source.get('format')!r})")
        for saved in source["spaces"]:
            for name, gstart, length, spos in saved["pieces"]:
                for wstart, wlength, space, pos in wanted.get(name, ()):
                    lo, hi = max(gstart, wstart), min(gstart + length, wstart + wlength)
                    if lo >= hi:
                        continue
                    src = slice(spos + lo - gstart, spos + hi - gstart)
                    dst = slice(pos + lo - wstart, pos + hi - wstart)
                    for key in MOMENTS:
                        getattr(space, key)[dst].copy_(saved[key][src])
                    covered[name] += hi - lo
    missing = [n for n, runs in wanted.items() if covered[n] != sum(r[1] for r in runs)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ShardedOptimizerError(f"the checkpoint has no optimizer state for {missing[0]}{more}; was the model "
                                    "changed?")


def restore_hyperparameters(param_groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """As torch's `load_state_dict` does, bring back the param groups' hyper-parameters (the
    learning rate an LR scheduler last set, ...): matched by group name, else by position; a group
    the checkpoint lacks (e.g. the expert group of an EP run resuming a run without EP) takes the
    learning rate of the first saved group."""
    by_name = {g.get("name"): g for g in saved_groups if g.get("name") is not None}
    for i, group in enumerate(param_groups):
        saved = by_name.get(group.get("name"))
        if saved is None and len(saved_groups) == len(param_groups) and not by_name:
            saved = saved_groups[i]
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            group.update({k: saved_groups[0][k] for k in ("lr", "initial_lr") if k in saved_groups[0]})
