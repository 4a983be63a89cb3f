"""`python -m ds_optimus.train --config X.json --check [--world N]`: what a run would be, known before
it is launched and without a process group, or the one-line error it would stop on; and the
shipped configs' README, which states the same figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_optimus.train.cli import main
from ds_optimus.train.preflight import check_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "ds_configs" / "mula-tiny-moe-cpu.json"


def _run(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["--config", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_check_says_what_would_run_without_a_process_group(tmp_path, capsys):
    status, out, err = _run(
        capsys,
        str(TINY),
        "--check",
        "--set",
        f"optimus.data.cache_dir={tmp_path}/cache",
        "--set",
        f"optimus.train.output_dir={tmp_path}/run",
    )
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{TINY}: ready to run"
    assert lines[1].startswith(
        "  model     preset mula-tiny-moe: 2.82M parameters (1.64M active per token), 4 layers, 8 experts top-2"
    )
    assert lines[2].startswith(
        "  layout    2 ranks (train_batch_size / (micro-batch x accumulation)): data parallel 2, expert parallel 2"
    )
    assert "8 sequences x 1 accumulation x 2 ranks = 16 sequences of 128 tokens (2,048 tokens) per step" in out
    assert f"tokens    cache {tmp_path}/cache; embedded tokenized at the start (every rank its share)" in out
    assert "predicted peak 0.15 GiB per rank" in out
    assert out.rstrip().endswith(f"starts at step 0 (no checkpoint in {tmp_path}/run/checkpoints)")
    assert not dist.is_initialized() and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()

    (tmp_path / "run" / "checkpoints" / "step_00000200").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000200" / "meta.json").write_text("{}")
    status, out, _ = _run(capsys, str(TINY), "--check", "--set", f"optimus.train.output_dir={tmp_path}/run")
    assert status == 0 and out.rstrip().endswith(
        "nothing to train: "
        + str(tmp_path / "run" / "checkpoints" / "step_00000200")
        + " is step 200 of 200 (raise optimus.train.steps to "
        "train further; the LR schedule then stretches to the new length)"
    )

    status, out, _ = _run(
        capsys,
        str(TINY),
        "--check",
        "--set",
        "optimus.checkpoint.keep_every=50",
        "--set",
        f"optimus.train.output_dir={tmp_path}/other",
    )
    model = re.search(r"the model alone every 50 steps \(kept: 4 of (\d+\.?\d*) MiB, (\d+\.?\d*) MiB by the end\)", out)
    assert status == 0 and model, out  # a tiny model's sizes in MiB, not "0 GiB, 0.0 TiB"
    assert float(model.group(2)) == pytest.approx(4 * float(model.group(1)), rel=0.01)  # each to 3 digits: 0.5 %

    status, out, _ = _run(
        capsys,
        str(TINY),
        "--check",
        "--world",
        "4",
        "--set",
        "gradient_accumulation_steps=null",
        "--set",
        "train_batch_size=null",
    )
    assert status == 0 and "4 ranks (--world): data parallel 4, expert parallel 2" in out
    assert "8 sequences x 1 accumulation x 4 ranks = 32 sequences" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--world", "3"],
            "train_batch_size 16 is not train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 1 x 3 ranks",
        ),
        (
            ["--world", "3", "--set", "train_batch_size=null", "--set", "gradient_accumulation_steps=1"],
            "expert parallel size 2 does not divide the world size 3",
        ),
        # without --world, a world guessed from the batch sizes: the error says so, and what to do
        (
            ["--set", "train_batch_size=24"],
            "expert parallel size 2 does not divide the world size 3 (the world size 3 is "
            "not given but taken from train_batch_size / (micro-batch x accumulation): pass "
            "--world N, the ranks the launch will start, or correct the batch sizes)",
        ),
        (
            ["--set", 'optimus.data.sources=["/no/such/corpus.jsonl"]'],
            "data path '/no/such/corpus.jsonl' does not exist",
        ),
        (["--set", "optimus.data.tokenizer=./no-tokenizer"], "tokenizer folder './no-tokenizer' does not exist"),
        (["--set", "gradient_clippng=1.0"], "unknown DeepSpeed config key 'gradient_clippng'"),
        (
            ["--set", 'optimus.model.overrides={"num_experts": 5}'],
            "expert parallel size 2 does not divide the number of experts 5",
        ),
        (["--world", "2", "--cluster", "no-such-cluster"], "--cluster: "),
        (
            ["--set", "optimus.data.seq_len=4096"],
            "optimus.data.seq_len 4096 is longer than the model's "
            "max_position_embeddings 1024: set optimus.model.overrides."
            "max_position_embeddings, or a shorter seq_len",
        ),
        (
            ["--set", "optimus.model.overrides.num_expert_per_tok=4"],
            "optimus.model.overrides.num_expert_per_tok is not a MulaConfig setting "
            "(did you mean 'num_experts_per_tok'?)",
        ),
    ],
)
def test_check_stops_on_the_error_the_run_would_stop_on(capsys, args, message):
    status, out, err = _run(capsys, str(TINY), "--check", *args)
    assert status == 2 and out == "", out
    assert err.startswith("ds_optimus.train: error: ") and message in err and len(err.splitlines()) == 1, err


def test_check_finds_missing_weights_from_the_file_headers_and_memory_that_does_not_fit(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM

    MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", vocab_size=4096)).save_pretrained(tmp_path / "mula")
    tensors = load_file(tmp_path / "mula" / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, tmp_path / "mula" / "model.safetensors", metadata={"format": "pt"})
    status, _, err = _run(capsys, str(TINY), "--check", "--set", f"optimus.model.path={tmp_path / 'mula'}")
    assert status == 2 and "has no weights for model.layers.2.self_attn.q_proj.weight: they would train" in err

    big = ROOT / "ds_configs" / "mula-220b-a10b.json"
    status, out, err = _run(
        capsys, str(big), "--check", "--cluster", "h100", "--set", "optimus.train.activation_checkpointing=false"
    )
    found = re.search(r"predicted peak (\d+\.\d) GiB per rank does not fit the 69\.5 GiB usable on an NVIDIA H100", err)
    assert status == 2 and found and float(found.group(1)) > 69.5, err


def _readme_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "ds_configs" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_configs_readme_states_what_the_configs_hold():
    rows = _readme_rows()
    assert sorted(rows) == sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json"))
    for name, (_, _, world, ep, zero, recompute, tokens, peak, _) in rows.items():
        config = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
        cluster = None if "cpu" in name else next((c for c in ("aurora", "frontier") if c in name), "h100")
        lines = check_run(config, int(world), cluster)
        layout, batch, memory = (next(x for x in lines if x.startswith(k)) for k in ("layout", "batch", "memory"))
        size = config["optimus"].get("expert_parallel", {}).get("size", 1)
        assert ep == "-" if "dense" in rows[name][1] else ep.startswith(f"{size} ("), (name, ep)
        assert f"ZeRO-{zero} " in layout, (name, layout)
        assert ("recomputed" in layout) == (recompute == "yes"), (name, recompute)
        assert f"({tokens} tokens) per step" in batch, (name, batch)
        predicted = float(re.search(r"predicted peak ([\d.,]+) GiB", memory).group(1))
        assert abs(predicted - float(peak.split()[0])) < 0.1, (name, predicted, peak)


def test_check_reads_an_olmoe_folders_weights_from_their_headers_and_names_a_damaged_file(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import OlmoeConfig, OlmoeForCausalLM

    OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=4096,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
        )
    ).save_pretrained(tmp_path / "olmoe", save_original_format=True)
    status, out, err = _run(capsys, str(TINY), "--check", "--set", f"optimus.model.path={tmp_path / 'olmoe'}")
    assert status == 0, err
    assert f"model     {tmp_path / 'olmoe'} (an OLMoE folder, converted on the fly, with its weights)" in out

    weights = tmp_path / "olmoe" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    status, _, err = _run(capsys, str(TINY), "--check", "--set", f"optimus.model.path={tmp_path / 'olmoe'}")
    assert status == 2 and err.strip().endswith(
        "(an OLMoE checkpoint, converted on the fly at the start): missing "
        "tensor model.layers.1.mlp.experts.2.up_proj.weight"
    ), err
    weights.write_bytes(b"\xff" * 64)  # a damaged header
    status, _, err = _run(capsys, str(TINY), "--check", "--set", f"optimus.model.path={tmp_path / 'olmoe'}")
    assert status == 2 and ": model.safetensors cannot be read (" in err and len(err.splitlines()) == 1, err


def test_check_reads_token_sources_headers_and_first_tokens(tmp_path, capsys):
    import numpy as np

    np.save(tmp_path / "good.npy", np.arange(4000, dtype=np.uint16))
    np.save(tmp_path / "other.npy", np.arange(60_000, dtype=np.uint16))  # another tokenizer's ids
    np.zeros(7, dtype=np.uint8).tofile(tmp_path / "raw.bin")
    good = json.dumps([{"tokens": str(tmp_path / "good.npy")}])
    status, out, err = _run(capsys, str(TINY), "--check", "--set", f"optimus.data.sources={good}")
    assert status == 0, err
    assert f"good: {tmp_path}/good.npy (1 token file, 4,000 tokens read in place)" in out
    assert "tokens    pre-tokenized sources only: nothing to tokenize" in out
    for sources, message in [
        (
            [{"tokens": str(tmp_path / "other.npy")}],
            "source 'other' holds token id 59999, outside the tokenizer's 4096 tokens",
        ),
        ([{"tokens": str(tmp_path / "raw.bin")}], 'raw .bin token files need the source\'s "dtype"'),
    ]:
        status, out, err = _run(capsys, str(TINY), "--check", "--set", f"optimus.data.sources={json.dumps(sources)}")
        assert status == 2 and message in err and len(err.splitlines()) == 1, err
