"""Workers (run on N gloo processes by tests/distributed.py) for tests/test_hf_engine.py: what
`deepspeed.initialize` makes of a config's `optimus` section once ds_optimus is imported."""

from __future__ import annotations

import torch

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}  # DeepSpeed's Adam: a compile


def _model(preset: str, **overrides):
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM

    torch.manual_seed(0)
    return MulaForCausalLM(MulaConfig.from_preset(preset, num_hidden_layers=1, **overrides))


def engine_refusals_worker(rank: int, world: int, cases: list[tuple[str, dict, dict]]) -> list[str]:
    """For each (preset, overrides, optimus section) the one-line error deepspeed.initialize raises."""
    import deepspeed

    import ds_optimus  # noqa: F401
    from ds_optimus.parallel import apply_expert_parallel

    messages = []
    for preset, overrides, optimus in cases:
        model = _model(preset, **overrides)
        if optimus.pop("already_ep", False):  # made expert-parallel by the script itself
            apply_expert_parallel(model, world)
        try:
            deepspeed.initialize(model=model, config={**BASE, "optimus": optimus})
            messages.append("no error")
        except Exception as err:  # noqa: BLE001 - the message is what is tested
            messages.append(f"{type(err).__name__}: {err}")
    return messages


def client_optimizer_worker(rank: int, world: int) -> dict:
    """An optimizer built over the full model before deepspeed.initialize (as the Trainer builds its
    own, with its decay / no-decay groups): the engine shards the experts, re-points the optimizer at
    the shards and moves them into `moe` groups that keep their group's settings."""
    import deepspeed

    import ds_optimus  # noqa: F401

    model = _model("mula-tiny-moe")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )
    # No ZeRO: the engine steps this optimizer itself, so its groups are what trains.
    config = {**{k: v for k, v in BASE.items() if k != "optimizer"}, "zero_optimization": {"stage": 0}}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config={**config, "optimus": {"expert_parallel": {"size": 2}}}
    )
    live = {id(p) for p in model.parameters()}
    groups = optimizer.param_groups
    experts = model.model.layers[0].mlp.experts
    ids = torch.randint(2, 4096, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    before = experts.gate_up_proj.detach().clone()
    engine.step()
    return {
        "rows": experts.gate_up_proj.shape[0],
        "stale": sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in live),
        "moe": sorted((g["name"], g["weight_decay"], len(g["params"])) for g in groups if g.get("moe")),
        "counted": sum(len(g["params"]) for g in groups),
        "params": len(list(model.parameters())),
        "moved": float((experts.gate_up_proj.detach() - before).abs().max()),
        "same_optimizer": engine.optimizer is optimizer,
    }


def engine_router_bias_worker(rank: int, world: int) -> list[dict]:
    """A Mula with a router bias under a bare DeepSpeed engine (gradient accumulation 2): the engine
    moves the bias once per optimizer step, at the accumulation boundary, from the loads of both
    micro-batches summed over the ranks."""
    import deepspeed

    import ds_optimus  # noqa: F401

    model = _model("mula-tiny-moe", router_bias_update_rate=0.01)
    config = {**BASE, "gradient_accumulation_steps": 2}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gate = model.model.layers[0].mlp.gate
    seen = []
    for micro in range(4):
        ids = torch.randint(2, 4096, (2, 16), generator=torch.Generator().manual_seed(10 * rank + micro))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        seen.append(
            {
                "bias_moved": float(gate.expert_bias.abs().sum()),
                "pending": float(gate.load_since_update.sum()),
                "drives": engine.drives_router_bias,
            }
        )
    return seen


def plain_engine_worker(rank: int, world: int, stage: int) -> dict:
    """A plain torch model and a DeepSpeed config without an `optimus` section through
    deepspeed.initialize, ds_optimus imported: what the engine built and whether ds_optimus left any
    state on it (attributes whose names it uses)."""
    import deepspeed

    import ds_optimus  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {**BASE, "zero_optimization": {"stage": stage}}
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    loss = engine(torch.randn(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()
    ours = sorted(n for n in vars(engine) if "ds_optimus" in n or n == "drives_router_bias")
    return {
        "optimizer": type(engine.optimizer).__name__,
        "ours": ours,
        "moe": engine.has_moe_layers,
        "hooked": type(engine)._configure_distributed_model.__module__,
    }
