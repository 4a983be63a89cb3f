"""The dropless MoE layer: routing plan, permutation, experts backends against the reference,
capacity dropping, backend selection and the standalone layer (global-batch load balancing and
expert parallelism are in test_expert_parallel.py)."""

import math

import pytest
import torch

from ds_optimus.hf_models.mula import MulaConfig
from ds_optimus.hf_models.mula.modeling_mula import MulaExperts
from ds_optimus.moe import (
    MoELayer,
    available_backends,
    grouped_swiglu,
    permute_tokens,
    plan_routing,
    select_backend,
    unpermute_combine,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def routing(kind: str, tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if kind == "one_expert":  # every slot of every token goes to one expert (k = 1)
        return torch.full((tokens, 1), experts - 1)
    # "empty": only the first k + 1 experts (or fewer) are ever chosen, the rest receive nothing
    used = min(experts, k + 1)
    return torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)])


# -- routing plan and permutation ----------------------------------------------------------------------
def test_plan_sorts_slots_by_expert_stably_and_inverts():
    index = torch.tensor([[2, 0], [0, 3], [2, 1], [3, 0]])
    plan = plan_routing(index, num_experts=5)
    assert plan.counts.tolist() == [3, 1, 2, 2, 0]
    assert index.reshape(-1)[plan.order].tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    assert plan.order.tolist()[:3] == [1, 2, 7]  # stable: tokens keep their order inside an expert
    assert torch.equal(plan.order[plan.inverse], torch.arange(8))
    assert torch.equal(plan.token_of_sorted, plan.order // 2)


def test_permute_and_combine_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(0)
    index = routing("random", 7, 5, 3, gen)
    plan = plan_routing(index, 5)
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: permute_tokens(t, plan), (x,))
    y = torch.randn(21, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: unpermute_combine(a, b, plan), (y, w))


def test_permute_then_combine_is_the_weighted_sum_of_copies():
    index = torch.tensor([[1, 0], [0, 1], [1, 1]])
    plan = plan_routing(index, 2)
    x = torch.randn(3, 6)
    w = torch.rand(3, 2)
    out = unpermute_combine(permute_tokens(x, plan), w, plan)
    torch.testing.assert_close(out, x * w.sum(-1, keepdim=True))


# -- experts backends against the reference --------------------------------------------------------------
def _backend_case(backend, device, dtype, tokens, hidden, inter, experts, k, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    index = routing(kind, tokens, experts, k, gen)
    plan = plan_routing(index, experts)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)
    down = torch.randn(experts, hidden, inter, generator=gen) / math.sqrt(inter)
    probe = torch.randn(tokens * index.shape[1], hidden, generator=gen)
    leaves = [t.to(device, dtype).requires_grad_() for t in (x, gate_up, down)]
    rows = permute_tokens(leaves[0], plan_on(plan, device))
    y = grouped_swiglu(rows, leaves[1], leaves[2], plan.counts.to(device), "silu", backend)
    (y.float() * probe.to(device)).sum().backward()
    return [t.detach().float().cpu() for t in (y, *(leaf.grad for leaf in leaves))]


def plan_on(plan, device):
    return type(plan)(*(t.to(device) if torch.is_tensor(t) else t for t in vars(plan).values()))


SHAPES = [  # tokens, hidden, intermediate, experts, k, routing
    (37, 64, 32, 8, 3, "random"),
    (29, 48, 40, 6, 2, "empty"),
    (16, 32, 24, 4, 1, "one_expert"),
    (1, 32, 16, 8, 8, "random"),
    (23, 10, 6, 5, 2, "random"),  # rows not 16-byte aligned: grouped_mm falls back to the loop
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["grouped_mm", "looped"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_backend_matches_reference(backend, dtype, device, shape):
    if backend not in available_backends(device, dtype):
        pytest.skip(f"{backend} does not run {dtype} on {device}")
    for seed in range(2):
        ref = _backend_case("reference", device, torch.float64 if device == "cpu" else torch.float32, *shape, seed)
        got = _backend_case(backend, device, dtype, *shape, seed)
        for name, a, b in zip(("output", "d_rows", "d_gate_up", "d_down"), got, ref, strict=True):
            assert rel(a, b) <= TOL[dtype], (name, rel(a, b))


@pytest.mark.parametrize("backend", ["grouped_mm", "looped"])
@pytest.mark.parametrize("act", ["gelu", "relu", "linear"])
def test_other_activations_match_reference(backend, act):
    """Non-SiLU activations take the generic backward (autograd on the recomputed activation); an
    activation that returns its input ("linear") must not be overwritten in place."""
    gen = torch.Generator().manual_seed(0)
    index = routing("random", 19, 4, 2, gen)
    plan = plan_routing(index, 4)
    weights = [
        torch.randn(19, 32, generator=gen),
        torch.randn(4, 48, 32, generator=gen) / 6,
        torch.randn(4, 32, 24, generator=gen) / 5,
    ]
    probe = torch.randn(38, 32, generator=gen)
    results = []
    for name in ("reference", backend):
        leaves = [w.clone().requires_grad_() for w in weights]
        y = grouped_swiglu(permute_tokens(leaves[0], plan), leaves[1], leaves[2], plan.counts, act, name)
        (y * probe).sum().backward()
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
    for a, b in zip(*results, strict=True):
        assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("backend", ["grouped_mm", "looped", "reference"])
def test_no_rows_gives_zero_output_and_gradients(backend):
    """An expert-parallel rank may receive no rows at all."""
    x = torch.zeros(0, 32, requires_grad=True)
    gate_up = torch.randn(4, 48, 32, requires_grad=True)
    down = torch.randn(4, 32, 24, requires_grad=True)
    y = grouped_swiglu(x, gate_up, down, torch.zeros(4, dtype=torch.long), "silu", backend)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert gate_up.grad is None or not gate_up.grad.any()
    assert down.grad is None or not down.grad.any()


def test_grouped_mm_backend_runs_the_grouped_gemm(monkeypatch):
    import ds_optimus.moe.experts as experts

    calls = []
    real = experts._GMM
    monkeypatch.setattr(experts, "_GMM", lambda *a, **k: calls.append(a[1].dim()) or real(*a, **k))
    out, _ = MoELayer(32, 16, 4, 2, experts_backend="grouped_mm")(torch.randn(7, 32, requires_grad=True))
    out.sum().backward()
    assert len(calls) == 6  # 2 forward GEMMs, 2 activation-gradient GEMMs, 2 ragged-K weight gradients


def _layer_case(impl, dtype, device, tokens, hidden, inter, experts, k, kind, seed, **config):
    torch.manual_seed(seed)
    cfg = MulaConfig(
        vocab_size=8,
        pad_token_id=None,
        eos_token_id=None,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=1,
        head_dim=2,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=inter,
        **config,
    )
    cfg._experts_implementation = impl
    module = MulaExperts(cfg)
    torch.nn.init.normal_(module.gate_up_proj, std=hidden**-0.5)
    torch.nn.init.normal_(module.down_proj, std=inter**-0.5)
    module.to(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    index = routing(kind, tokens, experts, k, gen).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    w = torch.rand(tokens, index.shape[1], generator=gen).to(device, dtype).requires_grad_()
    out = module(x, index, w)
    (out.float() * torch.randn(out.shape, generator=gen).to(device)).sum().backward()
    return [t.detach().float().cpu() for t in (out, x.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_layer_matches_the_model_reference(shape, dtype, device):
    """The whole experts path (permute, auto-selected backend, combine) against Mula's eager experts,
    which share no code with it: outputs and gradients of inputs, routing weights and expert weights."""
    ref = _layer_case("eager", torch.float64 if device == "cpu" else torch.float32, device, *shape, seed=3)
    got = _layer_case("ds_optimus", dtype, device, *shape, seed=3)
    for name, a, b in zip(("output", "d_input", "d_weights", "d_gate_up", "d_down"), got, ref, strict=True):
        assert rel(a, b) <= TOL[dtype], (name, rel(a, b))


def test_layer_is_deterministic():
    first = _layer_case("ds_optimus", torch.float32, "cpu", 64, 32, 16, 8, 4, "random", seed=5)
    again = _layer_case("ds_optimus", torch.float32, "cpu", 64, 32, 16, 8, 4, "random", seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_other_transformers_experts_classes_run_on_the_layer():
    """OLMoE's experts (same stacked layout, no expert-parallel attributes of their own) on the
    ds_optimus implementation give their eager outputs; the attributes are declared at their defaults."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    torch.manual_seed(0)
    cfg = OlmoeConfig(hidden_size=32, intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    module = OlmoeExperts(cfg)
    torch.nn.init.normal_(module.gate_up_proj, std=0.2)
    torch.nn.init.normal_(module.down_proj, std=0.2)
    x = torch.randn(10, 32)
    index = routing("random", 10, 4, 2, torch.Generator().manual_seed(1))
    weights = torch.rand(10, 2)
    eager = module(x, index, weights)
    cfg._experts_implementation = "ds_optimus"
    ours = module(x, index, weights)
    assert rel(ours, eager) <= 1e-5
    assert (module.num_local_experts, module.expert_parallel, module.expert_groups, module.experts_backend) == (
        4,
        None,
        None,
        None,
    )


# -- capacity dropping (explicit option) ------------------------------------------------------------------
def test_generous_capacity_equals_dropless():
    dropless = _layer_case("ds_optimus", torch.float32, "cpu", 40, 32, 16, 4, 2, "empty", seed=1)
    capped = _layer_case("ds_optimus", torch.float32, "cpu", 40, 32, 16, 4, 2, "empty", seed=1, moe_capacity_factor=4.0)
    assert all(torch.equal(a, b) for a, b in zip(dropless, capped, strict=True))


def test_capacity_drops_the_slots_past_each_experts_capacity():
    cfg = MulaConfig(
        vocab_size=8,
        pad_token_id=None,
        eos_token_id=None,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        head_dim=2,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        moe_capacity_factor=1.0,
    )
    cfg._experts_implementation = "ds_optimus"
    module = MulaExperts(cfg)
    torch.nn.init.normal_(module.gate_up_proj)
    torch.nn.init.normal_(module.down_proj)
    x = torch.randn(8, 16)
    index = torch.tensor([[0], [0], [0], [1], [0], [2], [1], [0]])  # capacity = ceil(8 / 4) = 2 per expert
    weights = torch.rand(8, 1)
    out = module(x, index, weights)
    cfg._experts_implementation = "eager"
    full = module(x, index, weights)
    kept = torch.tensor([0, 1, 3, 5, 6])  # first two of expert 0, both of expert 1, the one of expert 2
    dropped = torch.tensor([2, 4, 7])
    torch.testing.assert_close(out[kept], full[kept])
    assert torch.equal(out[dropped], torch.zeros(3, 16))


def test_capacity_factor_is_validated():
    with pytest.raises(ValueError, match="moe_capacity_factor must be None"):
        MulaConfig(moe_capacity_factor=0)


# -- backend selection ------------------------------------------------------------------------------------
def test_best_cpu_backend_is_grouped_mm_and_env_forces_reference(monkeypatch):
    assert select_backend("cpu", torch.float32) == "grouped_mm"
    assert available_backends("cpu", torch.float32)[-1] == "reference"
    monkeypatch.setenv("DS_OPTIMUS_EXPERTS_BACKEND", "reference")
    assert select_backend("cpu", torch.bfloat16) == "reference"


def test_unknown_backend_is_one_line_error():
    with pytest.raises(ValueError, match=r"^unknown experts backend 'fast'; registered: .*reference"):
        select_backend("cpu", torch.float32, "fast")


def test_forced_backend_is_used(monkeypatch):
    calls = []
    import ds_optimus.moe.experts as experts

    original = experts._BACKENDS["reference"].fn
    monkeypatch.setattr(experts._BACKENDS["reference"], "fn", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("DS_OPTIMUS_EXPERTS_BACKEND", "reference")
    MoELayer(32, 16, 4, 2)(torch.randn(5, 32))
    assert calls == [1]


# -- the standalone layer ------------------------------------------------------------------------------------
def test_moe_layer_outputs_losses_and_counts():
    layer = MoELayer(32, 16, num_experts=8, top_k=2)
    x = torch.randn(3, 11, 32, requires_grad=True)
    out, aux = layer(x)
    assert out.shape == x.shape
    assert aux["tokens_per_expert"].sum().item() == 3 * 11 * 2
    assert aux["aux_loss"].item() > 0.5 and aux["z_loss"].item() > 0
    (out.sum() + aux["aux_loss"]).backward()
    assert layer.gate.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_sigmoid_router_runs_through_the_layer():
    layer = MoELayer(32, 16, num_experts=8, top_k=3, scoring_func="sigmoid")
    out, aux = layer(torch.randn(10, 32))
    assert torch.isfinite(out).all() and aux["top_k_index"].shape == (10, 3)


@pytest.mark.parametrize("backend", ["grouped_mm", "looped"])
def test_frozen_expert_weights_get_no_gradient(backend):
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 32, generator=gen, requires_grad=True)
    gate_up = torch.randn(4, 48, 32, generator=gen) / 6
    down = torch.randn(4, 32, 24, generator=gen, requires_grad=True)
    counts = torch.tensor([10, 0, 25, 5])
    grouped_swiglu(rows, gate_up, down, counts, "silu", backend).sum().backward()
    ref_rows, ref_down = rows.detach().clone().requires_grad_(), down.detach().clone().requires_grad_()
    grouped_swiglu(ref_rows, gate_up, ref_down, counts, "silu", "reference").sum().backward()
    assert gate_up.grad is None
    assert rel(rows.grad, ref_rows.grad) <= 1e-5 and rel(down.grad, ref_down.grad) <= 1e-5
    assert not down.grad[1].any()  # the expert without rows


def test_looped_backend_rejects_counts_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match="counts sum to 9"):
        grouped_swiglu(
            torch.randn(10, 32), torch.randn(2, 48, 32), torch.randn(2, 32, 24), torch.tensor([4, 5]), "silu", "looped"
        )


def test_rowwise_dot_in_blocks_matches_float64():
    from ds_optimus.moe.permute import _rowwise_dot

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5000, 64, generator=gen)  # more rows than one block
    for dtype in (torch.float32, torch.bfloat16):
        got = _rowwise_dot(a.to(dtype), b.to(dtype), chunk_rows=512)
        want = (a.to(dtype).double() * b.to(dtype).double()).sum(-1)
        assert got.shape == (5000,) and rel(got.double(), want) <= TOL[dtype]
