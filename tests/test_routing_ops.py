"""The routing, gather and combine op (`ds_optimus.ops.routing`): its compiled CPU build against the
reference functions, the MoE layer and every expert-parallel exchange with the kernels against the
PyTorch path they replaced, and the op as one of DeepSpeed's (builder lookup, `ds_report`, prebuilt
at install with DS_BUILD_OPS=1, JIT-built otherwise, the reference where nothing can build it).

Tolerances. The C++ op adds the same float32 terms in the same order as the reference, with separate
multiply and add roundings (-ffp-contract=off): route, gather, combine and the gathered gradient rows
are bitwise equal. Only the routing weights' gradient (a dot product over H) sums in another order:
two orders of H float32 additions differ by at most H * 2**-23 * sum|terms|. Against the PyTorch path,
layers and exchanges differ only there, and in bf16 by the weights' rounding to bf16 that path does
before it multiplies; their tolerances are stated where they are used.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import needs
import pytest
import torch
from distributed import run_distributed
from doc_blocks import doc_block, ran
from ep_workers import ep_exchange_variants, tiny_moe

from ds_optimus.moe import MoELayer
from ds_optimus.ops import routing

ROOT = Path(__file__).resolve().parents[1]
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def op():
    module = routing.cpu_module()
    assert module is not None, f"the CPU op did not build: {routing.cpu_build_error()}"
    return module


def _ids(tokens, k, experts, gen, hot=False):
    ids = (
        torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
        if k <= experts
        else torch.randint(0, experts, (tokens, k), generator=gen)
    )
    if hot:
        ids[:, 0] = experts - 1
    return ids


@pytest.mark.parametrize(
    "tokens, k, experts, hot",
    [
        (1, 1, 1, False),
        (37, 3, 5, False),
        (300, 8, 64, True),
        (5000, 8, 240, False),
        (700, 2, 300, False),
        (64, 4, 3, False),
    ],
)
def test_route_is_the_stable_sort_bitwise(op, tokens, k, experts, hot):
    """Large enough (5000 x 8 slots) for several chunks on several threads."""
    ids = _ids(tokens, k, experts, torch.Generator().manual_seed(tokens), hot)
    for dtype in (torch.int64, torch.int32):
        got, want = op.route(ids.to(dtype), experts), routing.route(ids, experts)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_gather_and_combine_match_the_reference(op, dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, k, experts, hidden = 300, 4, 16, 72
    order, inverse, _ = routing.route(_ids(tokens, k, experts, gen), experts)
    row_of, table = order // k, inverse.view(tokens, k).clone()
    table[::3, 1] = -1  # padded entries, as the deduplicated exchange's member tables have
    table[5] = -1  # a row with no members: zeros
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    src = torch.randn(tokens * k, hidden, generator=gen).to(dtype)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    for weight in (None, torch.rand(tokens * k, generator=gen).to(dtype), torch.rand(tokens * k, generator=gen)):
        assert torch.equal(op.gather(x, row_of, weight), routing.gather(x, row_of, weight))
        assert torch.equal(op.combine(src, table, weight), routing.combine(src, table, weight))
        assert not op.combine(src, table, weight)[5].any()
        rows, grad_w = op.combine_backward(grad, src, row_of, weight, True)
        want_rows, want_w = routing.combine_backward(grad, src, row_of, weight, True)
        assert torch.equal(rows, want_rows) and grad_w.dtype == want_w.dtype
        # a sum of `hidden` products in another order: within hidden * 2**-23 * sum|terms| (float64: its eps)
        magnitude = (src.double() * grad.double().index_select(0, row_of)).abs().sum(1)
        eps = torch.finfo(torch.float64).eps if dtype == torch.float64 else EPS32
        assert ((grad_w.double() - want_w.double()).abs() <= hidden * eps * magnitude).all()
        assert op.combine_backward(grad, src, row_of, weight, False)[1].numel() == 0


def test_results_do_not_depend_on_the_thread_count(op):
    gen = torch.Generator().manual_seed(4)
    ids = _ids(6000, 8, 64, gen)
    src, grad = torch.randn(6000 * 8, 24, generator=gen).bfloat16(), torch.randn(6000, 24, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            order, inverse, counts = op.route(ids, 64)
            table = inverse.view(6000, 8)
            outs.append(
                [
                    order,
                    inverse,
                    counts,
                    op.combine(src, table, None),
                    *op.combine_backward(grad, src, order // 8, None, True),
                ]
            )
        finally:
            torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_ops_pass_torch_library_opcheck(op, dtype):
    """Fake implementations, autograd registration and schemas agree with the real ops
    (torch.library.opcheck: what torch.compile relies on), with int32 and strided indices too."""
    gen = torch.Generator().manual_seed(5)
    tokens, k, experts, hidden = 13, 3, 5, 24
    ids = _ids(tokens, k, experts, gen)
    order, inverse, _ = routing.route(ids, experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    src = torch.randn(tokens * k, hidden, generator=gen).to(dtype).requires_grad_()
    w = torch.rand(tokens * k, generator=gen).requires_grad_()
    table = inverse.view(tokens, k)
    torch.library.opcheck(torch.ops.ds_optimus.route, (ids, experts))
    torch.library.opcheck(torch.ops.ds_optimus.gather_rows, (x, (order // k).int(), table))
    torch.library.opcheck(torch.ops.ds_optimus.combine_rows, (src, w, table.t().contiguous().t(), order // k))
    torch.library.opcheck(torch.ops.ds_optimus.combine_rows, (src, None, table, order // k))
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    torch.library.opcheck(
        torch.ops.ds_optimus.combine_rows_backward, (grad, src.detach(), order // k, w.detach(), True)
    )


def test_bad_input_is_one_line(op):
    with pytest.raises(RuntimeError, match=r"route: an expert id is outside \[0, 4\)"):
        routing.route_slots(torch.tensor([[0, 4]]), 4)
    with pytest.raises(RuntimeError, match=r"combine: a table entry is outside \[-1, 2\)"):
        op.combine(torch.zeros(2, 3), torch.tensor([[0, 5]]), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_with_the_kernels_matches_the_pytorch_path(monkeypatch, dtype):
    """Forward and backward of a MoE layer. float32: the routing weights' gradient sums its 64 products
    in another order (elementwise within 64 * 2**-23 * sum|terms|, 7.6e-6 relative to that sum), and
    PyTorch's addcmul may fuse a multiply-add: 1e-5 relative over each tensor. bf16: the PyTorch path
    rounds the weights to bf16 before multiplying, 2**-9 relative on each term: 1e-2."""
    torch.manual_seed(0)
    layer = MoELayer(64, 32, 8, 3).to(dtype)
    x = torch.randn(2, 17, 64).to(dtype)
    grad = torch.randn(2, 17, 64).to(dtype)
    results = {}
    for choice in ("auto", "reference"):
        monkeypatch.setenv("DS_OPTIMUS_KERNELS", choice)
        assert routing.routing_kernel("cpu") == ("cpu" if choice == "auto" else "reference")
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        out = layer(xs)[0]
        out.backward(grad)
        results[choice] = [out, xs.grad, layer.gate.weight.grad, layer.experts.gate_up_proj.grad]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(results["auto"], results["reference"], strict=True):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= tol


EXCHANGES = {
    "per-slot": {"size": 2, "dedup": False},
    "dedup": {"size": 2, "dedup": True},
    "dedup-chunked": {"size": 2, "dedup": True, "chunks": 3},
    "allgather": {"size": 2, "dispatch": "allgather"},
    "hierarchical": {"size": 4, "node_size": 2, "dedup": False},
    "hierarchical-dedup": {"size": 4, "node_size": 2, "dedup": True},
}


def _exchanges(monkeypatch, choice: str, names: list[str], world: int):
    monkeypatch.setenv("DS_OPTIMUS_KERNELS", choice)
    variants = [{"expert_parallel": EXCHANGES[n]} for n in names]
    variants += [{"expert_parallel": EXCHANGES[n], "model": {"moe_capacity_factor": 0.5}} for n in names[:1]]
    return run_distributed(ep_exchange_variants, world, variants)


def _assert_close(got, want, tol, kernel):
    """Within `tol`, and `got` ran on the `kernel` module alone, `want` on the PyTorch path."""

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    kernel = kernel.rsplit(".", 1)[-1]
    layers = tiny_moe().config.num_hidden_layers
    for g_rank, w_rank in zip(got, want, strict=True):
        for g, w in zip(g_rank, w_rank, strict=True):
            used = g["kernels"]
            assert {name.split(".")[0] for name in used} == {kernel}, used
            # every exchange combines a layer's rows at least once, forward and backward (the all-gather
            # one by combine alone, the others with gather and combine_backward too)
            assert used.get(f"{kernel}.combine", 0) >= layers and sum(used.values()) >= 2 * layers, used
            assert {name.split(".")[0] for name in w["kernels"]} <= {"routing"}, w["kernels"]  # the PyTorch path
            assert rel(g["logits"], w["logits"]) <= tol
            assert all(rel(g["grads"][n], w["grads"][n]) <= tol for n in w["grads"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, names",
    [(2, ["per-slot", "dedup", "dedup-chunked", "allgather"]), (4, ["hierarchical", "hierarchical-dedup"])],
    ids=["flat", "hierarchical"],
)
def test_every_exchange_with_the_compiled_op_matches_the_pytorch_path(monkeypatch, world, names):
    """Each exchange, and the per-slot one with a capacity limit, with the compiled op and with the
    PyTorch path, through the 4-layer tiny model. The sums are in the same order but for the weights'
    gradient dot products, and PyTorch's addcmul may fuse its multiply and add (one rounding fewer):
    each combine differs by a few float32 ulps of its terms, which the attention and norms of 4 layers
    amplify to about 1e-6 relative on some gradients (measured); 1e-5, as against one process
    (test_expert_parallel.py)."""
    got = _exchanges(monkeypatch, "auto", names, world)
    _assert_close(got, _exchanges(monkeypatch, "reference", names, world), 1e-5, routing.cpu_module().__name__)


@pytest.mark.slow
def test_every_exchange_with_the_triton_kernels_matches_the_pytorch_path(monkeypatch):
    """The Triton kernels, in Triton's CPU interpreter, on every exchange (EP 4 for the hierarchical
    ones), within the same 1e-5 as the compiled op."""
    needs.module("triton", "pip install triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    names = ["per-slot", "dedup", "dedup-chunked", "allgather"]
    _assert_close(
        _exchanges(monkeypatch, "triton", names, 2),
        _exchanges(monkeypatch, "reference", names, 2),
        1e-5,
        "_triton_routing",
    )
    names = ["hierarchical", "hierarchical-dedup"]
    _assert_close(
        _exchanges(monkeypatch, "triton", names, 4),
        _exchanges(monkeypatch, "reference", names, 4),
        1e-5,
        "_triton_routing",
    )


def test_deepspeed_finds_the_builder_and_ds_report_lists_the_op():
    from deepspeed.accelerator import get_accelerator

    from ds_optimus.ops.op_builder import MoERoutingBuilder, prebuilt_available

    builder = get_accelerator().create_op_builder("MoERoutingBuilder")
    assert isinstance(builder, MoERoutingBuilder) and builder.name == "moe_routing"
    assert builder.is_compatible()
    command = doc_block("DeepSpeed's op report lists it with its own", "bash").strip()
    assert command == "python -m ds_optimus.ds_report"
    ran(command)
    done = subprocess.run(
        [sys.executable, *command.split()[1:], "--hide_errors_and_warnings"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("moe_routing "))
    assert ("[YES]" in line) == prebuilt_available() and "[OKAY]" in line
    assert any(line.startswith("cpu_adam ") for line in done.stdout.splitlines())  # DeepSpeed's own still there


def test_without_a_compiler_the_op_is_not_compatible_and_the_reference_serves(monkeypatch, capfd):
    """No C++ compiler: ds_report's "compatible" says no, and the layer runs the PyTorch path after one
    line saying why (no "compiling" line first)."""
    from ds_optimus.ops import op_builder

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not op_builder.MoERoutingBuilder().is_compatible()
    monkeypatch.setattr(op_builder.MoERoutingBuilder, "load", lambda self, verbose=False: pytest.fail("built"))
    monkeypatch.setattr(op_builder, "prebuilt_available", lambda: False)
    monkeypatch.setattr(routing, "_cpu_module", None)
    monkeypatch.setattr(routing, "_cpu_failed", None)
    assert routing.routing_kernel("cpu") == "reference"
    err = capfd.readouterr().err
    assert "no C++ compiler (no-such-compiler-here)" in err and "compiling" not in err


def test_without_a_build_the_reference_serves_and_says_so_once(monkeypatch, capfd):
    from ds_optimus.ops import op_builder

    def fails(self, verbose=False):
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr(op_builder.MoERoutingBuilder, "load", fails)
    monkeypatch.setattr(routing, "_cpu_module", None)
    monkeypatch.setattr(routing, "_cpu_failed", None)
    assert routing.routing_kernel("cpu") == "reference" and routing.routing_kernel("cpu") == "reference"
    err = capfd.readouterr().err
    assert err.count("the compiled moe_routing CPU op is unavailable (RuntimeError: no C++ compiler)") == 1
    torch.manual_seed(0)
    out, _ = MoELayer(16, 8, 4, 2)(torch.randn(5, 16))  # the layer runs on the PyTorch path
    assert out.shape == (5, 16)


@pytest.mark.slow
def test_jit_build_says_one_line_and_loads(tmp_path):
    """Without a prebuilt op, the first use compiles it into the environment's folder, said in one line;
    the folder's lock, left by a build killed before (its process ended), is taken over and said so."""
    folder = tmp_path / "ext" / "moe_routing"
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / "lock").touch()
    (folder / "lock.owner").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 0.0}))
    code = (
        "import ds_optimus; from ds_optimus.ops.op_builder import MoERoutingBuilder; import torch; "
        "m = MoERoutingBuilder().jit_load(verbose=False); "
        "print(m.__file__); print(m.route(torch.tensor([[1, 0]]), 2)[2].tolist())"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-2].startswith(str(tmp_path / "ext")) and lines[-1] == "[1, 1]"
    said = [line for line in done.stderr.splitlines() if "moe_routing op" in line]
    assert len(said) == 2 and "compiling ds_optimus' moe_routing op" in said[0] and "is ready" in said[1]
    assert f"the build lock {folder / 'lock'} was left by pid {dead.pid} on " in done.stderr, done.stderr[-3000:]
    assert not (folder / "lock").exists()


def test_a_build_is_said_by_rank_zero_alone_not_by_each_nodes_first_rank(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder.builder import OpBuilder

    from ds_optimus.integrations.deepspeed_ops import prepare_op_builds

    built = []
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: built.append(self.name) or "module")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    said = []
    prepare_op_builds(say=said.append)
    op = SimpleNamespace(name="moe_routing")
    for rank, local_rank in (("1", "0"), ("3", "1"), ("0", "0")):  # the second node's first rank, another, rank 0
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert OpBuilder.jit_load(op) == "module"
    assert built == ["moe_routing"] * 3
    assert len(said) == 2 and "compiling ds_optimus' moe_routing op" in said[0] and "is ready" in said[1]


@pytest.mark.slow
def test_ds_build_ops_prebuilds_the_op_at_install(tmp_path, installed_copy):
    """`DS_BUILD_OPS=1 pip install --no-build-isolation` of a clean copy (the session's, tests/installed_copy.py)
    compiles the op into the installed package, which then loads it without building anything."""
    built = list((installed_copy / "ds_optimus" / "ops").glob("moe_routing_op*.so"))
    assert len(built) == 1
    code = (
        "from ds_optimus.ops.op_builder import MoERoutingBuilder, prebuilt_available; "
        "m = MoERoutingBuilder().load(); print(prebuilt_available(), m.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(installed_copy), "TORCH_EXTENSIONS_DIR": str(tmp_path / "none")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["True", str(built[0])]
    assert "compiling" not in done.stderr and not (tmp_path / "none").exists()
