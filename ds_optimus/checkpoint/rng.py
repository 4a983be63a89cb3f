"""The state of every random generator a training step draws from, as a checkpoint keeps it (a leaf:
it imports nothing of ds_optimus).

- `rng_state` / `set_rng_state`: Python's, numpy's, torch's and the accelerator's generators on this rank.
- `numpy_array_types`: what loading an RNG state written before numpy's keys were kept as tensors needs.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from, on this rank, as tensors and plain containers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # numpy's key array is kept as a tensor: the file then loads without allow-listing numpy internals
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    accelerator = _accelerator()
    if accelerator is not None:
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (also the numpy arrays of checkpoints written before it kept tensors)."""
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    np.random.set_state((kind, keys, *rest))
    torch.set_rng_state(state["torch"])
    accelerator = _accelerator()
    if accelerator is not None and "accelerator" in state:
        accelerator.set_rng_state(state["accelerator"])


def _accelerator():
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator


def numpy_array_types() -> list[Any]:
    """What a pickled numpy array needs beyond plain containers (RNG states of checkpoints written
    before `rng_state` kept tensors): numpy's array constructor, under its numpy 1 and 2 names."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 warns on `np.core`: asked only for numpy 1
    rebuild = core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        (rebuild, "numpy._core.multiarray._reconstruct"),
        (rebuild, "numpy.core.multiarray._reconstruct"),
    ]
