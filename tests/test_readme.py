"""The documentation's Hugging Face Trainer example (docs/hf-trainer.md), taken from the page and run
as written, so the documentation cannot drift from the code: the script, its `ds.json` and the launch
command."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import doc_block, ran
from train_workers import child_pythonpath, deepspeed_launcher


def test_the_trainer_example_blocks_are_found():
    script = doc_block("A complete script, `train_hf.py`", "python")
    assert "import ds_optimus" in script and "trainer.train()" in script
    config = json.loads(doc_block("with `ds.json`", "json"))
    assert config["optimus"]["moe"]["experts_backend"] == "auto"  # the value accelerate used to stop on
    assert doc_block("launched on 2 processes", "bash").split() == ["deepspeed", "--num_gpus", "2", "train_hf.py"]


@pytest.mark.slow
def test_the_hugging_face_trainer_example_runs_as_written(tmp_path):
    from ds_optimus.plan.measure import free_port

    (tmp_path / "train_hf.py").write_text(doc_block("A complete script, `train_hf.py`", "python"))
    (tmp_path / "ds.json").write_text(doc_block("with `ds.json`", "json"))
    written = doc_block("launched on 2 processes", "bash").strip()
    command = shlex.split(written)
    launcher = deepspeed_launcher() if command[0] == "deepspeed" else str(Path(sys.executable).with_name(command[0]))
    command = [launcher, "--master_port", str(free_port()), *command[1:]]  # a free port, beside other runs
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    ran(written)
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    assert "not found in kwargs" not in output

    import torch
    from transformers import AutoModelForCausalLM

    state = json.loads((tmp_path / "out" / "checkpoint-20" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    assert [layer.mlp.experts.gate_up_proj.shape[0] for layer in model.model.layers] == [8] * 4
    ids = torch.randint(2, 4096, (1, 16))
    assert torch.isfinite(model(ids).logits).all()
