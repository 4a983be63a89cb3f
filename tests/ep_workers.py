"""Functions run on every rank by the multi-process expert-parallel tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ds_optimus  # noqa: F401  (registers the experts implementation)
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.parallel import apply_expert_parallel, is_expert_param


def tiny_moe(seed: int = 0, **overrides) -> MulaForCausalLM:
    torch.manual_seed(seed)
    config = MulaConfig.from_preset("mula-tiny-moe", **overrides)
    return MulaForCausalLM(config).float()


def global_batch(seed: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, seq), generator=g)
    probe = torch.randn(batch, seq, vocab, generator=g)  # a fixed linear functional of the logits
    return ids, probe


def ep_forward_backward(rank: int, world: int, ep_size: int, node_size: int | None, overrides: dict,
                        batch: int = 8, seq: int = 12):
    """Each rank runs its share of the global batch through the EP model; returns its logits slice
    and the gradients summed the way data parallelism sums them (dense over all ranks, experts
    over the expert-data-parallel group), with the experts' full tensors reassembled."""
    model = tiny_moe(**overrides)
    groups = apply_expert_parallel(model, ep_size, node_size=node_size)
    ids, probe = global_batch(1, batch, seq, model.config.vocab_size)
    per_rank = batch // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    logits = model(ids[mine]).logits
    (logits * probe[mine]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if is_expert_param(p):
            dist.all_reduce(g, group=groups.edp_group)
            parts = [torch.empty_like(g) for _ in range(groups.ep_size)]
            dist.all_gather(parts, g.contiguous(), group=groups.ep_group)
            g = torch.cat(parts)
        else:
            dist.all_reduce(g)
        grads[name] = g
    return {"logits": logits.detach(), "grads": grads, "rows": mine}


def reference_forward_backward(overrides: dict, batch: int = 8, seq: int = 12):
    model = tiny_moe(**overrides)
    model.set_experts_implementation("eager")
    ids, probe = global_batch(1, batch, seq, model.config.vocab_size)
    logits = model(ids).logits
    (logits * probe).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}
