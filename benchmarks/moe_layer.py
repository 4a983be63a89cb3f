"""Forward + backward of one OLMoE-proportioned MoE layer on the CPU: ds_optimus against its peers.

Contestants (identical weights, one run, interleaved, median of repeats):
  ours             ds_optimus' dropless layer (the Mula MoE block on the "ds_optimus" experts path)
  hf_eager         Transformers' OlmoeSparseMoeBlock, experts_implementation="eager"
  hf_grouped_mm    ... "grouped_mm"
  hf_batched_mm    ... "batched_mm"
  deepspeed        deepspeed.moe.layer.MoE, top-k gate, drop_tokens=False (dropless)
  floor            the same matmul FLOPs as one dense chain (no routing, no gather, no activation)
Then, with 2 processes at EP=2, the share of the layer's time spent in dispatch/combine (the
all-to-all exchanges and the regrouping around them).

    python benchmarks/moe_layer.py [--tokens 4096] [--repeats 7] [--dtypes float32,bfloat16] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_medians, write_result  # noqa: E402

import ds_optimus  # noqa: E402,F401
from ds_optimus.moe import MoELayer, select_backend  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 64, 8


def build_contestants(tokens: int, dtype: torch.dtype, with_deepspeed: bool):
    torch.manual_seed(0)
    # Top-k weights renormalised everywhere: DeepSpeed's gate always does it, so every contestant
    # computes the same function and the outputs can be checked against each other.
    ours = MoELayer(HIDDEN, INTER, EXPERTS, TOP_K, norm_topk_prob=True).to(dtype)
    x = torch.randn(1, tokens, HIDDEN, dtype=dtype)
    grad = torch.randn(1, tokens, HIDDEN, dtype=dtype)

    def fwd_bwd(module, call):
        def run():
            module.zero_grad(set_to_none=True)
            inp = x.detach().requires_grad_()
            call(module, inp).backward(grad)

        return run

    contestants = {"ours": fwd_bwd(ours, lambda m, inp: m(inp)[0])}
    outputs = {"ours": ours(x)[0].detach()}
    skipped: dict[str, str] = {}

    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    cfg = OlmoeConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True
    )
    for impl in ("eager", "grouped_mm", "batched_mm"):
        c = copy.deepcopy(cfg)
        c._experts_implementation = impl
        block = OlmoeSparseMoeBlock(c).to(dtype)
        block.load_state_dict(ours.block.state_dict(), strict=False)
        if impl == "batched_mm":  # it gathers a copy of the expert weights for every token slot
            need = tokens * TOP_K * 3 * INTER * HIDDEN * x.element_size()
            if need > available_memory() // 2:
                skipped["hf_batched_mm"] = (
                    f"needs {need / 2**30:.0f} GiB for per-slot weight copies, "
                    f"{available_memory() / 2**30:.0f} GiB available"
                )
                continue
        outputs[f"hf_{impl}"] = block(x).detach()
        contestants[f"hf_{impl}"] = fwd_bwd(block, lambda m, inp: m(inp))

    if with_deepspeed:
        contestants["deepspeed"], outputs["deepspeed"] = deepspeed_contestant(ours, x, grad, dtype)

    s = tokens * TOP_K
    a = torch.randn(s, HIDDEN, dtype=dtype)
    w1 = torch.randn(HIDDEN, 2 * INTER, dtype=dtype)
    w2 = torch.randn(INTER, HIDDEN, dtype=dtype)
    dy = torch.randn(s, HIDDEN, dtype=dtype)

    def floor():  # forward and backward matmuls of the two projections, nothing else
        h = a @ w1
        _ = h[:, :INTER] @ w2
        dh1 = dy @ w2.t()
        _ = h[:, :INTER].t() @ dy
        dh = torch.cat([dh1, dh1], dim=1)
        _ = dh @ w1.t()
        _ = a.t() @ dh

    contestants["floor"] = floor
    return contestants, outputs, skipped


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 2**62


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def deepspeed_contestant(ours, x, grad, dtype):
    import deepspeed
    from deepspeed.moe.layer import MoE

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        deepspeed.init_distributed(dist_backend="gloo")
    moe = MoE(
        HIDDEN, SwiGLU(), num_experts=EXPERTS, ep_size=1, k=TOP_K, drop_tokens=False, use_rts=False, min_capacity=0
    )
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
        for e, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            expert.gate_proj.weight.copy_(ours.experts.gate_up_proj[e, :INTER])
            expert.up_proj.weight.copy_(ours.experts.gate_up_proj[e, INTER:])
            expert.down_proj.weight.copy_(ours.experts.down_proj[e])
    moe = moe.to(dtype).train()

    def run():
        moe.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        moe(inp)[0].backward(grad)

    return run, moe(x)[0].detach()


# -- EP=2 dispatch/combine share ---------------------------------------------------------------------------
def ep_share_worker(rank, world, tokens, dtype_name, repeats):
    import ds_optimus.parallel.dispatch as a2a
    from ds_optimus.parallel import apply_expert_parallel

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, INTER, EXPERTS, TOP_K).to(dtype)
    apply_expert_parallel(layer, world, dedup=False)  # the per-slot dispatcher, whose pieces are timed
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    # Everything the dispatcher does besides the local experts: count exchange, all-to-alls, regrouping.
    a2a.all_to_all = timed(a2a.all_to_all)
    a2a.transpose_chunks = timed(a2a.transpose_chunks)
    x = torch.randn(1, tokens // world, HIDDEN, dtype=dtype)
    shares, totals = [], []
    for i in range(repeats + 2):
        spent[0] = 0.0
        torch.distributed.barrier()
        start = time.perf_counter()
        out, _ = layer(x.requires_grad_())
        out.float().sum().backward()
        total = time.perf_counter() - start
        if i >= 2:
            shares.append(spent[0] / total)
            totals.append(total)
    return {"share": sorted(shares)[len(shares) // 2], "layer_s": sorted(totals)[len(totals) // 2]}


def ep_share(tokens, dtype_name, repeats):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from distributed import run_distributed

    results = run_distributed(ep_share_worker, 2, tokens, dtype_name, repeats)
    return max(r["share"] for r in results), max(r["layer_s"] for r in results)


def profile_contestant(label: str, run, repeats: int) -> None:
    """Self CPU time per operator, averaged over `repeats` runs after two warm-up runs."""
    from torch.profiler import ProfilerActivity, profile

    run()
    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            run()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / repeats / 1e3
    print(f"\n{label}: {total:.0f} ms per forward+backward (profiled)")
    for e in events[:8]:
        print(f"  {e.key[:44]:<44}{e.self_cpu_time_total / repeats / 1e3:8.1f} ms  {e.count // repeats:>4} calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--no-ep", action="store_true", help="skip the EP=2 dispatch/combine measurement")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing, print where ours and the floor spend their time, per operator",
    )
    args = parser.parse_args()
    if args.profile:
        for dtype_name in args.dtypes.split(","):
            contestants, _, _ = build_contestants(args.tokens, getattr(torch, dtype_name), False)
            for name in ("ours", "floor"):
                profile_contestant(f"{dtype_name} {name}", contestants[name], args.repeats)
        return

    flops = 3 * 2 * args.tokens * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    payload = {
        "shape": dict(tokens=args.tokens, hidden=HIDDEN, intermediate=INTER, experts=EXPERTS, top_k=TOP_K),
        "matmul_flops_fwd_bwd": flops,
        "repeats": args.repeats,
        "results": {},
    }
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        contestants, outputs, skipped = build_contestants(args.tokens, dtype, not args.no_deepspeed)
        ref = outputs["hf_eager"].float()
        agree = {k: ((v.float() - ref).norm() / ref.norm()).item() for k, v in outputs.items()}
        print(
            f"\n{dtype_name}: ours uses backend {select_backend('cpu', dtype)!r}; "
            f"{args.repeats} interleaved repeats after {args.warmup} warm-up",
            flush=True,
        )
        times = interleaved_medians(contestants, args.repeats, args.warmup)
        ours = times["ours"]["median_s"]
        print(f"{'contestant':<16}{'median ms':>11}{'GFLOP/s':>10}{'vs ours':>9}{'rel. diff vs hf_eager':>24}")
        for name, t in times.items():
            med = t["median_s"]
            t["gflops"] = flops / med / 1e9
            t["ours_speedup"] = med / ours
            diff = f"{agree[name]:.1e}" if name in agree else "-"
            print(f"{name:<16}{med * 1e3:>11.1f}{t['gflops']:>10.1f}{med / ours:>8.2f}x{diff:>24}")
        for name, why in skipped.items():
            print(f"{name:<16} not run: {why}")
        peers = {k: v["median_s"] for k, v in times.items() if k not in ("ours", "floor")}
        summary = {
            "speedup_vs_hf_eager": peers["hf_eager"] / ours,
            "speedup_vs_fastest_peer": min(peers.values()) / ours,
            "fastest_peer": min(peers, key=peers.get),
            "ours_over_floor": ours / times["floor"]["median_s"],
            "output_rel_diff_vs_hf_eager": agree,
            "not_run": skipped,
        }
        if not args.no_ep:
            share, layer_s = ep_share(args.tokens, dtype_name, args.repeats)
            summary["ep2_dispatch_combine_share"] = share
            summary["ep2_layer_s"] = layer_s
        print("  ".join(f"{k}={v:.3f}" for k, v in summary.items() if isinstance(v, float)), flush=True)
        payload["results"][dtype_name] = {"times": times, "summary": summary}
    path = write_result("moe_layer_cpu", payload)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
