"""Data at scale, part 3: training on it. Every source kind in one weighted mixture on 2 ranks that
tokenize their shares at the start; the per-source counts in metrics.jsonl; data changed under a
resumed run; and a 4-trillion-token memory-mapped source that trains at once."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from distributed import run_distributed
from test_data_sources import _lines, write_corpus, write_zst
from train_workers import ROOT, tiny_config

from ds_optimus.data import embedded_documents, load_tokenizer


def _mixture(tmp_path: Path) -> list:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = embedded_documents()
    root = tmp_path / "sources"
    corpus = write_corpus(root / "web", 6, docs=docs)  # .json.gz and .json.zst by turns
    (root / "code.jsonl.gz").write_bytes(gzip.compress(_lines(docs[10:30]).encode()))
    write_zst(root / "papers.json.zst", _lines(docs[30:50]))
    pq.write_table(pa.table({"text": docs[50:70]}), root / "books.parquet")
    datasets.Dataset.from_dict({"content": docs[:40]}).save_to_disk(str(root / "saved"))
    tokenizer = load_tokenizer()
    ids = np.concatenate(
        [tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in docs[:30]]
    ).astype(np.uint16)
    np.save(root / "pretok.npy", ids)
    ids.tofile(root / "raw.bin")
    return [
        {"path": str(corpus), "weight": 3},
        {"path": str(root / "code.jsonl.gz"), "weight": 1},
        {"path": str(root / "papers.json.zst"), "weight": 1},
        {"path": str(root / "books.parquet"), "weight": 1},
        {"path": str(root / "saved"), "text_field": "content", "name": "disk", "weight": 1},
        {"tokens": str(root / "pretok.npy"), "weight": 1},
        {"tokens": str(root / "raw.bin"), "dtype": "uint16", "weight": 1},
    ]


def mixture_worker(rank: int, world: int, config: dict, changed: dict) -> dict:
    """Train, then resume on changed data (refused), then resume with the change allowed."""
    from ds_optimus.train import pretrain

    first = pretrain(config)
    try:
        pretrain(changed)
        refused = None
    except Exception as err:  # the error the run stops on, as the command line would print it
        refused = (type(err).__name__, str(err), getattr(err, "every_rank", False))
    changed["optimus"]["data"]["allow_change"] = True
    allowed = pretrain(changed)
    return {"first": first, "refused": refused, "allowed": allowed}


@pytest.mark.slow
def test_every_source_kind_trains_in_a_weighted_mixture_and_a_data_change_is_refused(tmp_path):
    sources = _mixture(tmp_path)
    names = ["web", "code", "papers", "books", "disk", "pretok", "raw"]
    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        train={"steps": 4, "log_interval": 2, "eval_interval": 4, "stop_after_steps": 4},
        checkpoint={"interval": 4},
    )
    config["optimus"]["data"]["sources"] = sources
    config["optimus"]["train"]["steps"] = 6
    changed = json.loads(json.dumps(config))
    changed["optimus"]["data"]["sources"][1]["weight"] = 2  # code up-weighted at the restart
    first, second = run_distributed(mixture_worker, 2, config, changed)

    assert first["first"]["start_step"] == 0 and len(first["first"]["losses"]) == 4
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "tokens/web" in r]
    step4 = next(r for r in logged if r["step"] == 4)
    tokens = {name: step4[f"tokens/{name}"] for name in names}
    assert sum(tokens.values()) == 4 * 2 * 4 * 32  # steps x ranks x micro-batch x sequence
    assert all(count > 0 for count in tokens.values()) and tokens["web"] == max(tokens.values())  # weight 3 of 9
    assert all(0 < step4[f"epochs/{name}"] for name in names)
    markers = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*/unit-*.json")]
    assert {m["rank"] for m in markers} == {0, 1}  # both ranks tokenized their shares at the start
    assert len(markers) == 6 + 4  # web's 6 files, one unit for each of the other 4 text sources

    kind, message, every_rank = first["refused"]
    assert kind == "DataError" and every_rank and "\n" not in message
    assert message.startswith(
        "the data changed since the checkpoint: source 'code' was reweighted: 1 -> 2; so the "
        "share of source 'code' went from 0.1111 to 0.2 (and 6 more shares); set "
        "optimus.data.allow_change to true"
    )
    assert first["allowed"]["start_step"] == 4 and first["allowed"]["finished"]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "data changed since the checkpoint (optimus.data.allow_change): source 'code' was reweighted: 1 -> 2" in log
    assert (
        "data changed since the checkpoint (optimus.data.allow_change): the share of source 'code' went from "
        "0.1111 to 0.2" in log
    )
    from ds_optimus.report.plots import resumed_changes  # the report marks the change where the run resumed

    marks = resumed_changes(tmp_path / "run" / "log.txt")
    assert list(marks) == [4] and marks[4][0] == "source 'code' was reweighted: 1 -> 2" and len(marks[4]) == 8
    assert second["allowed"]["losses"] == first["allowed"]["losses"]

    # --check reads the data's record in the newest checkpoint's manifest (step 6, saved on the changed
    # weights) and stops on the line the run would stop on; allowed, it is ready
    import contextlib
    import io

    from ds_optimus.train.cli import main

    config["optimus"]["train"].update(steps=8, stop_after_steps=None)
    (tmp_path / "again.json").write_text(json.dumps(config))
    said = []
    for extra in ([], ["--set", "optimus.data.allow_change=true"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            said.append(
                (main(["--config", str(tmp_path / "again.json"), "--check", "--world", "2", *extra]), err.getvalue())
            )
    (refused, message), (allowed, _) = said
    assert (refused, allowed) == (2, 0) and len(message.splitlines()) == 1, said
    assert (
        "step_00000006: source 'code' was reweighted: 2 -> 1; so the share of source 'code' went from 0.2 to "
        "0.1111 (and 6 more shares); set optimus.data.allow_change to true" in message
    )


# The training command in a child that reports, as it exits, its own peak RSS and the pages it faulted in
# (RUSAGE_CHILDREN would give the largest of every child the test process ever had).
CHILD = """
import resource, sys
from ds_optimus.train.cli import main  # the command's own code (its __main__ would exit before the count)
try:
    status = main(["--config", sys.argv[1]])
finally:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    sys.stderr.write(f"MAXRSS {usage.ru_maxrss} FAULTS {usage.ru_minflt + usage.ru_majflt}\\n")
sys.exit(status)
"""


def _run(config: dict, path: Path) -> tuple[int, int, str]:
    """The run's own peak RSS (KiB) and page faults, and its stderr."""
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss, faults = proc.stderr.rsplit("MAXRSS ", 1)[1].split()[0::2]
    return int(rss), int(faults), proc.stderr


@pytest.mark.slow
def test_a_four_trillion_token_source_trains_at_once_with_the_memory_of_a_small_one(tmp_path):
    """A sparse 4T-token .npy (it takes no disk) trains two steps through the command line with the peak
    RSS and the page faults of the same run on 4,000 times fewer tokens: nothing reads, indexes or
    allocates by the corpus's size (work counted in pages, not seconds, which a loaded machine stretches)."""
    from numpy.lib.format import open_memmap

    results = {}
    for name, tokens in (("small", 1_000_000_000), ("huge", 4_000_000_000_000)):
        array = open_memmap(tmp_path / f"{name}.npy", mode="w+", dtype=np.uint16, shape=(tokens,))
        array[:: tokens // 8] = 5  # a few pages written; the rest reads as zeros
        del array
        config = tiny_config(
            tmp_path / name,
            tmp_path / "cache",
            train={"steps": 1, "eval_interval": 0, "sample_tokens": 0},
            checkpoint={"interval": 0},
            data={"sources": [{"tokens": str(tmp_path / f"{name}.npy")}], "val_fraction": 0},
        )
        config["optimus"]["train"]["steps"] = 2
        config["optimus"]["model"]["overrides"] = {"num_hidden_layers": 1}
        results[name] = _run(config, tmp_path / f"{name}.json")
    print({name: (rss // 1024, faults) for name, (rss, faults, _) in results.items()})
    assert "data: 4,000,000,000,000 train / 0 held-out tokens" in results["huge"][2]
    assert results["huge"][0] < results["small"][0] + 100 * 1024  # peak RSS within 100 MiB (KiB here)
    # pages faulted in within 100 MiB's worth (4 KiB pages): one pass over the 8 TB would be 2e9
    assert results["huge"][1] < results["small"][1] + 100 * 256, results


def test_the_docs_speak_of_the_data_features():
    docs = "".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    for needle in (
        "python -m ds_optimus.data.prepare",
        "OLMoE-mix-0924",
        '"weight"',
        '"tokens"',
        "optimus.data.allow_change",
        "benchmarks/tokenize.py",
    ):
        assert needle in docs, needle
