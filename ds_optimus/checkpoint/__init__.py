"""Checkpoints: `files` (atomic writes, CRC-32, manifest, background writer), `rng`, `optimizer_state` (layout-free),
`engine_state` and `manager` (`CheckpointManager`, `CheckpointConfig`). Names load on first use (no PyTorch needed)."""

from .._lazy import lazy_exports

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriter",
    "atomic_save",
    "load",
    "rng_state",
    "set_rng_state",
    "verify",
    "write_text_atomic",
]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ("CheckpointError", "CheckpointWriter", "atomic_save", "load", "verify", "write_text_atomic"), ".files"
        ),
        **dict.fromkeys(("rng_state", "set_rng_state"), ".rng"),
        **dict.fromkeys(("CheckpointConfig", "CheckpointManager"), ".manager"),
    },
)
