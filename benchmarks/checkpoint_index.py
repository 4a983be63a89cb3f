"""What the checkpoint manifest's optimizer index costs, and how many optimizer files a rank opens on
resume, for a Mula model at the seed's scale (arithmetic on the meta device: no process group, no file).

Each optimizer file's entry in `meta.json` lists the [parameter, first element, length] runs it holds
(`ds_optimus.optim.shard_state.held_ranges`); a resuming rank opens only the files whose runs meet
its own (`files_holding`). This lays the state out the way the sharded optimizer does (per pipeline
stage, dense parameters in flat buckets over the shard group, each EP rank's experts in chunked
buckets over theirs; only a shard's first replica saves) and counts, for Mula-220B-A10B at PP 8 x
EP 12 x DP 1,536 (12,288 ranks): the index's entries and JSON bytes, and the most files one rank
opens when it resumes on the same or another shard group size. Layers are split evenly over the
stages (the runtime's balanced split moves a layer or so; the figures barely change).

    python benchmarks/checkpoint_index.py [--preset mula-220b-a10b] [--pp 8] [--ep 12] [--dp 1536]

Results: benchmarks/results/checkpoint_index.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.optim.bucket_layout import chunked_runs, flat_runs, split_buckets

BUCKET = 50_000_000  # optimus.sharded_optimizer.bucket_size's default


def stage_params(model, stage: int, pp: int, layers: int) -> list[tuple[str, int, bool]]:
    """(name, numel, is expert) of a stage's parameters, latest-defined first (the optimizer's order)."""
    per = layers // pp

    def owned(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) // per == stage
        return (stage == 0 and "embed" in name) or (stage == pp - 1 and "embed" not in name)  # norm, head: last

    params = [(n, p.numel(), "experts" in n) for n, p in model.named_parameters() if owned(n)]
    return params[::-1]


def shard_pieces(params: list[tuple[str, int]], group: int, expert: bool, bucket_size: int) -> dict[int, list[list]]:
    """Per owner in a shard group of `group` ranks: its [name, first element, length] runs."""
    make = chunked_runs if expert else flat_runs
    pieces: dict[int, list[list]] = defaultdict(list)
    for bucket in split_buckets([n for _, n in params], bucket_size):
        runs, _ = make([params[i][1] for i in bucket], group, bucket[0])
        for r in runs:
            pieces[r.owner].append([params[r.param][0], r.start, r.length])
    return pieces


def spaces(model, config, pp: int, ep: int, dp: int, shard: int | None, bucket_size: int = BUCKET):
    """Every saved shard's pieces: {(stage, kind, EP rank): {owner: pieces}}, with the shard group sizes."""
    out = {}
    for stage in range(pp):
        params = stage_params(model, stage, pp, config.num_hidden_layers)
        dense = [(n, k) for n, k, e in params if not e]
        experts = [(n, k // ep) for n, k, e in params if e]
        group = min(shard or dp, dp)
        out[(stage, "dense", 0)] = shard_pieces(dense, group, False, bucket_size)
        local, sizes = shard_pieces(experts, min(shard or dp // ep, dp // ep), True, bucket_size), dict(experts)
        for q in range(ep):  # each EP rank's local experts start at q x their size in the full weight
            out[(stage, "experts", q)] = {
                o: [[n, q * sizes[n] + s, length] for n, s, length in ps] for o, ps in local.items()
            }
    return out


def most_shards_met(saved, resumed, kind: str) -> int:
    """The most saved shards of `kind` one resuming shard's runs meet (files one rank opens for them)."""
    most = 0
    for key, owners in resumed.items():
        if key[1] != kind:
            continue
        held = saved[key]
        for pieces in owners.values():
            want = defaultdict(list)
            for name, start, length in pieces:
                want[name].append((start, start + length))
            met = sum(
                1
                for runs in held.values()
                if any(a < s + n and s < b for name, s, n in runs for a, b in want.get(name, ()))
            )
            most = max(most, met)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mula-220b-a10b")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=12)
    parser.add_argument("--dp", type=int, default=1536, help="data-parallel ranks per stage")
    args = parser.parse_args()
    config = MulaConfig.from_preset(args.preset)
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    ranks = args.pp * args.dp
    print(f"{args.preset}: PP {args.pp} x EP {args.ep} x DP {args.dp} = {ranks:,} ranks")
    layouts = {"shard groups of 16": 16, "full sharding": None}
    laid = {label: spaces(model, config, args.pp, args.ep, args.dp, s) for label, s in layouts.items()}
    result = {
        "preset": args.preset,
        "pp": args.pp,
        "ep": args.ep,
        "dp": args.dp,
        "ranks": ranks,
        "saved": {},
        "resumed": {},
    }
    for label, saved in laid.items():
        entries = sum(len(p) for owners in saved.values() for p in owners.values())
        size = sum(len(json.dumps(p)) for owners in saved.values() for p in owners.values())
        result["saved"][label] = {"index_entries": entries, "index_json_bytes": size}
        print(f"  saved in {label}: {entries:,} index entries, {size / 1e6:.1f} MB of JSON in meta.json")
    for a in layouts:
        for b in layouts:
            dense, experts = (most_shards_met(laid[a], laid[b], kind) for kind in ("dense", "experts"))
            result["resumed"][f"{a} -> {b}"] = {"dense_files": dense, "expert_files": experts}
            print(
                f"  saved in {a}, resumed in {b}: a rank's state meets at most {dense} saved dense and "
                f"{experts} saved expert shards: it opens at most {dense + experts} optimizer files of {ranks:,}"
            )
    out = Path(__file__).parent / "results" / "checkpoint_index.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
