"""Reliability for long runs: verified, optionally asynchronous checkpoints with exact resume."""

from .checkpoint import CheckpointError, CheckpointManager, CheckpointWriter, rng_state, set_rng_state, verify

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriter", "rng_state", "set_rng_state", "verify"]
