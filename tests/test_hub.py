"""Loading a Mula model from the Hub by repository id, tested offline against a cache laid out the
way a download leaves it, and what an exported folder carries for an upload: the model card, the
generation config and a tokenizer that plain Transformers loads."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_package import HIDE_DS_OPTIMUS

from ds_optimus.data import load_tokenizer
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, count_parameters
from ds_optimus.train.end_of_run import export
from ds_optimus.train.model_card import TrainingRecord

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "ds-optimus-tests/mula-tiny-moe"
TEXT = "The with statement is used to wrap the execution of a block"
PROMPT_WORDS = "Do you wish to run the custom code"  # Transformers' question when remote code is not allowed

# What the Hub keeps in Git LFS by default (its .gitattributes), besides any file over 10 MB.
LFS_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf"}


def _etag(data: bytes, name: str) -> str:
    """The id the Hub serves a file under, which names its blob in the cache: the SHA-256 of a file
    in Git LFS, the git blob id of any other."""
    if Path(name).suffix in LFS_SUFFIXES or len(data) > 10 * 2**20:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out_hub_cache(folder: Path, hub_cache: Path, repo_id: str) -> Path:
    """Put `folder`'s files into the Hub cache `hub_cache` as downloading `repo_id` at `main` would:
    `models--<org>--<name>/blobs/<etag>`, `snapshots/<commit>/<file>` as relative links to the
    blobs, `refs/main` holding the commit. Returns the snapshot folder."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    etags = {
        p.relative_to(folder).as_posix(): _etag(p.read_bytes(), p.name)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    commit = hashlib.sha1("".join(f"{name} {etag}\n" for name, etag in etags.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, etag in etags.items():
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / name, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # as huggingface_hub writes it: no newline
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A tiny MoE model exported by `ds_optimus.train.export` with the default tokenizer and a
    training record, its outputs on fixed input, and the folder laid out as a Hub cache."""
    from ds_optimus.data import parse_source
    from ds_optimus.data.units import source_key

    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe")).eval()
    tokenizer = load_tokenizer(None)
    config = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    record = TrainingRecord(
        config=config,
        data_fingerprint=source_key(parse_source("embedded"), tokenizer, 0.05),
        steps=8,
        tokens=8 * 16 * 128,
        loss=5.4321,
        eval_loss=5.6789,
        eval_step=8,
    )
    folder = root / "export"
    export(model, tokenizer, folder, None, record=record)

    x = tokenizer([TEXT], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(x).logits
        out = model.generate(x, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    torch.save(
        {"x": x, "logits": logits, "sequences": out.sequences, "step_logits": torch.stack(out.logits)},
        root / "expected.pt",
    )
    snapshot = lay_out_hub_cache(folder, root / "hub", REPO_ID)
    return {
        "root": root,
        "folder": folder,
        "snapshot": snapshot,
        "model": model,
        "tokenizer": tokenizer,
        "record": record,
    }


def _load_by_id(hub: dict, code: str, extra_env: dict | None = None) -> tuple[dict, str]:
    """Run `code` in a fresh interpreter (the Hub settings are read at import) with the test cache as
    the Hub cache and offline mode on; returns the JSON it printed last and everything it printed."""
    root = hub["root"]
    env = dict(
        os.environ,
        HF_HOME=str(root / "hf_home"),
        HF_HUB_CACHE=str(root / "hub"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_MODULES_CACHE=str(root / "modules"),
        **(extra_env or {}),
    )
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    checks = textwrap.dedent(
        f"""
        import json, torch
        from safetensors.torch import load_file
        from transformers.utils.hub import cached_file
        expected = torch.load({str(root / "expected.pt")!r})
        saved = load_file({str(hub["folder"] / "model.safetensors")!r})

        def compare(model, tokenizer):
            state = model.state_dict()
            x = expected["x"]
            with torch.no_grad():
                logits = model(x).logits
                out = model.generate(x, max_new_tokens=6, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
            same_length = out.sequences.shape == expected["sequences"].shape
            return {{
                "model": type(model).__module__ + "." + type(model).__name__,
                "name_or_path": model.name_or_path,
                "config_file": cached_file({REPO_ID!r}, "config.json"),
                "weights_equal": set(saved) <= set(state) and all(torch.equal(state[k], v) for k, v in saved.items()),
                "logits_diff": (logits - expected["logits"]).abs().max().item(),
                "same_tokens": same_length and torch.equal(out.sequences, expected["sequences"]),
                "step_logits_diff": (torch.stack(out.logits) - expected["step_logits"]).abs().max().item()
                                    if same_length else None,
                "generation": [model.generation_config.eos_token_id, model.generation_config.pad_token_id],
                "ids": tokenizer({TEXT!r}).input_ids,
                "special": [tokenizer.eos_token_id, tokenizer.pad_token_id],
                "tokenizer": type(tokenizer).__name__,
            }}
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", checks + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout + result.stderr


def _assert_same_model(got: dict, hub: dict) -> None:
    tokenizer = hub["tokenizer"]
    assert got["name_or_path"] == REPO_ID
    assert Path(got["config_file"]) == hub["snapshot"] / "config.json"  # read through the cache's links
    assert got["weights_equal"]
    assert got["logits_diff"] <= 1e-5 and got["same_tokens"] and got["step_logits_diff"] <= 1e-4, got
    assert got["ids"] == tokenizer(TEXT).input_ids
    assert got["special"] == got["generation"] == [tokenizer.eos_token_id, tokenizer.pad_token_id] == [1, 0]


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(hub):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    report = scan_cache_dir(hub["root"] / "hub")
    assert not report.warnings
    (repo,) = report.repos
    assert repo.repo_id == REPO_ID and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.refs == frozenset({"main"}) and revision.commit_hash == hub["snapshot"].name
    assert {f.file_name for f in revision.files} == {p.name for p in hub["folder"].iterdir()}
    found = try_to_load_from_cache(REPO_ID, "model.safetensors", cache_dir=hub["root"] / "hub")
    assert found == str(hub["snapshot"] / "model.safetensors") and Path(found).is_symlink()


def test_a_hub_id_loads_offline_through_the_auto_classes_with_ds_optimus(hub):
    got, printed = _load_by_id(
        hub,
        f"""
        import sys
        import ds_optimus
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({REPO_ID!r}).eval()
        tokenizer = AutoTokenizer.from_pretrained({REPO_ID!r})
        print(json.dumps(compare(model, tokenizer)))
        """,
    )
    _assert_same_model(got, hub)
    assert got["model"] == "ds_optimus.hf_models.mula.modeling_mula.MulaForCausalLM"
    assert PROMPT_WORDS not in printed


def test_a_hub_id_loads_offline_with_remote_code_where_ds_optimus_is_missing(hub):
    got, printed = _load_by_id(
        hub,
        HIDE_DS_OPTIMUS
        + textwrap.dedent(f"""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
        try:
            import ds_optimus
            raise SystemExit("ds_optimus was importable")
        except ImportError:
            pass
        config = AutoConfig.from_pretrained({REPO_ID!r}, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained({REPO_ID!r}, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained({REPO_ID!r}, trust_remote_code=True)
        plain = PreTrainedTokenizerFast.from_pretrained({REPO_ID!r})  # no config read, no remote code
        got = compare(model, tokenizer)
        got.update(config=type(config).__module__ + "." + type(config).__name__, experts=config.num_experts,
                   plain_ids=plain({TEXT!r}).input_ids, plain_special=[plain.eos_token_id, plain.pad_token_id],
                   imported="ds_optimus" in sys.modules)
        print(json.dumps(got))
        """),
    )
    _assert_same_model(got, hub)
    assert got["model"].startswith("transformers_modules.") and got["model"].endswith(".MulaForCausalLM")
    assert got["config"].startswith("transformers_modules.") and got["config"].endswith(".MulaConfig")
    assert got["experts"] == 8 and not got["imported"]
    assert got["plain_ids"] == got["ids"] and got["plain_special"] == [1, 0]
    assert PROMPT_WORDS not in printed


def _card(folder: Path):
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    blocks = re.findall(r"^```json\n(.*?)^```$", card.text, flags=re.S | re.M)
    return card, card.text, [json.loads(b) for b in blocks]


def test_an_exported_folder_carries_a_model_card_generation_config_and_plain_tokenizer(hub):
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    folder, record, tokenizer = hub["folder"], hub["record"], hub["tokenizer"]
    assert {
        "config.json",
        "model.safetensors",
        "configuration_mula.py",
        "modeling_mula.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    } <= {p.name for p in folder.iterdir()}

    card, text, blocks = _card(folder)
    front = card.data.to_dict()
    assert front == {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["mula", "moe", "ds_optimus"],
    }  # no license: none is known
    total, active = count_parameters(hub["model"].config)
    assert f"{total / 1e6:.2f}M total, {active / 1e6:.2f}M active per token" in text
    assert "| experts per MoE layer (routed per token) | 8 (2), softmax router |" in text
    assert blocks == [record.config]  # the training config, whole
    for fact in (
        f"`{record.data_fingerprint}`",
        "optimizer steps: 8",
        "training tokens: 16,384",
        "final training loss: 5.4321",
        "held-out LM loss: 5.6789 (after step 8)",
        'AutoModelForCausalLM.from_pretrained("<org>/<name>")',
        "trust_remote_code=True",
    ):
        assert fact in text, fact

    generation = GenerationConfig.from_pretrained(folder)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (None, 1, 0)
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    plain = PreTrainedTokenizerFast.from_pretrained(folder)
    assert plain(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert (plain.eos_token, plain.pad_token) == ("<eos>", "<pad>")


def test_a_dense_model_exported_without_record_or_tokenizer_has_a_card_of_what_is_known(tmp_path):
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-dense"))
    export(model, None, tmp_path / "dense", None)
    card, text, blocks = _card(tmp_path / "dense")
    assert card.data.tags == ["mula", "ds_optimus"] and card.data.pipeline_tag == "text-generation"
    total, _ = count_parameters(model.config)
    assert f"| parameters | {total / 1e6:.2f}M |" in text and "## Training" not in text and not blocks
    assert not (tmp_path / "dense" / "tokenizer.json").exists()
    generation = json.loads((tmp_path / "dense" / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (1, 0)  # from the model's config


def export_worker(rank: int, world: int, config: dict, folder: str) -> tuple[dict, TrainingRecord]:
    """Train `config`, then export it once more with the run's record; returns the summary and record."""
    from ds_optimus.train import Trainer
    from ds_optimus.train.model_card import training_record

    trainer = Trainer(config)
    summary = trainer.train()
    record = training_record(trainer)
    export(trainer.engine.module, trainer.tokenizer, Path(folder), trainer.groups, record=record)
    return summary, record


@pytest.mark.slow
def test_the_training_entry_point_exports_a_folder_ready_for_the_hub(tmp_path):
    """A 3-step run: its own export has the card, generation config and tokenizer; the record of the
    trainer (steps, tokens, losses, data fingerprint, effective config) goes into the card."""
    from distributed import run_distributed
    from train_workers import tiny_config

    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        train={"steps": 3, "eval_interval": 0, "warmup_steps": 1},
        checkpoint={"interval": 0},
    )
    summary, record = run_distributed(export_worker, 1, config, str(tmp_path / "with-record"))[0]

    hf = tmp_path / "run" / "hf"
    card, text, _ = _card(hf)
    assert card.data.library_name == "transformers" and "moe" in card.data.tags
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 1
    assert json.loads((hf / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"

    (cache,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    from ds_optimus.data import PreparedData, PreparedSource, parse_source
    from ds_optimus.data.shards import folder_stream

    meta = json.loads((cache / "meta.json").read_text())  # the fingerprint of the one source, by name and identity
    prepared = PreparedSource(parse_source("embedded"), meta["key"], folder_stream(cache), None, meta["documents"])
    assert record.data_fingerprint == PreparedData([prepared], 1, cache.parent).fingerprint
    assert record.steps == 3 and record.tokens == 3 * 4 * 32  # steps x micro-batch 4 x sequence 32, 1 rank
    assert record.loss == summary["losses"][3] and (record.eval_step, record.eval_loss) == (3, summary["evals"][3])
    assert record.config["train_batch_size"] == 4 and record.config["optimus"]["train"]["steps"] == 3

    _, text, blocks = _card(tmp_path / "with-record")
    assert blocks == [json.loads(json.dumps(record.config))]
    assert f"`{record.data_fingerprint}`" in text and "training tokens: 384" in text
    assert f"final training loss: {summary['losses'][3]:.4f}" in text
