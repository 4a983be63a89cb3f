"""Functions run on every rank by the all-gather exchange's multi-process tests."""

from __future__ import annotations

import torch
from ep_workers import ep_exchange_variants

from ds_optimus.moe import MoELayer
from ds_optimus.parallel import apply_expert_parallel
from ds_optimus.parallel.traffic import ExchangeTraffic

HIDDEN, INTER = 32, 16


class _CountingRows:
    """A dispatcher that counts the rows its wrapped dispatcher hands this rank's experts."""

    def __init__(self, inner) -> None:
        self.inner, self.deduplicated, self.rows = inner, inner.deduplicated, 0

    def __call__(self, *args):
        at = 3 if self.deduplicated else 2  # where the experts callable is in either interface

        def experts(rows, *rest):
            self.rows += rows.shape[0]
            return args[at](rows, *rest)

        return self.inner(*args[:at], experts, *args[at + 1 :])


def _layer_run(rank: int, world: int, case: dict, dispatch: str) -> dict:
    torch.manual_seed(0)  # the same router and experts on every rank and for both exchanges
    experts, dtype = case.get("experts", 8), getattr(torch, case.get("dtype", "float32"))
    layer = MoELayer(HIDDEN, INTER, experts, case["top_k"], capacity_factor=case.get("capacity")).to(dtype)
    if "bias" in case:  # a selection bias that pulls every token to these experts
        bias = torch.zeros(experts)
        bias[case["bias"]] = 10.0
        layer.gate.register_buffer("expert_bias", bias)
        layer.gate.uses_bias = True
    apply_expert_parallel(layer, world, dedup=False if dispatch == "alltoall" else "auto", dispatch=dispatch)
    module = layer.experts
    kind = type(module.expert_parallel).__name__
    module.expert_parallel = counting = _CountingRows(module.expert_parallel)
    g = torch.Generator().manual_seed(100 + rank)
    tokens = case["tokens"][rank]
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype).requires_grad_()
    probe = torch.randn(tokens, HIDDEN, generator=g)
    with ExchangeTraffic() as traffic:
        out, aux = layer(x)
        (out.float() * probe).sum().backward()
    grads = {
        "x": x.grad,
        "router": layer.gate.weight.grad,
        "gate_up": module.gate_up_proj.grad,
        "down": module.down_proj.grad,
    }
    local_slots = int((aux["top_k_index"] // (experts // world) == rank).sum())  # this rank's slots on its experts
    return {
        "dispatcher": kind,
        "out": out.detach(),
        "grads": grads,
        "expert_rows": counting.rows,
        "all_to_alls": traffic.calls,
        "local_slots": local_slots,
    }


def allgather_against_alltoall(rank: int, world: int, layer_cases: list[dict], model_variants: list[dict]):
    """One MoE layer per case on this rank's `tokens[rank]` tokens, under the per-slot all-to-all
    and under the all-gather exchange, then whole tiny Mula models configured through `setup_moe`
    (`ep_workers.ep_exchange_variants`). Returns both runs of every case, and the models' results."""
    layers = [{d: _layer_run(rank, world, case, d) for d in ("alltoall", "allgather")} for case in layer_cases]
    return {"layers": layers, "models": ep_exchange_variants(rank, world, model_variants) if model_variants else []}
