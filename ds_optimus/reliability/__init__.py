"""Reliability for long runs: atomic per-rank checkpoints with exact resume."""

from .checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state

__all__ = ["CheckpointError", "CheckpointManager", "rng_state", "set_rng_state"]
