"""Expert-parallel exchanges on 4 CPU processes (gloo): bytes and time, ds_optimus against DeepSpeed.

One OLMoE-proportioned MoE layer per rank (64 experts, top-8, hidden 512, expert intermediate 256;
the hidden/intermediate ratio and expert count of OLMoE-1B-7B at a quarter of its width), EP 4, in
one run with interleaved repeats after warm-up:

  per_slot            one row per routed slot each way (the exchange before deduplication)
  dedup               one row per (token, destination rank), partial sums sent back
  dedup_overlap       dedup cut into --chunks chunks whose exchanges overlap the experts' compute
  *_2x2               the same with node_size 2: two "nodes" of two ranks, hierarchical exchange
  deepspeed           deepspeed.moe.layer.MoE at ep_size 4, top-8, dropless (padded to the busiest expert)

For each: bytes every rank sends to other ranks in one forward + backward (exact: counted at
`torch.distributed.all_to_all_single`, which all of them call), the share of it that crosses
between the two "nodes" (ranks {0,1} and {2,3}), the median time of the whole layer forward +
backward, and, for ours, of the exchange alone (the experts replaced by a scaling). The routing
statistics measured (distinct destination ranks and nodes per token) are printed next to what the
planner's model (`ds_optimus.parallel.traffic`) expects for uniform routing.

    python benchmarks/ep_dispatch.py [--tokens 2048] [--repeats 5] [--chunks 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import interleaved_medians, write_result  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, WORLD, NODE = 512, 256, 64, 8, 4, 2
OURS = {  # name: (node_size, dedup, chunks)
    "per_slot": (None, False, 1),
    "dedup": (None, True, 1),
    "dedup_overlap": (None, True, "chunks"),
    "per_slot_2x2": (NODE, False, 1),
    "dedup_2x2": (NODE, True, 1),
    "dedup_overlap_2x2": (NODE, True, "chunks"),
}


def _layer(dtype, node_size, dedup, chunks):
    from ds_optimus.moe import MoELayer
    from ds_optimus.parallel import apply_expert_parallel

    torch.manual_seed(0)  # the same router and experts on every rank and for every contestant
    layer = MoELayer(HIDDEN, INTER, EXPERTS, TOP_K, norm_topk_prob=True).to(dtype)
    apply_expert_parallel(layer, WORLD, node_size=node_size, dedup=dedup, chunks=chunks)
    return layer


def _deepspeed_layer(ours, dtype):
    import deepspeed
    from deepspeed.moe.layer import MoE
    from moe_layer import SwiGLU

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    moe = MoE(
        HIDDEN, SwiGLU(), num_experts=EXPERTS, ep_size=WORLD, k=TOP_K, drop_tokens=False, use_rts=False, min_capacity=0
    )
    moe.set_deepspeed_parallelism()
    with torch.no_grad():  # the same routing as ours
        moe.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight.float())
    return moe.to(dtype).train()


def _exchange_only(dtype, node_size, dedup, chunks, x, ids, weights):
    """dispatch + combine of `x` with a scaling in place of the experts, as the layer calls them."""
    from ds_optimus.moe.permute import permute_tokens, plan_routing, unpermute_combine
    from ds_optimus.parallel import init_expert_parallel_groups
    from ds_optimus.parallel.dispatch import ExpertParallelDispatcher
    from ds_optimus.parallel.overlap import dedup_dispatcher

    groups = init_expert_parallel_groups(WORLD, node_size)
    local = EXPERTS // WORLD
    scale = torch.ones((), dtype=dtype, requires_grad=True)

    def experts(rows, counts, weight=scale):
        return rows * weight

    if dedup:
        dispatcher = dedup_dispatcher(groups, local, chunks)

        def run():
            return dispatcher(x, ids, weights, experts, (scale,))
    else:
        dispatcher = ExpertParallelDispatcher(groups, local)

        def run():
            plan = plan_routing(ids, EXPERTS)
            y = dispatcher(permute_tokens(x, plan), plan.counts, experts)
            return unpermute_combine(y, weights, plan)

    return run


def worker(
    rank: int, world: int, tokens: int, dtype_name: str, chunks: int, repeats: int, warmup: int, with_deepspeed: bool
) -> dict:
    from ds_optimus.parallel.traffic import ExchangeTraffic

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    grad = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    layers = {name: _layer(dtype, n, d, chunks if c == "chunks" else c) for name, (n, d, c) in OURS.items()}
    if with_deepspeed:
        layers["deepspeed"] = _deepspeed_layer(layers["per_slot"], dtype)

    def step(layer):
        def run():
            layer.zero_grad(set_to_none=True)
            inp = x.detach().requires_grad_()
            layer(inp)[0].backward(grad)

        return run

    contestants = {name: step(layer) for name, layer in layers.items()}
    traffic = {}
    for name, run in contestants.items():
        with ExchangeTraffic() as counted:
            run()
        row_bytes = HIDDEN * x.element_size()
        traffic[name] = {
            "bytes": counted.sent,
            "bytes_between_nodes": counted.inter_node(NODE),
            "hidden_rows": counted.rows(row_bytes),
            "collectives": counted.calls,
        }
    layer_times = interleaved_medians(contestants, repeats, warmup)

    # the exchange alone, on the routing the layer makes
    with torch.no_grad():
        _, weights, ids = layers["per_slot"].block.gate(x)
    inp = x.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    exchanges = {}
    for name, (n, d, c) in OURS.items():
        fn = _exchange_only(dtype, n, d, chunks if c == "chunks" else c, inp, ids, w)
        exchanges[name] = lambda fn=fn: fn().backward(grad)
    exchange_times = interleaved_medians(exchanges, repeats, warmup)

    ranks = ids.div(EXPERTS // WORLD, rounding_mode="floor")
    hit = torch.zeros(tokens, WORLD, dtype=torch.bool).scatter_(1, ranks, True)
    routing = {
        "ranks_per_token": hit.sum(1).float().mean().item(),
        "nodes_per_token": hit.view(tokens, WORLD // NODE, NODE).any(2).sum(1).float().mean().item(),
        "other_ranks_per_token": (hit.sum(1) - hit[:, rank].int()).float().mean().item(),
    }
    dist.barrier()
    return {"traffic": traffic, "layer": layer_times, "exchange": exchange_times, "routing": routing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--chunks", type=int, default=4, help="chunks of the overlapped exchange")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="64 tokens, 1 repeat: check that it runs")
    args = parser.parse_args()
    if args.dry_run:
        args.tokens, args.repeats, args.warmup = 64, 1, 0
    if args.tokens < 1 or args.repeats < 1 or args.chunks < 1:
        parser.error("--tokens, --repeats and --chunks must be positive")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from distributed import run_distributed

    from ds_optimus.parallel.traffic import expected_groups_hit, group_hit_probability

    print(
        f"{WORLD} processes (gloo), {args.tokens} tokens each, {args.dtype}, hidden {HIDDEN}, "
        f"{EXPERTS} experts top-{TOP_K}, EP {WORLD}; 2x2: nodes of {NODE}",
        flush=True,
    )
    results = run_distributed(
        worker, WORLD, args.tokens, args.dtype, args.chunks, args.repeats, args.warmup, not args.no_deepspeed
    )
    names = list(results[0]["traffic"])
    table = {}
    for name in names:
        sent = [r["traffic"][name]["bytes"] for r in results]
        between = sum(r["traffic"][name]["bytes_between_nodes"] for r in results)
        layer_s = max(r["layer"][name]["median_s"] for r in results)  # the slowest rank sets the pace
        exchange_s = max(r["exchange"][name]["median_s"] for r in results) if name in results[0]["exchange"] else None
        table[name] = {
            "bytes_per_rank": sent,
            "bytes_between_nodes": between,
            "layer_s": layer_s,
            "exchange_s": exchange_s,
            "hidden_rows_per_rank": [r["traffic"][name]["hidden_rows"] for r in results],
        }
    base = table["per_slot"]
    print(
        f"\n{'exchange':<20}{'MB/rank':>9}{'vs per_slot':>12}{'MB 2 nodes':>12}{'vs per_slot':>12}"
        f"{'layer ms':>10}{'exchange ms':>13}"
    )
    for name, row in table.items():
        mb = statistics.mean(row["bytes_per_rank"]) / 1e6
        row["fewer_bytes"] = statistics.mean(base["bytes_per_rank"]) / statistics.mean(row["bytes_per_rank"])
        row["fewer_bytes_between_nodes"] = base["bytes_between_nodes"] / row["bytes_between_nodes"]
        exchange = f"{row['exchange_s'] * 1e3:.1f}" if row["exchange_s"] is not None else "-"
        print(
            f"{name:<20}{mb:>9.2f}{row['fewer_bytes']:>11.2f}x{row['bytes_between_nodes'] / 1e6:>12.2f}"
            f"{row['fewer_bytes_between_nodes']:>11.2f}x{row['layer_s'] * 1e3:>10.1f}{exchange:>13}"
        )
    flat = table["per_slot_2x2"]["bytes_between_nodes"] / table["dedup_2x2"]["bytes_between_nodes"]
    measured = {k: statistics.mean(r["routing"][k] for r in results) for k in results[0]["routing"]}
    model = {
        "ranks_per_token": expected_groups_hit(EXPERTS, TOP_K, WORLD),
        "nodes_per_token": expected_groups_hit(EXPERTS, TOP_K, WORLD // NODE),
        "other_ranks_per_token": (WORLD - 1) * group_hit_probability(EXPERTS, TOP_K, EXPERTS // WORLD),
    }
    print("\nrouting, measured vs the planner's uniform-routing model:")
    for key in measured:
        print(f"  {key:<24}{measured[key]:>7.3f}  model {model[key]:.3f}")
    print(
        f"\nEP {WORLD}: dedup sends {table['dedup']['fewer_bytes']:.2f}x fewer bytes per rank than per-slot "
        f"(target 2x); 2x2: {flat:.2f}x fewer bytes between nodes (target 3x)"
    )
    if not args.dry_run:
        path = write_result(
            "ep_dispatch_cpu",
            {
                "shape": dict(
                    tokens_per_rank=args.tokens,
                    hidden=HIDDEN,
                    intermediate=INTER,
                    experts=EXPERTS,
                    top_k=TOP_K,
                    world=WORLD,
                    node_size=NODE,
                    dtype=args.dtype,
                    chunks=args.chunks,
                ),
                "repeats": args.repeats,
                "warmup": args.warmup,
                "results": table,
                "routing": {"measured": measured, "model": model},
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
