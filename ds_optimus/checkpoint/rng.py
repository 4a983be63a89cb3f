"""Random generators' states as a checkpoint keeps them (a leaf: it imports nothing of ds_optimus)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This rank's generators' states (Python, numpy, torch, accelerator) as tensors and plain containers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # numpy's key array is kept as a tensor: the file then loads without allow-listing numpy internals
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    accelerator = _accelerator()
    if accelerator is not None:
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (also older checkpoints' numpy arrays)."""
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
    """The numpy types older checkpoints' pickled RNG arrays need to load (under numpy 1 and 2 names)."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 warns on `np.core`: asked only for numpy 1
    rebuild = core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        (rebuild, "numpy._core.multiarray._reconstruct"),
        (rebuild, "numpy.core.multiarray._reconstruct"),
    ]
