"""Convert between Transformers OLMo checkpoints (`OlmoForCausalLM`) and dense Mula checkpoints.

    python -m ds_optimus.hf_models.mula.convert_olmo INPUT OUTPUT [--to-olmo]

OLMo is a dense Mula with non-parametric LayerNorms (epsilon 1e-5), no QK-norm and the same tensor names, so
only the config is translated; tied embeddings stay tied (the `mula-1b` preset is the same architecture untied).
Mula models OLMo cannot express are refused in one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .convert_common import (
    ConversionError,
    build_config,
    check_output,
    load_into_meta_model,
    read_config,
    read_mula_config,
    read_tensors,
    run_conversion,
    save_folder,
)

if TYPE_CHECKING:  # imported where used, so that --help needs neither PyTorch nor Transformers
    from .configuration_mula import MulaConfig

PROG = "ds_optimus.hf_models.mula.convert_olmo"
# OLMo's LayerNorm has no weight, no bias and a fixed epsilon.
OLMO_NORM = dict(norm_type="layer_norm", norm_elementwise_affine=False, rms_norm_eps=1e-5)
_SHARED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "clip_qkv",
)


# -- configs ------------------------------------------------------------------------------------
def olmo_to_mula_config(cfg: dict) -> MulaConfig:
    """The dense MulaConfig of an OLMo config.json dict, read as `OlmoConfig` reads it (v4 fields too)."""
    from transformers import OlmoConfig

    from .configuration_mula import MulaConfig

    try:
        olmo = OlmoConfig.from_dict(cfg)
    except (ValueError, TypeError, KeyError) as err:
        raise ConversionError(f"OLMo config.json: {str(err).splitlines()[0]}") from None
    values = {key: getattr(olmo, key) for key in _SHARED_KEYS}
    values.update(OLMO_NORM, num_experts=0, qk_norm=False, rope_parameters=dict(olmo.rope_parameters))
    if getattr(olmo, "head_dim", None) is not None:  # OlmoAttention honours one a config.json carries
        values["head_dim"] = olmo.head_dim
    if olmo.dtype is not None:
        values["dtype"] = olmo.dtype
    return build_config(MulaConfig, values)


def mula_to_olmo_config(config: MulaConfig):
    """Translate a dense MulaConfig into an OlmoConfig; refuse features OLMo cannot express."""
    from transformers import OlmoConfig

    unsupported = []
    if config.num_experts > 0:
        unsupported.append(f"MoE layers (num_experts={config.num_experts}; convert_olmoe writes OLMoE)")
    if config.qk_norm:
        unsupported.append("qk_norm=True")
    if config.norm_type != OLMO_NORM["norm_type"]:
        unsupported.append(f"norm_type={config.norm_type!r} (OLMo's norms are LayerNorms)")
    if config.norm_elementwise_affine:
        unsupported.append("norm_elementwise_affine=True (OLMo's LayerNorms have no weight or bias)")
    if config.rms_norm_eps != OLMO_NORM["rms_norm_eps"]:
        unsupported.append(f"rms_norm_eps={config.rms_norm_eps} (OLMo's LayerNorm epsilon is 1e-5)")
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        unsupported.append("head_dim * num_attention_heads != hidden_size")
    if unsupported:
        raise ConversionError("OLMo cannot express this Mula model: " + "; ".join(unsupported))
    values = {key: getattr(config, key) for key in _SHARED_KEYS}
    return build_config(OlmoConfig, {**values, "rope_parameters": dict(config.rope_parameters)})


# -- the two directions -------------------------------------------------------------------------
def convert_olmo_to_mula(input_dir: str | Path, output_dir: str | Path) -> Path:
    """Write a Mula checkpoint folder equivalent to the OLMo checkpoint in `input_dir`."""
    from .modeling_mula import MulaForCausalLM

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    cfg = read_config(input_dir)
    check_output(output_dir)
    model_type = cfg.get("model_type")
    if model_type != "olmo":
        hint = {
            "olmoe": "; convert it with ds_optimus.hf_models.mula.convert_olmoe",
            "hf_olmo": "; convert the Transformers release (the -hf one, e.g. allenai/OLMo-1B-hf)",
        }
        raise ConversionError(
            f"{input_dir} is not an OLMo checkpoint (model_type={model_type!r}){hint.get(model_type, '')}"
        )
    config = olmo_to_mula_config(cfg)
    model = load_into_meta_model(MulaForCausalLM, config, read_tensors(input_dir))
    save_folder(model, output_dir)
    return output_dir


def convert_mula_to_olmo(input_dir: str | Path, output_dir: str | Path) -> Path:
    """Write an OLMo checkpoint folder equivalent to the dense Mula checkpoint in `input_dir`."""
    from transformers import OlmoForCausalLM

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    config = read_mula_config(input_dir)
    check_output(output_dir)
    olmo_config = mula_to_olmo_config(config)
    model = load_into_meta_model(OlmoForCausalLM, olmo_config, read_tensors(input_dir))
    save_folder(model, output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Convert a Transformers OLMo checkpoint folder to a Mula folder, or back with --to-olmo. "
        "Tied embeddings stay tied (the mula-1b preset is the same architecture untied).",
    )
    parser.add_argument("input", help="checkpoint folder to read")
    parser.add_argument("output", help="folder to write (must not exist or be empty)")
    parser.add_argument("--to-olmo", action="store_true", help="convert Mula -> OLMo instead")
    parser.add_argument("--verbose", action="store_true", help="keep Transformers' and DeepSpeed's own output")
    args = parser.parse_args(argv)
    if args.to_olmo:
        out = run_conversion(PROG, lambda: convert_mula_to_olmo(args.input, args.output), args.verbose)
    else:
        out = run_conversion(PROG, lambda: convert_olmo_to_mula(args.input, args.output), args.verbose)
    if out is None:
        return 2
    if not args.to_olmo and read_config(out).get("tie_word_embeddings"):
        print(
            "note: the OLMo checkpoint ties its embeddings, so the Mula model does too (tie_word_embeddings=true); "
            "the mula-1b preset is this architecture untied, for training from scratch"
        )
    return 0


__all__ = ["convert_mula_to_olmo", "convert_olmo_to_mula", "main", "mula_to_olmo_config", "olmo_to_mula_config"]

if __name__ == "__main__":
    sys.exit(main())
