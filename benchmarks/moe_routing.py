"""The MoE layer's routing, gather and combine: the compiled kernels (`ds_optimus.ops.routing`, the C++
op on the CPU, Triton on a GPU) against the PyTorch path they replaced (`DS_OPTIMUS_KERNELS=reference`),
in one run, interleaved, after warm-up, medians of several runs.

Measured, forward + backward:
  part         routing (sort by expert), gather into expert order, weighted combine, on [T, H] rows
               (the experts left out: the gathered rows go straight to the combine)
  layer        one OLMoE-shaped MoE layer (router, routing, grouped SwiGLU experts, combine), EP 1
  layer_ep2    the same layer under expert parallelism on 2 processes (gloo), with the per-slot and
               the deduplicated all-to-all exchanges
Ratios are reference / kernels (above 1: the kernels are faster).

    python benchmarks/moe_routing.py [--tokens 4096] [--hidden 2048] [--inter 1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_medians, machine, write_result  # noqa: E402

import ds_optimus  # noqa: E402,F401
from ds_optimus.moe import MoELayer, permute_tokens, plan_routing, unpermute_combine  # noqa: E402
from ds_optimus.ops import routing  # noqa: E402

EXPERTS, TOP_K = 64, 8  # OLMoE: 64 experts, top-8, hidden 2048, expert intermediate 1024


@contextlib.contextmanager
def kernels(choice: str):
    """Run the block with $DS_OPTIMUS_KERNELS = `choice` ("auto": the compiled kernels)."""
    old = os.environ.get("DS_OPTIMUS_KERNELS")
    os.environ["DS_OPTIMUS_KERNELS"] = choice
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DS_OPTIMUS_KERNELS")
        else:
            os.environ["DS_OPTIMUS_KERNELS"] = old


def part_case(tokens: int, hidden: int, dtype: torch.dtype, device: str):
    """fwd + bwd of route, gather and combine, the experts left out (the gathered rows go to the combine)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).to(device)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    w = torch.rand(tokens, TOP_K, generator=g).to(device, dtype)
    grad = torch.randn(tokens, hidden, generator=g).to(device, dtype)

    def run(choice: str):
        def go():
            with kernels(choice):
                xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
                plan = plan_routing(ids, EXPERTS)
                rows = permute_tokens(xs, plan)
                out = unpermute_combine(rows, ws, plan)  # the experts left out: only this part is timed
                out.backward(grad)
            return out, xs.grad, ws.grad

        return go

    return run


def layer_case(tokens: int, hidden: int, inter: int, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    # On a GPU the Triton experts would take the whole step, gather and combine included: the grouped
    # GEMM backend leaves routing, gather and combine to the op measured here.
    backend = "grouped_mm" if device == "cuda" else None
    layer = MoELayer(hidden, inter, EXPERTS, TOP_K, experts_backend=backend).to(device, dtype)
    x = torch.randn(1, tokens, hidden, dtype=dtype, device=device)
    grad = torch.randn(1, tokens, hidden, dtype=dtype, device=device)

    def run(choice: str):
        def go():
            with kernels(choice):
                layer.zero_grad(set_to_none=True)
                xs = x.detach().requires_grad_()
                out = layer(xs)[0]
                out.backward(grad)
            return out, xs.grad, layer.gate.weight.grad

        return go

    return run


def compare(run, repeats: int, device: str) -> dict:
    """Both paths, interleaved; checks that they agree first."""
    got, want = run("auto")(), run("reference")()
    diff = max(
        ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        for a, b in zip(got, want, strict=True)
    )
    times = interleaved_medians({"kernels": run("auto"), "reference": run("reference")}, repeats, 2, device)
    return {
        "kernels_s": times["kernels"]["median_s"],
        "reference_s": times["reference"]["median_s"],
        "speedup": times["reference"]["median_s"] / times["kernels"]["median_s"],
        "max_rel_diff": diff,
    }


def ep2_worker(rank, world, tokens, hidden, inter, dtype_name, repeats, dedup):
    from ds_optimus.parallel import apply_expert_parallel

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layer = MoELayer(hidden, inter, EXPERTS, TOP_K).to(dtype)
    apply_expert_parallel(layer, world, dedup=dedup)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, tokens // world, hidden, generator=g).to(dtype)
    grad = torch.randn(1, tokens // world, hidden, generator=g).to(dtype)

    def run(choice):
        def go():
            with kernels(choice):
                torch.distributed.barrier()
                layer.zero_grad(set_to_none=True)
                layer(x.detach().requires_grad_())[0].backward(grad)
                torch.distributed.barrier()

        return go

    times = interleaved_medians({"kernels": run("auto"), "reference": run("reference")}, repeats, 2)
    return {name: t["median_s"] for name, t in times.items()}


def ep2(tokens, hidden, inter, dtype_name, repeats, dedup) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from distributed import run_distributed

    results = run_distributed(ep2_worker, 2, tokens, hidden, inter, dtype_name, repeats, dedup)
    k, r = max(x["kernels"] for x in results), max(x["reference"] for x in results)
    return {"kernels_s": k, "reference_s": r, "speedup": r / k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--skip-ep2", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = routing.routing_kernel(device)
    print(f"kernels on {device}: {kind}" + (f" ({routing.cpu_build_error()})" if kind == "reference" else ""))
    results = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        res = {
            "part": compare(part_case(args.tokens, args.hidden, dtype, device), args.repeats, device),
            "layer": compare(layer_case(args.tokens, args.hidden, args.inter, dtype, device), args.repeats, device),
        }
        if device == "cpu" and not args.skip_ep2:
            for label, dedup in (("layer_ep2_per_slot", False), ("layer_ep2_dedup", True)):
                res[label] = ep2(args.tokens, args.hidden, args.inter, name, args.repeats, dedup)
        results[name] = res
        for what, r in res.items():
            diff = f"  (rel diff {r['max_rel_diff']:.1e})" if "max_rel_diff" in r else ""
            print(
                f"{name:9s} {what:20s} reference {r['reference_s'] * 1e3:9.2f} ms  "
                f"kernels {r['kernels_s'] * 1e3:9.2f} ms  speedup {r['speedup']:.2f}x{diff}"
            )
    out = args.out or f"moe_routing_{device}"  # benchmarks/results/<out>.json
    write_result(
        out,
        {
            "machine": machine(),
            "kernel": kind,
            "shape": {
                "tokens": args.tokens,
                "hidden": args.hidden,
                "intermediate": args.inter,
                "experts": EXPERTS,
                "top_k": TOP_K,
            },
            "repeats": args.repeats,
            "results": results,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
