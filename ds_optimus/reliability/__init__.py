"""Reliability for long runs: verified, optionally asynchronous checkpoints with exact resume."""

from ..checkpoint_io import CheckpointError, CheckpointWriter, rng_state, set_rng_state, verify
from .checkpoint import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriter", "rng_state", "set_rng_state", "verify"]
