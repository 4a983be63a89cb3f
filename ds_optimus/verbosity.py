"""Quiet by default, verbose on request: the command lines keep the libraries' warnings that matter and their own
lines; `--verbose` or DS_OPTIMUS_VERBOSE=1 (which reaches every rank through a launcher) keeps all output."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator

from . import after_import

QUIET_ENVIRONMENT = {
    "WANDB_SILENT": "true",  # no banner, no run summary table (the run's files are unchanged)
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # Transformers' "Loading weights" / "Writing model shards" bars
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def verbose_requested(flag: bool = False) -> bool:
    """Whether the libraries keep their own output: the command's --verbose or DS_OPTIMUS_VERBOSE=1."""
    return flag or os.environ.get("DS_OPTIMUS_VERBOSE", "") not in ("", "0", "false")


def quiet_libraries(verbose: bool = False) -> None:
    """Unless `verbose`: quiet environment defaults (a variable already set wins) and DeepSpeed's logger at ERROR;
    call before those libraries are imported."""
    if verbose_requested(verbose):
        os.environ["DS_OPTIMUS_VERBOSE"] = "1"  # for the processes the command starts
        return
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    after_import("deepspeed.utils.logging", _quiet_deepspeed)
    # DeepSpeed's ZeRO and comm call the names PyTorch 2.13 deprecated (ds_optimus' own calls use the new
    # ones): a FutureWarning on every rank that no user can act on
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
        "is deprecated",
        category=FutureWarning,
    )
    if "transformers" in sys.modules:  # imported before this call: its environment was read already
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _quiet_deepspeed() -> None:
    logger = sys.modules["deepspeed.utils.logging"].logger
    logger.setLevel(logging.ERROR)
    for handler in logger.handlers:
        handler.setLevel(logging.ERROR)


@contextlib.contextmanager
def without_profiler_chatter() -> Iterator[None]:
    """Unless verbose: fd 2 inside, less libkineto's `USDT: ... profiler_start/stop` lines."""
    # C++ writes to fd 2, which no log level or variable of PyTorch 2.13 turns off
    if verbose_requested():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode(errors="replace").splitlines(keepends=True)
                if not line.startswith("USDT:")
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
