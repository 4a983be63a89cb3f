"""Shared test set-up: no network, no wandb, deterministic CPU runs."""

import os

# Nothing downloads at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep instead of spinning. The README's command runs two workers on two cores, each
# with torch's default of a thread per core, so a spinning thread takes the core the other worker (or its
# ranks) needs: the same tests run pairwise took 37 % less CPU time (130 -> 80 s each, 2 cores). Read by
# libgomp when torch loads: set here, before any import of torch, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's CPU interpreter (read when they are first imported).
if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ds_optimus  # noqa: E402,F401  (registers Mula with the Auto classes)

# DeepSpeed's own tests run in a pytest process of their own (test_deepspeed_upstream_subset.py), which
# sets this: they leave DeepSpeed's process group and environment behind in the process that ran them.
UPSTREAM = "DS_OPTIMUS_UPSTREAM_TESTS"
collect_ignore = [] if os.environ.get(UPSTREAM) else ["deepspeed_upstream"]


# The modules that take longest (seconds on 2 cores, measured 2026-12-02), run first: pytest-xdist's workers
# (the README's test command runs two, one module at a time each, in this order: --no-loadscope-reorder,
# without which xdist deals the modules with most tests first) then finish together instead of one
# waiting on a long module dealt out last. A module missing here only runs later; the order changes no result.
LONGEST_FIRST = (
    "test_pipeline.py",
    "test_fault_tolerance.py",
    "test_plan.py",
    "test_tensor_parallel_training.py",
    "test_sharded_optimizer.py",
    "test_trainer.py",
    "test_routing_ops.py",
    "test_train.py",
    "test_deepspeed_upstream_subset.py",
    "test_expert_parallel.py",
    "test_gpu_battery.py",
    "test_jobs.py",
    "test_evaluate.py",
    "test_hf_common.py",
    "test_launch.py",
    "test_hf_engine.py",
    "test_build.py",
    "test_kernels.py",
    "test_entry_points.py",
    "test_data_sources.py",
    "test_package.py",
    "test_data_training.py",
    "test_phase_profile.py",
    "test_readme.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept


@pytest.fixture(scope="session")
def installed_copy(tmp_path_factory):
    """A non-editable install of a clean copy with the routing op prebuilt, once a session (tests/installed_copy.py)."""
    from installed_copy import installed_copy as install

    return install(tmp_path_factory)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module", autouse=True)
def _workers_within_memory():
    """After a test module, stop the kept worker processes of `distributed.run_distributed` (one pool per
    world size, grown by every run they served) when less than a third of the machine's memory is free:
    the next run starts fresh workers instead of being killed for memory beside them."""
    yield
    import sys

    import psutil

    memory = psutil.virtual_memory()
    if memory.available < memory.total / 3 and "distributed" in sys.modules:
        sys.modules["distributed"].close_pools()


# -- every command tests/test_docs.py says a test runs is run by that test --------------------------

_passed: set[str] = set()


def pytest_configure(config):
    import tempfile

    from doc_blocks import RUNS_VAR

    if not hasattr(config, "workerinput"):  # the controller (or the only process): one file for all workers
        folder = tempfile.mkdtemp(prefix="ds_optimus-doc-runs-")
        os.environ[RUNS_VAR] = config._doc_runs = os.path.join(folder, "runs.jsonl")


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _passed.add(report.nodeid.split("[")[0])


def pytest_sessionfinish(session, exitstatus):
    """For each docs command whose named test passed in this session, the test recorded running it
    (`doc_blocks.ran`); else the session fails, naming them."""
    path = getattr(session.config, "_doc_runs", None)
    if path is None or os.environ.get(UPSTREAM):
        return
    import json
    import shutil

    try:
        from test_docs import RUN
    except ImportError:  # the docs tests were not collected (another folder given)
        return
    recorded = set()
    if os.path.exists(path):
        for line in open(path):
            entry = json.loads(line)
            recorded.add((entry["test"].split("[")[0], entry["command"]))
    missing = [
        f"{test}: {command}"
        for command, test in RUN.items()
        if f"tests/{test}" in _passed and (f"tests/{test}", command) not in recorded
    ]
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "docs commands their named test passed without running (doc_blocks.ran):\n  " + "\n  ".join(missing)
        (reporter.write_line if reporter else print)(text)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
