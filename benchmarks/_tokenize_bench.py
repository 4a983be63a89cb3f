"""The tokenization benchmark's body; run it as `python benchmarks/tokenize.py` (its docstring says
what it measures). It lives here because a module named `tokenize` must not import anything: see
that file."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("benchmark_common", HERE / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
write_result = common.write_result

OURS = """
import json, sys, time
from ds_optimus.data import load_tokenizer, parse_sources, prepare_data
files, cache, workers, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tokenizer = load_tokenizer(sys.argv[5] or None)
start = time.perf_counter()
data = prepare_data(parse_sources([files]), tokenizer, cache, 0.0, workers=workers, progress=False,
                    threads=None if threads == "auto" else int(threads))
print(json.dumps({"seconds": time.perf_counter() - start, "documents": data.documents, "tokens": data.train_tokens}))
"""

DATASETS = """
import glob, json, os, sys, time
import datasets
from ds_optimus.data import load_tokenizer
files, cache, procs = sys.argv[1], sys.argv[2], int(sys.argv[3])
datasets.disable_progress_bars()
tokenizer = load_tokenizer(sys.argv[4] or None)
eos = tokenizer.eos_token_id
def encode(batch):
    ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
    return {"input_ids": [x + [eos] for x in ids]}
start = time.perf_counter()
raw = datasets.load_dataset("json", data_files=sorted(glob.glob(files)), split="train", cache_dir=cache,
                            num_proc=procs if procs > 1 else None)
mapped = raw.map(encode, batched=True, batch_size=256, num_proc=procs if procs > 1 else None,
                 remove_columns=raw.column_names)
tokens = sum(len(x) for x in mapped["input_ids"])
print(json.dumps({"seconds": time.perf_counter() - start, "documents": len(mapped), "tokens": tokens}))
"""

CONTESTANTS = {
    "ours_w1": ("ours", 1, "1"),
    "ours_w2": ("ours", 2, "1"),
    "ours_w1_auto": ("ours", 1, "auto"),
    "datasets_np1": ("datasets", 1, None),
    "datasets_np2": ("datasets", 2, None),
}


def make_corpus(folder: Path, files: int, mb_per_file: float) -> tuple[int, int]:
    """`files` .jsonl.gz files of the embedded corpus's documents, each ~`mb_per_file` MB of text."""
    from ds_optimus.data import embedded_documents

    docs = embedded_documents()
    folder.mkdir(parents=True, exist_ok=True)
    total_docs = total_bytes = 0
    for i in range(files):
        lines, size, j = [], 0, i
        while size < mb_per_file * 1e6:
            text = docs[j % len(docs)]
            lines.append(json.dumps({"text": text, "id": f"{i}-{j}"}))
            size += len(text.encode())
            j += 1
        (folder / f"part-{i:04d}.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
        total_docs += len(lines)
        total_bytes += size
    return total_docs, total_bytes


def run(name: str, corpus: Path, work: Path, round_: int, tokenizer: str) -> dict:
    kind, n, threads = CONTESTANTS[name]
    cache = work / f"{name}-{round_}"
    env = {**os.environ}
    if kind == "ours":
        argv = [sys.executable, "-c", OURS, str(corpus / "*.jsonl.gz"), str(cache), str(n), threads, tokenizer]
        if threads != "auto":
            env.update(RAYON_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
        else:
            env.pop("RAYON_NUM_THREADS", None)
            env["TOKENIZERS_PARALLELISM"] = "true"
    else:
        argv = [sys.executable, "-c", DATASETS, str(corpus / "*.jsonl.gz"), str(cache), str(n), tokenizer]
        env.update(RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{name} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(doc: str) -> None:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb-per-file", type=float, default=2.0)
    parser.add_argument("--only", default=None, help="comma-separated contestants (default: all)")
    parser.add_argument(
        "--tokenizer",
        default="",
        help="an HF tokenizer folder or cached name (default: the shipped "
        "BPE); results then go to tokenize_<folder name>.json",
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CONTESTANTS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        documents, text_bytes = make_corpus(work / "corpus", args.files, args.mb_per_file)
        print(
            f"corpus: {args.files} .jsonl.gz files, {documents:,} documents, {text_bytes / 1e6:.1f} MB of text; "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for round_ in range(args.repeats + 1):  # round 0 warms the page cache and the imports
            for name in names:
                result = run(name, work / "corpus", work, round_, args.tokenizer)
                if round_:
                    runs[name].append(result)
                print(f"  round {round_} {name:14s} {result['seconds']:6.2f} s", flush=True)
    table = {}
    for name, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        table[name] = {
            "median_s": seconds,
            "runs_s": [r["seconds"] for r in results],
            "documents": results[0]["documents"],
            "tokens": results[0]["tokens"],
            "documents_per_s": results[0]["documents"] / seconds,
            "tokens_per_s": results[0]["tokens"] / seconds,
        }
    ratios = {}
    if {"ours_w1", "ours_w2"} <= set(table):
        ratios["ours_w2_over_w1"] = table["ours_w1"]["median_s"] / table["ours_w2"]["median_s"]
    for n in (1, 2):
        if {f"ours_w{n}", f"datasets_np{n}"} <= set(table):
            ratios[f"ours_over_datasets_n{n}"] = table[f"datasets_np{n}"]["median_s"] / table[f"ours_w{n}"]["median_s"]
    if {"ours_w1", "ours_w1_auto"} <= set(table):
        ratios["ours_w1_auto_over_w1"] = table["ours_w1"]["median_s"] / table["ours_w1_auto"]["median_s"]
    print(f"\n{'contestant':14s} {'median s':>9s} {'docs/s':>9s} {'tokens/s':>11s}")
    for name, row in table.items():
        print(f"{name:14s} {row['median_s']:9.2f} {row['documents_per_s']:9.0f} {row['tokens_per_s']:11.0f}")
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    suffix = f"_{Path(args.tokenizer).name}" if args.tokenizer else ""
    write_result(
        f"tokenize_cpu{suffix}",
        {
            "tokenizer": args.tokenizer or "shipped BPE",
            "files": args.files,
            "mb_per_file": args.mb_per_file,
            "documents": documents,
            "text_bytes": text_bytes,
            "repeats": args.repeats,
            "contestants": table,
            "ratios": ratios,
        },
    )
