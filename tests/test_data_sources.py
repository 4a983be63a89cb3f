"""Data at scale, part 1: every source kind (compressed JSON lines, parquet, `save_to_disk` folders,
pre-tokenized token files), one-line errors for bad inputs, and parallel, resumable preparation
(local workers, several launched processes, a killed preparation started again)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ds_optimus.data import (
    DataError,
    TokenBatches,
    embedded_documents,
    iter_documents,
    load_tokenizer,
    parse_source,
    parse_sources,
    prepare_data,
)
from ds_optimus.data.units import source_units, unit_documents

ROOT = Path(__file__).resolve().parents[1]
DOCS = [doc for doc in embedded_documents()[:24]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _lines(docs) -> str:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))


def write_zst(path: Path, text: str) -> None:
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))


def write_corpus(root: Path, files: int, docs=DOCS) -> Path:
    """`files` compressed JSON-lines files (gz and zst by turns) in the layout of OLMoE-mix-0924."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        part = docs[i % len(docs) :] + docs[: i % len(docs)]
        if i % 2:
            write_zst(root / f"part-{i:04d}.json.zst", _lines(part[:6]))
        else:
            (root / f"part-{i:04d}.json.gz").write_bytes(gzip.compress(_lines(part[:6]).encode()))
    return root


def test_every_text_source_kind_reads_the_same_documents(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = DOCS[:5]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_lines(docs).encode()))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(_lines(docs).encode()))
    write_zst(tmp_path / "c.jsonl.zst", _lines(docs))
    write_zst(tmp_path / "d.json.zst", _lines(docs))
    pq.write_table(pa.table({"text": docs}), tmp_path / "e.parquet")
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(tmp_path / "dict"))
    specs = [
        str(tmp_path / "a.jsonl.gz"),
        str(tmp_path / "b.json.gz"),
        {"path": str(tmp_path / "c.jsonl.zst")},
        str(tmp_path / "d.json.zst"),
        str(tmp_path / "e.parquet"),
        {"path": str(tmp_path / "saved"), "text_field": "body"},
        {"hf": str(tmp_path / "dict")},
    ]
    for spec in specs:
        assert list(iter_documents(parse_source(spec))) == docs, spec
    saved = parse_source({"path": str(tmp_path / "saved"), "text_field": "body"})
    assert [u.part for u in source_units(saved)] == [(0, 5)]  # row ranges: a save_to_disk folder splits by rows
    assert list(unit_documents(saved, source_units(saved)[0])) == docs
    # a folder of compressed files is one unit per file, and the default names come from the paths
    both = parse_source({"path": str(tmp_path / "*.json*")})
    assert len(source_units(both)) == 4 and both.label == tmp_path.name
    assert [parse_source(s).label for s in ("data/wiki/*.json.gz", "data/dclm", "x/pes2o-0001.json.zst")] == [
        "wiki",
        "dclm",
        "pes2o-0001",
    ]


def test_token_sources_are_mapped_in_place_across_file_boundaries(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(0, 50, dtype=np.uint16))
    np.arange(50, 130, dtype=np.uint32).tofile(tmp_path / "b.bin")
    np.save(tmp_path / "v.npy", np.arange(1000, 1040, dtype=np.int32))
    from ds_optimus.data import open_token_files

    npy = open_token_files(str(tmp_path / "a.npy"))
    assert npy.arrays == [None] and npy.files[0].length == 50  # sized from the header, mapped on first read
    assert npy.read(48, 2).tolist() == [48, 49]
    assert isinstance(npy.arrays[0], np.memmap) and npy.arrays[0].dtype == np.uint16  # the header's dtype
    data = prepare_data(
        parse_sources(
            [
                {"tokens": str(tmp_path / "a.npy"), "val": str(tmp_path / "v.npy")},
                {"tokens": str(tmp_path / "b.bin"), "dtype": "uint32"},
            ]
        ),
        load_tokenizer(),
        tmp_path / "cache",
    )
    assert [s.name for s in data.sources] == ["a", "b"] and data.documents == 0 and data.val_tokens == 40
    assert not (tmp_path / "cache").exists()  # nothing written for token sources
    loader = TokenBatches(data, 10, 13, shuffle=False)  # 5 + 8 sequences, by size; every one once
    batch = loader.next_batch().numpy()
    assert sorted(batch[:, 0].tolist()) == list(range(0, 130, 10))
    assert all((row == np.arange(row[0], row[0] + 10)).all() for row in batch)
    joined = data.tokens("train")  # the sources one after another; a read across the file boundary
    assert joined.read(45, 10).tolist() == list(range(45, 55))


BAD_INPUTS = [
    ({"path": "x", "weight": 0}, "weight must be a number > 0, got 0"),
    ({"path": "x", "weight": -1.5}, "weight must be a number > 0"),
    ({"path": "x", "weight": True}, "weight must be a number > 0"),
    ({"path": "x", "name": "a b"}, "name must be letters"),
    ({"tokens": "x", "dtype": "float32"}, "dtype 'float32' is not an integer type"),
    ({"path": "x", "tokens": "y"}, "needs exactly one of"),
    ({"tokens": "x", "text_field": "t"}, "unknown key 'text_field'"),
]


@pytest.mark.parametrize(("spec", "match"), BAD_INPUTS)
def test_bad_source_specs_are_one_line(spec, match):
    with pytest.raises(DataError, match=match) as err:
        parse_source(spec)
    assert "\n" not in str(err.value)


def test_bad_mixtures_and_bad_files_are_one_line(tmp_path, tokenizer):
    def one_line(fn, match):
        with pytest.raises(DataError, match=match) as err:
            fn()
        assert "\n" not in str(err.value)
        return str(err.value)

    one_line(
        lambda: parse_sources([{"path": "a", "weight": 1}, {"path": "b"}]),
        r"source 'b' has no \"weight\" while others have one",
    )
    one_line(lambda: parse_sources(["data/wiki.jsonl", "other/wiki.jsonl"]), "sources 0 and 1 are both named 'wiki'")
    one_line(
        lambda: parse_sources(["data/web/", {"path": "data/web", "name": "web2"}]),  # the same files, renamed
        r"sources 0 and 1 read the same data \(files:data/web\): list it once, with the \"weight\" it",
    )
    one_line(lambda: parse_sources([{"path": "x", "wieght": 2}]), r"unknown key 'wieght' \(did you mean 'weight'\?\)")
    one_line(
        lambda: list(iter_documents(parse_source(str(tmp_path / "*.jsonl.zst")))),
        r"data path '.*\*.jsonl.zst' matches no .txt, .md",
    )
    (tmp_path / "cut.json.zst").write_bytes(
        __import__("zstandard").ZstdCompressor().compress(_lines(DOCS).encode())[:3000]
    )  # a cut download
    one_line(
        lambda: list(iter_documents(parse_source(str(tmp_path / "cut.json.zst")))),
        r"cut.json.zst: not a readable zst-compressed file \(ZstdError: the file ends inside a zstd frame",
    )
    (tmp_path / "fields.jsonl").write_text('{"content": "x", "id": 1}\n')
    one_line(
        lambda: list(iter_documents(parse_source(str(tmp_path / "fields.jsonl")))),
        r"fields.jsonl:1: record has no 'text' field \(its fields: content, id; set the source's \"text_field\"\)",
    )
    (tmp_path / "corrupt.jsonl.gz").write_bytes(gzip.compress(_lines(DOCS[:50]).encode())[:400])
    one_line(
        lambda: list(iter_documents(parse_source(str(tmp_path / "corrupt.jsonl.gz")))),
        r"corrupt.jsonl.gz: not a readable gz-compressed file \(EOFError",
    )
    (tmp_path / "junk.json.zst").write_bytes(b"this is not zstd at all")
    one_line(
        lambda: list(iter_documents(parse_source(str(tmp_path / "junk.json.zst")))),
        "junk.json.zst: not a readable zst-compressed file",
    )
    (tmp_path / "notext.json.gz").write_bytes(gzip.compress(b'{"body": "x"}\n'))
    one_line(
        lambda: prepare_data(parse_sources([str(tmp_path / "notext.json.gz")]), tokenizer, tmp_path / "c"),
        r"notext.json.gz:1: record has no 'text' field",
    )
    np.save(tmp_path / "floats.npy", np.zeros(10, dtype=np.float32))
    one_line(
        lambda: prepare_data(parse_sources([{"tokens": str(tmp_path / "floats.npy")}]), tokenizer, tmp_path),
        r"source 'floats': .*floats.npy: holds float32 values, not integer token ids",
    )
    (tmp_path / "empty.npy").write_bytes(b"")
    one_line(
        lambda: prepare_data(parse_sources([{"tokens": str(tmp_path / "empty.npy")}]), tokenizer, tmp_path),
        r"empty.npy: not a readable .npy file \(EOFError",
    )
    np.save(tmp_path / "square.npy", np.zeros((3, 3), dtype=np.int32))
    one_line(
        lambda: prepare_data(parse_sources([{"tokens": str(tmp_path / "square.npy")}]), tokenizer, tmp_path),
        r"must be flat \(1-D\)",
    )
    np.zeros(5, dtype=np.uint8).tofile(tmp_path / "odd.bin")
    one_line(
        lambda: prepare_data(parse_sources([{"tokens": str(tmp_path / "odd.bin")}]), tokenizer, tmp_path),
        r"raw .bin token files need the source's \"dtype\"",
    )
    one_line(
        lambda: prepare_data(
            parse_sources([{"tokens": str(tmp_path / "odd.bin"), "dtype": "uint16"}]), tokenizer, tmp_path
        ),
        "5 bytes is not a whole number of uint16 tokens",
    )
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "d"))
    one_line(
        lambda: list(iter_documents(parse_source({"path": str(tmp_path / "d"), "split": "test"}))),
        r"has no split 'test' \(splits: train",
    )
    # a mixture weight on a source too small for one sequence
    np.save(tmp_path / "tiny.npy", np.arange(5, dtype=np.uint16))
    np.save(tmp_path / "big.npy", np.arange(500, dtype=np.uint16))
    data = prepare_data(
        parse_sources(
            [{"tokens": str(tmp_path / "tiny.npy"), "weight": 1}, {"tokens": str(tmp_path / "big.npy"), "weight": 1}]
        ),
        tokenizer,
        tmp_path,
    )
    one_line(lambda: TokenBatches(data, 16, 2), "source 'tiny' has fewer than 16 train tokens")
    # token ids the model cannot embed (another tokenizer's files): in a source's first tokens at the start,
    one_line(
        lambda: TokenBatches(data.sources[1].train, 16, 2, vocab_size=100),
        r"source 'data' holds token id 499 in its first 500 tokens, outside the model's vocabulary of 100",
    )
    np.save(tmp_path / "late.npy", np.arange(70_000, dtype=np.uint32))  # and past them, at the batch that holds one
    loader = TokenBatches(np.load(tmp_path / "late.npy", mmap_mode="r"), 16, 2, vocab_size=66_000)

    def draw_until_refused():
        for _ in range(1000):
            loader.next_batch()

    one_line(draw_until_refused, r"source 'data' holds token id \d+, outside the model's vocabulary of 66000")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*.bin"))}


def _prepare_cli(config: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ds_optimus.data.prepare", "--config", str(config), *extra],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _config(tmp_path: Path, corpus: Path, cache: Path) -> Path:
    config = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    config["optimus"]["data"] = {
        "sources": [{"path": str(corpus), "name": "mix"}, "embedded"],
        "cache_dir": str(cache),
        "val_fraction": 0.05,
    }
    path = tmp_path / f"{cache.name}.json"
    path.write_text(json.dumps(config))
    return path


def test_parallel_preparation_equals_one_process_bitwise(tmp_path, tokenizer):
    """Two local workers, and two launched processes (RANK/WORLD_SIZE, as a launcher sets them, each
    with its share of the files, waiting for the other's markers), give the bytes one process gives."""
    corpus = write_corpus(tmp_path / "corpus", 9)
    sources = parse_sources([{"path": str(corpus), "name": "mix"}, "embedded"])
    one = prepare_data(sources, tokenizer, tmp_path / "one", 0.05, progress=False)
    two = prepare_data(sources, tokenizer, tmp_path / "two", 0.05, workers=2, progress=False, threads=1)
    ranks = [
        _prepare_cli(_config(tmp_path, corpus, tmp_path / "ranks"), env={"RANK": str(r), "WORLD_SIZE": "2"})
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert "ready: " in outputs[0][0] and outputs[1][0] == ""  # rank 0 reports
    reference = {s.name: _files(s.folder) for s in one.sources}
    for cache in ("two", "ranks"):
        for source in one.sources:
            (folder,) = (tmp_path / cache).glob(source.folder.name)
            assert _files(folder) == reference[source.name], (cache, source.name)
    markers = [json.loads(p.read_text()) for p in (tmp_path / "ranks").glob("mix-*/unit-*.json")]
    assert len(markers) == 9 and {m["rank"] for m in markers} == {0, 1}  # each rank did its share
    assert two.fingerprint == one.fingerprint and two.documents == one.documents == 9 * 6 + len(embedded_documents())


def test_a_killed_preparation_resumes_and_gives_the_same_tokens(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "corpus", 24, docs=embedded_documents())
    sources = parse_sources([{"path": str(corpus), "name": "mix"}, "embedded"])
    reference = prepare_data(sources, tokenizer, tmp_path / "ref", 0.05, progress=False)
    config = _config(tmp_path, corpus, tmp_path / "killed")
    proc = _prepare_cli(config, "--workers", "1")
    deadline, done = time.time() + 120, 0
    while time.time() < deadline and proc.poll() is None:
        done = len(list((tmp_path / "killed").glob("mix-*/unit-*.json")))
        if done >= 3:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the preparation finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    (folder,) = (tmp_path / "killed").glob("mix-*")
    markers = len(list(folder.glob("unit-*.json")))
    assert 3 <= markers < 24 and not (folder / "meta.json").exists()
    again = _prepare_cli(config)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"going on from an earlier preparation ({markers} of 25 files done)" in err
    done = _prepare_cli(config)
    assert "nothing to tokenize: every source is prepared" in done.communicate(timeout=300)[1]
    for source in reference.sources:
        (folder,) = (tmp_path / "killed").glob(source.folder.name)
        assert _files(folder) == _files(source.folder), source.name
        assert not list(folder.glob("*.tmp-*"))


def test_an_error_on_one_rank_stops_the_others_with_its_line(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", 4)
    (corpus / "part-0002.json.gz").write_bytes(b"\x1f\x8b broken")  # a file rank 1 or 0 gets
    config = _config(tmp_path, corpus, tmp_path / "cache")
    ranks = [_prepare_cli(config, env={"RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2]
    said = [[line for line in err.splitlines() if "error:" in line] for err in errors]
    assert len(said[0]) == 1 and len(said[1]) <= 1 and "Traceback" not in errors[0] + errors[1]  # rank 0 says it;
    for line in said[0] + said[1]:  # the rank that met the file says it too, unless that is rank 0
        assert "part-0002.json.gz: not a readable gz-compressed file" in line, errors
