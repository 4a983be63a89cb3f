"""Every command line starts fast: `--help` imports neither PyTorch, Transformers nor DeepSpeed and
answers within 1.5 s, and `import ds_optimus` alone imports none of them either (it hooks them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from needs import missing

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "ds_optimus.train",
    "ds_optimus.train.hf_example",
    "ds_optimus.evaluate",
    "ds_optimus.plan",
    "ds_optimus.report",
    "ds_optimus.reliability.supervise",
    "ds_optimus.hf_models.mula.convert_olmoe",
    "ds_optimus.demo",
    "ds_optimus.data.prepare",
]
SCRIPTS = ["ds-optimus-train", "ds-optimus-plan", "ds-optimus-evaluate"]
HEAVY = ("torch", "transformers", "deepspeed", "accelerate", "datasets")

# Runs a module's --help in this interpreter and prints which heavy modules that imported.
PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print("IMPORTED", *[m for m in {heavy!r} if m in sys.modules])
"""


# What makes `--help` answer at once is that it imports no heavy library (PyTorch, Transformers,
# DeepSpeed: seconds each); that is what is tested, not the seconds, which depend on the machine's load.
@pytest.mark.parametrize("module", MODULES)
def test_help_imports_no_heavy_library(module):
    probe = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), module], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.splitlines()[-1] == "IMPORTED", probe.stdout.splitlines()[-1]
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m "), proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_scripts_answer_help(script):
    path = Path(sys.executable).with_name(script)
    if not path.exists():
        missing(f"{script} is not installed (pip install -e .)")
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr


def test_importing_the_package_imports_no_heavy_library_until_used():
    code = (
        "import sys, ds_optimus; print(*[m for m in {heavy!r} if m in sys.modules]); "
        "from transformers import AutoConfig; print(type(AutoConfig.for_model('mula')).__name__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code.format(heavy=HEAVY)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["", "MulaConfig"]  # registered once Transformers is imported


def test_the_mula_classes_register_when_our_own_import_brings_transformers_in():
    # configuration_mula imports Transformers while it is itself being imported: the registration
    # waits for that import to finish, then happens without another import of ours
    code = (
        "from ds_optimus.hf_models.mula import MulaConfig\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
        "model = AutoModelForCausalLM.from_config(MulaConfig.from_preset('mula-tiny-moe'))\n"
        "print(type(model).__name__, 'ds_optimus' in ALL_EXPERTS_FUNCTIONS)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["MulaForCausalLM", "True"]


def test_help_texts_are_whole():
    proc = subprocess.run(
        [sys.executable, "-m", "ds_optimus.train.hf_example", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert "from the same config as\n`python -m ds_optimus.train` (its optimus section gives the model" in proc.stdout
    assert "--config CONFIG  DeepSpeed JSON config with an optimus section" in proc.stdout


def test_progress_is_a_plain_line_where_stderr_is_not_a_terminal():
    import io

    from ds_optimus.progress import LineProgress, progress

    out = io.StringIO()
    bar = progress(total=10, initial=2, desc="training", unit="step", file=out, interval=3600)
    assert isinstance(bar, LineProgress)
    for _ in range(8):
        bar.update(1)
        bar.set_postfix({"loss": "7.65"})
    bar.write("step 10: checkpoint runs/x/checkpoints/step_00000010")
    bar.close()
    bar.close()  # nothing new: no second line
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 10: checkpoint runs/x/checkpoints/step_00000010" and len(lines) == 2
    assert lines[1].startswith("training: 10/10 steps (") and lines[1].endswith(", loss=7.65)") and "\r" not in lines[1]


QUIET_PROBE = """
import os, sys
from ds_optimus.verbosity import QUIET_ENVIRONMENT, quiet_libraries, verbose_requested
for key in (*QUIET_ENVIRONMENT, "DS_OPTIMUS_VERBOSE"):
    os.environ.pop(key, None)
if sys.argv[1] == "verbose":
    quiet_libraries(verbose=True)
    assert os.environ["DS_OPTIMUS_VERBOSE"] == "1" and verbose_requested()  # and so in the processes it starts
    assert not any(key in os.environ for key in QUIET_ENVIRONMENT)
else:
    os.environ["WANDB_SILENT"] = "false"  # the user's own setting wins
    quiet_libraries()
    assert os.environ["WANDB_SILENT"] == "false" and os.environ["TRANSFORMERS_VERBOSITY"] == "error"
import logging, deepspeed, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_gather_into_tensor(torch.zeros(1), torch.ones(1))  # as DeepSpeed's ZeRO calls it
dist.destroy_process_group()
print(logging.getLevelName(sys.modules["deepspeed.utils.logging"].logger.level))
"""


@pytest.mark.parametrize("mode, level", [("quiet", "ERROR"), ("verbose", "WARNING")])
def test_quiet_by_default_and_verbose_on_request(mode, level):
    proc = subprocess.run(
        [sys.executable, "-c", QUIET_PROBE, mode], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == level
    deprecated = "`torch.distributed.all_gather_into_tensor` is deprecated" in proc.stderr
    assert deprecated == (mode == "verbose")  # PyTorch 2.13's warning on DeepSpeed's calls, on every rank
    if mode == "quiet":  # not even the accelerator line DeepSpeed logs while it is being imported
        assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr


# The torch.profiler runs of a training process (train.profile_steps, the CPU memory meter) through
# their own code, in a process of their own (the lines are C++ writes to fd 2, which pytest cannot capture).
PROFILER_PROBE = """
import os, sys, types
from pathlib import Path
import torch
from ds_optimus.train.callbacks.profiling import ProfileCallback
from ds_optimus.train.memory_meter import MemoryMeter
callback = ProfileCallback(1, 1)
callback.trainer = types.SimpleNamespace(rank=1)  # a rank that writes no table
callback.pre_step(1)
os.write(2, b"a line of the step\\n")
torch.ones(3).sum()
callback.post_step(1)
meter = MemoryMeter(torch.device("cpu"))
meter.start()
torch.ones(1000).sum()
print("peak", meter.stop()["peak_bytes"] > 0)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_the_profilers_start_and_stop_lines_are_left_out_unless_verbose(verbose):
    env = {**os.environ, "DS_OPTIMUS_VERBOSE": "1" if verbose else "0"}
    proc = subprocess.run(
        [sys.executable, "-c", PROFILER_PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "peak True"
    assert "a line of the step" in proc.stderr  # what else reached fd 2 meanwhile is kept
    usdt = [line for line in proc.stderr.splitlines() if line.startswith("USDT:")]
    # verbose: both profilers' start and stop, so the quiet case's absence is the filter's doing
    assert len(usdt) == (4 if verbose else 0), proc.stderr


# The train command's quick exit (`command_line.exit_without_teardown`): nothing a normal exit keeps is lost.
QUICK_EXIT = """
import atexit, os, sys, threading, time
from ds_optimus.command_line import exit_without_teardown
class Torn:  # says so when the interpreter's teardown frees it
    def __del__(self, write=os.write):
        write(2, b" torn down")
kept = Torn()
atexit.register(lambda: print("atexit handler ran", flush=False))
print("buffered output", end="")
sys.stderr.write("buffered error")
if sys.argv[1] == "thread":  # a non-daemon thread still writing: the exit waits for it, as a normal one does
    threading.Thread(target=lambda: (time.sleep(0.5), open(sys.argv[2], "w").write("done"))).start()
exit_without_teardown(int(sys.argv[3]))
"""


@pytest.mark.parametrize("mode,status", [("alone", 0), ("thread", 0), ("alone", 3)])
def test_the_quick_exit_keeps_the_status_the_output_the_atexit_handlers_and_a_writing_thread(tmp_path, mode, status):
    """Only a clean finish with no thread left skips the teardown; a failed rank exits as before."""
    written = tmp_path / "written"
    run = subprocess.run(
        [sys.executable, "-c", QUICK_EXIT, mode, str(written), str(status)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == status, run.stderr
    assert run.stdout == "buffered outputatexit handler ran\n"
    quick = mode == "alone" and status == 0
    assert run.stderr == "buffered error" + ("" if quick else " torn down")
    assert written.read_text() == "done" if mode == "thread" else not written.exists()
