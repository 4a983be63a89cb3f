"""Tile sizes of the Triton expert kernels, measured one kernel at a time on this GPU.

For each kernel of `ds_optimus.ops` (forward: gate_up, down; backward: down_bwd, weight_grad (both
weight gradients), dx) on the OLMoE-shaped layer (hidden 2048, expert intermediate 1024, 64 experts,
top-8, bfloat16), every candidate tiling is compiled and timed (CUDA events, median of repeats), and
set against a dense bf16 matmul of the same FLOPs (the ceiling of that kernel). Prints the table and
the best tiling per kernel; `--write` stores the best ones in `ops/tuned_blocks.json` under this
GPU's name, where the kernels look them up. Needs no DeepSpeed.

    python benchmarks/tune_moe_kernels.py [--tokens 8192] [--repeats 20] [--write]
    python benchmarks/tune_moe_kernels.py --compile-only --jobs 12   # fill Triton's cache, in parallel

Compiling every candidate takes most of a tuning run (one kernel at a time, a second or more each);
`--compile-only --jobs N` compiles them in N processes at once into Triton's on-disk cache (each
launches every candidate of its share once, untimed), so that the timed run that follows only
loads them. The battery runs it beside the correctness tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from ds_optimus.moe import plan_routing  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1024, 64, 8
CANDIDATES = [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for m, n, k, w, s in [
        (64, 64, 64, 4, 3),
        (64, 128, 64, 4, 3),
        (128, 64, 64, 4, 3),
        (128, 64, 64, 8, 3),
        (128, 64, 64, 4, 4),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 32, 8, 4),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (64, 256, 64, 8, 3),
        (128, 128, 128, 8, 2),
        (128, 64, 128, 8, 3),
        (64, 128, 128, 4, 3),
        (128, 128, 64, 8, 4),
        (256, 128, 64, 8, 4),
        (128, 256, 64, 8, 4),
    ]
]


def time_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write", action="store_true", help="store the best tilings in ops/tuned_blocks.json")
    parser.add_argument("--compile-only", action="store_true", help="launch each candidate once, untimed")
    parser.add_argument("--jobs", type=int, default=1, help="with --compile-only: processes compiling at once")
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "i/n": this process's share
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be a positive integer")
    if args.jobs > 1 and not args.compile_only:
        parser.error("--jobs compiles in parallel: it needs --compile-only (timings must not overlap)")
    if not torch.cuda.is_available():
        sys.exit("tune_moe_kernels.py measures on a GPU; none is visible")
    if args.compile_only and args.jobs > 1 and args.shard is None:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--compile-only",
                    "--tokens",
                    str(args.tokens),
                    "--shard",
                    f"{i}/{args.jobs}",
                ]
            )
            for i in range(args.jobs)
        ]
        failed = [i for i, proc in enumerate(procs) if proc.wait() != 0]
        sys.exit(f"compile shards {failed} failed" if failed else 0)
    from ds_optimus.ops import _triton_moe as k

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    tokens, inter, hidden = args.tokens, INTER, HIDDEN
    logits = torch.randn(tokens, EXPERTS, device=dev)
    weights, index = torch.topk(logits.softmax(-1), TOP_K)
    plan = plan_routing(index, EXPERTS)
    s = tokens * TOP_K
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    gate_up = torch.randn(EXPERTS, 2 * inter, hidden, device=dev, dtype=dt) / hidden**0.5
    down = torch.randn(EXPERTS, hidden, inter, device=dev, dtype=dt) / inter**0.5
    grad = torch.randn(tokens, hidden, device=dev, dtype=dt)
    src, dst, w = plan.token_of_sorted, plan.order, weights.reshape(-1).contiguous()
    sched = k._Schedule(plan.counts, s)
    num = k._numerics(dt)
    gu, h = x.new_empty(s, 2 * inter), x.new_empty(s, inter)
    y, dgu, hw, dx = x.new_empty(s, hidden), torch.empty_like(gu), torch.empty_like(h), x.new_empty(s, hidden)
    d_gate_up, d_down = torch.empty_like(gate_up), torch.empty_like(down)

    def weight_grads(cfg):
        k.launch_weight_grad(grad, src, hw, None, d_down, sched, cfg, num)
        k.launch_weight_grad(dgu, None, x, src, d_gate_up, sched, cfg, num)

    def down_bwd(cfg):
        parts = torch.empty(s, -(-inter // cfg["BLOCK_N"]), device=dev, dtype=torch.float32)
        k.launch_down_bwd(grad, src, down, gu, dst, w, dgu, hw, parts, sched, cfg, num)

    # Dense matmuls with each kernel's shapes and FLOPs (contiguous operands), the ceiling per kernel.
    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt)

    rows_h, rows_i, rows_2i = rand(s, hidden), rand(s, inter), rand(s, 2 * inter)
    w_h_2i, w_i_h = rand(hidden, 2 * inter), rand(inter, hidden)
    w_h_i, w_2i_h = rand(hidden, inter), rand(2 * inter, hidden)
    kernels = {  # name: (matmul FLOPs, launch(cfg), the dense matmul of the same shapes)
        "gate_up": (
            2 * s * hidden * 2 * inter,
            lambda c: k.launch_gate_up(x, src, gate_up, gu, h, sched, c, num),
            lambda: torch.mm(rows_h, w_h_2i),
        ),
        "down": (
            2 * s * inter * hidden,
            lambda c: k.launch_down(h, down, y, dst, w, sched, c, num),
            lambda: torch.mm(rows_i, w_i_h),
        ),
        "down_bwd": (2 * s * hidden * inter, down_bwd, lambda: torch.mm(rows_h, w_h_i)),
        "weight_grad": (
            2 * s * hidden * 3 * inter,
            weight_grads,
            lambda: (torch.mm(rows_h.t(), rows_i), torch.mm(rows_2i.t(), rows_h)),
        ),
        "dx": (
            2 * s * 2 * inter * hidden,
            lambda c: k.launch_dx(dgu, gate_up, dx, dst, sched, c, num),
            lambda: torch.mm(rows_2i, w_2i_h),
        ),
    }
    k.launch_gate_up(x, src, gate_up, gu, h, sched, k.resolve_blocks("gate_up", dev), num)  # real gu for backward
    if args.compile_only:
        index, count = map(int, (args.shard or "0/1").split("/"))
        work = [(name, cfg) for name, (_, launch, _) in kernels.items() for cfg in CANDIDATES]
        for name, cfg in work[index::count]:
            try:
                kernels[name][1](cfg)
            except Exception as error:  # noqa: BLE001  (does not fit; the timed run skips it too)
                print(f"  {name} {cfg}: skipped ({type(error).__name__})")
        torch.cuda.synchronize()
        return
    gpu = torch.cuda.get_device_name()
    report = {"gpu": gpu, "tokens": tokens, "kernels": {}}
    best = {}
    print(f"{gpu}, {tokens} tokens x top-{TOP_K}")
    for name, (flops, launch, dense) in kernels.items():
        dense_tflops = flops / time_ms(dense, args.repeats) / 1e9
        rows = []
        for cfg in CANDIDATES:
            try:
                ms = time_ms(lambda cfg=cfg, launch=launch: launch(cfg), args.repeats)
            except Exception as error:  # noqa: BLE001  (a tiling that does not fit: out of shared memory / registers)
                print(f"  {name} {cfg}: skipped ({type(error).__name__})")
                continue
            rows.append({"blocks": cfg, "ms": ms, "tflops": flops / ms / 1e9})
        rows.sort(key=lambda r: r["ms"])
        default = k.resolve_blocks(name, dev)
        default_ms = time_ms(lambda launch=launch, default=default: launch(default), args.repeats)
        print(
            f"\n{name}: dense same-FLOPs {dense_tflops:.0f} TFLOP/s; current tiling {default_ms:.3f} ms "
            f"({flops / default_ms / 1e9:.0f} TFLOP/s)"
        )
        for r in rows[:5]:
            share = r["tflops"] / dense_tflops
            print(f"  {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOP/s  {share:.0%} of dense  {r['blocks']}")
        report["kernels"][name] = {"dense_tflops": dense_tflops, "current_ms": default_ms, "candidates": rows}
        best[name] = rows[0]["blocks"]
    print(f"\nwrote {write_result('moe_kernels_tuning_' + gpu.replace(' ', '_'), report)}")
    if args.write:
        path = Path(k.__file__).with_name("tuned_blocks.json")
        tuned = json.loads(path.read_text()) if path.exists() else {}
        tuned[gpu] = best
        path.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path} [{gpu}]")


if __name__ == "__main__":
    main()
