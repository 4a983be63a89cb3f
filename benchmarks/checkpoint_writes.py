"""What each rank writes when a checkpoint of Mula-220B-A10B is saved at the seed's scale, with and without
staggered model files (arithmetic on the meta device: no process group, no file written).

Layout: PP 8 x EP 12 x 1,536 data-parallel ranks a stage (12,288 ranks), bf16 weights, the sharded
optimizer's fp32 master weights and two Adam moments (12 bytes a parameter) sharded over each stage's
data-parallel ranks (dense) and each EP rank's 128 expert-data-parallel replicas (experts). Layers are
split evenly over the stages. For each file kind it counts the bytes, the ranks that hold it, the parts
`optimus.checkpoint.min_part_mib` cuts it into and the most one rank writes; then the checkpoint's file
count and the write time at a per-rank write rate (the slowest rank decides it: every rank waits for
the manifest). The busiest rank is found by placing every part on its writer as the checkpoint code
does (`model_files.writer_of`, each file's writers starting at an offset hashed from its name), so a
rank writing parts of two files is counted.

    python benchmarks/checkpoint_writes.py [--preset mula-220b-a10b] [--pp 8] [--ep 12] [--dp 1536]
                                           [--min-part-mib 256] [--rank-gbps 2.0]

Results: benchmarks/results/checkpoint_writes_220b.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from checkpoint_index import stage_params  # the stages' parameters, as that benchmark splits them

from ds_optimus.checkpoint.model_files import first_writer, part_count, writer_of
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM

GIB = 2**30


def stage_bytes(model, stage: int, pp: int, layers: int) -> tuple[int, int]:
    """(dense parameters, expert parameters) of one stage, with the stage split of `checkpoint_index`."""
    owned = stage_params(model, stage, pp, layers)
    return sum(n for _, n, expert in owned if not expert), sum(n for _, n, expert in owned if expert)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mula-220b-a10b")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=12)
    parser.add_argument("--dp", type=int, default=1536, help="data-parallel ranks of a stage (EP inside them)")
    parser.add_argument("--min-part-mib", type=int, default=256)
    parser.add_argument("--rank-gbps", type=float, default=2.0, help="one rank's write rate to the file system, GB/s")
    args = parser.parse_args()
    config = MulaConfig.from_preset(args.preset)
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    ranks, edp, floor = args.pp * args.dp, args.dp // args.ep, args.min_part_mib * 2**20
    stages = [stage_bytes(model, s, args.pp, config.num_hidden_layers) for s in range(args.pp)]
    rows, most = [], {"whole": 0.0, "staggered": 0.0}
    files = {"whole": 0, "staggered": 0}
    for s, (dense, experts) in enumerate(stages):
        # what each of the stage's ranks writes (stage-local rank r: EP rank r % EP, replica r // EP of it)
        written = {"whole": [0.0] * args.dp, "staggered": [0.0] * args.dp}
        optimizer = 12 * (dense / args.dp + experts / args.ep / edp)  # every rank's own shard
        files_of = [(f"model_dense_pp{s:03d}", 2 * dense, list(range(args.dp)))]
        files_of += [
            (f"model_experts_ep{q:03d}_pp{s:03d}", 2 * experts // args.ep, list(range(q, args.dp, args.ep)))
            for q in range(args.ep)
        ]
        for name, size, replicas in files_of:
            parts = part_count(size, len(replicas), floor)
            written["whole"][replicas[0]] += size
            offset = first_writer(name, len(replicas))
            for j in range(parts):
                written["staggered"][replicas[writer_of(j, parts, len(replicas), offset)]] += size / parts
            files["whole"] += 1
            files["staggered"] += parts
            if name.startswith("model_dense") or name.startswith("model_experts_ep000"):
                rows.append(
                    {
                        "stage": s,
                        "kind": name.split("_")[1],
                        "files": 1 if "dense" in name else args.ep,
                        "bytes": size,
                        "replicas": len(replicas),
                        "parts": parts,
                        "most_per_rank_gib": size / parts / GIB,
                    }
                )
        for kind in most:
            most[kind] = max(most[kind], optimizer + max(written[kind]))
    optimizer = max(12 * (dense / args.dp + experts / args.ep / edp) for dense, experts in stages)  # one rank's shard
    files = {k: v + 2 * ranks + 3 for k, v in files.items()}  # each rank's optimizer and client files; engine, ...
    total = sum(12 * (d + e) + 2 * (d + e) for d, e in stages)
    result = {
        "preset": args.preset,
        "layout": f"PP {args.pp} x EP {args.ep} x DP {args.dp} ({ranks:,} ranks)",
        "min_part_mib": args.min_part_mib,
        "checkpoint_gib": total / GIB,
        "optimizer_shard_gib": optimizer / GIB,
        "files": files,
        "most_per_rank_gib": {k: v / GIB for k, v in most.items()},
        "seconds_at_rank_gbps": {k: v / (args.rank_gbps * 1e9) for k, v in most.items()},
        "rank_gbps": args.rank_gbps,
        "model_files": rows,
    }
    print(
        f"{args.preset} at {result['layout']}: a checkpoint of {total / GIB:,.0f} GiB; each rank's optimizer "
        f"shard {optimizer / GIB:.3f} GiB"
    )
    for row in rows[:4] + rows[-2:]:
        print(
            f"  stage {row['stage']} {row['kind']:8s} {row['files']:3d} file(s) of {row['bytes'] / GIB:6.2f} GiB, "
            f"{row['replicas']:5d} replicas -> {row['parts']:3d} parts of {row['most_per_rank_gib']:.3f} GiB"
        )
    for kind in ("whole", "staggered"):
        print(
            f"  {kind:9s}: {files[kind]:,} files; the busiest rank writes {most[kind] / GIB:.2f} GiB, "
            f"{result['seconds_at_rank_gbps'][kind]:.1f} s at {args.rank_gbps} GB/s a rank"
        )
    out = Path(__file__).parent / "results" / "checkpoint_writes_220b.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
