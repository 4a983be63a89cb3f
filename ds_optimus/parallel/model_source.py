"""Where a run's model comes from (a preset, or a Mula, OLMoE or OLMo folder, with `optimus.model.overrides`): its
`MulaConfig`, header-only checks of a folder's weights, and the build. `model` is the `ModelConfig` section."""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path

from ..schema import ConfigError, need


def build(
    model, tokenizer=None, *, ep_size: int = 1, ep_rank: int = 0, seed: int = 0, stage=None, tensor_parallel=None
):
    """The Mula model in fp32 on the meta device, holding each MoE layer's experts [ep_rank*E/ep_size,
    (ep_rank+1)*E/ep_size): a folder's weights (only those rows read) or random values seeded by `seed`, name and
    expert. `stage` and `tensor_parallel` keep this rank's part."""
    from .build import WeightsError, build_model

    config = mula_config(model, tokenizer)
    folder = Path(model.path) if model.path is not None else None
    kind = folder_kind(folder) if folder is not None and has_weights(folder) else None
    if kind is not None:
        check_folder_weights(folder, config, kind)
    try:
        return build_model(
            config,
            ep_size=ep_size,
            ep_rank=ep_rank,
            seed=seed,
            folder=folder if kind else None,
            kind=kind or "mula",
            stage=stage,
            tensor_parallel=tensor_parallel,
        )
    except WeightsError as err:
        raise ConfigError(f"optimus.model.path {str(folder)!r}: {err}") from None


def mula_config(model, tokenizer=None, seq_len: int | None = None):
    """The `MulaConfig` of the model `build` makes, with `tokenizer`'s end and padding ids, checked against
    `seq_len`."""
    from ..hf_models.mula import MulaConfig

    folder = Path(model.path) if model.path is not None else None
    kind = folder_kind(folder) if folder is not None else "preset"
    known = set(MulaConfig().to_dict()) | set(inspect.signature(MulaConfig.__init__).parameters) - {"self"}
    known |= {"attn_implementation", "rope_theta", "rope_scaling", "torch_dtype"}  # converted or popped by HF
    for key in model.overrides:  # a misspelled one would only become an unused attribute
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        need(
            key in known,
            f"optimus.model.overrides.{key} is not a MulaConfig setting"
            + (f" (did you mean {close[0]!r}?)" if close else ""),
        )
    try:
        if kind in ("olmoe", "olmo"):
            from ..hf_models.mula.convert_common import read_config
            from ..hf_models.mula.convert_olmo import olmo_to_mula_config
            from ..hf_models.mula.convert_olmoe import olmoe_to_mula_config

            convert = olmoe_to_mula_config if kind == "olmoe" else olmo_to_mula_config
            config = convert(read_config(folder))
            config = MulaConfig(**{**config.to_dict(), **model.overrides})
        elif kind == "mula":
            config = MulaConfig.from_pretrained(folder, **model.overrides)
        else:
            config = MulaConfig.from_preset(model.preset, **model.overrides)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        where = "optimus.model.overrides" if model.overrides else f"optimus.model.path {str(folder)!r}"
        raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None
    need(
        seq_len is None or seq_len <= config.max_position_embeddings,
        f"optimus.data.seq_len {seq_len} is longer than the model's max_position_embeddings "
        f"{config.max_position_embeddings}: set optimus.model.overrides.max_position_embeddings, or a shorter "
        "seq_len",
    )
    if tokenizer is not None:
        if len(tokenizer) > config.vocab_size:
            fix = (
                "set optimus.data.tokenizer to the model's own tokenizer: its weights fix the vocabulary"
                if folder is not None and has_weights(folder)
                else "set optimus.model.overrides.vocab_size"
            )
            raise ConfigError(
                f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size "
                f"{config.vocab_size} ({fix})"
            )
        config.eos_token_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    return config


def describe(model) -> str:
    """What the model comes from, in words."""
    if model.path is None:
        return f"preset {model.preset}"
    folder = Path(model.path)
    weights = "with its weights" if has_weights(folder) else "without weights: random initial values"
    kind = {"olmoe": "an OLMoE folder, converted on the fly", "olmo": "an OLMo folder, read as Mula"}.get(
        folder_kind(folder), "a Mula folder"
    )
    return f"{folder} ({kind}, {weights})"


def folder_kind(folder: Path) -> str:
    """ "mula", "olmoe" or "olmo", from the folder's config.json; anything else is a ConfigError."""
    import json

    where = f"optimus.model.path {str(folder)!r}"
    if not folder.is_dir():
        raise ConfigError(f"{where} is not a folder")
    if not (folder / "config.json").exists():
        raise ConfigError(f"{where} has no config.json")
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{where}: config.json is not a readable JSON object ({type(err).__name__})") from None
    if model_type in ("mula", "olmoe", "olmo"):
        return model_type
    raise ConfigError(
        f"{where} holds a {model_type!r} model, not a Mula, OLMoE or OLMo one (OLMoE and OLMo "
        "folders are converted on the fly; other architectures are not trained by ds_optimus)"
    )


def check_folder_weights(folder: Path, config, kind: str, when: str = "") -> None:
    """A ConfigError where `folder`'s weights (from the file headers) would not fill `MulaForCausalLM(config)` (for
    "olmoe": once converted); `when` ends the OLMoE message."""
    import torch

    from ..hf_models.mula import MulaForCausalLM
    from ..hf_models.mula.convert_olmoe import ConversionError, check_tensors, stack_experts
    from .build import WeightsError, folder_shapes

    where = f"optimus.model.path {str(folder)!r}"
    try:
        shapes = folder_shapes(folder)
    except WeightsError as err:
        raise ConfigError(f"{where}: {err}") from None
    if kind == "olmoe":
        empty = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
        try:  # as the conversion does, on tensors without data
            check_tensors(MulaForCausalLM, config, stack_experts(empty, config.num_experts))
        except ConversionError as err:
            raise ConfigError(f"{where} (an OLMoE checkpoint, converted on the fly{when}): {err}") from None
        return
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in MulaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    refuse_uninitialised(
        folder,
        sorted(name for name in expected if name not in shapes),
        sorted(name for name in expected if name in shapes and shapes[name] != expected[name]),
    )


def refuse_uninitialised(folder: Path, missing: list[str], wrong: list[str]) -> None:
    """A ConfigError when a folder's weights leave parameters `missing` or of another shape (`wrong`)."""
    names = missing or wrong
    if names:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        what = "has no weights for" if missing else "has weights of another shape for"
        raise ConfigError(
            f"optimus.model.path {str(folder)!r} {what} {', '.join(names[:3])}{more}: they would train "
            "from random values (is it a checkpoint of another layout or architecture?)"
        )


def has_weights(folder: Path) -> bool:
    """Whether an HF folder holds weights (safetensors or PyTorch .bin, single or sharded)."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
