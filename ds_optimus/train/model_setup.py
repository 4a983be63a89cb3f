"""What the trainer does to a built model: recomputation, compiled layers, a fingerprint of its dense weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def enable_activation_checkpointing(model, parts: bool | Sequence[str] = True) -> None:
    """Recompute each decoder layer in backward, or only `parts` of each (`MulaDecoderLayer.recompute`)."""
    if parts is not True:
        layers = [m for m in model.modules() if isinstance(getattr(type(m), "recompute", None), property)]
        if not layers:
            raise ValueError(f"selective recomputation needs Mula decoder layers; {type(model).__name__} has none")
        for layer in layers:
            layer.recompute = tuple(parts or ())
        return
    kwargs = {"use_reentrant": False}  # the sharded optimizer's gradient hooks then fire once per parameter
    if hasattr(model, "activation_checkpointing_enable"):  # the name since Transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_layers(model) -> int:
    """Compile every decoder layer in place; returns the count."""
    layers = model.model.layers
    layers = list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)  # a pipeline stage's
    for layer in layers:
        layer.compile()
    return len(layers)


def dense_fingerprint(model) -> float:
    """The sum of the non-expert weights: equal on every rank unless replicas diverged."""
    from ..parallel.expert_parallel import is_expert_param

    with torch.no_grad():
        model.state_dict(keep_vars=True)  # waits for a parameter all-gather still under way (overlap_param_gather)
        return float(sum(p.detach().double().sum() for p in model.parameters() if not is_expert_param(p)))
