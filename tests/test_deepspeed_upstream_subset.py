"""DeepSpeed's own unit tests of the areas ds_optimus patches (tests/deepspeed_upstream/: engine
initialisation, optimizer config, ZeRO-1/2 steps and clipping, ZeRO checkpoints, AutoEP's
expert-parallel set-up, config models), run with ds_optimus imported, in a pytest process of their
own: DeepSpeed's harness runs some of them in pytest's own process and leaves its process group and
RANK/WORLD_SIZE/MASTER_* there."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import LONG_TEST_TIMEOUT_S

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.timeout(LONG_TEST_TIMEOUT_S)
def test_deepspeeds_own_tests_pass_with_ds_optimus_imported():
    env = {**os.environ, "DS_OPTIMUS_UPSTREAM_TESTS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(HERE / "deepspeed_upstream"),
        ],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=LONG_TEST_TIMEOUT_S - 60,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 50 and "failed" not in summary, summary
