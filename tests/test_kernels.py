"""The Triton expert kernels (`ds_optimus.ops`) against the reference, forward and backward.

Without a GPU they run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1); without
Triton the kernel tests skip and the fallback tests still run. The oracle is the library's pure
PyTorch path (permute, one matmul pair per expert, weighted combine) under autograd, evaluated in
float64 on the same inputs, so the tolerances measure the kernels' own error: float32 within 1e-4,
bfloat16 within 2e-2 (relative, over the whole tensor).
"""

from __future__ import annotations

import json

import needs
import pytest
import torch

import ds_optimus.ops as ops
from ds_optimus.moe import MoELayer, grouped_swiglu, permute_tokens, plan_routing, select_backend, unpermute_combine
from ds_optimus.ops import moe as ops_moe

needs_triton = needs.unless(ops.triton_available(), "Triton is not installed (pip install triton)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SMALL_BLOCKS = {
    name: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16) for name in ("gate_up", "down", "down_bwd", "dx", "weight_grad")
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_case(tokens, hidden, inter, experts, k, kind, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    elif kind == "hot":  # one expert takes every token's first slot; the rest spread over a few
        rest = torch.stack([torch.randperm(experts - 1, generator=gen)[: k - 1] + 1 for _ in range(tokens)])
        index = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), rest], 1)
    else:  # "empty": only the first k + 1 experts are ever chosen
        index = torch.stack([torch.randperm(min(experts, k + 1), generator=gen)[:k] for _ in range(tokens)])
    tensors = [
        torch.randn(tokens, hidden, generator=gen),
        torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5,
        torch.randn(experts, hidden, inter, generator=gen) / inter**0.5,
        torch.rand(tokens, k, generator=gen),
        torch.randn(tokens, hidden, generator=gen),  # the output gradient
    ]
    tensors = [t.to(DEVICE, dtype) for t in tensors[:3]] + [tensors[3].to(DEVICE), tensors[4].to(DEVICE, dtype)]
    return plan_routing(index.to(DEVICE), experts), tensors


def oracle(plan, x, gate_up, down, weights, grad):
    """Output and gradients of (x, gate_up, down, weights) in float64 through the pure-PyTorch path."""
    leaves = [t.detach().double().requires_grad_() for t in (x, gate_up, down, weights)]
    rows = permute_tokens(leaves[0], plan)
    y = grouped_swiglu(rows, leaves[1], leaves[2], plan.counts, "silu", "reference")
    out = unpermute_combine(y, leaves[3], plan)
    out.backward(grad.double())
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def fused(plan, x, gate_up, down, weights, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down, weights)]
    out = ops.moe_swiglu(*leaves[:3], plan.counts, plan.token_of_sorted, plan.order, leaves[3])
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiles of 16 so that the small test shapes span several row, column and reduction tiles."""
    from ds_optimus.ops import _triton_moe

    monkeypatch.setattr(_triton_moe, "_tuned", {})  # no GPU-tuned tiles over these
    for name, cfg in SMALL_BLOCKS.items():
        monkeypatch.setitem(_triton_moe.DEFAULT_BLOCKS, name, {**_triton_moe.DEFAULT_BLOCKS[name], **cfg})


# tokens, hidden, inter, experts, k, routing: sizes that are not multiples of the tiles
CASES = [
    (37, 40, 24, 6, 1, "random"),
    (29, 40, 24, 6, 2, "empty"),
    (33, 48, 20, 8, 3, "hot"),
    (21, 24, 40, 8, 5, "random"),
    (19, 40, 24, 8, 8, "random"),
    (1, 32, 16, 4, 2, "random"),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_forward_and_backward_match_reference(case, dtype, small_blocks):
    plan, tensors = make_case(*case, dtype)
    assert ops.kernel_for(DEVICE) == "triton"
    got = fused(plan, *tensors)
    want = oracle(plan, *tensors)
    for name, a, b in zip(("output", "d_x", "d_gate_up", "d_down", "d_weights"), got, want, strict=True):
        assert a.dtype == (tensors[3].dtype if name == "d_weights" else dtype)
        assert rel(a, b) <= TOL[dtype], (name, rel(a, b))
    if case[5] == "empty":  # experts that got no rows get exactly zero weight gradients
        unused = plan.counts == 0
        assert unused.any() and not got[2][unused].any() and not got[3][unused].any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_tiles_match_reference(dtype):
    """The tile sizes the GPU uses, with rows, columns and reductions shorter than one tile."""
    plan, tensors = make_case(45, 72, 40, 8, 4, "random", dtype)
    for name, a, b in zip(
        ("output", "d_x", "d_gate_up", "d_down", "d_weights"),
        fused(plan, *tensors),
        oracle(plan, *tensors),
        strict=True,
    ):
        assert rel(a, b) <= TOL[dtype], (name, rel(a, b))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sorted_rows_op_matches_reference(dtype, small_blocks):
    """`swiglu_experts` on rows already sorted by expert (the expert-parallel path), with an expert
    that gets no rows and one that gets most."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 41, 3, 0, 17])
    rows = torch.randn(int(counts.sum()), 40, generator=gen)
    gate_up = torch.randn(6, 48, 40, generator=gen) / 6
    down = torch.randn(6, 40, 24, generator=gen) / 5
    probe = torch.randn(rows.shape[0], 40, generator=gen)
    results = []
    for kind, dt in (("ops", dtype), ("reference", torch.float64)):
        leaves = [t.detach().to(DEVICE, dt).requires_grad_() for t in (rows, gate_up, down)]
        if kind == "ops":
            y = ops.swiglu_experts(*leaves, counts.to(DEVICE))
        else:
            y = grouped_swiglu(*leaves, counts, "silu", "reference")
        y.backward(probe.to(DEVICE, dt))
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
    for name, a, b in zip(("output", "d_rows", "d_gate_up", "d_down"), *results, strict=True):
        assert rel(a, b) <= TOL[dtype], (name, rel(a, b))
    assert not results[0][2][1].any() and not results[0][3][4].any()


@needs_triton
def test_no_rows_gives_zeros():
    x = torch.zeros(0, 32, device=DEVICE, requires_grad=True)
    gate_up = torch.randn(4, 48, 32, device=DEVICE, requires_grad=True)
    down = torch.randn(4, 32, 24, device=DEVICE, requires_grad=True)
    y = ops.swiglu_experts(x, gate_up, down, torch.zeros(4, dtype=torch.long, device=DEVICE))
    assert y.shape == (0, 32)
    y.sum().backward()
    assert gate_up.grad.shape == gate_up.shape and not gate_up.grad.any() and not down.grad.any()


@needs_triton
def test_results_are_deterministic(small_blocks):
    """No atomics: two runs give bit-identical outputs and gradients."""
    plan, tensors = make_case(31, 40, 24, 8, 4, "random", torch.bfloat16)
    first, second = fused(plan, *tensors), fused(plan, *tensors)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@needs_triton
def test_ops_pass_torch_library_checks():
    """Schema, fake (meta) implementation and autograd registration, as `torch.library.opcheck`
    tests them (what torch.compile relies on)."""
    plan, (x, gate_up, down, weights, _) = make_case(9, 16, 16, 4, 2, "random", torch.float32)
    args = (
        x.requires_grad_(),
        gate_up.requires_grad_(),
        down.requires_grad_(),
        plan.counts,
        plan.token_of_sorted,
        plan.order,
        weights.reshape(-1).requires_grad_(),
        2,
    )
    torch.library.opcheck(
        torch.ops.ds_optimus.swiglu_experts_fwd.default,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@needs_triton
def test_works_under_torch_compile(small_blocks):
    plan, tensors = make_case(23, 32, 16, 4, 2, "random", torch.float32)
    x, gate_up, down, weights, grad = tensors

    def layer(x, gate_up, down, weights):
        return torch.tanh(ops.moe_swiglu(x, gate_up, down, plan.counts, plan.token_of_sorted, plan.order, weights))

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (layer, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down, weights)]
        fn(*leaves).backward(grad)
        results.append([leaf.grad for leaf in leaves])
    for a, b in zip(*results, strict=True):
        assert rel(a, b) <= 1e-6


@needs_triton
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_layer_runs_the_kernels_when_asked(capacity_factor, monkeypatch):
    """`experts_backend="triton"` puts the layer on the fused op (dropless) or on the sorted-rows op
    (capacity limit), with the same result as the reference backend."""
    calls = []
    for name in ("moe_swiglu", "swiglu_experts"):
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
    torch.manual_seed(0)
    layer = MoELayer(32, 24, num_experts=6, top_k=2, capacity_factor=capacity_factor, experts_backend="triton")
    x = torch.randn(2, 9, 32)
    results = []
    for backend in ("triton", "reference"):
        layer.zero_grad()
        layer.experts.experts_backend = backend
        leaf = x.clone().requires_grad_()
        out, _ = layer(leaf)
        out.square().sum().backward()
        results.append(
            [out.detach(), leaf.grad, layer.experts.gate_up_proj.grad.clone(), layer.gate.weight.grad.clone()]
        )
    assert calls == ["moe_swiglu" if capacity_factor is None else "swiglu_experts"]
    for a, b in zip(*results, strict=True):
        assert rel(a, b) <= 1e-5


# -- selection and fallbacks (these run without Triton too) ------------------------------------------


def test_auto_never_picks_the_interpreter_on_cpu():
    assert select_backend("cpu", torch.bfloat16) != "triton"


def test_env_forces_the_reference(monkeypatch):
    plan, (x, gate_up, down, weights, _) = make_case(11, 16, 16, 4, 2, "random", torch.float32)
    monkeypatch.setenv("DS_OPTIMUS_KERNELS", "reference")
    assert ops.kernel_for(DEVICE) == "reference"
    monkeypatch.setattr(ops_moe, "_triton", lambda: pytest.fail("Triton used though the reference was forced"))
    out = ops.moe_swiglu(x, gate_up, down, plan.counts, plan.token_of_sorted, plan.order, weights)
    want = unpermute_combine(
        grouped_swiglu(permute_tokens(x, plan), gate_up, down, plan.counts, "silu", "reference"), weights, plan
    )
    assert rel(out, want) <= 1e-6


def test_bad_settings_and_inputs_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("DS_OPTIMUS_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"^DS_OPTIMUS_KERNELS must be one of auto, triton, reference, got 'fast'$"):
        ops.kernel_for("cpu")
    monkeypatch.setenv("DS_OPTIMUS_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="DS_OPTIMUS_KERNELS=triton but"):
        ops.kernel_for("cpu")
    monkeypatch.delenv("DS_OPTIMUS_KERNELS")
    with pytest.raises(ValueError, match="shapes do not match"):
        ops.swiglu_experts(torch.randn(4, 32), torch.randn(2, 48, 32), torch.randn(2, 32, 20), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="must share one of"):
        ops.swiglu_experts(
            torch.randn(4, 32).double(), torch.randn(2, 48, 32), torch.randn(2, 32, 24), torch.tensor([2, 2])
        )
    with pytest.raises(ValueError, match="counts sum to 3 but there are 4 rows"):
        ops.swiglu_experts(torch.randn(4, 32), torch.randn(2, 48, 32), torch.randn(2, 32, 24), torch.tensor([2, 1]))


def test_without_triton_the_layer_falls_back(monkeypatch):
    monkeypatch.setattr(ops_moe, "triton_available", lambda: False)
    assert not ops.triton_runs_on("cuda")
    assert select_backend("cpu", torch.float32) == "grouped_mm"
    with pytest.raises(ValueError, match=r"experts backend 'triton' does not support .* \(Triton is not installed\)"):
        select_backend("cpu", torch.float32, "triton")
    assert ops.kernel_for("cpu") == "reference"


def test_tuned_tiles_are_fitted_to_the_gpus_shared_memory_for_float32_data():
    # The H200 tiles are tuned on bf16; float32 doubles every tile. On the H200 (232,448 bytes of shared
    # memory per block) Triton refused the tuned "dx" tiles on float32 data asking for 294,912 bytes.
    needs.module("triton", "pip install triton")
    from ds_optimus.ops import _triton_moe as k

    limit = 232448
    tuned = json.loads(k._TUNED_FILE.read_text())["NVIDIA H200"]
    assert k.shared_memory_bytes("dx", tuned["dx"], 4) == 294912
    for name, cfg in tuned.items():
        assert k.fit_shared_memory(name, cfg, 2, limit) == cfg  # bf16: as tuned
        fitted = k.fit_shared_memory(name, cfg, 4, limit)
        assert k.shared_memory_bytes(name, fitted, 4) <= limit
        assert fitted["num_stages"] >= 2 and (fitted == cfg) == (k.shared_memory_bytes(name, cfg, 4) <= limit)
    assert k.fit_shared_memory("dx", tuned["dx"], 4, None) == tuned["dx"]  # no limit known: unchanged
