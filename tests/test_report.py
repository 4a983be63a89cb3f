"""The run report (`python -m ds_optimus.report RUN_DIR`): PNGs from metrics.jsonl, the expert-load
heatmap's numbers, resumed and rolled-back runs, files still being written, one-line errors, and the
per-expert token counts a real run records (and its plots at the end)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ds_optimus.report import ExpertLoads, load_metrics, write_report
from ds_optimus.report.__main__ import main
from ds_optimus.report.plots import _bin_columns
from ds_optimus.train.metrics import MetricsSink, expert_imbalance, expert_token_counts

ROOT = Path(__file__).resolve().parents[1]
LAYERS, EXPERTS, TOP_K, TOKENS_PER_STEP = 3, 8, 2, 512
MOE_PLOTS = {
    "loss.png",
    "lr.png",
    "grad_norm.png",
    "throughput.png",
    "skipped_steps.png",
    "expert_load.png",
    "expert_imbalance.png",
}


def _window_counts(rng: np.random.Generator, steps: int) -> np.ndarray:
    """Token slots per layer and expert over `steps` steps, as the trainer sums them."""
    slots = TOKENS_PER_STEP * TOP_K * steps
    return np.stack([rng.multinomial(slots, rng.dirichlet(np.ones(EXPERTS))) for _ in range(LAYERS)])


def _log(
    folder: Path,
    steps,
    *,
    start_step: int = 0,
    moe: bool = True,
    eval_every: int = 0,
    skipped_at=(),
    skipped_before: int = 0,
    loss_offset: float = 0.0,
    seed: int = 0,
) -> dict[int, np.ndarray]:
    """Log `steps` through the trainer's metrics sink with the metrics callback's keys (opened as a
    run resumed at `start_step` would); returns each logged step's expert counts."""
    sink = MetricsSink(folder, 100, start_step, SimpleNamespace(mode="disabled"), {}, enabled=True)
    rng, logged, skipped, previous = np.random.default_rng(seed), {}, skipped_before, start_step
    for step in steps:
        skipped += sum(previous < s <= step for s in skipped_at)
        metrics = {
            "loss": 8.0 - 0.1 * step + loss_offset,
            "lm_loss": 7.9 - 0.1 * step,
            "aux_loss": 1.0,
            "z_loss": 4.0,
            "lr": 1e-3 * min(1.0, step / 3),
            "grad_norm": 1.0 + 0.1 * step,
            "tokens_per_s": 1000.0 + step,
            "step_seconds": 0.5,
            "tokens": step * TOKENS_PER_STEP,
            "skipped_steps": skipped,
            "mfu": 0.01,
        }
        if moe:
            counts = _window_counts(rng, step - previous)
            per_layer = expert_imbalance(counts.astype(float).tolist())
            metrics["expert_imbalance_max"] = max(per_layer)
            metrics.update({f"expert_imbalance/layer_{i}": v for i, v in enumerate(per_layer)})
            metrics["expert_tokens"] = expert_token_counts(counts.astype(float).tolist())
            logged[step] = counts
        else:
            for key in ("aux_loss", "z_loss"):
                metrics.pop(key)
        sink.log(step, metrics)
        if eval_every and step % eval_every == 0:
            sink.log(step, {"eval_loss": 7.5 - 0.1 * step}, progress=False)
        previous = step
    sink.close()
    return logged


def _png(path: Path) -> tuple[int, int]:
    """Width and height of a valid PNG (signature, header, and the whole image decodes)."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert 5_000 < len(data) < 400_000, (path, len(data))
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width) and pixels[..., :3].std() > 0.05, path  # not a blank page
    return width, height


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def test_the_report_draws_every_plot_and_the_heatmap_holds_the_counts(tmp_path):
    run = tmp_path / "run"
    logged = _log(run, [2, 4, 6, 8, 9], eval_every=4, skipped_at=(5,))  # every 2nd step and the last
    status, out, err = _cli(run)
    assert status == 0 and err == ""
    written = [Path(line) for line in out.splitlines()]
    assert {p.name for p in written} == MOE_PLOTS and all(p.parent == run / "plots" for p in written)
    for path in written:
        width, height = _png(path)
        assert width >= 600 and height >= 250, (path, width, height)

    loads = load_metrics(run).expert_loads()
    assert loads.steps == [2, 4, 6, 8, 9] and loads.counts.shape == (LAYERS, EXPERTS, 5)
    assert loads.counts.dtype == np.int64
    for t, step in enumerate(loads.steps):
        np.testing.assert_array_equal(loads.counts[:, :, t], logged[step])
    window = np.diff([0, *loads.steps])  # steps each logged column covers
    np.testing.assert_array_equal(loads.counts.sum(axis=1), np.tile(window * TOKENS_PER_STEP * TOP_K, (LAYERS, 1)))
    np.testing.assert_allclose(loads.relative().mean(axis=1), 1.0)  # per layer and window, over the mean
    assert load_metrics(run).skipped == [(6, 1)]  # skipped at step 5, logged with step 6

    out_dir = tmp_path / "elsewhere" / "figs"
    written = write_report(run, out_dir, dpi=60)
    assert {p.parent for p in written} == {out_dir} and _png(out_dir / "loss.png")[0] == 480  # 8 inches


def test_a_long_runs_heatmap_sums_windows_into_columns():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 100, size=(2, 4, 1000))
    loads = ExpertLoads(steps=list(range(5, 5005, 5)), counts=counts)
    binned, edges = _bin_columns(loads, 400)
    assert binned.shape == (2, 4, 400) and edges.shape == (401,)
    assert edges[0] == 0 and edges[-1] == 5000 and np.all(np.diff(edges) > 0)
    np.testing.assert_array_equal(binned.sum(axis=-1), counts.sum(axis=-1))  # no count lost or doubled


def test_resumed_and_rolled_back_runs_and_a_line_being_written(tmp_path):
    run = tmp_path / "run"
    _log(run, [1, 2, 3, 4, 5, 6], eval_every=2, skipped_at=(4, 5, 6))
    # resumed from the checkpoint of step 4 (1 update skipped by then): the sink drops the lines of 5 and 6
    _log(run, [5, 6, 7], start_step=4, eval_every=2, skipped_at=(7,), skipped_before=1, loss_offset=1.0)
    with (run / "metrics.jsonl").open("a") as f:  # rolled back from 7 to the checkpoint of step 5
        f.write('{"step": 6, "loss": 0.5, "skipped_steps": 1}\n')
        f.write("not a record\n")
        f.write('{"step": 7, "loss": 0.25, "skipped_steps": 2}\n')
        f.write('{"step": 8, "loss": 0.1, "sk')  # the trainer is writing this line
    metrics = load_metrics(run)
    assert [r["step"] for r in metrics.records] == list(range(1, 8))
    assert metrics.series("loss")[1][3:] == [8.0 - 0.4, 8.0 - 0.5 + 1.0, 0.5, 0.25]  # later lines win
    assert metrics.records[5]["eval_loss"] == pytest.approx(7.5 - 0.6) and "expert_tokens" in metrics.records[5]
    assert metrics.rewinds == [(7, 6)]
    assert metrics.skipped == [(4, 1), (7, 1), (7, 1)]  # step 7's skip was rolled back, and skipped again
    assert metrics.unreadable == 1

    notes = []
    written = write_report(run, say=notes.append)
    assert {p.name for p in written} == MOE_PLOTS
    assert notes == [f"1 line(s) of {run / 'metrics.jsonl'} were not metrics records and were left out"]


def test_a_dense_run_without_evaluations_has_no_heatmap_said_in_one_line(tmp_path):
    run = tmp_path / "dense"
    _log(run, range(1, 61), moe=False)  # enough points for the running means
    status, out, err = _cli(run)
    assert status == 0
    assert {Path(line).name for line in out.splitlines()} == MOE_PLOTS - {"expert_load.png", "expert_imbalance.png"}
    assert err == "no expert heatmap: a dense model (no MoE layer)\n"
    assert load_metrics(run).expert_loads() is None and load_metrics(run).series("eval_loss") == ([], [])


def test_what_cannot_be_reported_is_one_line_and_exit_status_2(tmp_path):
    (tmp_path / "no_metrics").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "metrics.jsonl").write_text('{"step": 1, "lo')
    (tmp_path / "a_file").write_text("")
    cases = {
        tmp_path / "nowhere": r"nowhere does not exist \(give the run's folder",
        tmp_path / "a_file": r"a_file is not a folder",
        tmp_path / "no_metrics": r"no_metrics has no metrics.jsonl: not a training run's folder",
        tmp_path / "empty": r"empty/metrics.jsonl is empty: no step has been logged yet",
        tmp_path / "cut": r"cut/metrics.jsonl holds no complete record: no step has been logged yet",
    }
    for folder, message in cases.items():
        status, out, err = _cli(folder)
        assert status == 2 and out == "" and err.count("\n") == 1, (folder, err)
        assert err.startswith("ds_optimus.report: error: "), err
        assert re.search(message, err), (message, err)
    assert not (tmp_path / "no_metrics" / "plots").exists()  # nothing made for a folder with nothing to draw

    done = subprocess.run(
        [sys.executable, "-m", "ds_optimus.report", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("ds_optimus.report: error: ")


def test_without_matplotlib_the_command_and_the_end_of_a_run_say_how_to_get_it(tmp_path, monkeypatch):
    from ds_optimus.train.callbacks import MetricsCallback

    run = tmp_path / "run"
    _log(run, [1, 2])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    status, _, err = _cli(run)
    assert status == 2 and err == "ds_optimus.report: error: the plots need matplotlib: pip install matplotlib\n"
    assert not (run / "plots").exists()

    callback, messages = MetricsCallback(), []
    callback.trainer = SimpleNamespace(
        output_dir=run,
        rank=0,
        stop_reason=None,
        message=messages.append,
        step=2,
        start_step=2,
        opt=SimpleNamespace(train=SimpleNamespace(plots=True)),
    )
    callback.close(None)  # the loop never ran (set-up failed): nothing to draw
    callback.post_train()
    callback.close(None)  # a finished run launched again trained nothing: its plots are left as they are
    callback.trainer.start_step = 0
    callback.close(RuntimeError("the export failed"))
    callback.trainer.stop_reason = "preempted"
    callback.close(None)
    assert messages == []
    callback.trainer.stop_reason = None
    callback.close(None)
    assert messages == [f"plots: pip install matplotlib, then python -m ds_optimus.report {run}"]


def test_a_run_without_skipped_steps_says_so_in_its_plot(tmp_path, monkeypatch):
    import ds_optimus.report.plots as plots

    figures = {}
    original = plots._save
    monkeypatch.setattr(
        plots,
        "_save",
        lambda fig, folder, name, dpi, written: (
            figures.__setitem__(name, [t.get_text() for ax in fig.axes for t in ax.texts]),
            original(fig, folder, name, dpi, written),
        ),
    )
    _log(tmp_path / "clean", [1, 2, 3])
    write_report(tmp_path / "clean")
    assert figures["skipped_steps.png"] == ["no skipped steps: every update was applied"]
    _log(tmp_path / "skips", [1, 2, 3], skipped_at=(2,))
    write_report(tmp_path / "skips")
    assert figures["skipped_steps.png"] == []


def test_the_profile_plots_scale_leaves_a_slow_first_step_off_it(tmp_path, monkeypatch):
    """Step 1 (compiles, first touches) at 3.9 s beside 0.3-0.8 s: the scale is the later steps', so the
    jitter marks show; step 1 is labelled off scale. A first step like the others sets the scale."""
    import ds_optimus.report.plots as plots
    from ds_optimus.report.reader import RunMetrics

    panels = {}
    monkeypatch.setattr(
        plots,
        "_save",
        lambda fig, folder, name, dpi, written: panels.__setitem__(
            name, (fig.axes[0].get_ylim(), [t.get_text() for t in fig.axes[0].texts])
        ),
    )
    for name, first in (("slow", 3.9), ("even", 0.7)):
        seconds = [first, 0.3, 0.8, 0.5]
        records = [
            {"step": i + 1, "profile/step_s": t, "profile/forward_s": t / 2, "profile/backward_s": t / 2}
            for i, t in enumerate(seconds)
        ]
        plots.plot_profile(RunMetrics(tmp_path / name, records), tmp_path, 80, [])
        panels[name] = panels.pop("profile.png")
    assert panels["slow"] == ((0, pytest.approx(1.5 * 800)), ["3.9 s (off scale)"])
    assert panels["even"] == ((0, pytest.approx(1.5 * 800)), [])


def test_the_report_imports_nothing_of_the_training_code():
    from test_structure import GRAPH

    imports = {t for m, targets in GRAPH.items() if m.startswith("ds_optimus.report") for t in targets}
    assert "ds_optimus.report.reader" in imports  # the walk sees the package
    assert all(t.startswith("ds_optimus.report") or t == "ds_optimus.command_line" for t in imports), imports  # a leaf


@pytest.mark.slow
def test_a_real_run_records_each_experts_tokens_and_leaves_its_plots(tmp_path):
    """Two processes at expert parallelism 2, logging every 2nd step: each logged step's
    `expert_tokens` holds, per MoE layer, every expert's tokens summed over both ranks and the
    steps since the last log line (tokens x top-k per layer); the run ends by drawing its plots."""
    from distributed import run_distributed
    from train_workers import metrics_worker, tiny_config

    from ds_optimus.hf_models.mula import MulaConfig

    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        train={"steps": 5, "eval_interval": 2, "log_interval": 2, "plots": True},
        checkpoint={"interval": 0},
        expert_parallel={"size": 2},
    )
    records = [r for r in run_distributed(metrics_worker, 2, config)[0] if "loss" in r]
    preset = MulaConfig.from_preset("mula-tiny-moe")
    layers, experts, top_k = preset.num_hidden_layers, preset.num_experts, preset.num_experts_per_tok
    tokens_per_step = 2 * 4 * 32  # ranks x micro-batch x sequence length
    assert [r["step"] for r in records] == [2, 4, 5]
    previous = 0
    for record in records:
        table = record["expert_tokens"]
        assert len(table) == layers and all(len(row) == experts for row in table)
        assert all(isinstance(c, int) and c >= 0 for row in table for c in row)
        routed = (record["step"] - previous) * tokens_per_step * top_k
        assert [sum(row) for row in table] == [routed] * layers, (record["step"], table)
        assert [record[f"expert_imbalance/layer_{i}"] for i in range(layers)] == pytest.approx(
            [max(row) * experts / sum(row) for row in table]
        )
        previous = record["step"]

    run = tmp_path / "run"
    trained = MOE_PLOTS | {"data_mixture.png"}  # a run logs each data source's tokens
    assert {p.name for p in (run / "plots").iterdir()} == trained  # drawn by rank 0 at the end of the run
    assert f"plots: 8 PNGs in {run / 'plots'}/" in (run / "log.txt").read_text()
    loads = load_metrics(run).expert_loads()
    assert loads.steps == [2, 4, 5] and loads.counts.shape == (layers, experts, 3)
    np.testing.assert_array_equal(loads.counts.sum(axis=1), np.array([[2, 2, 1]] * layers) * tokens_per_step * top_k)
    status, out, _ = _cli(run, "--out", tmp_path / "again", "--dpi", "60")
    assert status == 0 and {Path(line).name for line in out.splitlines()} == trained
    _png(tmp_path / "again" / "expert_load.png")


def test_a_run_with_plots_off_draws_none(tmp_path):
    """`optimus.train.plots: false`: the run ends without drawing, and its metrics still draw later."""
    from distributed import run_distributed
    from train_workers import pretrain_worker, tiny_config

    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        train={"steps": 2, "eval_interval": 0, "export": False},
        checkpoint={"interval": 0},
    )
    assert config["optimus"]["train"]["plots"] is False
    run_distributed(pretrain_worker, 1, config)
    run = tmp_path / "run"
    assert (run / "summary.json").exists() and not (run / "plots").exists()
    assert "plots:" not in (run / "log.txt").read_text()
    status, out, _ = _cli(run, "--out", tmp_path / "later", "--dpi", "60")
    assert status == 0 and "loss.png" in {Path(line).name for line in out.splitlines()}


def test_the_data_mixture_is_drawn_from_each_sources_tokens(tmp_path):
    records = [
        {
            "step": step,
            "loss": 5.0,
            "tokens/wiki": 100 * step,
            "tokens/code": 300 * step,
            "epochs/wiki": step / 10,
            "epochs/code": step / 40,
        }
        for step in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = write_report(tmp_path, say=lambda _: None)
    assert "data_mixture.png" in {p.name for p in written}
    assert load_metrics(tmp_path).series("tokens/code") == ([1, 2, 3], [300.0, 600.0, 900.0])


def _mixture_run(
    run: Path, shares_before: dict, shares_after: dict, resume_at: int = 30, last: int = 60, per_interval: int = 10_000
) -> None:
    """A run logged every 10 steps, `per_interval` tokens a log interval drawn by `shares_before`,
    resumed from its checkpoint at `resume_at` (the sink keeps the lines up to it) and drawn by
    `shares_after` from there: each source's token counter as the metrics callback logs it."""
    totals: dict[str, float] = {}

    def log(sink, steps, shares):
        for step in steps:
            for name, share in shares.items():
                totals[name] = totals.get(name, 0) + round(share * per_interval)
            sink.log(step, {"loss": 5.0, **{f"tokens/{name}": int(totals[name]) for name in shares}})
        sink.close()

    log(MetricsSink(run, 100, 0, SimpleNamespace(mode="disabled"), {}, enabled=True), range(10, 50, 10), shares_before)
    totals.clear()  # as the checkpoint of step 30 holds them: the interval after it is not trained
    totals.update({name: round(share * per_interval) * resume_at // 10 for name, share in shares_before.items()})
    log(
        MetricsSink(run, 100, resume_at, SimpleNamespace(mode="disabled"), {}, enabled=True),
        range(resume_at + 10, last + 1, 10),
        shares_after,
    )


def _drawn(fig) -> tuple[dict[str, tuple[list, list]], list[float], list[str]]:
    """What the mixture figure drew: each source's per-interval share line, the steps of the change
    markers and their labels (read back from the Axes, not the pixels)."""
    top, bottom = fig.axes
    lines = {
        line.get_gid()[len("share/") :]: (list(line.get_xdata()), list(line.get_ydata()))
        for line in bottom.lines
        if (line.get_gid() or "").startswith("share/")
    }
    marks = [line.get_xdata()[0] for line in top.lines if line.get_gid() == "mixture-change"]
    assert marks == [line.get_xdata()[0] for line in bottom.lines if line.get_gid() == "mixture-change"]
    return lines, marks, [text.get_text() for text in top.texts]


def test_the_data_mixture_draws_each_intervals_shares_and_marks_a_source_added_at_a_resume(tmp_path):
    from ds_optimus.report.plots import data_mixture_figure

    run = tmp_path / "run"
    _mixture_run(run, {"code": 0.7, "web": 0.3}, {"code": 0.5817, "web": 0.2493, "tok": 0.169})
    metrics = load_metrics(run)
    assert [r["step"] for r in metrics.records] == [10, 20, 30, 40, 50, 60]
    lines, marks, labels = _drawn(data_mixture_figure(metrics))
    assert lines["tok"][0] == [40, 50, 60] and lines["tok"][1] == pytest.approx([16.9] * 3, abs=0.01)
    assert lines["code"][0] == [10, 20, 30, 40, 50, 60]
    assert lines["code"][1] == pytest.approx([70.0] * 3 + [58.17] * 3, abs=0.01)
    tokens = metrics.records[-1]  # what a cumulative share would have drawn for tok: half of what it is drawn at
    assert tokens["tokens/tok"] / sum(tokens[f"tokens/{n}"] for n in ("code", "web", "tok")) == pytest.approx(0.0845)
    assert marks == [30] and labels == ["+tok"]  # the last logged step before the change: the resume
    assert "data_mixture.png" in {p.name for p in write_report(run, say=lambda _: None)}
    _png(run / "plots" / "data_mixture.png")


def test_a_reweighted_resume_is_marked_from_the_runs_log_and_a_dropped_source_from_the_metrics(tmp_path):
    from ds_optimus.report.plots import data_mixture_figure, resumed_changes
    from ds_optimus.train.metrics import append_log

    run = tmp_path / "run"
    _mixture_run(run, {"code": 0.7, "web": 0.3}, {"code": 0.5, "web": 0.5})
    say = lambda text: append_log(run, text)  # noqa: E731  (what the trainer's launches wrote)
    say("data: 9,000 train / 100 held-out tokens from 2 pre-tokenized sources (cache); drawn code 70.0%, web 30.0%")
    say("data: 9,000 train / 100 held-out tokens from 2 pre-tokenized sources (cache); drawn code 40.0%, web 60.0%")
    changed = "data changed since the checkpoint (optimus.data.allow_change): "
    say(f"{changed}source 'code' was reweighted: 7 -> 4")
    say("resumed from run/checkpoints/step_00000040 at step 40")  # a resume that was cut short after it ...
    say("data: 9,000 train / 100 held-out tokens from 2 pre-tokenized sources (cache); drawn code 50.0%, web 50.0%")
    say(f"{changed}source 'code' was reweighted: 7 -> 5")
    say(f"{changed}source 'web' was reweighted: 3 -> 5")
    say(f"{changed}the share of source 'code' went from 0.7 to 0.5")
    say("resumed from run/checkpoints/step_00000030 at step 30")  # ... and the run resumed from an earlier one
    assert resumed_changes(run / "log.txt") == {
        30: [
            "source 'code' was reweighted: 7 -> 5",
            "source 'web' was reweighted: 3 -> 5",
            "the share of source 'code' went from 0.7 to 0.5",
        ]
    }
    lines, marks, labels = _drawn(data_mixture_figure(load_metrics(run)))
    assert lines["web"][1] == pytest.approx([30.0] * 3 + [50.0] * 3)
    assert marks == [30] and labels == ["'code' was reweighted: 7 -> 5; 'web' was reweighted: 3 -> 5"]

    dropped = tmp_path / "dropped"  # no log: the metrics alone show a source gone after step 30
    _mixture_run(dropped, {"code": 0.7, "web": 0.3}, {"code": 1.0})
    lines, marks, labels = _drawn(data_mixture_figure(load_metrics(dropped)))
    assert lines["web"][0] == [10, 20, 30] and lines["code"][1] == pytest.approx([70.0] * 3 + [100.0] * 3)
    assert marks == [30] and labels == ["-web"]
    append_log(dropped, "data: 9,000 train / 0 held-out tokens (cache)")  # a fresh start in the same folder later
    assert resumed_changes(dropped / "log.txt") == {}
