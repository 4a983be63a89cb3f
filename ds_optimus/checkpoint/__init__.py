"""Checkpoints, in one package, from the file up:

- `files`: the I/O leaf: atomic writes, CRC-32 and the manifest (`meta.json`), the writer that
  saves in the background, verification on load.
- `rng`: every random generator's state (Python, NumPy, PyTorch's CPU and accelerator ones).
- `optimizer_state`: the EP-aware sharded optimizer's layout-free checkpoints (state keyed by
  parameter name and element range), resumable on another world size, EP or pipeline layout.
- `engine_state`: what a per-rank checkpoint keeps of a DeepSpeed engine without the sharded optimizer.
- `manager`: `CheckpointManager` (save, keep the last N, find the newest intact one, recover from
  damaged ones), `CheckpointConfig` (`optimus.checkpoint`), and the consolidated model of a
  checkpoint (what `python -m ds_optimus.evaluate` exports).

Names are imported on first use (`import ds_optimus.checkpoint` needs no PyTorch).
"""

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
