"""Checkpoint file I/O: the leaf module stays a leaf, files load without running code, the file hooks,
and the damaged-checkpoint cases `latest_good` reports instead of passing over silently."""

from __future__ import annotations

import ast
import json
import os
import random
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

import ds_optimus.checkpoint.files as checkpoint_io
import ds_optimus.checkpoint.rng as rng_state_module
from ds_optimus.checkpoint import CheckpointManager
from ds_optimus.checkpoint.files import (
    CheckpointError,
    CheckpointWriter,
    atomic_save,
    load,
    verify,
)
from ds_optimus.checkpoint.rng import numpy_array_types, rng_state, set_rng_state

PLANTED = f"{os.system.__module__}.system"  # how pickle names os.system (posix.system here)


class _Planted:
    """Unpickled without restrictions, this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(path: Path, marker: Path) -> None:
    """Replace checkpoint file `path` by a pickle that would create `marker` when loaded, and make the
    folder's manifest agree with it (its size and checksum; what else it says of the file stays): only
    the unpickling itself can stop it."""
    record = atomic_save({"weights": torch.zeros(3), "payload": _Planted(marker)}, path)
    manifest = path.parent / "meta.json"
    meta = json.loads(manifest.read_text())
    meta["files"][path.name] = {**(meta["files"].get(path.name) or {}), **record}
    manifest.write_text(json.dumps(meta))


def refusal(path: Path) -> str:
    return f"{path} holds objects that are not plain tensors or containers ({PLANTED}); refusing to unpickle it"


def save(manager: CheckpointManager, step: int, files: dict | None = None) -> Path:
    name = f"step_{step:08d}"
    manager.writer.prepare(manager.directory, name)
    manager.writer.write(
        manager.directory,
        name,
        files or {"rank00000.pt": {"step": step}},
        {"step": step, "world_size": 1, "ep_size": 1},
    )  # what both formats record
    return manager.directory / name


# -- the leaf ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "leaf, expected",
    [
        (checkpoint_io, {"torch"}),
        (rng_state_module, {"torch", "numpy", "deepspeed"}),
    ],
)
def test_the_leaves_import_nothing_of_ds_optimus(leaf, expected):
    tree = ast.parse(Path(leaf.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):  # function bodies included
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import on line {node.lineno}"
            imported.add(node.module.split(".")[0])
    assert "ds_optimus" not in imported
    assert expected <= imported  # the walk saw the imports, inside functions too
    assert imported <= {
        "__future__",
        "collections",
        "json",
        "os",
        "pickle",
        "random",
        "re",
        "shutil",
        "threading",
        "time",
        "zlib",
        "pathlib",
        "typing",
        "numpy",
        "torch",
        "deepspeed",
    }


def test_file_hooks_see_every_file_with_its_step(tmp_path):
    writer = CheckpointWriter(0, 1)
    seen = []
    writer.file_hooks.append(lambda path, step: seen.append((path, step, path.stat().st_size)))
    files = {"a.pt": {"w": torch.arange(10.0)}, "b.pt": [1, 2]}
    writer.prepare(tmp_path, "step_00000003")
    writer.write(tmp_path, "step_00000003", files, {"step": 3})
    meta = json.loads((tmp_path / "step_00000003" / "meta.json").read_text())
    folder = tmp_path / "step_00000003.tmp"  # the hooks run while the folder is being assembled
    assert seen == [(folder / name, 3, meta["files"][name]["bytes"]) for name in ("a.pt", "b.pt")]

    seen.clear()
    writer.prepare(tmp_path, "step_00000004")
    writer.write(tmp_path, "step_00000004", files, {"step": 4}, background=True)
    writer.wait()
    assert [(p.name, step) for p, step, _ in seen] == [("a.pt", 4), ("b.pt", 4)]

    seen.clear()
    writer.prepare(tmp_path, "extra")
    writer.write(tmp_path, "extra", {"c.pt": {}}, None)  # no step in the meta
    assert [(p.name, step) for p, step, _ in seen] == [("c.pt", None)]

    def stop(path, step):
        raise RuntimeError(f"stopped after {path.name} of step {step}")

    writer.file_hooks.append(stop)  # a hook that raises fails the save, as a failed write does
    writer.prepare(tmp_path, "step_00000005")
    expected = (
        r"^saving checkpoint step_00000005 failed \(rank 0: RuntimeError: stopped after a.pt of step 5\); "
        r"the previous checkpoints are untouched$"
    )
    with pytest.raises(CheckpointError, match=expected):
        writer.write(tmp_path, "step_00000005", files, {"step": 5})
    assert not (tmp_path / "step_00000005").exists() and (tmp_path / "latest").read_text() == "extra"
    assert CheckpointManager(tmp_path).writer.file_hooks == []  # the manager's writer, for hooks to be added


# -- loading without running code -------------------------------------------------------------------


def test_a_planted_pickle_is_refused_in_one_line_and_does_not_run(tmp_path):
    path, marker = tmp_path / "client_rank00000.pt", tmp_path / "planted_ran"
    atomic_save({"weights": torch.zeros(3), "payload": _Planted(marker)}, path)
    with pytest.raises(CheckpointError) as caught:
        load(path)
    assert str(caught.value) == refusal(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: unpickled without restrictions, the payload runs
    assert marker.exists()

    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"^\S+garbage.pt cannot be read \(UnpicklingError: [^\n]+\)$"):
        load(tmp_path / "garbage.pt")
    with pytest.raises(CheckpointError, match=r"^\S+absent.pt cannot be read \(\[Errno 2\] No such file"):
        load(tmp_path / "absent.pt")


def test_rng_state_is_saved_as_plain_tensors_and_old_numpy_states_still_load(tmp_path):
    atomic_save(rng_state(), tmp_path / "new.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "new.pt") == []
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    set_rng_state(load(tmp_path / "new.pt"))
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == draws

    # written before rng_state kept tensors: numpy's state as a (pickled) array
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    atomic_save({"rng": old, "extra": {"loader": {"tokens_consumed": 64}}}, tmp_path / "old.pt")
    draws = np.random.rand(3).tolist()
    with pytest.raises(CheckpointError, match="numpy"):
        load(tmp_path / "old.pt")  # numpy arrays only where asked for
    state = load(tmp_path / "old.pt", allow=numpy_array_types())
    set_rng_state(state["rng"])
    assert np.random.rand(3).tolist() == draws and state["extra"] == {"loader": {"tokens_consumed": 64}}


# -- what latest_good says --------------------------------------------------------------------------


def test_a_newer_folder_without_a_manifest_is_reported_and_the_older_checkpoint_used(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 4)
    save(manager, 8)
    (tmp_path / "step_00000008" / "meta.json").unlink()  # `latest` names it too: one line, not two
    notes = []
    assert manager.latest_good(notes.append) == tmp_path / "step_00000004"
    assert notes == [
        "checkpoint step_00000008 has no manifest meta.json (an interrupted save?); falling back to step_00000004"
    ]
    assert (tmp_path / "step_00000008").is_dir()  # left as it is, as before

    (tmp_path / "latest").write_text("step_00000004")
    notes.clear()
    assert manager.latest_good(notes.append) == tmp_path / "step_00000004"
    assert notes == [
        "checkpoint step_00000008 has no manifest meta.json (an interrupted save?); falling back to step_00000004"
    ]

    (tmp_path / "step_00000004" / "meta.json").unlink()
    notes.clear()
    with pytest.raises(CheckpointError, match="^no intact checkpoint is left in "):  # never a silent fresh start
        manager.latest_good(notes.append)
    assert notes == [
        f"checkpoint step_0000000{s} has no manifest meta.json (an interrupted save?); no complete "
        "checkpoint is left to fall back to"
        for s in (8, 4)
    ]


def test_a_latest_that_names_no_checkpoint_is_reported(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 4)
    save(manager, 8)
    notes = []
    assert manager.latest_good(notes.append) == tmp_path / "step_00000008" and notes == []  # all well: silent

    (tmp_path / "latest").write_text("step_00000012")
    assert manager.latest_good(notes.append) == tmp_path / "step_00000008"
    assert notes == ["latest names step_00000012, which is missing; using step_00000008"]

    (tmp_path / "step_00000008.corrupt").mkdir()  # what an earlier fallback left
    (tmp_path / "latest").write_text("step_00000008")
    os.rename(tmp_path / "step_00000008", tmp_path / "step_00000008.away")
    notes.clear()
    assert manager.latest_good(notes.append) == tmp_path / "step_00000004"
    assert notes == [
        "latest names step_00000008, which was set aside as damaged (step_00000008.corrupt); using step_00000004"
    ]


def test_a_manifest_without_sizes_and_checksums_counts_as_damage(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (4, 8, 12, 16):
        save(manager, step, {"rank00000.pt": {"step": step}, "model.pt": {"w": torch.ones(2)}})
    manifest = tmp_path / "step_00000016" / "meta.json"
    meta = json.loads(manifest.read_text())
    meta["files"]["model.pt"] = {}  # valid JSON, no size or checksum: once a KeyError on every rank
    manifest.write_text(json.dumps(meta))
    (tmp_path / "step_00000012" / "meta.json").write_text("{}")
    meta = json.loads((tmp_path / "step_00000008" / "meta.json").read_text())
    del meta["files"]["rank00000.pt"]["crc32"]
    (tmp_path / "step_00000008" / "meta.json").write_text(json.dumps(meta))
    notes = []
    assert manager.latest_good(notes.append) == tmp_path / "step_00000004"
    assert notes == [
        "checkpoint step_00000016 is damaged: its manifest meta.json gives no size and CRC-32 for model.pt; "
        "falling back to the previous one",
        "checkpoint step_00000012 is damaged: its manifest meta.json has no step; falling back to the previous one",
        "checkpoint step_00000008 is damaged: its manifest meta.json gives no size and CRC-32 for rank00000.pt; "
        "falling back to the previous one",
    ]
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == [f"step_000000{s}.corrupt" for s in ("08", "12", "16")]
    assert verify(tmp_path / "step_00000004") is None


def test_a_newer_complete_checkpoint_than_latest_is_resumed_and_latest_said_to_be_behind(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 4)
    save(manager, 8)
    (tmp_path / "latest").write_text("step_00000004")  # a crash between the rename and the `latest` write:
    os.utime(tmp_path / "latest", (0, 0))  # latest is older than step 8's manifest
    notes = []
    assert manager.latest_good(notes.append) == tmp_path / "step_00000008"
    assert notes == [
        "latest names step_00000004, but step_00000008 is newer and complete (latest was behind: a "
        "save interrupted before latest was updated); using step_00000008"
    ]

    (tmp_path / "step_00000008" / "rank00000.pt").write_bytes(b"damaged")  # the newer one damaged: latest's
    notes.clear()
    assert manager.latest_good(notes.append) == tmp_path / "step_00000004"
    assert notes[1].startswith("checkpoint step_00000008 is damaged: rank00000.pt has 7 bytes")


def test_a_latest_set_back_by_hand_is_obeyed_and_said(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (4, 8, 12):
        save(manager, step)
    (tmp_path / "latest").write_text("step_00000008")  # written after step 12's manifest: on purpose
    notes = []
    assert manager.latest_good(notes.append) == tmp_path / "step_00000008"
    assert notes == [
        "latest names step_00000008, set after step_00000012 (rewound by hand?): resuming from "
        "step_00000008 as it says; the newer checkpoints are overwritten as the run gets there again"
    ]
    os.utime(tmp_path / "latest", (0, 0))  # older than step 12's manifest: a crash before latest was updated
    notes.clear()
    assert manager.latest_good(notes.append) == tmp_path / "step_00000012" and "latest was behind" in notes[0]


def _latest_good_worker(rank: int, world: int, directory: str) -> tuple[str, list[str]]:
    notes: list[str] = []
    chosen = CheckpointManager(directory).latest_good(notes.append)
    return str(chosen), notes


@pytest.mark.slow
def test_reports_come_from_rank_zero_only(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 4)
    save(manager, 8, {"rank00000.pt": {"x": torch.ones(4)}})
    (tmp_path / "step_00000008" / "rank00000.pt").write_bytes(b"damaged")
    (tmp_path / "latest").write_text("step_00000012")
    (tmp_path / "step_00000016").mkdir()
    size = json.loads((tmp_path / "step_00000008" / "meta.json").read_text())["files"]["rank00000.pt"]["bytes"]
    ranks = run_distributed(_latest_good_worker, 2, str(tmp_path))
    expected = [
        "checkpoint step_00000016 has no manifest meta.json (an interrupted save?); falling back to step_00000008",
        "latest names step_00000012, which is missing; using step_00000008",
        f"checkpoint step_00000008 is damaged: rank00000.pt has 7 bytes, the manifest says {size}; "
        "falling back to the previous one",
    ]
    assert ranks == [(str(tmp_path / "step_00000004"), expected), (str(tmp_path / "step_00000004"), [])]


# -- through the engine -----------------------------------------------------------------------------


def _engine(zero: int, sharded: bool):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        "optimus": {"sharded_optimizer": {"enabled": sharded}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(2):  # optimizer state exists
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
    return engine


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _refusal_worker(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    out: dict = {}

    def attempt(name: str, fn, marker: Path) -> None:
        try:
            fn()
            out[name] = None
        except CheckpointError as err:
            out[name] = (type(err).__name__, str(err), marker.exists())

    # the sharded optimizer's (the engine's) format, through the manager and through engine.load_checkpoint
    engine = _engine(1, sharded=True)
    manager = CheckpointManager(root / "sharded")
    folder = manager.save(2, engine, {"loader": {"tokens_consumed": 8}})
    plant(folder / "client_rank00000.pt", root / "sharded_ran")
    out["sharded_verified"] = verify(folder)
    attempt("sharded_manager", lambda: manager.load(folder, engine), root / "sharded_ran")
    engine.save_checkpoint(str(root / "engine"), tag="t")
    plant(root / "engine" / "t" / "optim_rank00000.pt", root / "engine_ran")
    attempt("engine_load", lambda: engine.load_checkpoint(str(root / "engine"), tag="t"), root / "engine_ran")

    # the per-rank format (DeepSpeed's own optimizers): ZeRO-1's state holds DeepSpeed objects and loads;
    # so does a file of before this change (numpy's RNG state as an array); a planted pickle does not
    engine = _engine(1, sharded=False)
    manager = CheckpointManager(root / "per_rank")
    saved = _params(engine)
    folder = manager.save(2, engine, {"loader": {"tokens_consumed": 8}})
    own = torch.load(folder / "rank00000.pt", weights_only=False)
    own["rng"]["numpy"] = np.random.get_state()
    plant_free = atomic_save(own, folder / "rank00000.pt")  # rewritten as the old code wrote it
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["rank00000.pt"] = plant_free
    (folder / "meta.json").write_text(json.dumps(meta))
    expected_draw = np.random.rand()
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()  # moved away from the checkpoint
    out["per_rank_resumed"] = manager.load(folder, engine)
    out["per_rank_weights_back"] = all(torch.equal(a, b) for a, b in zip(_params(engine), saved, strict=True))
    out["per_rank_numpy_back"] = np.random.rand() == expected_draw
    out["per_rank_optimizer"] = type(engine.optimizer).__name__
    plant(folder / "rank00000.pt", root / "per_rank_ran")
    attempt("per_rank_manager", lambda: manager.load(folder, engine), root / "per_rank_ran")
    return out


def _refused_on_another_rank(rank: int, world: int, root: str) -> dict:
    engine, out = _engine(1, sharded=True), {}
    for tag in ("planted", "index"):
        engine.save_checkpoint(root, tag=tag)
    if rank == 0:  # rank 1's optimizer file: on the same layout, rank 0 has no reason to open it
        plant(Path(root) / "planted" / "optim_rank00001.pt", Path(root) / "ran")
        manifest = Path(root) / "index" / "meta.json"  # an index that says rank 1's file holds nothing
        meta = json.loads(manifest.read_text())
        meta["files"]["optim_rank00001.pt"]["holds"] = []
        manifest.write_text(json.dumps(meta))
    dist.barrier()
    for tag in ("planted", "index"):
        try:
            engine.load_checkpoint(root, tag=tag)
            out[tag] = None
        except CheckpointError as err:
            out[tag] = (type(err).__name__, str(err), getattr(err, "every_rank", False))
    return {**out, "ran": (Path(root) / "ran").exists()}


@pytest.mark.slow
def test_a_file_only_one_rank_reads_is_refused_on_every_rank(tmp_path):
    """Each rank opens only the optimizer files its elements are in: a refused one, or state that
    the files it opened lack, stops every rank with the same line (none is left waiting in the
    optimizer's collectives)."""
    out = run_distributed(_refused_on_another_rank, 2, str(tmp_path))
    planted = ("CheckpointError", refusal(tmp_path / "planted" / "optim_rank00001.pt"), True)
    assert [o["planted"] for o in out] == [planted, planted] and not any(o["ran"] for o in out)
    assert (
        out[0]["index"]
        == out[1]["index"]
        == (
            "CheckpointLoadError",
            f"{tmp_path / 'index'}: the checkpoint has no optimizer state for 0.weight; was the model changed?",
            True,
        )
    )


@pytest.mark.slow
def test_planted_pickles_are_refused_by_every_loader(tmp_path):
    out = run_distributed(_refusal_worker, 1, str(tmp_path))[0]
    assert out["sharded_verified"] is None  # the manifest agrees: only the unpickling can stop it
    assert out["sharded_manager"] == (
        "CheckpointError",
        refusal(tmp_path / "sharded" / "step_00000002" / "client_rank00000.pt"),
        False,
    )
    assert out["engine_load"] == ("CheckpointError", refusal(tmp_path / "engine" / "t" / "optim_rank00000.pt"), False)
    assert out["per_rank_optimizer"] == "DeepSpeedZeroOptimizer"
    assert out["per_rank_resumed"] == (2, {"loader": {"tokens_consumed": 8}})
    assert out["per_rank_weights_back"] and out["per_rank_numpy_back"]
    assert out["per_rank_manager"] == (
        "CheckpointError",
        refusal(tmp_path / "per_rank" / "step_00000002" / "rank00000.pt"),
        False,
    )
    assert not any(tmp_path.glob("*_ran"))
