"""Forward + backward of an OLMoE-shaped MoE layer on one GPU: the layer's experts backends against
Transformers' experts implementations and the measured dense bf16 matmul rate (the practical ceiling).

Shape: hidden 2048, expert intermediate 1024, 64 experts, top-8, bfloat16; 8192 and 16384 tokens.
Contestants (identical weights, interleaved, median of repeats):
  ours_<backend>   ds_optimus' layer with each experts backend available on the device
                   (ours_triton: the Triton kernels of ds_optimus.ops, fused permute and combine)
  hf_grouped_mm    Transformers' OlmoeSparseMoeBlock, experts_implementation="grouped_mm"
  hf_eager         ... "eager"
  dense            the same matmul FLOPs as one dense chain
TFLOP/s counts the expert matmuls only (forward 2 GEMMs, backward 4), so every contestant is
measured against the same useful work. Targets of the Triton kernels: at 16k tokens 1.3x the speed
of ours_grouped_mm (the layer on torch's grouped GEMM) and 60 % of the dense rate, at 8k 1.2x. The
"host ms" column is the time until a call returns, before the GPU is waited for: near the whole time,
the host sets the pace. Needs no DeepSpeed.

    python benchmarks/moe_kernels.py [--tokens 8192,16384] [--repeats 20] [--profile]

`--profile` adds, for the last token count, torch.profiler's table of the top kernels of ours_triton
and ours_grouped_mm (moe_kernels_profile_<GPU>.txt beside the JSON).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_medians, profile_table, write_result, write_text_result  # noqa: E402

import ds_optimus  # noqa: E402,F401
from ds_optimus.moe import MoELayer, available_backends  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1024, 64, 8


def matmul_flops(tokens: int) -> int:
    return 3 * 2 * tokens * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)


def contestants_for(tokens: int, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    ours = MoELayer(HIDDEN, INTER, EXPERTS, TOP_K).to(device, dtype)
    x = torch.randn(1, tokens, HIDDEN, device=device, dtype=dtype)
    grad = torch.randn_like(x)

    def fwd_bwd(module, call):
        def run():
            module.zero_grad(set_to_none=True)
            call(module, x.detach().requires_grad_()).backward(grad)

        return run

    runs, outputs = {}, {}
    for backend in available_backends(device, dtype):
        if backend == "reference":
            continue

        def call(m, inp, backend=backend):
            m.experts.experts_backend = backend
            return m(inp)[0]

        runs[f"ours_{backend}"] = fwd_bwd(ours, call)
        outputs[f"ours_{backend}"] = call(ours, x).detach()

    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    cfg = OlmoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
    )
    for impl in ("grouped_mm", "eager"):
        c = copy.deepcopy(cfg)
        c._experts_implementation = impl
        block = OlmoeSparseMoeBlock(c).to(device, dtype)
        block.load_state_dict(ours.block.state_dict(), strict=False)
        runs[f"hf_{impl}"] = fwd_bwd(block, lambda m, inp: m(inp))
        outputs[f"hf_{impl}"] = block(x).detach()

    s = tokens * TOP_K
    a = torch.randn(s, HIDDEN, device=device, dtype=dtype)
    w1 = torch.randn(HIDDEN, 2 * INTER, device=device, dtype=dtype)
    w2 = torch.randn(INTER, HIDDEN, device=device, dtype=dtype)
    h = torch.randn(s, 2 * INTER, device=device, dtype=dtype)
    dy = torch.randn(s, HIDDEN, device=device, dtype=dtype)

    def dense():  # the six GEMMs of forward and backward, nothing else
        torch.mm(a, w1)
        torch.mm(h[:, :INTER], w2)
        torch.mm(dy, w2.t())
        torch.mm(h[:, :INTER].t(), dy)
        torch.mm(h, w1.t())
        torch.mm(a.t(), h)

    runs["dense"] = dense
    return runs, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="top-kernel tables of ours at the last token count")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernels.py measures on a GPU; none is visible")
    device, dtype = "cuda", torch.bfloat16
    try:
        import triton

        versions = {"triton": triton.__version__}
    except ImportError:
        versions = {"triton": None}
    shape = dict(hidden=HIDDEN, intermediate=INTER, experts=EXPERTS, top_k=TOP_K, dtype="bfloat16")
    payload = {**versions, "shape": shape, "repeats": args.repeats, "results": {}}
    for tokens in map(int, args.tokens.split(",")):
        runs, outputs = contestants_for(tokens, device, dtype)
        ref = outputs["hf_eager"].float()
        agree = {k: ((v.float() - ref).norm() / ref.norm()).item() for k, v in outputs.items()}
        times = interleaved_medians(runs, args.repeats, args.warmup, device)
        flops = matmul_flops(tokens)
        dense_rate = flops / times["dense"]["median_s"]
        print(f"\n{tokens} tokens, {torch.cuda.get_device_name()}: dense bf16 rate {dense_rate / 1e12:.0f} TFLOP/s")
        print(
            f"{'contestant':<20}{'median ms':>10}{'host ms':>9}{'TFLOP/s':>9}{'of dense':>10}"
            f"{'rel. diff vs hf_eager':>23}"
        )
        for name, t in times.items():
            t["tflops"] = flops / t["median_s"] / 1e12
            t["fraction_of_dense"] = t["tflops"] * 1e12 / dense_rate
            diff = f"{agree[name]:.1e}" if name in agree else "-"
            print(
                f"{name:<20}{t['median_s'] * 1e3:>10.2f}{t['host_median_s'] * 1e3:>9.2f}{t['tflops']:>9.0f}"
                f"{t['fraction_of_dense']:>9.0%}{diff:>23}"
            )
        result = {"matmul_flops_fwd_bwd": flops, "times": times, "output_rel_diff_vs_hf_eager": agree}
        if "ours_triton" in times and "ours_grouped_mm" in times:
            speedup = times["ours_grouped_mm"]["median_s"] / times["ours_triton"]["median_s"]
            share = times["ours_triton"]["fraction_of_dense"]
            want_speedup, want_share = (1.3, 0.6) if tokens >= 16384 else (1.2, None)
            result["triton_targets"] = {
                "speedup_vs_grouped_mm": speedup,
                "fraction_of_dense": share,
                "met": speedup >= want_speedup and share >= (want_share or 0),
            }
            print(
                f"triton: {speedup:.2f}x ours_grouped_mm (target {want_speedup}x), {share:.0%} of dense"
                + (f" (target {want_share:.0%})" if want_share else "")
            )
        payload["results"][str(tokens)] = result
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    print(f"\nwrote {write_result('moe_kernels_' + gpu, payload)}")
    if args.profile:
        tables = [
            f"== {name}, {tokens} tokens, forward + backward\n{profile_table(runs[name], device)}"
            for name in ("ours_triton", "ours_grouped_mm")
            if name in runs
        ]
        print(f"wrote {write_text_result(f'moe_kernels_profile_{gpu}.txt', chr(10).join(tables))}")


if __name__ == "__main__":
    main()
