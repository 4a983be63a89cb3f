"""Uniform routing (`optimus.moe.force_uniform_routing`), the benchmark mode: the router picks the assigned
experts (the seed's pattern with one sequence, the general assignment for any micro-batch), every expert
gets the same load in one process and over a 2-rank expert-parallel group, the router still learns (its
weights are its softmax restricted to the assigned experts), the mode is refused in a run that keeps a
model, and off by default the routing is unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from train_workers import metrics_worker, tiny_config

import ds_optimus  # noqa: F401  (registers the experts implementation)
from ds_optimus.config import ConfigError, OptimusConfig, check_run_config
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.hf_models.mula.modeling_mula import MulaTopKRouter, uniform_expert_assignment
from ds_optimus.moe import MoELayer
from ds_optimus.parallel import setup_moe
from ds_optimus.parallel.expert_parallel import set_uniform_routing


def seed_mask(sequence_length: int, num_experts: int, top_k: int, ep_ind: int = 0) -> torch.Tensor:
    """The seed's allowed experts [S, E] for one sequence on EP rank `ep_ind`: token s gets the top_k
    consecutive experts from (ep_ind * S + s) mod E on, wrapping at E (its loop, written out again)."""
    mask = torch.zeros(sequence_length, num_experts, dtype=torch.bool)
    for s in range(sequence_length):
        first = (ep_ind * sequence_length + s) % num_experts
        for j in range(top_k):
            mask[s, (first + j) % num_experts] = True
    return mask


def dealt_slots(tokens: int, num_experts: int, top_k: int, rank: int = 0) -> list[list[int]]:
    """The general assignment, slot by slot: the group's slots numbered rank by rank, token by token
    (k per token), slot i dealt to expert i mod E."""
    rows = []
    for t in range(tokens):
        first_slot = (rank * tokens + t) * top_k
        rows.append([(first_slot + j) % num_experts for j in range(top_k)])
    return rows


def uniform_layer(num_experts: int = 8, top_k: int = 2, rank: int = 0, **kwargs) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(16, 8, num_experts, top_k, force_uniform_routing=True, initializer_range=0.5, **kwargs)
    layer.gate.uniform_routing_rank = rank
    return layer


def chosen(layer: MoELayer, batch: int, seq: int) -> torch.Tensor:
    _, aux = layer(torch.randn(batch, seq, 16))
    return aux["top_k_index"]


@pytest.mark.parametrize("seq, experts, rank", [(6, 8, 0), (6, 8, 1), (13, 4, 3), (3, 8, 2)])
def test_one_sequence_with_one_expert_per_token_is_the_seeds_pattern(seq, experts, rank):
    index = chosen(uniform_layer(experts, 1, rank), 1, seq)
    picked = torch.zeros(seq, experts, dtype=torch.bool).scatter_(1, index, True)
    assert torch.equal(picked, seed_mask(seq, experts, 1, rank))


@pytest.mark.parametrize("seq, experts, top_k, rank", [(6, 8, 2, 0), (6, 8, 3, 1), (5, 8, 8, 1), (7, 6, 4, 2)])
def test_more_experts_per_token_are_the_seeds_consecutive_experts_from_slot_g_times_k(seq, experts, top_k, rank):
    # The seed starts token g's k consecutive experts at g mod E; ours start at g*k mod E: token g of
    # rank r picks what the seed's mask gives sequence position g*k (rank 0), wrap-around included.
    index = chosen(uniform_layer(experts, top_k, rank), 1, seq)
    picked = torch.zeros(seq, experts, dtype=torch.bool).scatter_(1, index, True)
    positions = (rank * seq + torch.arange(seq)) * top_k
    assert torch.equal(picked, seed_mask(int(positions.max()) + 1, experts, top_k)[positions])


def test_the_seeds_start_balances_less_often_than_dealing_slots():
    # 4 tokens x top-2 = 8 slots over 8 experts: the seed's starts 0..3 load experts 1-3 twice, 4 once, 5-7 never.
    seed = seed_mask(4, 8, 2).sum(0)
    assert seed.tolist() == [1, 2, 2, 2, 1, 0, 0, 0]
    ours = torch.bincount(uniform_expert_assignment(4, 8, 2).flatten(), minlength=8)
    assert ours.tolist() == [1] * 8


@pytest.mark.parametrize("batch, seq, experts, top_k, rank", [(3, 5, 8, 2, 1), (4, 7, 6, 4, 0), (2, 9, 5, 3, 3)])
def test_any_micro_batch_gets_the_dealt_slots_of_its_flattened_tokens(batch, seq, experts, top_k, rank):
    index = chosen(uniform_layer(experts, top_k, rank), batch, seq)
    assert index.tolist() == dealt_slots(batch * seq, experts, top_k, rank)
    assert all(len(set(row)) == top_k for row in index.tolist())  # distinct experts per token


@pytest.mark.parametrize("tokens, experts, top_k", [(12, 8, 2), (30, 8, 2), (7, 6, 4), (10, 7, 3)])
def test_loads_are_equal_when_experts_divide_the_slots_else_within_one(tokens, experts, top_k):
    load = torch.bincount(uniform_expert_assignment(tokens, experts, top_k).flatten(), minlength=experts)
    slots = tokens * top_k
    assert int(load.sum()) == slots
    if slots % experts == 0:
        assert load.tolist() == [slots // experts] * experts
    else:  # the first (tokens x k) mod E experts get one slot more
        extra = slots % experts
        assert load.tolist() == [slots // experts + 1] * extra + [slots // experts] * (experts - extra)


def uniform_model(seed: int = 0, **optimus) -> MulaForCausalLM:
    torch.manual_seed(seed)
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe"))
    setup_moe(model, OptimusConfig.parse({"moe": {"force_uniform_routing": True}, **optimus}, "optimus"))
    return model


def routed(model: MulaForCausalLM, ids: torch.Tensor):
    """The model's output on `ids` and the experts [T, k] each MoE layer chose."""
    experts = []
    hooks = [
        m.register_forward_hook(lambda module, args, out: experts.append(out[2]))
        for m in model.modules()
        if isinstance(m, MulaTopKRouter)
    ]
    try:
        return model(ids), experts
    finally:
        for hook in hooks:
            hook.remove()


def test_every_layer_of_a_model_gets_the_same_balanced_pattern_in_one_process():
    model = uniform_model()
    batch, seq = 3, 4  # 12 tokens x top-2 = 24 slots: 3 per expert
    ids = torch.randint(2, model.config.vocab_size, (batch, seq))
    out, indices = routed(model, ids)
    assert len(indices) == model.config.num_hidden_layers
    expected = dealt_slots(batch * seq, 8, 2)
    for index in indices:
        assert index.tolist() == expected
        assert torch.bincount(index.flatten(), minlength=8).tolist() == [3] * 8
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("scoring, normalise", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_the_weights_are_the_routers_scores_restricted_to_the_assigned_experts(scoring, normalise):
    layer = uniform_layer(8, 3, 1, scoring_func=scoring, norm_topk_prob=normalise)
    x = torch.randn(10, 16)
    logits, weights, index = layer.gate(x)
    assigned = logits.gather(1, index).double()
    restricted = F.softmax(assigned, -1) if scoring == "softmax" else torch.sigmoid(assigned)
    if scoring == "sigmoid":
        restricted = restricted / restricted.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), restricted, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.sum(-1).double(), torch.ones(10, dtype=torch.float64))
    assert torch.equal(logits, F.linear(x, layer.gate.weight))  # the losses see the unmasked logits


def test_the_router_weight_still_gets_a_gradient():
    layer = uniform_layer(8, 2)
    out, aux = layer(torch.randn(2, 6, 16))
    out.square().sum().backward()  # through the routing weights only
    grad = layer.gate.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    layer.zero_grad()
    _, aux = layer(torch.randn(2, 6, 16))
    (aux["aux_loss"] + aux["z_loss"]).backward()  # and through the losses
    assert torch.isfinite(layer.gate.weight.grad).all() and layer.gate.weight.grad.abs().sum() > 0


def test_a_selection_bias_does_not_move_the_assigned_experts():
    config = MulaConfig.from_preset("mula-tiny-moe", router_bias_update_rate=1e-3)
    router = MulaTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.copy_(torch.arange(8.0) * 100)  # would send every token to experts 6 and 7
    router.force_uniform_routing = True
    _, _, index = router(torch.randn(16, config.hidden_size))
    assert index.tolist() == dealt_slots(16, 8, 2)


def _original_forward(router: MulaTopKRouter, x: torch.Tensor):
    """The router as it was before uniform routing (softmax top-k, no selection bias)."""
    logits = F.linear(x, router.weight)
    weights, index = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), router.top_k, dim=-1)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return logits, weights.to(logits.dtype), index


@pytest.mark.parametrize("normalise", [False, True])
def test_off_by_default_the_routing_is_unchanged_bitwise(normalise):
    assert OptimusConfig.parse({}, "optimus").moe.force_uniform_routing is False
    torch.manual_seed(1)
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", norm_topk_prob=normalise))
    setup_moe(model, OptimusConfig.parse({}, "optimus"))
    routers = [m for m in model.modules() if isinstance(m, MulaTopKRouter)]
    assert len(routers) == model.config.num_hidden_layers and not any(r.force_uniform_routing for r in routers)
    x = torch.randn(24, model.config.hidden_size)
    for router in routers:
        for got, want in zip(router(x), _original_forward(router, x), strict=True):
            assert torch.equal(got, want)
    # and turned on, then off again, the model is where it was
    ids = torch.randint(2, model.config.vocab_size, (2, 8))
    before, chosen_before = routed(model, ids)
    set_uniform_routing(model, True)
    on, _ = routed(model, ids)
    set_uniform_routing(model, False)
    after, chosen_after = routed(model, ids)
    assert torch.equal(before.logits, after.logits) and not torch.equal(before.logits, on.logits)
    assert all(torch.equal(a, b) for a, b in zip(chosen_before, chosen_after, strict=True))


def test_a_saved_model_routes_normally(tmp_path):
    model = uniform_model()
    model.save_pretrained(tmp_path)
    assert "force_uniform_routing" not in (tmp_path / "config.json").read_text()
    loaded = MulaForCausalLM.from_pretrained(tmp_path)
    assert not any(getattr(m, "force_uniform_routing", False) for m in loaded.modules())


def _run_config(**optimus) -> dict:
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "optimus": {"moe": {"force_uniform_routing": True}},
    }
    for section, values in optimus.items():
        config["optimus"].setdefault(section, {}).update(values)
    return config


@pytest.mark.parametrize(
    "optimus, named",
    [
        ({}, ["optimus.train.export false", "optimus.checkpoint.enabled false"]),
        ({"train": {"export": False}}, ["optimus.checkpoint.enabled false"]),
        ({"checkpoint": {"enabled": False}}, ["optimus.train.export false"]),
    ],
)
def test_a_run_that_keeps_a_model_is_refused_in_one_line_naming_the_keys(optimus, named):
    with pytest.raises(ConfigError) as err:
        check_run_config(_run_config(**optimus))
    message = str(err.value)
    assert "\n" not in message and message.startswith("optimus.moe.force_uniform_routing ")
    assert all(key in message for key in named)
    assert message.count(" false") == len(named)


def test_a_run_that_keeps_nothing_takes_it_and_a_bad_value_is_one_line():
    opt = check_run_config(_run_config(train={"export": False}, checkpoint={"enabled": False}))
    assert opt.moe.force_uniform_routing is True
    with pytest.raises(ConfigError, match=r"^optimus\.moe\.force_uniform_routing must be true or false, got 'yes'$"):
        OptimusConfig.parse({"moe": {"force_uniform_routing": "yes"}}, "optimus")


# -- expert parallelism --------------------------------------------------------------------------------


def _ep_uniform_worker(rank: int, world: int, batch: int, seq: int) -> dict:
    model = uniform_model(expert_parallel={"size": world})
    ids = torch.randint(2, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
    per_rank = batch // world
    out, indices = routed(model, ids[rank * per_rank : (rank + 1) * per_rank])
    out.logits.sum().backward()
    router = model.model.layers[0].mlp.gate
    return {
        "index": [i.tolist() for i in indices],
        "logits": out.logits.detach(),
        "rank": router.uniform_routing_rank,
        "router_grad": router.weight.grad.clone(),
    }


@pytest.mark.slow
def test_two_ep_ranks_spread_the_group_batch_evenly_and_match_one_process():
    # 2 rows of 5 tokens per rank x top-2 = 20 slots: no rank balances alone (20 is not a multiple of
    # 8), the group's 40 slots do, 5 per expert, because rank 1 continues where rank 0 ends.
    batch, seq = 4, 5
    results = run_distributed(_ep_uniform_worker, 2, batch, seq)
    assert [r["rank"] for r in results] == [0, 1]
    single = uniform_model()
    ids = torch.randint(2, single.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
    whole, indices = routed(single, ids)
    for layer in range(single.config.num_hidden_layers):
        group = results[0]["index"][layer] + results[1]["index"][layer]
        assert group == indices[layer].tolist() == dealt_slots(batch * seq, 8, 2)
        assert torch.bincount(torch.tensor(group).flatten(), minlength=8).tolist() == [5] * 8
        assert torch.bincount(torch.tensor(results[0]["index"][layer]).flatten(), minlength=8).tolist() != [5] * 8
    torch.testing.assert_close(torch.cat([r["logits"] for r in results]), whole.logits, rtol=1e-5, atol=1e-5)
    assert all(torch.isfinite(r["router_grad"]).all() and r["router_grad"].abs().sum() > 0 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("world, seq_len", [(1, 32), (2, 30)], ids=["one-process", "ep2"])
def test_a_benchmark_run_loads_every_expert_equally_in_every_step(tmp_path, world, seq_len):
    """Through ds_optimus.train: one sequence per micro-batch, two micro-batches per step. At EP 2 each
    rank's 30 tokens x top-2 = 60 slots do not divide by the 8 experts, the group's 120 do."""
    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        moe={"force_uniform_routing": True},
        expert_parallel={"size": world},
        data={"seq_len": seq_len},
        train={"steps": 3, "export": False, "eval_interval": 0, "eval_batches": 1, "warmup_steps": 0},
        checkpoint={"enabled": False},
    )
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    records = [r for r in run_distributed(metrics_worker, world, config)[0] if "loss" in r]
    preset = MulaConfig.from_preset("mula-tiny-moe")
    per_expert = world * 2 * seq_len * preset.num_experts_per_tok // preset.num_experts
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["expert_tokens"] == [[per_expert] * preset.num_experts] * preset.num_hidden_layers
        assert record["expert_imbalance_max"] == 1.0
    assert not (tmp_path / "run" / "hf").exists() and not (tmp_path / "run" / "checkpoints").exists()
