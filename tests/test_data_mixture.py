"""Data at scale, part 2: the keyed-bijection shuffle, weighted mixtures (shares, resume, a source
running out), data changed under a resumed run, and a 4-trillion-token source that costs nothing
to open."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from ds_optimus.data import DataError, TokenBatches, TokenStream, load_tokenizer, parse_sources, prepare_data
from ds_optimus.data.mixture import (
    changed_data_message,
    data_changes,
    mixture_sources,
    mixture_thresholds,
    permute,
    stable_key,
)


def test_the_keyed_permutation_is_a_bijection_for_every_size():
    for n in [*range(1, 70), 127, 128, 129, 1000, 4097, 65_536, 100_003]:
        image = permute(np.arange(n), n, key=n)
        assert np.array_equal(np.sort(image), np.arange(n)), n
    a, b = permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2)
    assert not np.array_equal(a, b) and np.array_equal(a, permute(np.arange(1000), 1000, 1))
    assert abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1  # no trace of the input order
    # 2x10^9 sequences (4T tokens at 2048): any offset is a few integer operations, nothing stored
    n = 2_000_000_000
    tracemalloc.start()  # NumPy reports its arrays to tracemalloc: a table of n entries would be 16 GB
    far = permute(np.array([0, 1, n // 2, n - 1]), n, 7)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20, peak  # a few arrays of 4 elements, however large n is
    assert ((far >= 0) & (far < n)).all() and len(set(far.tolist())) == 4
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, 10\)"):
        permute([10], 10, 0)


def test_mixture_draws_follow_the_weights_in_every_window():
    thresholds = mixture_thresholds([0.75, 0.25])
    key = stable_key(0, "mixture")
    for start in (0, 10_000, 3_000_000_000):  # the share holds anywhere in the run, not only on average
        draws = mixture_sources(np.arange(start, start + 200), thresholds, key)
        assert abs((draws == 0).mean() - 0.75) < 0.02
    three = mixture_sources(np.arange(10_000), mixture_thresholds([5, 3, 2]), key)
    assert np.allclose(np.bincount(three) / 10_000, [0.5, 0.3, 0.2], atol=0.002)


def _sources(tmp_path, sizes, weights=None):
    specs = []
    for i, size in enumerate(sizes):
        np.save(tmp_path / f"s{i}.npy", (np.arange(size) + 1_000_000 * i).astype(np.uint32))  # source, position
        spec = {"tokens": str(tmp_path / f"s{i}.npy"), "name": f"src{i}"}
        if weights:
            spec["weight"] = weights[i]
        specs.append(spec)
    return prepare_data(parse_sources(specs), load_tokenizer(), tmp_path / "cache")


def test_a_weighted_mixture_draws_its_shares_and_resumes_exactly(tmp_path):
    data = _sources(tmp_path, [8 * 400, 8 * 400], weights=[0.75, 0.25])
    run = TokenBatches(data, 8, 5, dp_rank=0, dp_size=2, seed=3)
    other = TokenBatches(data, 8, 5, dp_rank=1, dp_size=2, seed=3)
    rows = []
    for step in range(20):  # 200 sequences
        rows += [run.next_batch(), other.next_batch()]
        if step == 9:  # a restart in the middle: the state through JSON, new loaders
            state = json.loads(json.dumps(run.state_dict()))
            resumed = [TokenBatches(data, 8, 5, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
            for loader in resumed:
                assert loader.load_state_dict(state) == []
            after = [torch.cat([resumed[0].next_batch(), resumed[1].next_batch()]) for _ in range(10)]
    drawn = torch.cat(rows)
    from_first = (drawn[:, 0] < 1_000_000).float().mean().item()  # which source a row is from
    assert abs(from_first - 0.75) < 0.05
    assert all(torch.equal(a, torch.cat(rows[20 + 2 * i : 22 + 2 * i])) for i, a in enumerate(after))
    tokens = run.source_tokens()
    assert tokens == other.source_tokens() and sum(tokens.values()) == 200 * 8 and abs(tokens["src0"] - 150 * 8) <= 16


def test_without_weights_sources_are_drawn_by_size_and_every_sequence_once(tmp_path):
    data = _sources(tmp_path, [8 * 30, 8 * 10])
    loader = TokenBatches(data, 8, 4, seed=1)
    rows = torch.cat([loader.next_batch() for _ in range(10)])
    keys = sorted((int(r[0]) // 1_000_000, int(r[0]) % 1_000_000 // 8) for r in rows)
    assert keys == [(0, i) for i in range(30)] + [(1, i) for i in range(10)]  # one epoch of the union
    assert loader.take_events() == []


def test_a_source_that_runs_out_repeats_in_a_new_order_and_says_so_once(tmp_path):
    data = _sources(tmp_path, [8 * 100, 8 * 6], weights=[1, 1])
    loader = TokenBatches(data, 8, 4, seed=0)
    small = []
    for _ in range(7):  # 28 draws: ~14 of the small source, over two of its epochs
        batch = loader.next_batch()
        small += [int(r[0]) % 1_000_000 // 8 for r in batch if int(r[0]) >= 1_000_000]
    assert sorted(small[:6]) == list(range(6)) and sorted(small[6:12]) == list(range(6))
    assert small[:6] != small[6:12]  # a new order
    events = loader.take_events()  # one line as each epoch of it begins
    assert (
        events
        == [
            f"data: source 'src1' ran through its 6 sequences; epoch {e} of it goes on in a new order"
            for e in range(2, (len(small) - 1) // 6 + 2)
        ]
        and len(events) >= 1
    )
    assert loader.take_events() == [] and loader.source_epochs()["src1"] == pytest.approx(len(small) / 6)


def test_data_changed_under_a_resume_is_refused_in_one_line_unless_allowed(tmp_path):
    data = _sources(tmp_path, [8 * 50, 8 * 50], weights=[0.5, 0.5])
    run = TokenBatches(data, 8, 4, seed=0)
    for _ in range(3):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))
    reweighted = prepare_data(
        parse_sources(
            [
                {**s, "weight": w}
                for s, w in zip(
                    [
                        {"tokens": str(tmp_path / "s0.npy"), "name": "src0"},
                        {"tokens": str(tmp_path / "s1.npy"), "name": "src1"},
                    ],
                    [0.8, 0.2],
                    strict=True,
                )
            ]
        ),
        load_tokenizer(),
        tmp_path / "cache",
    )
    with pytest.raises(
        DataError,
        match=r"^the data changed since the checkpoint: source 'src0' was reweighted: 0.5 "
        r"-> 0.8; source 'src1' was reweighted: 0.5 -> 0.2; so the share of source "
        r"'src0' went from 0.5 to 0.8 \(and 1 more share\); set "
        "optimus.data.allow_change to",
    ) as err:
        TokenBatches(reweighted, 8, 4, seed=0).load_state_dict(state)
    assert "\n" not in str(err.value)
    np.save(tmp_path / "s1.npy", np.arange(8 * 60, dtype=np.uint32))  # new content: another size
    with pytest.raises(DataError, match=r"changed since the checkpoint: source 'src1' holds other data \(its files"):
        TokenBatches(_sources_named(tmp_path, ["s0", "s1"]), 8, 4, seed=0).load_state_dict(state)
    loader = TokenBatches(_sources_named(tmp_path, ["s0", "s1", "s2"]), 8, 4, seed=0)
    notes = loader.load_state_dict(state, allow_change=True)
    assert notes == [
        "source 'src2' was added (weight 1)",  # weights 1, 1 for 0.5, 0.5: the same two-source mix
        "source 'src1' holds other data (its files, their sizes or times, or the tokenizer)",
        "the share of source 'src0' went from 0.5 to 0.3333",
    ]
    assert loader.drawn.tolist()[:2] == [run.drawn[0], run.drawn[1]] and loader.drawn[2] == 0  # kept by name
    loader.next_batch()


def _weighted(tmp_path, weights: dict[str, float]):
    for i, name in enumerate(["code", "web", "tok"]):
        if not (tmp_path / f"{name}.npy").exists():  # written once: a rewritten file is other data
            np.save(tmp_path / f"{name}.npy", (np.arange(8 * 40) + 1_000_000 * i).astype(np.uint32))
    return prepare_data(
        parse_sources([{"tokens": str(tmp_path / f"{name}.npy"), "weight": w} for name, w in weights.items()]),
        load_tokenizer(),
        tmp_path / "cache",
    )


def test_a_data_change_is_said_by_what_the_user_did_before_the_shares_that_follow(tmp_path):
    run = TokenBatches(_weighted(tmp_path, {"code": 7, "web": 3}), 8, 4, seed=0)
    run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))
    assert state["sources"]["code"]["weight"] == 7 and state["sources"]["code"]["share"] == pytest.approx(0.7)
    added = TokenBatches(_weighted(tmp_path, {"code": 7, "web": 3, "tok": 2}), 8, 4, seed=0)
    with pytest.raises(DataError) as err:  # the shares moved because a source was added: that comes first
        added.load_state_dict(state)
    assert str(err.value) == (
        "the data changed since the checkpoint: source 'tok' was added (weight 2); so the share "
        "of source 'code' went from 0.7 to 0.5833 (and 1 more share); set "
        "optimus.data.allow_change to true to continue on the new data"
    )
    assert added.load_state_dict(state, allow_change=True) == [  # every change in the log, in that order
        "source 'tok' was added (weight 2)",
        "the share of source 'code' went from 0.7 to 0.5833",
        "the share of source 'web' went from 0.3 to 0.25",
    ]
    # weights all scaled alike are the same mixture: no change, as before
    assert TokenBatches(_weighted(tmp_path, {"code": 0.7, "web": 0.3}), 8, 4, seed=0).load_state_dict(state) == []


def test_each_kind_of_data_change_is_named_with_its_old_and_new_values():
    def saved(**sources):
        return {
            name: {"drawn": 5, "identity": f"id-{name}", "share": share, "weight": weight}
            for name, (share, weight) in sources.items()
        }

    def changes(before, now, weights, identities=None):
        shares = [w / sum(weights) for w in weights]
        return data_changes(before, now, identities or [f"id-{name}" for name in now], shares, weights)

    two = saved(code=(0.7, 7), web=(0.3, 3))
    assert changes(two, ["code"], [7]) == ["source 'web' was dropped", "the share of source 'code' went from 0.7 to 1"]
    assert changes(two, ["code", "www"], [7, 3], ["id-code", "id-web"]) == ["source 'web' was renamed 'www'"]
    assert changes(two, ["code", "web"], [5, 5]) == [
        "source 'code' was reweighted: 7 -> 5",
        "source 'web' was reweighted: 3 -> 5",
        "the share of source 'code' went from 0.7 to 0.5",
        "the share of source 'web' went from 0.3 to 0.5",
    ]
    three = saved(web=(0.5, 5), code=(0.3, 3), math=(0.2, 2))
    assert changes(three, ["web", "code", "math"], [10, 6, 8]) == [  # two of them doubled: the third was reweighted
        "source 'math' was reweighted: 2 -> 8",
        "the share of source 'math' went from 0.2 to 0.3333",
        "the share of source 'web' went from 0.5 to 0.4167",
        "the share of source 'code' went from 0.3 to 0.25",
    ]
    assert changes(three, ["web", "code", "math"], [1, 0.6, 0.4]) == []  # scaled alike: the same mixture
    assert changes(two, ["code", "web"], [7, 3], ["id-code", "id-other"]) == [
        "source 'web' holds other data (its files, their sizes or times, or the tokenizer)"
    ]
    old = {name: {k: v for k, v in record.items() if k != "weight"} for name, record in two.items()}
    assert changes(old, ["code", "web"], [5, 5]) == [  # a checkpoint from before weights were recorded: shares only
        "the share of source 'code' went from 0.7 to 0.5",
        "the share of source 'web' went from 0.3 to 0.5",
    ]
    many = changes(two, ["code", "a", "b", "c", "d"], [7, 1, 1, 1, 1])
    assert changed_data_message(many, since="step_00000040") == (
        "the data changed since step_00000040: source 'a' was added (weight 1); source 'b' was added (weight 1); "
        "source 'c' was added (weight 1) (and 2 more); so the share of source 'code' went from 0.7 to 0.6364; set "
        "optimus.data.allow_change to true to continue on the new data"
    )


def _sources_named(tmp_path, stems):
    np.save(tmp_path / "s2.npy", np.arange(8 * 20, dtype=np.uint32))
    return prepare_data(
        parse_sources([{"tokens": str(tmp_path / f"{s}.npy"), "name": f"src{s[1:]}", "weight": 1} for s in stems]),
        load_tokenizer(),
        tmp_path / "cache",
    )


PROBE = """
import resource, sys, time
from ds_optimus.data import TokenBatches, load_tokenizer, parse_sources, prepare_data
tokenizer = load_tokenizer()
imported = time.perf_counter()
data = prepare_data(parse_sources([{"tokens": sys.argv[1]}]), tokenizer, sys.argv[2])
loader = TokenBatches(data, 2048, 8, dp_rank=3, dp_size=12288, seed=0)
batches = [loader.next_batch() for _ in range(2)]
built = time.perf_counter()
print(data.train_tokens, loader.num_sequences, built - imported, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_four_trillion_token_source_opens_and_draws_at_once(tmp_path):
    """A sparse 4T-token .npy (no disk used): mapped, sized from its header, drawn from at rank 3 of
    12,288 with no allocation that grows with it (peak RSS against a 400M-token file)."""
    from numpy.lib.format import open_memmap

    runs = {}
    for name, tokens in (("small", 400_000_000), ("huge", 4_000_000_000_000)):
        path = tmp_path / f"{name}.npy"
        array = open_memmap(path, mode="w+", dtype=np.uint16, shape=(tokens,))
        array[-4096:] = 7  # the only pages written
        del array
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(path), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.split()
        runs[name] = [int(out[0]), int(out[1]), float(out[2]), int(out[3])]
    assert runs["huge"][:2] == [4_000_000_000_000, 4_000_000_000_000 // 2048]
    # no work or memory that grows with the tokens: the peak RSS is that of a file 10,000 times smaller (the
    # seconds are printed, not bounded: time belongs in benchmarks, and a loaded machine stretches them)
    assert runs["huge"][3] - runs["small"][3] < 50 * 1024  # KiB


def test_the_trainer_glue_draws_by_weight_with_random_access(tmp_path):
    from ds_optimus.train.hf_trainer import PackedSequences

    data = _sources(tmp_path, [8 * 400, 8 * 400], weights=[0.75, 0.25])
    dataset = PackedSequences(data, 8)
    assert len(dataset) == 800
    every = np.array([int(dataset[i]["input_ids"][0]) for i in range(800)])
    # shares exact; source 0 (400 sequences) wraps round once its 400 are used, source 1 gives its first 200
    assert (every < 1_000_000).sum() == 600 and len(set(every.tolist())) == 400 + 200
    assert isinstance(data.tokens("train"), TokenStream)


def test_held_out_batches_come_from_the_sources_that_have_enough(tmp_path):
    from ds_optimus.data import eval_batches

    for name, size in (("a", 800), ("b", 800), ("va", 80), ("vb", 5)):
        offset = 1_000_000 if name.endswith("b") else 0  # which source a token is from
        np.save(tmp_path / f"{name}.npy", (np.arange(size) + offset).astype(np.uint32))
    data = prepare_data(
        parse_sources(
            [
                {"tokens": str(tmp_path / "a.npy"), "val": str(tmp_path / "va.npy"), "weight": 1},
                {"tokens": str(tmp_path / "b.npy"), "val": str(tmp_path / "vb.npy"), "weight": 3},
            ]
        ),
        load_tokenizer(),
        tmp_path,
    )
    batches = eval_batches(data, 8, 2, 0, 1, max_batches=100)  # source b's 5 held-out tokens make no sequence
    rows = torch.cat(batches)
    assert len(batches) == 5 and (rows < 1_000_000).all()
    assert torch.equal(rows[:, 0], torch.arange(0, 80, 8))  # in order: the same every evaluation


def test_a_stream_of_many_files_keeps_few_mapped_and_every_index_is_reachable(tmp_path):
    from ds_optimus.data.shards import MAX_MAPPED
    from ds_optimus.data.token_files import TokenFile

    files = []
    for i in range(MAX_MAPPED + 40):  # more files than a stream keeps mapped
        np.arange(i * 64, (i + 1) * 64, dtype=np.uint32).tofile(tmp_path / f"{i}.bin")
        files.append(TokenFile(str(tmp_path / f"{i}.bin"), 64, np.dtype(np.uint32).str))
    stream = TokenStream(files)
    for _ in range(2):
        for i in range(len(files) - 1):  # each read crosses into the next file
            assert stream.read(i * 64 + 60, 8).tolist() == list(range(i * 64 + 60, i * 64 + 68))
    assert sum(a is not None for a in stream.arrays) <= MAX_MAPPED
    # the Trainer glue reaches its last index whatever the float sum of the shares; a source of no
    # sequence at the end of the list is never drawn
    thresholds = mixture_thresholds([3, 3, 3, 1, 0])
    assert thresholds[-1] == np.uint64(2**64 - 1)
    from ds_optimus.train.hf_trainer import PackedSequences

    parts = [np.arange(n * 8, dtype=np.uint16) for n in (30, 30, 30, 10)]
    for i, part in enumerate(parts):
        np.save(tmp_path / f"p{i}.npy", part)
    data = prepare_data(
        parse_sources([{"tokens": str(tmp_path / f"p{i}.npy")} for i in range(4)]), load_tokenizer(), tmp_path
    )
    dataset = PackedSequences(data, 8)
    assert len(dataset) == 100 and dataset[99]["input_ids"].shape == (8,)
