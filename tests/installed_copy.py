"""One non-editable install of a clean copy of the repository, with the routing op prebuilt
(`DS_BUILD_OPS=1 pip install --no-build-isolation --target`), made once per test session and shared by
the tests that need an installed package (one compile of the op, also under pytest-xdist's workers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a fresh clone does not have, or the package does not ship
LEFT_OUT = (
    ".git",
    ".venv",
    "build",
    "*.so",
    "__pycache__",
    "*.egg-info",
    "tests",
    "benchmarks",
    "docs",
    ".gpu-kit",
    "runs",
)


def installed_copy(tmp_path_factory) -> Path:
    """The `--target` folder of the session's install (made by the first test that asks)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    folder = shared / "installed-copy"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(ROOT, folder / "src", ignore=shutil.ignore_patterns(*LEFT_OUT))
            env = {**os.environ, "DS_BUILD_OPS": "1"}
            env.pop("DS_BUILD_MOE_ROUTING", None)
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-build-isolation",
                    "--no-deps",
                    "--target",
                    str(folder / "site"),
                    str(folder / "src"),
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=540,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            (folder / "done").touch()
    return folder / "site"
