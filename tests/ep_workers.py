"""Functions run on every rank by the multi-process expert-parallel tests."""

from __future__ import annotations

import contextlib
import gc
import tempfile
import weakref

import torch
import torch.distributed as dist

import ds_optimus  # noqa: F401  (registers the experts implementation)
from ds_optimus.config import OptimusConfig
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.parallel import apply_expert_parallel, full_state_dict, is_expert_param, setup_moe


def tiny_moe(seed: int = 0, dtype: str = "float32", **overrides) -> MulaForCausalLM:
    torch.manual_seed(seed)
    config = MulaConfig.from_preset("mula-tiny-moe", **overrides)
    return MulaForCausalLM(config).to(getattr(torch, dtype))


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
    checkpointing = overrides.pop("checkpointing", None)
    model = tiny_moe(**overrides)
    if checkpointing is not None:  # recomputation in backward repeats the all-to-alls
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    if isinstance(ep_size, dict):  # a DeepSpeed config with an "optimus" section
        groups = setup_moe(model, OptimusConfig.from_ds_config(ep_size))
    else:
        groups = apply_expert_parallel(model, ep_size, node_size=node_size)
    ids, probe = global_batch(1, batch, seq, model.config.vocab_size)
    per_rank = batch // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    with _overlapped_runs() as runs:
        logits = model(ids[mine]).logits
        gc.collect()
        kept = sum(run() is not None for run in runs)  # overlapped layers' rows kept for the backward pass
    (logits.float() * probe[mine]).sum().backward()
    return {"logits": logits.detach(), "grads": summed_grads(model, groups), "rows": mine, "kept_runs": kept,
            "runs": len(runs)}


@contextlib.contextmanager
def _overlapped_runs():
    """Weak references to every overlapped exchange run started inside."""
    from ds_optimus.parallel import overlap

    runs, original = [], overlap._Run.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runs.append(weakref.ref(self))

    overlap._Run.__init__ = init
    try:
        yield runs
    finally:
        overlap._Run.__init__ = original


def summed_grads(model, groups) -> dict[str, torch.Tensor]:
    """Gradients summed the way data parallelism sums them (dense over all ranks, experts over the
    expert-data-parallel group), the experts' full tensors reassembled."""
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
    return grads


def reference_forward_backward(overrides: dict, batch: int = 8, seq: int = 12):
    model = tiny_moe(**overrides)
    model.set_experts_implementation("eager")
    ids, probe = global_batch(1, batch, seq, model.config.vocab_size)
    logits = model(ids).logits
    (logits * probe).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def global_batch_aux_loss(rank: int, world: int, batch: int = 8, seq: int = 12):
    """Global-batch load balancing: the aux loss and router gradients of rank-local micro-batches."""
    model = tiny_moe(router_aux_loss_scope="global_batch").train()
    ids, _ = global_batch(2, batch, seq, model.config.vocab_size)
    per_rank = batch // world
    out = model(ids[rank * per_rank:(rank + 1) * per_rank], labels=ids[rank * per_rank:(rank + 1) * per_rank])
    out.aux_loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "gate.weight" in n}
    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    aux = out.aux_loss.detach().clone()
    dist.all_reduce(aux)
    return {"aux": aux / world, "grads": grads}


def reference_aux_loss(batch: int = 8, seq: int = 12):
    model = tiny_moe().train()
    ids, _ = global_batch(2, batch, seq, model.config.vocab_size)
    out = model(ids, labels=ids)
    out.aux_loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "gate.weight" in n}
    return {"aux": out.aux_loss.detach(), "grads": grads}


DS_LR = 0.5


def deepspeed_sgd_step(rank: int, world: int, ep_size: int, stage: int, batch: int = 8, seq: int = 12):
    """One ZeRO-`stage` step of plain SGD through DeepSpeed's engine on an expert-parallel model, each
    rank training on its own micro-batch; returns the updated parameters, reassembled."""
    import deepspeed
    from deepspeed.utils import groups as ds_groups

    from ds_optimus.parallel import moe_param_groups

    model = tiny_moe().train()
    groups = apply_expert_parallel(model, ep_size)
    registered = [ds_groups._get_expert_data_parallel_group_dict().get(groups.name) is groups.edp_group]
    optimizer = torch.optim.SGD(moe_param_groups(model), lr=DS_LR)
    config = {
        "train_micro_batch_size_per_gpu": batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told otherwise
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    registered.append(ds_groups._get_expert_data_parallel_group_dict().get(groups.name) is groups.edp_group)
    ids, _ = global_batch(3, batch, seq, model.config.vocab_size)
    mine = ids[rank * (batch // world):(rank + 1) * (batch // world)]
    loss = engine(mine, labels=mine).loss
    engine.backward(loss)
    engine.step()
    params = {n: t for n, t in full_state_dict(engine.module, groups).items() if n in dict(model.named_parameters())}
    try:
        with tempfile.TemporaryDirectory() as folder:
            engine.save_checkpoint(folder)
        refused = None
    except NotImplementedError as err:
        refused = str(err)
    return {"params": params, "has_moe_layers": engine.has_moe_layers, "checkpoint_refused": refused,
            "registered": registered}


def reference_sgd_step(world: int, batch: int = 8, seq: int = 12):
    """The same step on one process: the mean of the per-rank micro-batch losses, then SGD."""
    model = tiny_moe().train()
    model.set_experts_implementation("eager")
    ids, _ = global_batch(3, batch, seq, model.config.vocab_size)
    per_rank = batch // world
    loss = sum(model(ids[r * per_rank:(r + 1) * per_rank], labels=ids[r * per_rank:(r + 1) * per_rank]).loss
               for r in range(world)) / world
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= DS_LR * p.grad
    return {n: p.detach() for n, p in model.named_parameters()}


def bad_layout(rank: int, world: int, ep_size: int, overrides: dict):
    """Returns the error message `apply_expert_parallel` raises (or None)."""
    try:
        apply_expert_parallel(tiny_moe(**overrides), ep_size)
    except ValueError as err:
        return str(err)
    return None


def save_expert_parallel(rank: int, world: int, ep_size: int, folder: str):
    """Export an EP-sharded model with export_pretrained (collective); return its logits on a fixed
    batch, whether the folder was complete when this rank returned, and what a plain save_pretrained
    of the sharded model said."""
    from pathlib import Path

    from ds_optimus.parallel import export_pretrained

    model = tiny_moe().eval()
    groups = apply_expert_parallel(model, ep_size)
    try:
        model.save_pretrained(Path(folder) / f"plain{rank}")
        refused = None
    except ValueError as err:
        refused = str(err)
    export_pretrained(model, folder, groups)
    complete = (Path(folder) / "config.json").is_file() and any(Path(folder).glob("*.safetensors"))
    ids, _ = global_batch(4, 2, 10, model.config.vocab_size)
    return {"logits": model(ids).logits.detach(), "complete": complete, "refused": refused,
            "plain_written": (Path(folder) / f"plain{rank}").exists()}


def ep_exchange_variants(rank: int, world: int, variants: list[dict], batch: int = 8, seq: int = 12):
    """The same global batch through several expert-parallel exchanges, one fresh model each.

    A variant gives `expert_parallel` (the config section), optional `model` overrides, and optional
    `bias` ({expert: value}: a router bias that pulls every token to those experts). Returns, per
    variant, this rank's logits, the gradients reassembled as `ep_forward_backward` does, and the
    hidden-state rows this rank sent to other ranks and to other nodes of 2 (counted at the
    collective, forward and backward)."""
    from ds_optimus.parallel.traffic import ExchangeTraffic

    results = []
    for variant in variants:
        overrides = dict(variant.get("model", {}))
        if "bias" in variant:
            overrides["router_bias_update_rate"] = 0.01
        model = tiny_moe(**overrides)
        for expert, value in variant.get("bias", {}).items():
            for layer in model.model.layers:
                layer.mlp.gate.expert_bias[expert] = value
        config = {"optimus": {"expert_parallel": variant["expert_parallel"]}}
        groups = setup_moe(model, OptimusConfig.from_ds_config(config))
        ids, probe = global_batch(1, batch, seq, model.config.vocab_size)
        mine = slice(rank * (batch // world), (rank + 1) * (batch // world))
        with ExchangeTraffic() as traffic:
            logits = model(ids[mine]).logits
            (logits.float() * probe[mine]).sum().backward()
        row_bytes = model.config.hidden_size * logits.element_size()
        dispatcher = model.model.layers[0].mlp.experts.expert_parallel
        results.append({"logits": logits.detach(), "grads": summed_grads(model, groups), "rows": mine,
                        "dedup": dispatcher.deduplicated, "rows_sent": traffic.rows(row_bytes),
                        "rows_between_nodes": traffic.rows(row_bytes, node_size=2)})
    return results
