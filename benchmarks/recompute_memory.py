"""Activation bytes one decoder layer keeps for the backward pass, per activation-recomputation choice.

One OLMoE-shaped MoE decoder layer (hidden 2048, 16 heads, QK-norm, 64 experts of 1024, top-8; the
Mula-7B-A1B layer) runs a training forward pass on `--batch` x `--seq` tokens under each choice of
`optimus.train.activation_checkpointing`: none, ["norms"], ["attention"], ["moe"],
["moe", "attention", "norms"] and the whole layer (true). `torch.autograd.graph.saved_tensors_hooks`
sees every tensor autograd saves (non-reentrant checkpointing saves its region's inputs through the
same hooks); the figure is the bytes of their distinct storages, less the parameters and the RoPE
tables (shared by all layers). The planner's prediction (`ModelShape.layer_saved_bytes_per_token`)
is printed beside it. Runs in well under a minute on a CPU (SDPA attention, the default experts path).

    python benchmarks/recompute_memory.py [--seq 1024] [--batch 1] [--dtype bf16]

Result: benchmarks/results/recompute_memory.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

import ds_optimus  # noqa: E402,F401  (registers the experts implementation)
from ds_optimus.hf_models.mula import MulaConfig, MulaModel  # noqa: E402
from ds_optimus.moe.experts import select_backend  # noqa: E402
from ds_optimus.plan import ModelShape  # noqa: E402
from ds_optimus.train.model_setup import enable_activation_checkpointing  # noqa: E402

CHOICES = {
    "none": False,
    "norms": ["norms"],
    "attention": ["attention"],
    "moe": ["moe"],
    "moe+attention+norms": ["moe", "attention", "norms"],
    "whole layer": True,
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer_config(hidden: int, heads: int, experts: int, intermediate: int, top_k: int) -> MulaConfig:
    """One MoE decoder layer of the OLMoE shape (a small vocabulary: the layer is what is measured)."""
    return MulaConfig.from_preset(
        "mula-7b-a1b",
        num_hidden_layers=1,
        vocab_size=512,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_experts=experts,
        moe_intermediate_size=intermediate,
        num_experts_per_tok=top_k,
    )


def saved_bytes(model: MulaModel, choice, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages the layer's forward pass saves for the backward
    pass under recomputation `choice` (the backward pass itself is not run: tests/test_recompute.py
    checks that it gives the gradients of the run without recomputation)."""
    layer = model.layers[0]
    layer.recompute = choice if isinstance(choice, list) else ()
    if choice is True:
        enable_activation_checkpointing(model)
    elif hasattr(model, "activation_checkpointing_disable"):  # the name since Transformers 5.2x
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
    position_ids = torch.arange(x.shape[1]).unsqueeze(0)
    cos, sin = model.rotary_emb(x, position_ids)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()

    torch.manual_seed(0)
    config = layer_config(args.hidden, args.heads, args.experts, args.intermediate, args.top_k)
    dtype = DTYPES[args.dtype]
    model = MulaModel(config).to(dtype).train()
    backend = select_backend("cpu", dtype, model.layers[0].mlp.experts.experts_backend)
    attention = model.config._attn_implementation
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype, requires_grad=True)
    shape = ModelShape.from_config(config)
    a = torch.empty((), dtype=dtype).element_size()
    tokens = args.batch * args.seq

    rows = {}
    for name, choice in CHOICES.items():
        measured = saved_bytes(model, choice, x)
        predicted = tokens * shape.layer_saved_bytes_per_token(a, True, choice)
        rows[name] = {
            "choice": choice,
            "measured_bytes": measured,
            "predicted_bytes": predicted,
            "predicted_over_measured": predicted / measured,
        }
    base = rows["none"]["measured_bytes"]
    print(
        f"one MoE decoder layer: hidden {args.hidden}, {args.heads} heads, {args.experts} experts x "
        f"{args.intermediate}, top-{args.top_k}; {args.batch} x {args.seq} tokens, {args.dtype}, "
        f"{attention} attention, experts backend {backend}"
    )
    print(
        f"{'recomputed':22s} {'saved MiB':>10s} {'of none':>8s} {'KiB/token':>10s} {'planner MiB':>12s} "
        f"{'pred/meas':>9s}"
    )
    for name, row in rows.items():
        print(
            f"{name:22s} {row['measured_bytes'] / 2**20:10.1f} {row['measured_bytes'] / base:8.1%} "
            f"{row['measured_bytes'] / tokens / 1024:10.1f} {row['predicted_bytes'] / 2**20:12.1f} "
            f"{row['predicted_over_measured']:9.3f}"
        )
    path = write_result(
        "recompute_memory",
        {
            "shape": {
                "hidden": args.hidden,
                "heads": args.heads,
                "experts": args.experts,
                "expert_intermediate": args.intermediate,
                "top_k": args.top_k,
                "qk_norm": True,
            },
            "batch": args.batch,
            "seq_len": args.seq,
            "dtype": args.dtype,
            "attention": attention,
            "experts_backend": backend,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
