"""Atomic per-rank checkpoints of a DeepSpeed training run, with expert-parallel models.

A checkpoint is a folder `step_00000100/` in the checkpoint directory (on a file system every rank
sees):

    model.pt              dense weights and buffers (written by rank 0)
    experts_ep000.pt ...  each EP rank's expert shard (written by the first replica of that shard)
    rank00000.pt ...      each rank's optimizer partition, LR scheduler, engine counters, RNG
                          states and the caller's extra state (the data loader's position)
    meta.json             step, layout and file list, written last

Every file is written under a temporary name and renamed; the folder itself is assembled as
`step_N.tmp` and renamed by rank 0 after every rank has finished (stale `.tmp` folders of a crash
are removed by the next save). A crash at any point leaves either the previous checkpoints or a
complete new one, never a folder that looks complete and is not. Loading needs the same world
size and EP size as saving.

With the EP-aware sharded optimizer (`optimus.sharded_optimizer`), a checkpoint is instead the
engine's own (`ds_optimus.optim.checkpointing`: weights and optimizer state named by parameter and
element range, not by rank), with the RNG states and the caller's extra state as client state; it
resumes on any world size and EP size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run; the message says why, in one line."""


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from, on this rank."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    accelerator = _accelerator()
    if accelerator is not None:
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    accelerator = _accelerator()
    if accelerator is not None and "accelerator" in state:
        accelerator.set_rng_state(state["accelerator"])


def _accelerator():
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator


def atomic_save(obj: Any, path: Path) -> None:
    """`torch.save` to a temporary name, fsync, then rename: `path` is complete or absent."""
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sharded(engine) -> bool:
    from ..optim.sharded import ShardedOptimizer

    return isinstance(engine.optimizer, ShardedOptimizer)


class CheckpointManager:
    """Save and find checkpoints of `engine` (whose module may be expert-parallel) in `directory`."""

    def __init__(self, directory: str | Path, keep_last: int = 2, groups=None) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.groups = groups  # ExpertParallelGroups, or None without expert parallelism
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.ep_size = groups.ep_size if groups is not None else 1

    # -- finding ----------------------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()
                 and (p / "meta.json").exists()]
        return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[-1] if done else None

    def latest_agreed(self) -> Path | None:
        """Rank 0's `latest()`, on every rank (so no rank resumes from a different step because its
        view of the directory differs)."""
        choice = [str(self.latest()) if self.rank == 0 and self.latest() is not None else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] is not None else None

    # -- saving -----------------------------------------------------------------------------------

    def _expert_names(self, model: torch.nn.Module) -> set[str]:
        from ..parallel.expert_parallel import is_expert_param

        if self.groups is None:
            return set()
        return {name for name, p in model.named_parameters() if is_expert_param(p)}

    def save(self, step: int, engine, extra: dict[str, Any] | None = None) -> Path:
        """Write checkpoint `step` (collective: every rank calls it) and prune old ones."""
        from ..optim.deepspeed_compat import engine_state

        model = engine.module
        final = self.directory / f"{STEP_PREFIX}{step:08d}"
        tmp = self.directory / f"{final.name}.tmp"
        if self.rank == 0:
            for stale in self.directory.glob(f"{STEP_PREFIX}*.tmp"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
            if not _sharded(engine):
                tmp.mkdir(parents=True)
        _barrier()
        if _sharded(engine):
            from ..optim import checkpointing

            checkpointing.save_checkpoint(engine, self.directory, tag=final.name, save_latest=False,
                                          client_state={"rng": rng_state(), "extra": extra or {}})
            self._prune()
            return final
        state = model.state_dict()
        experts = self._expert_names(model)
        if self.rank == 0:
            atomic_save({k: v for k, v in state.items() if k not in experts}, tmp / "model.pt")
        if experts and self.rank == self.groups.edp_ranks[0]:
            atomic_save({k: v for k, v in state.items() if k in experts},
                        tmp / f"experts_ep{self.groups.ep_rank:03d}.pt")
        atomic_save({"engine": engine_state(engine), "rng": rng_state(), "extra": extra or {}},
              tmp / f"rank{self.rank:05d}.pt")
        _barrier()
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size, "ep_size": self.ep_size, "time": time.time(),
                    "files": sorted(p.name for p in tmp.iterdir())}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        self._prune()
        return final

    def _prune(self) -> None:
        if self.rank == 0:
            for old in self.complete()[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()

    # -- loading ----------------------------------------------------------------------------------

    def load(self, path: str | Path, engine) -> tuple[int, dict[str, Any]]:
        """Restore model, optimizer, scheduler, counters and RNG from `path` on every rank; returns
        (step, the extra state saved with it)."""
        from ..optim.deepspeed_compat import load_engine_state

        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path} is not a complete checkpoint ({err})") from None
        engine_format = meta.get("format", "").startswith("ds_optimus.checkpoint/")
        if engine_format != _sharded(engine):
            raise CheckpointError(f"{path} was saved {'with' if engine_format else 'without'} the sharded optimizer; "
                                  f"set optimus.sharded_optimizer.enabled to {str(engine_format).lower()} to resume it")
        if engine_format:
            from ..optim import checkpointing

            try:
                _, client = checkpointing.load_checkpoint(engine, self.directory, tag=path.name)
            except checkpointing.CheckpointLoadError as err:
                raise CheckpointError(str(err)) from None
            if meta["world_size"] == self.world_size:  # on another layout the generators stay as seeded
                set_rng_state(client["rng"])
            return int(path.name[len(STEP_PREFIX):]), client["extra"]
        if (meta["world_size"], meta["ep_size"]) != (self.world_size, self.ep_size):
            raise CheckpointError(
                f"{path} was saved by {meta['world_size']} ranks at EP {meta['ep_size']}; this run has "
                f"{self.world_size} ranks at EP {self.ep_size} (resuming on another layout is not supported)")
        model = engine.module
        state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        if self._expert_names(model):
            state.update(torch.load(path / f"experts_ep{self.groups.ep_rank:03d}.pt", map_location="cpu",
                                    weights_only=True))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0]
            raise CheckpointError(f"{path} does not fit this model ({first}); was the model config changed?") from None
        own = torch.load(path / f"rank{self.rank:05d}.pt", map_location="cpu", weights_only=False)
        load_engine_state(engine, own["engine"])
        set_rng_state(own["rng"])
        return meta["step"], own["extra"]
