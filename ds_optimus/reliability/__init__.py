"""Reliability for long runs: verified, optionally asynchronous checkpoints with exact resume. Names
are imported on first use (the supervisor's command line needs no PyTorch)."""

from .._lazy import lazy_exports

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriter", "rng_state", "set_rng_state", "verify"]
__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(("CheckpointError", "CheckpointWriter", "verify"), "..checkpoint_io"),
    **dict.fromkeys(("rng_state", "set_rng_state"), "..rng_state"),
    "CheckpointManager": ".checkpoint"})
