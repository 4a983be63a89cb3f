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


def ep_forward_backward(
    rank: int, world: int, ep_size: int, node_size: int | None, overrides: dict, batch: int = 8, seq: int = 12
):
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
    return {
        "logits": logits.detach(),
        "grads": summed_grads(model, groups),
        "rows": mine,
        "kept_runs": kept,
        "runs": len(runs),
    }


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
    out = model(ids[rank * per_rank : (rank + 1) * per_rank], labels=ids[rank * per_rank : (rank + 1) * per_rank])
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
    mine = ids[rank * (batch // world) : (rank + 1) * (batch // world)]
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
    return {
        "params": params,
        "has_moe_layers": engine.has_moe_layers,
        "checkpoint_refused": refused,
        "registered": registered,
    }


def reference_sgd_step(world: int, batch: int = 8, seq: int = 12):
    """The same step on one process: the mean of the per-rank micro-batch losses, then SGD."""
    model = tiny_moe().train()
    model.set_experts_implementation("eager")
    ids, _ = global_batch(3, batch, seq, model.config.vocab_size)
    per_rank = batch // world
    loss = (
        sum(
            model(ids[r * per_rank : (r + 1) * per_rank], labels=ids[r * per_rank : (r + 1) * per_rank]).loss
            for r in range(world)
        )
        / world
    )
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
    return {
        "logits": model(ids).logits.detach(),
        "complete": complete,
        "refused": refused,
        "plain_written": (Path(folder) / f"plain{rank}").exists(),
    }


@contextlib.contextmanager
def routing_kernels_used():
    """A Counter of the routing ops' calls, as "module.function" of the implementation that ran them
    (`ds_optimus.ops.routing` picks one per call: the compiled CPU op's module, the Triton module, or
    its own reference functions)."""
    from collections import Counter

    from ds_optimus.ops import routing

    used, pick = Counter(), routing._impl

    class Counted:
        def __init__(self, impl) -> None:
            self.impl = impl

        def __getattr__(self, name):
            used[f"{self.impl.__name__.rsplit('.', 1)[-1]}.{name}"] += 1
            return getattr(self.impl, name)

    def counted(*args, **kwargs):
        return Counted(pick(*args, **kwargs))

    routing._impl = counted
    try:
        yield used
    finally:
        routing._impl = pick


def ep_exchange_variants(rank: int, world: int, variants: list[dict], batch: int = 8, seq: int = 12):
    """The same global batch through several expert-parallel exchanges, one fresh model each.

    A variant gives `expert_parallel` (the config section), optional `model` overrides, and optional
    `bias` ({expert: value}: a router bias that pulls every token to those experts). Returns, per
    variant, this rank's logits, the gradients reassembled as `ep_forward_backward` does, the
    hidden-state rows this rank sent to other ranks and to other nodes of 2 (counted at the
    collective, forward and backward), and the routing ops' calls by implementation."""
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
        with ExchangeTraffic() as traffic, routing_kernels_used() as kernels:
            logits = model(ids[mine]).logits
            (logits.float() * probe[mine]).sum().backward()
        row_bytes = model.config.hidden_size * logits.element_size()
        dispatcher = model.model.layers[0].mlp.experts.expert_parallel
        results.append(
            {
                "logits": logits.detach(),
                "grads": summed_grads(model, groups),
                "rows": mine,
                "dedup": dispatcher.deduplicated,
                "rows_sent": traffic.rows(row_bytes),
                "rows_between_nodes": traffic.rows(row_bytes, node_size=2),
                "kernels": dict(kernels),
            }
        )
    return results


def dispatcher_edge_cases(
    rank: int, world: int, cases: list[dict], k: int = 3, experts: int = 8, hidden: int = 16, inter: int = 8
) -> list[dict]:
    """`DedupDispatcher` on hand-made routing against the same sum computed on one rank with every
    expert. A case gives `node_size`, `chunks`, `tokens` (per rank: 0 is a rank that sends nothing,
    fewer than `chunks` leaves chunks empty) and `frozen` (expert weights without gradients). A
    fifth of the slots are dropped (-1), and each rank's first token has all of its slots dropped.
    Returns the largest relative differences of the output and of every gradient."""
    from ds_optimus.moe.experts import grouped_swiglu
    from ds_optimus.parallel import init_expert_parallel_groups
    from ds_optimus.parallel.overlap import dedup_dispatcher

    def swiglu(rows, counts, gate_up, down):
        return grouped_swiglu(rows, gate_up, down, counts, "silu", "reference")

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()

    results = []
    for case in cases:
        groups = init_expert_parallel_groups(world, case.get("node_size"))
        torch.manual_seed(0)
        gate_up, down = torch.randn(experts, 2 * inter, hidden) * 0.3, torch.randn(experts, hidden, inter) * 0.3
        local = experts // world
        mine = slice(groups.ep_rank * local, (groups.ep_rank + 1) * local)
        trainable = not case.get("frozen", False)
        shard = [gate_up[mine].clone().requires_grad_(trainable), down[mine].clone().requires_grad_(trainable)]
        g = torch.Generator().manual_seed(10 + rank)
        tokens = case["tokens"][rank]
        ids = (
            torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
            if tokens
            else torch.zeros(0, k, dtype=torch.long)
        )
        ids[torch.rand(tokens, k, generator=g) < 0.2] = -1
        ids[:1] = -1
        x = torch.randn(tokens, hidden, generator=g)
        w = torch.rand(tokens, k, generator=g)
        probe = torch.randn(tokens, hidden, generator=g)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        if case.get("copying_hook"):  # a saved-tensor hook that copies what it saves (as offloading does)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                out = dedup_dispatcher(groups, local, case["chunks"])(xs, ids, ws, swiglu, tuple(shard))
            try:
                (out * probe).sum().backward()
                results.append({"error": None})
            except RuntimeError as err:
                results.append({"error": str(err)})
            continue
        out = dedup_dispatcher(groups, local, case["chunks"])(xs, ids, ws, swiglu, tuple(shard))
        (out * probe).sum().backward()
        # the same on this rank with every expert
        full = [gate_up.clone().requires_grad_(), down.clone().requires_grad_()]
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = torch.zeros(tokens, hidden) + 0 * (xr.sum() + wr.sum())  # a graph even if every slot is dropped
        for t in range(tokens):
            for j in range(k):
                e = int(ids[t, j])
                if e >= 0:
                    one = torch.tensor([1])
                    ref[t] = ref[t] + wr[t, j] * swiglu(xr[t : t + 1], one, full[0][e : e + 1], full[1][e : e + 1])[0]
        (ref * probe).sum().backward() if tokens else None
        diffs = {"out": rel(out, ref) if tokens else 0.0}
        if tokens:
            diffs.update(x=rel(xs.grad, xr.grad), weights=rel(ws.grad, wr.grad))
        for name, mine_p, full_p in zip(("gate_up", "down"), shard, full, strict=True):
            total = full_p.grad if full_p.grad is not None else torch.zeros_like(full_p)
            dist.all_reduce(total)  # every rank's tokens, as the shard's owner sees them
            if trainable:
                diffs[name] = rel(mine_p.grad, total[mine])
            else:
                diffs[name] = 0.0 if mine_p.grad is None else float("inf")
        results.append(diffs)
    return results
