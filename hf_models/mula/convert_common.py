"""What the checkpoint converters (`convert_olmoe`, `convert_olmo`) share: reading a Transformers checkpoint
folder, checking its tensors, writing the result; every problem is a one-line `ConversionError`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# PyTorch and Transformers are imported where used, so that a converter's `--help` needs neither.
if TYPE_CHECKING:
    import torch

    from .configuration_mula import MulaConfig

# Buffers some older checkpoints saved; they are recomputed from the config.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.original_inv_freq)$")


class ConversionError(ValueError):
    """A checkpoint that cannot be converted (a one-line message)."""


# -- reading ------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict:
    """The parsed config.json of a checkpoint folder."""
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder")
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} is not a checkpoint folder: it has no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return config


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (safetensors or .bin, single or sharded)."""
    import torch
    from safetensors.torch import load_file

    def load_bin(path: Path) -> dict[str, torch.Tensor]:
        return torch.load(path, map_location="cpu", weights_only=True)

    for single, index, loader in (
        ("model.safetensors", "model.safetensors.index.json", load_file),
        ("pytorch_model.bin", "pytorch_model.bin.index.json", load_bin),
    ):
        if (folder / single).is_file():
            files = [folder / single]
        elif (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
            files = [folder / name for name in sorted(set(weight_map.values()))]
        else:
            continue
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            if not file.is_file():
                raise ConversionError(f"weight shard {file.name} listed in the index is missing from {folder}")
            try:
                tensors.update(loader(file))
            except Exception as err:  # corrupt or truncated files surface here
                raise ConversionError(f"cannot read {file}: {str(err).splitlines()[0]}") from None
        return tensors
    raise ConversionError(f"{folder} has no weights (model.safetensors or pytorch_model.bin, single or sharded)")


def read_mula_config(folder: Path) -> MulaConfig:
    """The MulaConfig of a Mula checkpoint folder, else a ConversionError."""
    from .configuration_mula import MulaConfig

    cfg = read_config(folder)
    if cfg.get("model_type") != "mula":
        raise ConversionError(f"{folder} is not a Mula checkpoint (model_type={cfg.get('model_type')!r})")
    known = {k: v for k, v in cfg.items() if k not in ("auto_map", "architectures", "transformers_version")}
    return build_config(MulaConfig, known)


def build_config(config_cls, values: dict):
    """`config_cls(**values)`, a validation error raised as a ConversionError."""
    try:
        return config_cls(**values)
    except (ValueError, TypeError) as err:
        raise ConversionError(str(err).splitlines()[0]) from None


def rope_parameters(cfg: dict) -> dict:
    """A config.json dict's RoPE parameters, from Transformers v5 or v4 keys."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def checkpoint_dtype(cfg: dict) -> dict:
    """`{"dtype": ...}` if a config.json dict names one (`dtype`, `torch_dtype`)."""
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"dtype": dtype} if dtype else {}


# -- tensors ------------------------------------------------------------------------------------
def check_tensors(model_cls, config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `model_cls(config)` loads (bar ignored buffers, a tied head), checked present and shaped."""
    import torch

    with torch.device("meta"):
        model = model_cls(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = "lm_head.weight" if config.tie_word_embeddings else None
    tensors = {k: v for k, v in tensors.items() if not IGNORED.search(k) and k != tied}
    for name, shape in expected.items():
        if name == tied:
            continue
        if name not in tensors:
            raise ConversionError(f"missing tensor {name} (expected shape {list(shape)})")
        if tuple(tensors[name].shape) != shape:
            raise ConversionError(
                f"tensor {name} has shape {list(tensors[name].shape)}, the config implies {list(shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConversionError(f"unexpected tensor {unexpected[0]}{more} for this config")
    return tensors


def load_into_meta_model(model_cls, config, tensors: dict[str, torch.Tensor]):
    """`model_cls(config)` on the meta device with the checked tensors assigned (for saving only)."""
    import torch

    tensors = check_tensors(model_cls, config, tensors)
    with torch.device("meta"):
        model = model_cls(config)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


# -- writing ------------------------------------------------------------------------------------
def check_output(output_dir: Path) -> None:
    """Refuse an output that is a file or a non-empty folder."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"output {output_dir} exists and is not a folder")
    if output_dir.is_dir() and any(output_dir.iterdir()):
        raise ConversionError(f"output folder {output_dir} exists and is not empty")


def save_folder(model, output_dir: Path, **kwargs) -> None:
    """`model.save_pretrained(output_dir, **kwargs)` into a new or empty folder."""
    check_output(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, **kwargs)


def quiet_libraries() -> None:
    """Silence Transformers' warnings and shard bars, and DeepSpeed's accelerator line."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # Filtered before DeepSpeed (imported by Transformers' checks) creates it: its first line is caught too.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)


def run_conversion(prog: str, convert: Callable[[], Path], verbose: bool = False) -> Path | None:
    """For a command line: prints `wrote <folder>` and returns it, or the error and None."""
    if not verbose:
        quiet_libraries()
    try:
        out = convert()
    except ConversionError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return None
    print(f"wrote {out}")
    return out
