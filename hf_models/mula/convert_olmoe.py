"""Convert between Transformers OLMoE checkpoints and Mula checkpoints.

    python -m ds_optimus.hf_models.mula.convert_olmoe INPUT OUTPUT             # OLMoE -> Mula
    python -m ds_optimus.hf_models.mula.convert_olmoe INPUT OUTPUT --to-olmoe  # Mula -> OLMoE

OLMoE input may store experts stacked (`mlp.experts.gate_up_proj [E, 2I, H]`, Transformers v5) or
one module per expert (`mlp.experts.{e}.gate_proj.weight`, Transformers v4 and the Hub files).
Mula uses the stacked layout with the same tensor names, so conversion is a config translation
plus stacking. OLMoE output is written per expert by default (loads in Transformers v4 and v5);
`--layout stacked` writes the v5 layout. Tensors keep their dtype.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# The helpers every converter shares; ds_optimus' config and planner import several from here.
from .convert_common import (
    ConversionError,
    build_config,
    check_output,
    check_tensors,
    checkpoint_dtype,
    load_into_meta_model,
    read_config,
    read_mula_config,
    read_tensors,
    rope_parameters,
    run_conversion,
    save_folder,
)

PROG = "ds_optimus.hf_models.mula.convert_olmoe"

if TYPE_CHECKING:  # imported where used, so that --help needs neither PyTorch nor Transformers
    import torch

    from .configuration_mula import MulaConfig

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# -- configs ------------------------------------------------------------------------------------
_SHARED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "clip_qkv",
    "num_experts_per_tok",
    "num_experts",
    "router_aux_loss_coef",
    "norm_topk_prob",
)


def olmoe_to_mula_config(cfg: dict) -> MulaConfig:
    """Translate an OLMoE config.json dict into the equivalent MulaConfig (a ConversionError, a ValueError,
    names what is wrong)."""
    from .configuration_mula import MulaConfig

    values = {key: cfg[key] for key in _SHARED_KEYS if key in cfg}
    if "num_experts" not in values and "num_local_experts" in cfg:
        values["num_experts"] = cfg["num_local_experts"]
    if "intermediate_size" not in cfg:
        raise ConversionError("OLMoE config.json has no intermediate_size")
    values["moe_intermediate_size"] = cfg["intermediate_size"]
    values["intermediate_size"] = cfg["intermediate_size"]  # unused: every OLMoE layer is MoE
    values.update(
        qk_norm=True,
        moe_layer_freq=1,
        router_scoring_func="softmax",
        rope_parameters=rope_parameters(cfg),
        **checkpoint_dtype(cfg),
    )
    return build_config(MulaConfig, values)


def mula_to_olmoe_config(config: MulaConfig):
    """Translate a MulaConfig into an OlmoeConfig; refuse features OLMoE cannot express."""
    from transformers import OlmoeConfig

    unsupported = []
    if config.num_experts == 0 or config.moe_layer_freq != 1:
        unsupported.append("dense FFN layers (OLMoE has MoE in every layer)")
    if not config.qk_norm:
        unsupported.append("qk_norm=False")
    if config.router_scoring_func != "softmax":
        unsupported.append(f"router_scoring_func={config.router_scoring_func!r}")
    if config.router_bias_update_rate > 0:
        unsupported.append("router bias balancing (router_bias_update_rate > 0)")
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        unsupported.append("head_dim * num_attention_heads != hidden_size")
    if config.norm_type != "rms_norm":
        unsupported.append(f"norm_type={config.norm_type!r} (OLMoE's norms are RMSNorms)")
    if not config.norm_elementwise_affine:
        unsupported.append("norm_elementwise_affine=False")
    if unsupported:
        raise ConversionError("OLMoE cannot express this Mula model: " + "; ".join(unsupported))
    values = {key: getattr(config, key) for key in _SHARED_KEYS}
    values.update(intermediate_size=config.moe_intermediate_size, rope_parameters=dict(config.rope_parameters))
    return OlmoeConfig(**values)


# -- tensors ------------------------------------------------------------------------------------
def stack_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Replace per-expert gate/up/down weights by stacked gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    import torch

    per_layer: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match:
            layer, expert, kind = int(match[1]), int(match[2]), match[3]
            per_layer.setdefault(layer, {}).setdefault(expert, {})[kind] = tensor
        else:
            out[name] = tensor
    for layer, experts in sorted(per_layer.items()):
        prefix = f"model.layers.{layer}.mlp.experts"
        if sorted(experts) != list(range(num_experts)):
            missing = sorted(set(range(num_experts)) - set(experts))
            extra = sorted(set(experts) - set(range(num_experts)))
            what = f"missing experts {missing}" if missing else f"experts {extra} beyond num_experts={num_experts}"
            raise ConversionError(f"layer {layer}: {what}")
        for expert, parts in experts.items():
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if kind not in parts:
                    raise ConversionError(f"missing tensor {prefix}.{expert}.{kind}.weight")
            shapes = {tuple(p.shape) for p in (parts["gate_proj"], parts["up_proj"])}
            if len(shapes) != 1:
                raise ConversionError(f"{prefix}.{expert}: gate_proj and up_proj shapes differ ({sorted(shapes)})")
        ordered = [experts[e] for e in range(num_experts)]
        for expert, parts in enumerate(ordered):
            for kind in ("gate_proj", "down_proj"):
                want, got = tuple(ordered[0][kind].shape), tuple(parts[kind].shape)
                if got != want:
                    raise ConversionError(
                        f"tensor {prefix}.{expert}.{kind}.weight has shape {list(got)}, expert 0 has {list(want)}"
                    )
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `stack_experts`: one gate/up/down weight per expert."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, w in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = w.contiguous()
        else:
            out[name] = tensor
    return out


# -- the two directions -------------------------------------------------------------------------
def convert_olmoe_to_mula(input_dir: str | Path, output_dir: str | Path) -> Path:
    """Write a Mula checkpoint folder equivalent to the OLMoE checkpoint in `input_dir`."""
    from .modeling_mula import MulaForCausalLM

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    cfg = read_config(input_dir)
    check_output(output_dir)
    if cfg.get("model_type") != "olmoe":
        raise ConversionError(f"{input_dir} is not an OLMoE checkpoint (model_type={cfg.get('model_type')!r})")
    config = olmoe_to_mula_config(cfg)
    tensors = stack_experts(read_tensors(input_dir), config.num_experts)
    model = load_into_meta_model(MulaForCausalLM, config, tensors)
    save_folder(model, output_dir)
    return output_dir


def convert_mula_to_olmoe(input_dir: str | Path, output_dir: str | Path, layout: str = "per-expert") -> Path:
    """Write an OLMoE checkpoint folder equivalent to the Mula checkpoint in `input_dir`."""
    from transformers import OlmoeForCausalLM

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    config = read_mula_config(input_dir)
    check_output(output_dir)
    olmoe_config = mula_to_olmoe_config(config)
    tensors = read_tensors(input_dir)
    if any(_PER_EXPERT.match(name) for name in tensors):
        tensors = stack_experts(tensors, config.num_experts)
    model = load_into_meta_model(OlmoeForCausalLM, olmoe_config, tensors)
    save_folder(model, output_dir, save_original_format=(layout == "per-expert"))
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Convert a Transformers OLMoE checkpoint folder to a Mula folder, or back with --to-olmoe.",
    )
    parser.add_argument("input", help="checkpoint folder to read")
    parser.add_argument("output", help="folder to write (must not exist or be empty)")
    parser.add_argument("--to-olmoe", action="store_true", help="convert Mula -> OLMoE instead")
    parser.add_argument(
        "--layout",
        choices=("per-expert", "stacked"),
        default="per-expert",
        help="expert layout of OLMoE output (default: per-expert, readable by Transformers v4 and v5)",
    )
    parser.add_argument("--verbose", action="store_true", help="keep Transformers' and DeepSpeed's own output")
    args = parser.parse_args(argv)
    if args.to_olmoe:
        out = run_conversion(PROG, lambda: convert_mula_to_olmoe(args.input, args.output, args.layout), args.verbose)
    else:
        out = run_conversion(PROG, lambda: convert_olmoe_to_mula(args.input, args.output), args.verbose)
    return 2 if out is None else 0


__all__ = [
    "ConversionError",
    "check_tensors",
    "convert_mula_to_olmoe",
    "convert_olmoe_to_mula",
    "load_into_meta_model",
    "main",
    "mula_to_olmoe_config",
    "olmoe_to_mula_config",
    "read_config",
    "read_tensors",
    "stack_experts",
    "unstack_experts",
]

if __name__ == "__main__":
    sys.exit(main())
