"""Data: sources, the default tokenizer, tokenize-and-pack caching, and the resumable loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ds_optimus.data import (
    DataError,
    TokenBatches,
    embedded_documents,
    eval_batches,
    iter_documents,
    load_tokenizer,
    parse_source,
    prepare_data,
    token_dtype,
)
from ds_optimus.data.shards import folder_stream


def _all(stream) -> np.ndarray:
    return stream.read(0, stream.total)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_default_tokenizer_round_trips_and_compresses_the_corpus(tokenizer):
    assert len(tokenizer) == 4096 and tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    text = 'with open("f") as f:\n    print(f.read())  # naïve café ✓'
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    docs = embedded_documents()[:10]
    n_bytes = sum(len(d.encode()) for d in docs)
    n_tokens = sum(len(ids) for ids in tokenizer(docs)["input_ids"])
    assert n_tokens < 0.35 * n_bytes  # a trained BPE, not bytes


def test_a_tokenizer_path_that_does_not_exist_is_named_as_a_missing_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for path in (str(tmp_path / "tok"), "./no-such-tokenizer", "data/tokenizers/mine", "~/tok/"):
        with pytest.raises(ValueError, match=f"^tokenizer folder '{path}' does not exist$"):
            load_tokenizer(path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="is a file; give the folder that holds it$"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    monkeypatch.chdir(tmp_path)  # `org/name` could be either: said to have been tried as both
    with pytest.raises(
        ValueError,
        match=r"^cannot load tokenizer 'org/name' \(no such folder here; tried it as a "
        r"Hub name\): ",
    ):
        load_tokenizer("org/name")
    load_tokenizer().save_pretrained(tmp_path / "mine")
    assert load_tokenizer("mine").eos_token_id == 1  # a relative folder with one part


def test_sources_parse_and_fail_with_one_line(tmp_path):
    assert parse_source("embedded").kind == "embedded"
    assert parse_source({"hf": "org/name", "split": "validation"}).split == "validation"
    for bad, match in [
        ({"hf": "x", "colour": 1}, "unknown key 'colour'"),
        ({"what": 1}, "needs exactly one of 'path', 'hf', 'tokens'"),
        ({"path": "x", "max_documents": 0}, "max_documents"),
    ]:
        with pytest.raises(DataError, match=match):
            parse_source(bad)
    with pytest.raises(DataError, match="does not exist"):
        list(iter_documents(parse_source(str(tmp_path / "missing.jsonl"))))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: record has no 'text' field"):
        list(iter_documents(parse_source(str(bad_json))))


def test_local_text_jsonl_and_parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"record {i}"}) for i in range(3)) + "\n")
    pq.write_table(pa.table({"content": ["p0", "p1"]}), tmp_path / "c.parquet")
    docs = list(iter_documents(parse_source({"path": str(tmp_path / "*.txt")})))
    docs += list(iter_documents(parse_source(str(tmp_path / "b.jsonl"))))
    docs += list(iter_documents(parse_source({"path": str(tmp_path / "c.parquet"), "text_field": "content"})))
    assert docs == ["first document", "record 0", "record 1", "record 2", "p0", "p1"]
    capped = parse_source({"path": str(tmp_path / "b.jsonl"), "max_documents": 2})
    assert list(iter_documents(capped)) == ["record 0", "record 1"]


def test_hf_dataset_source_streams_a_local_datasets_folder(tmp_path):
    """The Hub code path (`datasets.load_dataset(..., streaming=True)`) on a dataset folder the test
    makes in the layout of allenai/OLMoE-mix-0924 (JSON lines files with a `text` field)."""
    folder = tmp_path / "mix" / "data"
    folder.mkdir(parents=True)
    for shard in range(2):
        (folder / f"part-{shard}.jsonl").write_text(
            "\n".join(json.dumps({"text": f"doc {shard}-{i}", "id": i}) for i in range(4)) + "\n"
        )
    docs = list(iter_documents(parse_source({"hf": str(tmp_path / "mix"), "split": "train"})))
    assert sorted(docs) == sorted(f"doc {s}-{i}" for s in range(2) for i in range(4))
    with pytest.raises(DataError, match="no 'body' field"):
        list(iter_documents(parse_source({"hf": str(tmp_path / "mix"), "text_field": "body"})))


def test_prepare_packs_documents_with_eos_and_caches_by_fingerprint(tmp_path, tokenizer):
    corpus = tmp_path / "docs.jsonl"
    texts = [f"document number {i} says hello" for i in range(40)]
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    source = parse_source(str(corpus))
    packed = prepare_data([source], tokenizer, tmp_path / "cache", val_fraction=0.1, progress=False)
    (prepared,) = packed.sources
    assert prepared.train.array(0).dtype == np.uint16 and packed.documents == 40 and packed.val_tokens > 0
    stream = np.concatenate([_all(packed.tokens("train")), _all(packed.tokens("val"))])
    assert (stream == tokenizer.eos_token_id).sum() == 40  # one EOS after every document
    expected = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)
    assert packed.train_tokens + packed.val_tokens == expected
    train_docs = tokenizer.decode(_all(packed.tokens("train"))).split("<eos>")
    assert train_docs[:2] == [texts[0], texts[2]]  # document 1 is held out always; the rest keep their order
    one = tmp_path / "book.txt"  # a source of one document keeps it for training
    one.write_text("a single long document " * 50)
    book = prepare_data([parse_source(str(one))], tokenizer, tmp_path / "cache", val_fraction=0.1, progress=False)
    assert book.train_tokens > 0 and book.val_tokens == 0
    # same inputs: the finished folder is reused; a changed file gets a new one
    again = prepare_data([source], tokenizer, tmp_path / "cache", val_fraction=0.1, progress=False)
    assert again.sources[0].folder == prepared.folder and again.fingerprint == packed.fingerprint
    corpus.write_text(corpus.read_text() + "\n" + json.dumps({"text": "one more"}))
    changed = prepare_data([source], tokenizer, tmp_path / "cache", val_fraction=0.1, progress=False)
    assert changed.sources[0].folder != prepared.folder and changed.fingerprint != packed.fingerprint
    assert not list((tmp_path / "cache").rglob("*.tmp-*"))


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(50304) == np.uint16 and token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32


def _stream(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint16)


def test_loader_is_deterministic_and_visits_every_sequence_once_per_epoch():
    tokens = _stream(8 * 40)  # 40 sequences of 8
    a = TokenBatches(tokens, 8, 4, seed=3)
    b = TokenBatches(tokens, 8, 4, seed=3)
    first = [a.next_batch() for _ in range(10)]
    assert all(torch.equal(x, b.next_batch()) for x in first)
    starts = sorted(int(x[0]) // 8 for batch in first for x in batch)
    assert starts == list(range(40))  # one epoch = each sequence exactly once
    second_epoch = [a.next_batch() for _ in range(10)]
    assert not all(torch.equal(x, y) for x, y in zip(first, second_epoch, strict=True))  # reshuffled
    assert not torch.equal(TokenBatches(tokens, 8, 4, seed=4).next_batch(), first[0])
    assert torch.equal(first[0][0], torch.arange(int(first[0][0, 0]), int(first[0][0, 0]) + 8))


def test_loader_shards_by_rank_and_together_equals_the_single_rank_stream():
    tokens = _stream(8 * 64)
    single = TokenBatches(tokens, 8, 6, seed=1)
    ranks = [TokenBatches(tokens, 8, 3, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    for _ in range(15):  # crosses epoch boundaries (64 sequences, 6 per step)
        together = torch.cat([r.next_batch() for r in ranks])
        assert torch.equal(together, single.next_batch())


def test_loader_resumes_from_tokens_consumed():
    tokens = _stream(8 * 30)
    run = TokenBatches(tokens, 8, 4, seed=7)
    for _ in range(9):
        run.next_batch()
    state = run.state_dict()
    assert state["tokens_consumed"] == 9 * 4 * 8
    resumed = TokenBatches(tokens, 8, 4, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(run.next_batch(), resumed.next_batch()) for _ in range(12))
    with pytest.raises(DataError, match="seq_len 8 and seed 7"):
        TokenBatches(tokens, 8, 4, seed=8).load_state_dict(state)


def test_loader_errors_name_the_problem():
    with pytest.raises(DataError, match="fewer than one global micro-batch"):
        TokenBatches(_stream(100), 8, 4, dp_size=4)
    with pytest.raises(DataError, match="dp_rank 2"):
        TokenBatches(_stream(1000), 8, 4, dp_rank=2, dp_size=2)


def test_eval_batches_are_fixed_and_sharded():
    tokens = _stream(8 * 20)
    r0 = eval_batches(tokens, 8, 2, 0, 2, max_batches=100)
    r1 = eval_batches(tokens, 8, 2, 1, 2, max_batches=100)
    assert len(r0) == len(r1) == 5
    assert torch.equal(r0[0][:, 0], torch.tensor([0, 8])) and torch.equal(r1[0][:, 0], torch.tensor([16, 24]))


def test_a_prepared_folder_reopens(tmp_path, tokenizer):
    packed = prepare_data([parse_source("embedded")], tokenizer, tmp_path, val_fraction=0.02, progress=False)
    again = folder_stream(packed.sources[0].folder, "val")
    assert packed.train_tokens == folder_stream(packed.sources[0].folder).total > 100_000
    assert np.array_equal(again.head(50), packed.tokens("val").head(50))


def test_null_text_is_skipped_and_non_strings_refused(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"text": "kept"}\n{"text": null}\n{"text": "also kept"}\n')
    assert list(iter_documents(parse_source(str(path)))) == ["kept", "also kept"]
    path.write_text('{"text": 42}\n')
    with pytest.raises(DataError, match="holds a int, not a string"):
        list(iter_documents(parse_source(str(path))))


def test_a_failed_tokenization_leaves_no_partial_cache(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"other": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: record has no 'text' field"):
        prepare_data([parse_source(str(path))], tokenizer, tmp_path / "cache", progress=False)
    folder, error = sorted((tmp_path / "cache").iterdir())  # the error, said for the other ranks
    assert error.name == f"{folder.name}.error.rank0" and "record has no 'text' field" in error.read_text()
    assert list(folder.iterdir()) == []  # nothing that looks done, nothing half-written
