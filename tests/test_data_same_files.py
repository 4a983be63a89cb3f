"""The same files listed twice are refused under any spellings, not only under the same one: a folder
and a glob of its files, a file and a glob that matches it, a symbolic or a hard link, for text and
token files alike; at data preparation and by `--check`, in one line naming both sources and a file
they share. Files are told apart by a stat each (device and inode), never by reading them."""

from __future__ import annotations

import builtins
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ds_optimus.data import DataError, load_tokenizer, parse_sources, prepare_data
from ds_optimus.data.sources import DistinctFiles, parse_source
from ds_optimus.train.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "ds_configs" / "mula-tiny-moe-cpu.json"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _corpus(tmp_path: Path) -> Path:
    """data/a.jsonl and data/b.jsonl (records with "text" and "title"), data/tok/{a,b}.npy."""
    data = tmp_path / "data"
    (data / "tok").mkdir(parents=True)
    for stem in ("a", "b"):
        (data / f"{stem}.jsonl").write_text(
            "".join(json.dumps({"text": f"{stem} document {i} " * 20, "title": f"{stem} {i}"}) + "\n" for i in range(8))
        )
        np.save(data / "tok" / f"{stem}.npy", np.arange(500, dtype=np.uint16))
    return data


def _link(tmp_path: Path, target: Path, name: str, hard: bool = False) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir(exist_ok=True)
    (os.link if hard else os.symlink)(target, folder / name)
    return folder / name


# (the sources, given the corpus folder; the line that refuses them)
SPELLINGS = {
    "folder and a glob of its files": (
        lambda d, t: [str(d), {"path": str(d / "*.jsonl"), "name": "data_glob"}],
        lambda d: rf"sources 0 \('data'\) and 1 \('data_glob'\) both read {d}/a.jsonl: list each file in one source",
    ),
    "a file and a glob that matches it": (
        lambda d, t: [
            {"path": str(d / "b.jsonl"), "weight": 1},
            {"path": str(d / "*.jsonl"), "name": "all", "weight": 2},
        ],
        lambda d: rf"sources 0 \('b'\) and 1 \('all'\) both read {d}/b.jsonl: list each file in one source",
    ),
    "a symbolic link to a file of a folder": (
        lambda d, t: [str(d), str(_link(t, d / "a.jsonl", "mirror.jsonl"))],
        lambda d: (
            rf"sources 0 \('data'\) and 1 \('mirror'\) both read {d}/a.jsonl \(as .*/elsewhere/mirror.jsonl\): "
            "list each file in one source"
        ),
    ),
    "a hard link": (
        lambda d, t: [str(_link(t, d / "b.jsonl", "copy.jsonl", hard=True)), str(d / "*.jsonl")],
        lambda d: (
            r"sources 0 \('copy'\) and 1 \('data'\) both read .*/elsewhere/copy.jsonl "
            rf"\(as {d}/b.jsonl\): list each file in one source"
        ),
    ),
    "token files: a folder and a glob": (
        lambda d, t: [{"tokens": str(d / "tok")}, {"tokens": str(d / "tok" / "*.npy"), "name": "tok_glob"}],
        lambda d: rf"sources 0 \('tok'\) and 1 \('tok_glob'\) both read {d}/tok/a.npy: list each file in one source",
    ),
    "token files: a symbolic link to a folder": (
        lambda d, t: [{"tokens": str(d / "tok" / "b.npy")}, {"tokens": str(_link(t, d / "tok", "tokens"))}],
        lambda d: rf"sources 0 \('b'\) and 1 \('tokens'\) both read {d}/tok/b.npy \(as .*/elsewhere/tokens/b.npy\)",
    ),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_same_files_under_other_spellings_are_refused_at_preparation(tmp_path, tokenizer, spelling):
    data = _corpus(tmp_path)
    specs, message = SPELLINGS[spelling]
    sources = parse_sources(specs(data, tmp_path))  # the spellings differ: the config alone cannot tell
    with pytest.raises(DataError, match=f"^{message(data)}") as err:
        prepare_data(sources, tokenizer, tmp_path / "cache")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache").exists()  # refused before anything was tokenized


@pytest.mark.parametrize(
    "spelling",
    ["folder and a glob of its files", "a symbolic link to a file of a folder", "token files: a folder and a glob"],
)
def test_check_refuses_them_with_the_same_line(tmp_path, capsys, spelling):
    data = _corpus(tmp_path)
    specs, message = SPELLINGS[spelling]
    status = main(
        [
            "--config",
            str(TINY),
            "--check",
            "--set",
            f"optimus.data.cache_dir={tmp_path}/cache",
            "--set",
            f"optimus.train.output_dir={tmp_path}/run",
            "--set",
            f"optimus.data.sources={json.dumps(specs(data, tmp_path))}",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("ds_optimus.train: error: ") and re.search(message(data), err), err


def test_other_files_and_other_fields_of_the_same_files_are_not_the_same_data(tmp_path, tokenizer):
    data = _corpus(tmp_path)
    prepared = prepare_data(
        parse_sources(
            [
                str(data / "a*.jsonl"),
                {"path": str(data / "b*.jsonl"), "name": "b"},
                {"path": str(data / "*.jsonl"), "text_field": "title", "name": "titles"},
                {"tokens": str(data / "tok" / "a.npy"), "name": "tok_a"},
                {"tokens": str(data / "tok" / "b.npy"), "name": "tok_b"},
            ]
        ),
        tokenizer,
        tmp_path / "cache",
    )
    assert [s.name for s in prepared.sources] == ["data", "b", "titles", "tok_a", "tok_b"]
    assert [s.documents for s in prepared.sources] == [8, 8, 16, None, None]
    assert [s.train.total for s in prepared.sources][3:] == [500, 500]


def test_files_are_told_apart_by_one_stat_each_and_never_read(tmp_path, monkeypatch):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(1000):
        (folder / f"part-{i:04d}.jsonl").write_text("x")
    files = sorted(folder.iterdir())
    stats = []
    real_stat = os.stat

    def counted(path, *args, **kwargs):
        stats.append(path)
        return real_stat(path, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("a file was opened")

    distinct = DistinctFiles()
    monkeypatch.setattr(os, "stat", counted)
    monkeypatch.setattr(builtins, "open", refused)
    monkeypatch.setattr(io, "open", refused)
    distinct.add(0, parse_source(str(folder / "part-0*.jsonl")), files[:500])
    distinct.add(1, parse_source(str(folder / "part-1*.jsonl")), files[500:])
    with pytest.raises(DataError, match=r"^sources 0 \('many'\) and 2 \('last'\) both read .*part-0499.jsonl"):
        distinct.add(2, parse_source({"path": str(files[499]), "name": "last"}), files[499:500])
    monkeypatch.undo()
    assert len(stats) == 1001  # one stat per file listed
