"""Crash-safe checkpoints of a DeepSpeed run: saving, finding the newest intact one, loading.

A checkpoint is a folder `step_00000100/` with a manifest `meta.json`, assembled as `step_N.tmp`, renamed,
then named by `latest`. With the sharded optimizer its files are layout-free (resumed on any world and EP
size), otherwise per-rank (same layout only). The file I/O is `files.py`'s, re-exported here.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..schema import Section, need, non_negative_int, positive_int
from .files import (  # noqa: F401  (atomic_save, file_record, write_text_atomic: re-exported)
    LATEST,
    CheckpointError,
    CheckpointWriter,
    atomic_save,
    barrier,
    copy_to_cpu,
    file_record,
    load,
    verify,
    write_text_atomic,
)
from .rng import numpy_array_types, rng_state, set_rng_state

STEP_PREFIX = "step_"


def saved_layout(meta: dict[str, Any]) -> tuple[int, int, int, int]:
    """(ranks, EP, PP, TP sizes) from a manifest; older ones lack PP and TP (1)."""
    return meta["world_size"], meta.get("ep_size", 1), meta.get("pp_size", 1), meta.get("tp_size", 1)


def describe_layout(world: int, ep: int, pp: int, tp: int = 1) -> str:
    """'8 ranks (PP 2 x TP 2 x EP 2)', '2 ranks (EP 2)', '1 rank'."""
    parts = [f"PP {pp}"] * (pp > 1) + [f"TP {tp}"] * (tp > 1) + [f"EP {ep}"] * (ep > 1)
    return f"{world} rank{'s' * (world != 1)}" + (f" ({' x '.join(parts)})" if parts else "")


class CollectiveCheckpointError(CheckpointError):
    """A CheckpointError raised alike on every rank, so the command lines print it once."""

    every_rank = True


MANIFEST_KEYS = ("step", "world_size", "ep_size")  # what `load` reads from a manifest, in both formats
# The model's config and tokenizer (rank 0), so that a checkpoint exports as a Hugging Face folder on
# its own (`ds_optimus.evaluate`), without the run's config or the library's defaults of the day.
MODEL_FILE = "model_config.pt"


def model_record(config, tokenizer=None) -> dict[str, Any]:
    """`MODEL_FILE`'s contents: the config dict, and the tokenizer's JSON and special tokens."""
    record: dict[str, Any] = {"config": config.to_dict()}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        record["tokenizer"] = {"json": backend.to_str(), "special_tokens": special}
    return record


def consolidated_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict from checkpoint folder `path`, parts joined, on the CPU; no process group."""
    from ..parallel.tensor_parallel import Split, join_parts
    from .model_files import grouped, read_weights

    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    engine_format = str(meta.get("format", "")).startswith("ds_optimus.checkpoint/")
    files = sorted(meta.get("files", ()))
    if not engine_format:
        state = load(path / "model.pt", mmap=True)
        shards = [
            load(path / f"experts_ep{q:03d}.pt", mmap=True)
            for q in range(meta["ep_size"])
            if (path / f"experts_ep{q:03d}.pt").exists()
        ]
    else:  # one file per pipeline stage, or its parts
        state, _ = read_weights(path, [f for f in files if f.startswith("model_dense")])
        shards = [
            shard
            for q in range(meta["ep_size"])
            if (shard := read_weights(path, [f for f in files if f.startswith(f"model_experts_ep{q:03d}")])[0])
        ]
        parts: dict[str, list] = {}
        for group in grouped(files, "model_tensor").values():  # each TP rank's parts of the split weights
            weights, saved = read_weights(path, group)
            for name, tensor in weights.items():
                full, dim, start, stop = saved["splits"][name]
                parts.setdefault(name, []).append((Split(tuple(full), dim, start, stop), tensor))
        state.update(
            {name: join_parts(pieces, 0, pieces[0][0].full[pieces[0][0].dim]) for name, pieces in parts.items()}
        )
    for name in shards[0] if shards else ():
        state[name] = torch.cat([shard[name] for shard in shards])
    return state


COLD = "cold"  # the folder of the model-only checkpoints kept for good (`checkpoint.keep_every`)


def cold_name(step: int, tokens: int) -> str:
    """'step1000-tokens6B' (tokens rounded to B; M or K below a billion)."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= size:
            return f"step{step}-tokens{round(tokens / size)}{unit}"
    return f"step{step}-tokens{tokens}"


def step_of(folder: Path) -> int:
    """The step of a checkpoint folder (`step_<n>`)."""
    return int(folder.name[len(STEP_PREFIX) :])


def _sharded(engine) -> bool:
    from ..optim.sharded import ShardedOptimizer

    return isinstance(engine.optimizer, ShardedOptimizer)


def trained_without_checkpoint(output_dir: str | Path, directory: str | Path) -> str | None:
    """Why a fresh start in `output_dir` is refused (its run saved a checkpoint `directory` lacks), else None."""
    try:
        progress = json.loads((Path(output_dir) / "progress.json").read_text())
        step, last = int(progress["step"]), progress.get("checkpoint")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not last or any((p / "meta.json").exists() for p in CheckpointManager(directory).step_folders()):
        return None
    return (
        f"{output_dir} holds a run trained to step {step}, its last checkpoint {last}, but {directory} has no "
        "complete checkpoint to resume from; refusing to start over (its metrics would be rewritten): point "
        "optimus.checkpoint.dir at its checkpoints, give another optimus.train.output_dir, or remove the folder "
        "to start over"
    )


class CheckpointManager:
    """Saves and finds an engine's checkpoints in `directory`."""

    def __init__(
        self, directory: str | Path, keep_last: int = 2, groups=None, min_part_bytes: int | None = None
    ) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.min_part_bytes = min_part_bytes  # staggered model files (`model_files`); None: each by one rank
        self.groups = groups  # ExpertParallelGroups, or None without expert parallelism
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.ep_size = groups.ep_size if groups is not None else 1
        self.writer = CheckpointWriter(self.rank, self.world_size)
        self.layout_note: str | None = None  # what the last load says of a checkpoint saved on another layout
        self.model_record: dict[str, Any] | None = None  # `model_record(...)`: rank 0 saves it as MODEL_FILE
        self.keep_for_now: set[Path] = set()  # not pruned while something still reads them (rank 0)

    # -- finding ----------------------------------------------------------------------------------

    def step_folders(self) -> list[Path]:
        """Every `step_N` folder here, complete or not, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX) :].isdigit()
        ]
        return sorted(found, key=step_of)

    def complete(self) -> list[Path]:
        """Complete checkpoint folders (those with a manifest), oldest first."""
        return [p for p in self.step_folders() if (p / "meta.json").exists()]

    def has_checkpoints(self) -> bool:
        """Whether rank 0 sees a complete checkpoint here (collective)."""
        found = [bool(self.complete()) if self.rank == 0 else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def candidates(self) -> list[Path]:
        """Complete checkpoints, newest first; a `latest` rewound by hand keeps only it and older."""
        # A crash between the rename and `latest` leaves `latest` behind a complete checkpoint: not obeyed.
        done = self.complete()[::-1]
        named = self._rewound_to(done)
        return [p for p in done if step_of(p) <= step_of(named)] if named is not None else done

    def _rewound_to(self, done: list[Path]) -> Path | None:
        """The checkpoint `latest` names if written after every newer manifest, else None."""
        try:
            named = self.directory / (self.directory / LATEST).read_text().strip()
            written = (self.directory / LATEST).stat().st_mtime
            newer = [
                json.loads((p / "meta.json").read_text()).get("time", 0) for p in done if step_of(p) > step_of(named)
            ]
        except (OSError, ValueError):
            return None
        return named if named in done and newer and written > max(newer) else None

    def passed_over(self, candidates: list[Path]) -> list[str]:
        """A note on each thing `candidates` passes over (newer folders without a manifest, a bad or stale `latest`)."""
        best = candidates[0] if candidates else None
        notes, reported = [], set()
        for folder in reversed(self.step_folders()):
            if not (folder / "meta.json").exists() and (best is None or step_of(folder) > step_of(best)):
                then = f"falling back to {best.name}" if best else "no complete checkpoint is left to fall back to"
                notes.append(f"checkpoint {folder.name} has no manifest meta.json (an interrupted save?); {then}")
                reported.add(folder.name)
        try:
            named = (self.directory / LATEST).read_text().strip()
        except OSError:  # no `latest` (the first save had not got that far): nothing named, nothing missed
            return notes
        if named in reported or (best is not None and self.directory / named == best):
            if best is not None and self.directory / named == best and self._rewound_to(self.complete()[::-1]):
                newer = [p.name for p in self.complete() if step_of(p) > step_of(best)]
                notes.append(
                    f"latest names {named}, set after {', '.join(newer)} (rewound by hand?): resuming from "
                    f"{named} as it says; the newer checkpoints are overwritten as the run gets there again"
                )
            return notes
        then = f"using {best.name}" if best else "no complete checkpoint is left"
        folder = self.directory / named
        if folder in candidates:
            notes.append(
                f"latest names {named}, but {best.name} is newer and complete (latest was behind: a "
                f"save interrupted before latest was updated); using {best.name}"
            )
            return notes
        if folder.is_dir() and not (folder / "meta.json").exists():
            why = "has no manifest meta.json (an interrupted save?)"
        elif (self.directory / f"{named}.corrupt").is_dir():
            why = f"was set aside as damaged ({named}.corrupt)"
        elif not folder.exists():
            why = "is missing"
        else:
            why = "is not a complete checkpoint"
        notes.append(f"latest names {named}, which {why}; {then}" if named else f"latest is empty; {then}")
        return notes

    def latest_good(self, report: Callable[[str], None] = print) -> Path | None:
        """The newest intact checkpoint by rank 0's view (collective), damaged ones renamed `<name>.corrupt`;
        None without checkpoints, CheckpointError if none is intact."""
        notes: list[str] = []
        listed: list[Any] = [None]
        if self.rank == 0:
            candidates = self.candidates()
            notes = self.passed_over(candidates)
            set_aside = sorted(p.name for p in self.directory.glob(f"{STEP_PREFIX}*.corrupt"))
            listed = [([str(p) for p in candidates], notes or set_aside)]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(listed, src=0)
        candidates, traces = [Path(p) for p in listed[0][0]], listed[0][1]
        for note in notes:
            report(note)
        if not candidates and traces:
            # Checkpoints were here and none is usable: starting afresh would silently lose the run
            # (a restart after the refusal below would otherwise do just that).
            raise CollectiveCheckpointError(
                f"no intact checkpoint is left in {self.directory} "
                f"({'; '.join(traces)}); move the folder away to start over"
            )
        problems = []
        for path in candidates:
            problem = verify(path, self.rank, self.world_size, required=MANIFEST_KEYS)
            if problem is None:
                return path
            problems.append(f"{path.name}: {problem}")
            if self.rank == 0:
                report(f"checkpoint {path.name} is damaged: {problem}; falling back to the previous one")
            barrier()  # every rank is done reading it
            if self.rank == 0:
                shutil.rmtree(path.with_name(path.name + ".corrupt"), ignore_errors=True)
                os.replace(path, path.with_name(path.name + ".corrupt"))
        if candidates:
            raise CollectiveCheckpointError(
                f"none of the {len(candidates)} checkpoints in {self.directory} is "
                f"intact ({'; '.join(problems)}); move them away to start over"
            )
        return None

    # -- saving -----------------------------------------------------------------------------------

    def _expert_names(self, model: torch.nn.Module) -> set[str]:
        from ..parallel.expert_parallel import is_expert_param

        if self.groups is None:
            return set()
        return {name for name, p in model.named_parameters() if is_expert_param(p)}

    def save(
        self,
        step: int,
        engine,
        extra: dict[str, Any] | None = None,
        background: bool = False,
        manifest: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint `step` and prune old ones (collective); `background`: in a thread, one save in flight."""
        self.wait()
        name = f"{STEP_PREFIX}{step:08d}"
        self.writer.prepare(self.directory, name)
        client = {"rng": rng_state(), "extra": extra or {}}
        if _sharded(engine):
            from . import optimizer_state as checkpointing

            files, meta, about = checkpointing.checkpoint_files(
                engine, self.groups, client, copy=background, min_part_bytes=self.min_part_bytes
            )
            meta["tag"] = name
        else:
            (files, meta), about = self._per_rank_files(engine, client, copy=background), None
        meta["step"] = step
        meta.update(manifest or {})
        if self.rank == 0 and self.model_record is not None:
            files[MODEL_FILE] = self.model_record
        try:
            self.writer.write(self.directory, name, files, meta, background=background, keep=self._prune, about=about)
        except CheckpointError as err:  # gathered from every rank: the same on each
            raise CollectiveCheckpointError(str(err)) from None
        return self.directory / name

    def save_cold(self, step: int, engine, tokens: int) -> Path:
        """Write the model-only checkpoint `cold/step{step}-tokens{T}` (collective); never pruned or resumed."""
        from .optimizer_state import layout_meta, model_files

        root, name = self.directory / COLD, cold_name(step, tokens)
        writer = CheckpointWriter(self.rank, self.world_size)  # its own: a full save may be in flight
        writer.prepare(root, name)
        files, about = model_files(engine, self.groups, min_part_bytes=self.min_part_bytes)
        if self.rank == 0 and self.model_record is not None:
            files[MODEL_FILE] = self.model_record
        meta = {**layout_meta(engine, self.groups), "step": step, "tokens": tokens, "model_only": True, "tag": name}
        try:
            writer.write(root, name, files, meta, save_latest=False, about=about)
        except CheckpointError as err:
            raise CollectiveCheckpointError(str(err)) from None
        return root / name

    def wait(self) -> None:
        """Finish the save in flight (collective); raises its failure on every rank."""
        try:
            self.writer.wait()
        except CheckpointError as err:
            raise CollectiveCheckpointError(str(err)) from None

    def _per_rank_files(self, engine, client: dict, copy: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        from .engine_state import engine_state

        model = engine.module
        state = model.state_dict()
        experts = self._expert_names(model)
        files: dict[str, Any] = {}
        if self.rank == 0:
            files["model.pt"] = {k: v for k, v in state.items() if k not in experts}
        if experts and self.rank == self.groups.edp_ranks[0]:
            files[f"experts_ep{self.groups.ep_rank:03d}.pt"] = {k: v for k, v in state.items() if k in experts}
        files[f"rank{self.rank:05d}.pt"] = {"engine": engine_state(engine), **client}
        if copy:
            files = copy_to_cpu(files)
        return files, {"world_size": self.world_size, "ep_size": self.ep_size}

    def _prune(self, root: Path) -> None:
        for old in self.complete()[: -self.keep_last]:
            if old not in set(self.keep_for_now):
                shutil.rmtree(old, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------------

    def load(self, path: str | Path, engine) -> tuple[int, dict[str, Any]]:
        """Restore model, optimizer, scheduler, counters and RNG from `path`; returns (step, extra state)."""
        from .engine_state import load_engine_state

        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path} is not a complete checkpoint ({err})") from None
        engine_format = meta.get("format", "").startswith("ds_optimus.checkpoint/")
        if engine_format != _sharded(engine):
            raise CheckpointError(
                f"{path} was saved {'with' if engine_format else 'without'} the sharded optimizer; "
                f"set optimus.sharded_optimizer.enabled to {str(engine_format).lower()} to resume it"
            )
        if engine_format:
            from . import optimizer_state as checkpointing

            client = checkpointing.load_folder(engine, path, self.groups, meta=meta)  # errors: CheckpointErrors
            if meta["world_size"] == self.world_size:  # on another layout the generators stay as seeded
                set_rng_state(client["rng"])
            pipeline = checkpointing.pipeline_of(engine, self.groups)
            tensor = getattr(self.groups, "tensor", None)
            now = (
                self.world_size,
                self.ep_size,
                self.world_size // len(pipeline.stage_ranks) if pipeline else 1,
                tensor.size if tensor is not None else 1,
            )
            saved = saved_layout(meta)
            self.layout_note = (
                None
                if saved == now
                else (
                    f"the checkpoint was saved by {describe_layout(*saved)}; resumed by {describe_layout(*now)}, "
                    "its state resharded"
                    + (
                        ""
                        if saved[0] == now[0]
                        else "; the random generators start from the "
                        "run's seed (dropout and sampling draw other numbers than before)"
                    )
                )
            )
            return step_of(path), client["extra"]
        if (meta["world_size"], meta["ep_size"]) != (self.world_size, self.ep_size):
            raise CheckpointError(
                f"{path} was saved by {describe_layout(*saved_layout(meta))}; this run has "
                f"{describe_layout(self.world_size, self.ep_size, 1)} (resuming on another layout needs the sharded "
                "optimizer: optimus.sharded_optimizer.enabled)"
            )
        from .engine_state import engine_state_types

        # This rank's own file first: one that is refused leaves the model untouched.
        own = load(path / f"rank{self.rank:05d}.pt", allow=[*engine_state_types(), *numpy_array_types()])
        model = engine.module
        state = load(path / "model.pt")
        if self._expert_names(model):
            state.update(load(path / f"experts_ep{self.groups.ep_rank:03d}.pt"))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0]
            raise CheckpointError(f"{path} does not fit this model ({first}); was the model config changed?") from None
        load_engine_state(engine, own["engine"])
        set_rng_state(own["rng"])
        return meta["step"], own["extra"]


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """`optimus.checkpoint`: when to save, how many to keep, where, and whether to resume."""

    interval: int = 0  # every N steps, and always at the end; 0: only at the end
    # false: no checkpoint at all, not even at the end or before a stop (throughput measurements,
    # where writing the optimizer state costs more than the steps); a crash then loses the run
    enabled: bool = True
    keep_last: int = 2  # checkpoints kept; older ones are deleted (never one still to be evaluated)
    dir: str | None = None  # where checkpoints go; null: <train.output_dir>/checkpoints
    resume: bool = True  # continue from the latest complete checkpoint in dir, if there is one
    async_save: bool = False  # write checkpoints in a background thread while training goes on
    # every this many steps also a model-only checkpoint <dir>/cold/step{step}-tokens{T}B (M, K below a
    # billion), never pruned (the seed's "cold" checkpoints: the run's history, each exported by `python -m
    # ds_optimus.evaluate.export` and scored by `ds_optimus.evaluate`); 0: none
    keep_every: int = 0
    # each model file written in parts by the ranks that hold it (each a share, none under min_part_mib),
    # not whole by the first of them (`checkpoint.model_files`)
    stagger_writes: bool = True
    min_part_mib: int = 256  # the smallest part a staggered model file is cut into, in MiB

    def check(self, where: str) -> None:
        for key in ("interval", "keep_every"):
            need(
                non_negative_int(getattr(self, key)),
                f"{where}.{key} must be an integer >= 0, got {getattr(self, key)!r}",
            )
        need(positive_int(self.keep_last), f"{where}.keep_last must be a positive integer, got {self.keep_last!r}")
        need(
            positive_int(self.min_part_mib),
            f"{where}.min_part_mib must be a positive integer, got {self.min_part_mib!r}",
        )

    def build(self, output_dir: str | Path, groups=None) -> CheckpointManager:
        """The run's checkpoint manager (`dir`, or `<output_dir>/checkpoints`); collective-free."""
        return CheckpointManager(
            self.dir or Path(output_dir) / "checkpoints",
            self.keep_last,
            groups,
            self.min_part_mib * 2**20 if self.stagger_writes else None,
        )
