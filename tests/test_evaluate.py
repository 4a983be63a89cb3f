"""Downstream evaluation (`python -m ds_optimus.evaluate`, `optimus.eval.downstream`), offline: the
built-in `pydoc_cloze` task and a task of the test's own YAML and JSONL, scored on the tiny preset's
checkpoints (exported on the fly, experts joined from two EP ranks) and on its exported folder."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import needs
import pytest
import torch

needs.module("lm_eval", "lm-evaluation-harness is an optional extra: pip install -e '.[eval]'")

from ds_optimus.evaluate.__main__ import main  # noqa: E402
from ds_optimus.evaluate.tasks import MULA_SUITE, expand, write_pydoc_cloze  # noqa: E402

TASK = """task: animal_sounds
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _run(capsys, *args) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 steps of the tiny preset on 2 processes at EP 2, a checkpoint every 2 steps, each scored on
    pydoc_cloze by the training run itself."""
    from distributed import run_distributed
    from train_workers import pretrain_worker, tiny_config

    tmp = tmp_path_factory.mktemp("evaluate")
    config = tiny_config(
        tmp,
        tmp / "cache",
        expert_parallel={"size": 2},
        train={"steps": 4, "eval_interval": 0},
        checkpoint={"interval": 2, "keep_last": 3},
        eval={"downstream": {"tasks": ["pydoc_cloze"], "limit": 24}},
    )
    run_distributed(pretrain_worker, 2, config)
    return Path(config["optimus"]["train"]["output_dir"])


@pytest.mark.slow
def test_a_run_scores_each_checkpoint_and_the_cli_agrees_on_its_checkpoints_and_export(run, tmp_path, capsys):
    scored = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run / "eval").glob("step_*.json")}
    assert sorted(scored) == [2, 4]
    for step, record in scored.items():
        task = record["tasks"]["pydoc_cloze"]
        assert record["step"] == step and task["samples"] == 24 and 0 <= task["acc"] <= 1 and "acc_norm" in task
    log = (run / "log.txt").read_text()  # scored in a process of their own, said in the run's log when done
    assert [line.split(": ")[0][20:] for line in log.splitlines() if ": downstream pydoc_cloze acc_norm " in line] == [
        "step 2",
        "step 4",
    ], log
    # the run ended before the last was scored (and, on a busy machine, before the first)
    assert re.search(r"waiting for the downstream evaluation of step\(s\) (2, )?4$", log, re.M), log
    assert (run / "eval" / "step_00000002.log").exists()
    assert not list((run / "eval").glob("hf-*"))  # the on-the-fly exports are removed

    # the same checkpoint scored again from the command line, and the run's exported folder (the
    # weights of step 4): the same numbers, so the export joins the experts of both EP ranks right
    status, out, err = _run(
        capsys, run, "--step", 4, "--tasks", "pydoc_cloze", "--limit", 24, "--out", tmp_path / "again.json"
    )
    assert status == 0, err
    again = json.loads((tmp_path / "again.json").read_text())["tasks"]["pydoc_cloze"]
    status, out, err = _run(capsys, run / "hf", "--tasks", "pydoc_cloze", "--limit", 24, "--out", tmp_path / "hf.json")
    assert status == 0, err
    from_hf = json.loads((tmp_path / "hf.json").read_text())["tasks"]["pydoc_cloze"]
    for metric in ("acc", "acc_norm"):
        assert again[metric] == pytest.approx(scored[4]["tasks"]["pydoc_cloze"][metric])
        assert from_hf[metric] == pytest.approx(again[metric])
    assert out.startswith(
        f"loading the tasks pydoc_cloze\nscoring {run / 'hf'} on pydoc_cloze (cpu, float32)\npydoc_cloze acc_norm "
    )

    # the report draws the scores
    from ds_optimus.report import write_report

    written = write_report(run, tmp_path / "plots", say=lambda _: None)
    assert tmp_path / "plots" / "downstream.png" in written
    assert struct.unpack(">II", (tmp_path / "plots" / "downstream.png").read_bytes()[16:24])[0] >= 600


@pytest.mark.slow
def test_the_docs_evaluate_command_scores_the_newest_checkpoint(run, tmp_path, monkeypatch, capsys):
    """`python -m ds_optimus.evaluate runs/mula-tiny-moe --tasks pydoc_cloze` as README.md and
    docs/evaluation.md give it, on a copy of the run: the newest checkpoint, all 200 sentences."""
    import shlex
    import shutil

    from doc_blocks import doc_commands, ran

    found = {c.text for c in doc_commands() if c.text.startswith("python -m ds_optimus.evaluate runs/mula-tiny-moe")}
    assert len(found) == 1, found
    shutil.copytree(run, tmp_path / "runs" / "mula-tiny-moe")
    monkeypatch.chdir(tmp_path)
    written = found.pop()
    ran(written)
    status, out, err = _run(capsys, *shlex.split(written)[3:])
    assert status == 0, err
    scores = json.loads((tmp_path / "runs" / "mula-tiny-moe" / "eval" / "step_00000004.json").read_text())
    assert scores["tasks"]["pydoc_cloze"]["samples"] == 200 and "pydoc_cloze acc_norm " in out


@pytest.mark.slow
def test_a_checkpoint_exports_as_a_complete_hugging_face_folder(run, tmp_path, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ds_optimus.evaluate import export_checkpoint

    before = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a user's script: the library's call draws no bar of its own
    try:
        folder = export_checkpoint(run / "checkpoints" / "step_00000004", tmp_path / "export")
        assert hf_logging.is_progress_bar_enabled()  # and leaves the caller's setting as it was
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
    assert "Writing model shards" not in capfd.readouterr().err
    exported = AutoModelForCausalLM.from_pretrained(folder).eval()
    final = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert exported.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # both EP ranks' experts
    ids = AutoTokenizer.from_pretrained(folder)("The with statement", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, final(ids).logits)
    assert AutoTokenizer.from_pretrained(folder).model_max_length == exported.config.max_position_embeddings


QUESTIONS = [
    ("Which animal barks?", ["a dog", "a cat", "a fish"]),
    ("Which animal meows?", ["a dog", "a cat", "a cow"]),
    ("What does a cow say?", ["moo", "woof", "quack quack"]),
    ("What flies?", ["a bird", "a stone", "the sea"]),
    ("What swims?", ["a fish", "a tree", "a car"]),
    ("What is cold?", ["ice", "fire", "the sun at noon"]),
    ("What is a number?", ["seven", "blue", "loud"]),
    ("What do we read?", ["a book", "a spoon", "rain"]),
    ("Which is a colour?", ["red", "ten", "under"]),
    ("What grows?", ["a plant", "a rock", "a key"]),
    ("Which is a fruit?", ["an apple", "a shoe", "a door"]),
    ("What rings?", ["a bell", "a sock", "milk"]),
]


def _choice_logliks(folder: Path, questions) -> list[list[float]]:
    """Each choice's log-likelihood after its question, computed here as lm-eval defines it for a
    multiple-choice task (the continuation " " + choice, the pair encoded whole and split after the
    context's tokens), with the exported model and its tokenizer: the oracle of the scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.encode("Answer: a") == tokenizer.encode("Answer: a", add_special_tokens=False)
    out = []
    for question, choices in questions:
        context = f"Question: {question}\nAnswer:"
        start = len(tokenizer.encode(context))
        row = []
        for choice in choices:
            ids = torch.tensor([tokenizer.encode(context + " " + choice)])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids[:, :-1]).logits.double(), -1)[0]
            row.append(logp[start - 1 :].gather(1, ids[0, start:, None]).sum().item())
        out.append(row)
    return out


@pytest.mark.slow
def test_a_task_of_ones_own_yaml_and_jsonl_and_every_checkpoint_once(run, tmp_path, capsys):
    """A task whose answers the test sets from the models' own log-likelihoods (computed here): the
    likeliest choice right for the first half of the questions and the least likely for the rest, so
    that the final checkpoint scores exactly 0.5 and the earlier one what its own likelihoods say."""
    from ds_optimus.evaluate import export_checkpoint

    folders = {2: export_checkpoint(run / "checkpoints" / "step_00000002", tmp_path / "step2"), 4: run / "hf"}
    lls = {step: _choice_logliks(folder, QUESTIONS) for step, folder in folders.items()}
    lengths = [[float(len(c)) for c in choices] for _, choices in QUESTIONS]

    def margin(values):
        top = sorted(values, reverse=True)
        return top[0] - top[1]

    # questions whose choices the models tell apart well beyond float32 rounding (batched or not)
    kept = [
        i
        for i in range(len(QUESTIONS))
        if all(
            margin(ll[i]) > 1e-2 and margin([v / n for v, n in zip(ll[i], lengths[i], strict=True)]) > 1e-3
            for ll in lls.values()
        )
    ]
    assert len(kept) >= 4, lls
    kept = kept[: len(kept) // 2 * 2]
    final = [max(range(3), key=lls[4][i].__getitem__) for i in kept]
    labels = [
        best if j < len(kept) // 2 else min(range(3), key=lls[4][i].__getitem__)
        for j, (i, best) in enumerate(zip(kept, final, strict=True))
    ]
    expected = {}
    for step, ll in lls.items():
        acc = [max(range(3), key=ll[i].__getitem__) == label for i, label in zip(kept, labels, strict=True)]
        norm = [
            max(range(3), key=lambda c, i=i: ll[i][c] / lengths[i][c]) == label
            for i, label in zip(kept, labels, strict=True)
        ]
        expected[step] = (sum(acc) / len(kept), sum(norm) / len(kept))
    assert expected[4][0] == 0.5

    data = tmp_path / "tasks" / "animal_sounds.jsonl"
    data.parent.mkdir()
    data.write_text(
        "".join(
            json.dumps({"question": QUESTIONS[i][0], "choices": QUESTIONS[i][1], "label": label}) + "\n"
            for i, label in zip(kept, labels, strict=True)
        )
    )
    (tmp_path / "tasks" / "animal_sounds.yaml").write_text(TASK.format(data=json.dumps(str(data))))
    status, out, err = _run(capsys, run, "--all", "--tasks", "pydoc_cloze")  # the run scored it at every checkpoint
    assert status == 0 and out == f"every checkpoint of {run} is scored on pydoc_cloze already ({run / 'eval'})\n"
    status, out, err = _run(capsys, run, "--all", "--tasks", "animal_sounds", "--include", tmp_path / "tasks")
    assert status == 0 and out.count("animal_sounds acc_norm ") == 2, out + err  # both checkpoints, the new task
    for step in (2, 4):  # added beside the scores the run wrote, which stay
        record = json.loads((run / "eval" / f"step_0000000{step}.json").read_text())
        assert sorted(record["tasks"]) == ["animal_sounds", "pydoc_cloze"] and record["step"] == step
        task = record["tasks"]["animal_sounds"]
        assert task["samples"] == len(kept) and record["tasks"]["pydoc_cloze"]["limit"] == 24
        assert (task["acc"], task["acc_norm"]) == pytest.approx(expected[step]), (step, expected, lls)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "no_such_task"], "unknown task 'no_such_task' (lm-eval 0.4."),
        (["--tasks", "pydoc_cloze", "--include", "/no/such/tasks"], "task folder '/no/such/tasks' does not exist"),
        (["--tasks", "pydoc_cloze", "--step", "3"], "has no complete checkpoint of step 3"),
        (["--tasks", "pydoc_cloze", "--all", "--out", "x.json"], "--out names one results file"),
    ],
)
def test_bad_input_is_one_line(run, capsys, args, message):
    status, out, err = _run(capsys, run, *args)
    assert status == 2 and err.startswith("ds_optimus.evaluate: error: ") and message in err, err
    assert len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_misspelled_task_stops_before_a_checkpoint_is_exported(run, capsys, monkeypatch):
    import ds_optimus.evaluate.run as evaluate_run

    exported = []  # an export is the whole model written out: minutes at scale, for a typo
    monkeypatch.setattr(evaluate_run, "export_checkpoint", lambda *args: exported.append(args))
    status, out, err = _run(capsys, run, "--tasks", "pydoc_clozee")
    assert status == 2 and "unknown task 'pydoc_clozee' (did you mean 'pydoc_cloze'? lm-eval" in err, err
    assert exported == [] and "scoring" not in out, out  # found before any model is touched
    assert "give YAML tasks of your own with --include" in err
    tasks = run / "my_tasks"
    tasks.mkdir()
    status, _, err = _run(capsys, run, "--tasks", "pydoc_clozee", "--include", str(tasks))
    assert status == 2 and f"nor in the YAML files of {tasks})" in err and "--include" not in err, err


def test_a_folder_that_is_no_model_and_a_damaged_checkpoint_are_named(tmp_path, capsys):
    status, _, err = _run(capsys, tmp_path, "--tasks", "pydoc_cloze")
    assert status == 2 and "is neither a Hugging Face folder (config.json), a run (checkpoints/) nor a" in err
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text(
        json.dumps({"step": 2, "world_size": 1, "ep_size": 1, "files": {"model.pt": {"bytes": 5, "crc32": "00000000"}}})
    )
    status, _, err = _run(capsys, tmp_path / "run", "--tasks", "pydoc_cloze")
    assert status == 2 and err.strip().endswith("is damaged: model.pt is missing"), err


def test_the_tasks_named_and_made_here():
    assert expand(["pydoc_cloze", "mula-suite", "arc_easy"]) == ["pydoc_cloze", *MULA_SUITE]


def test_pydoc_cloze_is_deterministic_and_well_formed(tmp_path):
    first = (write_pydoc_cloze(tmp_path / "a") / "pydoc_cloze.jsonl").read_text()
    assert first == (write_pydoc_cloze(tmp_path / "b") / "pydoc_cloze.jsonl").read_text()
    items = [json.loads(line) for line in first.splitlines()]
    assert len(items) == 200 and len({item["context"] for item in items}) == 200
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == 4 and 0 <= item["label"] < 4
        assert item["context"] and item["choices"][item["label"]].endswith(".")


def test_a_preempted_run_stops_its_evaluations_and_says_how_to_finish_them(tmp_path):
    import subprocess
    import sys
    from types import SimpleNamespace

    from ds_optimus.evaluate.downstream_config import DownstreamConfig
    from ds_optimus.train.callbacks import DownstreamCallback

    said = []
    trainer = SimpleNamespace(
        rank=0,
        stop_reason="preempted",
        output_dir=tmp_path,
        device="cpu",
        message=said.append,
        checkpoints=SimpleNamespace(keep_for_now=set()),
    )
    callback = DownstreamCallback(DownstreamConfig(tasks=["pydoc_cloze"], limit=24))
    callback.trainer = trainer
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    callback.running = (4, tmp_path / "checkpoints" / "step_00000004", sleeper)
    callback.due = [(6, tmp_path / "checkpoints" / "step_00000006")]
    callback.close()
    assert sleeper.poll() is not None  # stopped: a preempted job has seconds, not a task suite's minutes
    assert said == [
        f"downstream evaluation of step(s) 4, 6 not done (the run stopped); score them with: python -m "
        f"ds_optimus.evaluate {tmp_path} --all --tasks pydoc_cloze --num-fewshot 0 --batch-size 8 "
        "--device cpu --limit 24"
    ]
