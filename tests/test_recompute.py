"""Selective activation recomputation (`optimus.train.activation_checkpointing` as a list of parts):
the same losses, gradients and router side effects as without recomputation, the parts really
replayed and their activations really dropped, the config's errors, and the planner's model of it
(saved bytes against measured ones, the recomputed forward in the time model, the search, the
configs it writes, the pre-flight line). The trainer path with a list runs in
tests/test_plan.py::test_activation_checkpointing_gives_the_same_losses (2 processes at EP 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_optimus.config import ConfigError, OptimusConfig, TrainConfig
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.hf_models.mula.modeling_mula import CACHE_NAME, RECOMPUTE_PARTS
from ds_optimus.plan import BUILTIN, Layout, LayoutError, ModelShape, estimate_memory, estimate_time, layout_config
from ds_optimus.plan import layout as plan_layout
from ds_optimus.plan.search import RECOMPUTE_CHOICES, candidate_layouts, search
from ds_optimus.train.model_setup import enable_activation_checkpointing
from ds_optimus.train.preflight import check_run

ROOT = Path(__file__).resolve().parents[1]
CHOICES = [
    True,
    ["moe"],
    ["attention"],
    ["norms"],
    ["moe", "attention", "norms"],
    ["moe", "norms"],
    ["attention", "norms"],
]


def _ids(choice) -> str:
    return "whole-layer" if choice is True else "+".join(choice)


def _model(choice, **overrides) -> MulaForCausalLM:
    torch.manual_seed(0)
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", router_bias_update_rate=0.01, **overrides)).train()
    if choice:
        enable_activation_checkpointing(model, choice)
    return model


def _step(model: MulaForCausalLM) -> dict:
    """One forward and backward pass; the loss parts, gradients, router loads and how often each
    sub-block ran (forward pre-hooks: a replay cut short after its last saved tensor counts too)."""
    calls: dict[str, int] = {}

    def counter(name):
        def hook(module, args):
            calls[name] = calls.get(name, 0) + 1

        return hook

    layer = model.model.layers[0]
    for name, module in (
        ("attention", layer.self_attn),
        ("input_norm", layer.input_layernorm),
        ("post_norm", layer.post_attention_layernorm),
        ("ffn", layer.mlp),
    ):
        module.register_forward_pre_hook(counter(name))
    torch.manual_seed(1)
    x = torch.randint(2, model.config.vocab_size, (2, 48))
    out = model(x, labels=x, use_cache=False)
    out.loss.backward()
    moe = [m for m in model.model.layers if m.is_moe]
    loads = [m.mlp.gate.load_since_update.clone() for m in moe]
    model.update_router_bias()
    return {
        "loss": out.loss.detach(),
        "aux": out.aux_loss.detach(),
        "z": out.z_loss.detach(),
        "tokens_per_expert": out.tokens_per_expert,
        "loads": loads,
        "bias": [m.mlp.gate.expert_bias.clone() for m in moe],
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "calls": calls,
    }


@pytest.fixture(scope="module")
def base() -> dict:
    return _step(_model(False))


@pytest.mark.parametrize("choice", CHOICES, ids=_ids)
def test_each_choice_gives_the_loss_gradients_and_router_counts_of_no_recomputation(choice, base):
    got = _step(_model(choice))
    for key in ("loss", "aux", "z"):
        torch.testing.assert_close(got[key], base[key], rtol=1e-6, atol=1e-6)
    # side effects: the tokens per expert of the losses, the load the router bias update counts
    # (each token slot once, not again in the replay), and the bias it then moves to
    assert torch.equal(got["tokens_per_expert"], base["tokens_per_expert"])
    for mine, theirs in zip(got["loads"] + got["bias"], base["loads"] + base["bias"], strict=True):
        assert torch.equal(mine, theirs)
    assert got["loads"][0].sum() == 2 * 48 * 2  # tokens x top-2, once
    assert got["grads"].keys() == base["grads"].keys()
    for name, grad in base["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=name)
    # the parts asked for (and only those) ran again in the backward pass
    parts = set(RECOMPUTE_PARTS) if choice is True else set(choice)
    again = {
        "attention": "attention" in parts,
        "ffn": "moe" in parts,
        "input_norm": "norms" in parts or (choice is True),
        "post_norm": "norms" in parts or (choice is True),
    }
    assert got["calls"] == {name: 2 if twice else 1 for name, twice in again.items()}, (choice, got["calls"])


def test_dense_layers_recompute_their_ffn_as_the_moe_part():
    base = _step(_model(False, moe_layer_freq=2))  # layers 0 and 2 dense, 1 and 3 MoE
    got = _step(_model(["moe", "norms"], moe_layer_freq=2))
    assert not _model(False, moe_layer_freq=2).model.layers[0].is_moe and got["calls"]["ffn"] == 2
    torch.testing.assert_close(got["loss"], base["loss"], rtol=1e-6, atol=1e-6)
    for name, grad in base["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=name)


def _saved_bytes(model: MulaForCausalLM, batch: int = 4, seq: int = 64) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one training forward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["mula-tiny-moe", "mula-tiny-dense"])
def test_saved_bytes_drop_as_the_planner_predicts(preset, dtype):
    shape = ModelShape.from_preset(preset)
    a = torch.empty((), dtype=dtype).element_size()
    measured = {}
    for choice in [False, *CHOICES]:
        torch.manual_seed(0)
        model = MulaForCausalLM(MulaConfig.from_preset(preset)).to(dtype).train()
        if choice:
            enable_activation_checkpointing(model, choice)
        measured[_ids(choice) if choice else "none"] = got = _saved_bytes(model)
        predicted = 4 * 64 * shape.saved_bytes_per_token(a, Layout(1, checkpointing=choice).checkpointing)
        assert abs(predicted / got - 1) < 0.03, (choice, predicted, got)
    # every part saves something, and the whole layer the most
    assert measured["none"] > measured["norms"] > measured["attention+norms"] > measured["moe+attention+norms"]
    assert measured["none"] > measured["moe"] > measured["moe+norms"] > measured["moe+attention+norms"]
    assert measured["attention"] < measured["none"] and measured["whole-layer"] < measured["moe+attention+norms"]


def test_planner_formula_matches_the_measured_olmoe_layer():
    """benchmarks/recompute_memory.py's measurement (one OLMoE-shaped layer, 1024 tokens) against
    `layer_saved_bytes_per_token`, within 15 % (the MoE block's own count, not recomputation's, is
    what differs: see the README)."""
    result = json.loads((ROOT / "benchmarks" / "results" / "recompute_memory.json").read_text())
    s = result["shape"]
    config = MulaConfig.from_preset(
        "mula-7b-a1b",
        num_hidden_layers=1,
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        num_experts=s["experts"],
        moe_intermediate_size=s["expert_intermediate"],
        num_experts_per_tok=s["top_k"],
    )
    shape = ModelShape.from_config(config)
    a = {"bf16": 2, "fp32": 4}[result["dtype"]]
    tokens = result["batch"] * result["seq_len"]
    assert set(result["rows"]) == {"none", "norms", "attention", "moe", "moe+attention+norms", "whole layer"}
    for name, row in result["rows"].items():
        choice = Layout(1, checkpointing=row["choice"]).checkpointing
        predicted = tokens * shape.layer_saved_bytes_per_token(a, True, choice)
        assert abs(predicted / row["measured_bytes"] - 1) < 0.15, (name, predicted, row["measured_bytes"])
    rows = result["rows"]
    assert rows["moe"]["measured_bytes"] < 0.5 * rows["none"]["measured_bytes"]
    assert rows["whole layer"]["measured_bytes"] == tokens * s["hidden"] * a  # the layer's input alone


# -- the switch --------------------------------------------------------------------------------------


def test_whole_layer_checkpointing_wins_and_evaluation_does_not_recompute(base):
    model = _model(["moe"])
    enable_activation_checkpointing(model)  # Transformers' own, over the parts: the layer is replayed once
    got = _step(model)
    assert got["calls"] == {"attention": 2, "input_norm": 2, "post_norm": 2, "ffn": 2}
    torch.testing.assert_close(got["loss"], base["loss"], rtol=1e-6, atol=1e-6)
    # in evaluation mode the parts run as they are (what autograd saves is that of no recomputation)
    plain, parts = _model(False).eval(), _model(["moe", "attention", "norms"]).eval()
    assert _saved_bytes(parts) == _saved_bytes(plain)
    x = torch.randint(2, 100, (1, 16))
    assert torch.equal(
        parts.generate(x, max_new_tokens=3, do_sample=False),  # with its cache, as usual
        plain.generate(x, max_new_tokens=3, do_sample=False),
    )


def test_a_cache_is_dropped_where_the_attention_is_recomputed():
    model = _model(["attention"])
    x = torch.randint(2, 100, (1, 8))
    out = model(x, use_cache=True)  # training with gradients: the replay would write the cache twice
    assert getattr(out, CACHE_NAME).get_seq_length() == 0
    model.eval()
    assert getattr(model(x, use_cache=True), CACHE_NAME).get_seq_length() == 8


def test_the_layer_refuses_unknown_or_repeated_parts():
    layer = _model(False).model.layers[0]
    assert layer.recompute == ()
    layer.recompute = ["norms", "moe"]
    assert layer.recompute == ("moe", "norms")  # kept in RECOMPUTE_PARTS' order
    for bad in (["mlp"], ["moe", "moe"]):
        with pytest.raises(ValueError, match="recompute: 'm"):
            layer.recompute = bad
    assert RECOMPUTE_PARTS == TrainConfig.recompute_parts == plan_layout.RECOMPUTE_PARTS


@pytest.mark.parametrize(
    "value, message",
    [
        (
            ["mlp"],
            'optimus.train.activation_checkpointing: unknown part \'mlp\' (allowed: "moe", "attention", "norms")',
        ),
        (
            [],
            'optimus.train.activation_checkpointing is an empty list; name parts to recompute ("moe", '
            '"attention", "norms") or use false',
        ),
        (
            ["moe", "norms", "moe"],
            'optimus.train.activation_checkpointing: \'moe\' is listed twice (allowed: "moe", "attention", "norms")',
        ),
        (
            "moe",
            "optimus.train.activation_checkpointing must be true, false or a list of parts to recompute "
            '("moe", "attention", "norms"), got \'moe\'',
        ),
        (1, "optimus.train.activation_checkpointing must be true, false or a list"),
    ],
)
def test_config_errors_are_one_line_naming_the_key(value, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.parse({"activation_checkpointing": value}, "optimus.train")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_config_accepts_true_false_and_lists():
    for value, recompute in (
        (True, True),
        (False, False),
        (["norms", "attention"], ("attention", "norms")),
        (["moe", "attention", "norms"], ("moe", "attention", "norms")),
    ):
        assert TrainConfig.parse({"activation_checkpointing": value}, "optimus.train").recompute == recompute


# -- the planner ----------------------------------------------------------------------------------------


def test_time_model_charges_the_recomputed_parts_forward():
    h100 = BUILTIN["h100"]
    shape = ModelShape.from_preset("mula-7b-a1b")
    base = Layout(world=64, ep=8, zero=1, micro=2, accumulation=8, dedup=True)
    t = {c: estimate_time(shape, base.with_(checkpointing=c), h100) for c in RECOMPUTE_CHOICES}
    none, whole = t[False], t[True]
    moe, attn, norms = t[("moe",)], t[("attention", "norms")], t[("norms",)]
    assert none.compute < norms.compute * 1.0001 and norms.step < none.step * 1.01  # the norms: almost free
    assert none.step < attn.step < moe.step < whole.step
    # the MoE block's replay runs its exchange again (6 all-to-alls a layer, as for the whole layer)
    assert moe.all_to_all == pytest.approx(whole.all_to_all) and attn.all_to_all == pytest.approx(none.all_to_all)
    # the parts together cost what the whole layer costs (up to the norms, counted as free)
    assert t[("moe", "attention", "norms")].compute == pytest.approx(whole.compute, rel=0.01)
    # MoE: the experts' forward at the expert rate, the routers' at the dense one
    dense, experts = shape.recompute_flops_per_token(("moe",), 4096)
    assert experts == 2 * shape.moe_layers * shape.top_k * 3 * shape.hidden * shape.expert_intermediate
    assert dense == shape.moe_layers * 2 * shape.experts * shape.hidden


def test_memory_model_of_the_choices():
    shape = ModelShape.from_preset("mula-100b-a7b")
    base = Layout(world=384, ep=24, zero=2, micro=2, hierarchical=True, dedup=True)
    m = {c: estimate_memory(shape, base.with_(checkpointing=c)) for c in RECOMPUTE_CHOICES}
    order = [False, ("norms",), ("attention", "norms"), ("moe", "attention", "norms"), True]
    assert all(m[a].activations > m[b].activations for a, b in zip(order, order[1:], strict=False))
    assert m[False].activations > m[("moe",)].activations > m[("moe", "norms")].activations
    # a replay rebuilds one region at a time: the MoE block's, smaller than a whole layer's
    assert 0 < m[("moe",)].transient <= m[True].transient


def test_search_considers_the_parts_and_picks_the_fastest_that_fits():
    aurora = BUILTIN["aurora"]
    shape = ModelShape.from_preset("mula-100b-a7b")
    layouts = candidate_layouts(shape, aurora, 384, 768, 4096)
    assert {lay.checkpointing for lay in layouts} == set(RECOMPUTE_CHOICES)
    plans, _ = search(shape, aurora, 384, 768, 4096)
    best = plans[0]
    whole, _ = search(shape, aurora, 384, 768, 4096, checkpointing=(False, True))
    assert best.fits and best.layout.checkpointing not in (False, True)
    assert best.time.step < whole[0].time.step  # selective recomputation buys speed here
    config = layout_config(best.layout, "mula-100b-a7b", aurora)
    assert config["optimus"]["train"]["activation_checkpointing"] == list(best.layout.checkpointing)
    assert OptimusConfig.from_ds_config(json.loads(json.dumps(config))).train.recompute == best.layout.checkpointing


def test_layout_carries_the_parts():
    lay = Layout(world=8, ep=8, checkpointing=["norms", "moe"])
    assert lay.checkpointing == ("moe", "norms") and lay.describe().endswith("ckpt:moe+norms")
    assert Layout(world=8, checkpointing=("moe", "attention", "norms")).describe().endswith("ckpt:moe+attn+norms")
    assert Layout(**json.loads(json.dumps(lay.to_json()))) == lay
    for bad in ([], ["mlp"], ["moe", "moe"]):
        with pytest.raises(LayoutError, match="checkpointing must be true, false or a list"):
            Layout(world=8, ep=8, checkpointing=bad).check(experts=64)


def test_preflight_names_the_recomputed_parts():
    config = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    lines = {}
    for value in (True, ["moe"], ["moe", "attention", "norms"], False):
        config["optimus"].setdefault("train", {})["activation_checkpointing"] = value
        layout = next(line for line in check_run(config, 2) if line.startswith("layout"))
        lines[_ids(value) if value else "none"] = layout
    assert lines["whole-layer"].endswith("; every decoder layer recomputed in the backward pass")
    assert lines["moe"].endswith("; the MoE block of every decoder layer recomputed in the backward pass")
    assert lines["moe+attention+norms"].endswith(
        "; the MoE block, the attention and the norms of every decoder layer recomputed in the backward pass"
    )
    assert "recomputed" not in lines["none"]
