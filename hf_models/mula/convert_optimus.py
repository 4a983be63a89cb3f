"""Import a checkpoint of the seed (Optimus, IntelLabs/Optimus-LM) as a Mula Hugging Face folder (docs/models.md).

    python -m ds_optimus.hf_models.mula.convert_optimus CHECKPOINT_DIR OUTPUT_DIR \\
        (--model-choice STR | --config PATH | --preset NAME) [--pp N] [--ep N] [--vpp N] \\
        [--dtype bf16|fp32|keep] [--tokenizer PATH] [--force]

A shard's layer indices are local to its pipeline stage, its expert indices to its EP rank (or stacked in
`*_proj_merged_weight`). Pass 1 checks every shard against the config; pass 2 writes one stage at a time, so host
memory never holds the model.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .convert_common import ConversionError, build_config, check_output, run_conversion, save_folder

if TYPE_CHECKING:  # imported where used, so that --help needs neither PyTorch nor Transformers
    import torch

    from .configuration_mula import MulaConfig

PROG = "ds_optimus.hf_models.mula.convert_optimus"
SINGLE = "model_checkpoint.pth"
SHARD = re.compile(r"^model_checkpoint_shard-(\d+)\.pth$")
MARKER = "completed"
MAX_FILE_BYTES = 5 * 2**30  # one output safetensors file (a tensor is never cut), as ds_optimus' own exports
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MERGED = re.compile(r"^mlp\.experts\.(gate_proj|up_proj|down_proj)_merged_weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_QK_NORM = re.compile(r"\.self_attn\.[qk]_norm\.weight$")


def shard_name(index: int) -> str:
    return f"model_checkpoint_shard-{index}.pth"


def _first_line(err: BaseException) -> str:
    return (str(err).strip() or type(err).__name__).splitlines()[0]


# -- the model's shape --------------------------------------------------------------------------
OLMOE_BASE, OLMO_BASE = "allenai/OLMoE-1B-7B-0924", "allenai/OLMo-1B-hf"
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# allenai/OLMoE-1B-7B-0924 as the seed's OlmoeParallelConfig defaults give it, with the seed's router
# losses (Transformers' pooled load-balancing form, no z-loss).
OLMOE_VALUES = dict(
    vocab_size=50304,
    hidden_size=2048,
    moe_intermediate_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    rms_norm_eps=1e-5,
    rope_parameters=_ROPE,
    max_position_embeddings=4096,
    pad_token_id=1,
    eos_token_id=50279,
    bos_token_id=None,
    norm_topk_prob=False,
    router_aux_loss_coef=0.01,
    router_aux_loss_type="transformers",
    router_z_loss_coef=0.0,
    clip_qkv=None,
    qk_norm=True,
    moe_layer_freq=1,
    router_scoring_func="softmax",
    tie_word_embeddings=False,
)
# allenai/OLMo-1B-hf as the seed's OLMo branch makes it: 4096 positions, untied, parameter-free LayerNorms.
OLMO_VALUES = dict(
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    rope_parameters=_ROPE,
    max_position_embeddings=4096,
    pad_token_id=1,
    eos_token_id=50279,
    bos_token_id=None,
    num_experts=0,
    qk_norm=False,
    norm_type="layer_norm",
    norm_elementwise_affine=False,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    clip_qkv=None,
)
# OLMoE tags: a scale of base fields (the new value is int(scale * base)); SM and S scale several at once.
_OLMOE_SCALES = {
    "SA": ("num_attention_heads", "num_key_value_heads"),
    "SH": ("hidden_size",),
    "SE": ("num_experts",),
    "SC": ("num_experts_per_tok",),
    "SI": ("moe_intermediate_size",),
}
_OLMOE_GROUPS = {"SM": ("SA", "SH"), "S": ("SA", "SH", "SE", "SI")}
_OLMO_SCALED = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size")


def _tags(choice: str, text: str) -> list[tuple[str, float | None]]:
    """The `KEY[number]` tags after the `--` of a model choice."""
    tags = []
    for token in text.split("-") if text else []:
        match = re.fullmatch(r"([A-Z]+)([0-9.]*)", token)
        try:
            value = float(match[2]) if match and match[2] else None
        except ValueError:
            match = None
        if match is None:
            raise ConversionError(f"model choice {choice!r}: tag {token!r} is not capitals and an optional number")
        tags.append((match[1], value))
    return tags


def _need_number(choice: str, key: str, value: float | None, integer: bool = False) -> float:
    if value is None or (integer and value != int(value)):
        raise ConversionError(f"model choice {choice!r}: tag {key} needs {'an integer' if integer else 'a number'}")
    return value


def _olmoe_values(choice: str, tags: list[tuple[str, float | None]]) -> tuple[dict, bool]:
    """OLMoE's values under the seed's tags (get_modified_config's OLMoE branch), and whether SKIPQKNORM."""
    values = copy.deepcopy(OLMOE_VALUES)
    keys = {key for key, _ in tags}
    for group, members in _OLMOE_GROUPS.items():
        if group in keys and keys & set(members):
            raise ConversionError(
                f"model choice {choice!r}: {group} scales {', '.join(members)} together and "
                f"cannot be given with {', '.join(sorted(keys & set(members)))}"
            )
    scale, flags = dict.fromkeys(_OLMOE_SCALES, 1.0), set()
    for key, value in tags:
        if key in ("NAL", "SKIPQKNORM") and value is None:
            flags.add(key)
        elif key == "L":
            values["num_hidden_layers"] = int(_need_number(choice, key, value, integer=True))
        elif key in _OLMOE_SCALES or key in _OLMOE_GROUPS:
            for member in _OLMOE_GROUPS.get(key, (key,)):
                scale[member] = _need_number(choice, key, value)
        else:
            raise ConversionError(
                f"model choice {choice!r}: unknown OLMoE tag {key!r} (the seed's are L, SA, SH, "
                "SE, SC, SI, SM, S, NAL and SKIPQKNORM)"
            )
    for key, fields in _OLMOE_SCALES.items():
        for name in fields:
            values[name] = int(scale[key] * OLMOE_VALUES[name])
    values["intermediate_size"] = values["moe_intermediate_size"]  # unused: every layer is MoE
    if "NAL" in flags:  # the run had no auxiliary loss
        values["router_aux_loss_coef"] = 0.0
    skip_qk_norm = "SKIPQKNORM" in flags
    if skip_qk_norm:  # the run stored its q/k norm weights but did not apply them
        values["qk_norm"] = False
    return values, skip_qk_norm


def _olmo_values(choice: str, tags: list[tuple[str, float | None]]) -> dict:
    """OLMo-1B's values under the seed's tags (get_modified_config's OLMo branch): L, S, TWE, RMS."""
    values, scale = copy.deepcopy(OLMO_VALUES), 1.0
    for key, value in tags:
        if key == "L":
            values["num_hidden_layers"] = int(_need_number(choice, key, value, integer=True))
        elif key == "S":
            scale = _need_number(choice, key, value)
        elif key == "RMS" and value is None:
            values.update(norm_type="rms_norm", norm_elementwise_affine=True)
        elif key != "TWE" or value is not None:
            raise ConversionError(
                f"model choice {choice!r}: unknown OLMo tag {key!r} (the seed's are L, S, TWE and RMS)"
            )
    for name in _OLMO_SCALED:
        values[name] = int(scale * OLMO_VALUES[name])
    return values


def config_from_model_choice(choice: str) -> tuple[MulaConfig, bool]:
    """The MulaConfig of a seed `--model_choice`, and whether the run skipped QK-norm (SKIPQKNORM)."""
    from .configuration_mula import MulaConfig

    base, _, text = choice.partition("--")
    text = text.split("_")[0]  # a run folder's name goes on with its settings after a `_`
    name = base.replace("__", "/") if "/" in base or "__" in base else f"allenai/{base}"
    if name not in (OLMOE_BASE, OLMO_BASE):
        raise ConversionError(
            f"model choice {choice!r}: the base {base!r} is not {OLMOE_BASE} or {OLMO_BASE}, "
            "the two whose numbers this importer knows; give --config or --preset"
        )
    tags = _tags(choice, text)
    values, skip_qk_norm = _olmoe_values(choice, tags) if name == OLMOE_BASE else (_olmo_values(choice, tags), False)
    heads = values["num_attention_heads"]
    if heads > 0:  # the seed's head width is hidden // heads (it has no head_dim setting)
        values["head_dim"] = values["hidden_size"] // heads
    return build_config(MulaConfig, values), skip_qk_norm


def config_from_file(path: Path) -> MulaConfig:
    """The MulaConfig of a Mula, OLMoE or OLMo config.json (or the folder holding it)."""
    from .configuration_mula import MulaConfig
    from .convert_olmo import olmo_to_mula_config
    from .convert_olmoe import olmoe_to_mula_config

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConversionError(
            f"--config {path}: no such file" + (" (the folder has no config.json)" if path.is_dir() else "")
        )
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"--config {file} is not valid JSON: {str(err).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"--config {file} is not a JSON object")
    model_type = cfg.get("model_type")
    if model_type == "olmoe":
        return olmoe_to_mula_config(cfg)
    if model_type == "olmo":
        return olmo_to_mula_config(cfg)
    if model_type != "mula":
        raise ConversionError(f"--config {file} describes a {model_type!r} model, not a Mula, OLMoE or OLMo one")
    skip = ("auto_map", "architectures", "transformers_version", "model_type")
    return build_config(MulaConfig, {k: v for k, v in cfg.items() if k not in skip})


def model_config(model_choice: str | None, config: str | Path | None, preset: str | None) -> tuple[MulaConfig, bool]:
    """The MulaConfig the shards are read as (always untied), and whether to leave out their q/k norm weights."""
    from .configuration_mula import MulaConfig

    if sum(x is not None for x in (model_choice, config, preset)) != 1:
        raise ConversionError("give exactly one of --model-choice, --config and --preset: the seed stores no config")
    skip_qk_norm = False
    if model_choice is not None:
        mula, skip_qk_norm = config_from_model_choice(model_choice)
    elif config is not None:
        mula = config_from_file(Path(config))
    else:
        try:
            mula = MulaConfig.from_preset(preset)
        except ValueError as err:
            raise ConversionError(str(err).splitlines()[0]) from None
    mula.tie_word_embeddings = False
    return mula, skip_qk_norm


# -- the checkpoint folder ----------------------------------------------------------------------
def not_a_checkpoint(folder: Path, names: list[str]) -> ConversionError:
    """The error for a folder without model files, saying what it seems to be."""
    inner = [
        d
        for d in sorted(folder.iterdir())
        if d.is_dir() and any(SHARD.match(p.name) or p.name == SINGLE for p in d.iterdir())
    ]
    if inner:
        shown = ", ".join(d.name for d in inner[:4]) + (", ..." if len(inner) > 4 else "")
        return ConversionError(
            f"{folder} holds no model files, but its folders are checkpoints of the seed: import one of them ({shown})"
        )
    if (folder / "checkpoints").is_dir():
        return ConversionError(
            f"{folder} is a run folder of the seed: import one of its checkpoints, "
            f"{folder / 'checkpoints'}/<checkpoint1, checkpoint2, main or step...>"
        )
    if "config.json" in names:
        return ConversionError(
            f"{folder} is a Hugging Face folder (it has config.json), not a checkpoint of the seed: "
            "convert_olmoe and convert_olmo read OLMoE and OLMo folders, optimus.model.path all "
            "three"
        )
    optimizer = " (only optimizer state)" if any(n.startswith("optimizer_checkpoint") for n in names) else ""
    return ConversionError(
        f"{folder} is not a checkpoint of the seed: it has no {SINGLE} or model_checkpoint_shard-N.pth{optimizer}"
    )


def find_model_files(folder: Path, pp: int | None, ep: int | None) -> list[Path]:
    """A seed checkpoint folder's model files in shard order (mp_ind = pp * EP + ep)."""
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder")
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        raise ConversionError(f"{folder} is empty")
    shards = {int(m[1]): folder / name for name in names if (m := SHARD.match(name))}
    if not shards and SINGLE not in names:
        raise not_a_checkpoint(folder, names)
    if SINGLE in names and shards:
        if pp is None and ep is None:
            raise ConversionError(
                f"{folder} holds both {SINGLE} and {len(shards)} model_checkpoint_shard-N.pth files "
                "(the seed never deletes old files): give --pp and --ep to choose"
            )
        if (pp or 1) * (ep or 1) == 1:
            return [folder / SINGLE]
    if not shards:
        return [folder / SINGLE]
    missing = [k for k in range(max(shards)) if k not in shards]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(
            f"{folder}: {shard_name(missing[0])} is missing{more}; the folder has shards up to "
            f"{shard_name(max(shards))}"
        )
    return [shards[k] for k in sorted(shards)]


def load_shard(path: Path) -> tuple[int | None, dict[str, torch.Tensor]]:
    """(train_step_id, state dict) of one model file, memory-mapped: tensors are read when used."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # truncated, corrupt or not a PyTorch file
        raise ConversionError(f"cannot read {path}: {_first_line(err)}") from None
    wrapped = isinstance(saved, dict) and "state_dict" in saved
    state = saved["state_dict"] if wrapped else saved  # the seed's loader takes a bare state dict too
    if not isinstance(state, dict) or not state or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ConversionError(f"{path} is not a model checkpoint of the seed: no state dict of tensors in it")
    step = saved.get("train_step_id") if wrapped else None
    return (step if isinstance(step, int) else None), state


def check_marker(folder: Path, step: int | None, force: bool) -> str | None:
    """Refuse (unless `force`) a checkpoint whose `completed` marker is missing or names another step; returns a note
    when forced past it."""
    marker = folder / MARKER
    if not marker.is_file():
        problem = (
            f"{folder} has no `{MARKER}` marker: the seed may not have finished writing it (a save deletes "
            "the marker first and writes it last)"
        )
    else:
        text = marker.read_text().strip()
        if step is None or text == str(step):
            return None
        problem = f"{marker} says step {text}, the shards are from step {step}"
    if force:
        return f"note: {problem}; imported anyway (--force)"
    raise ConversionError(f"{problem}; import the other hot checkpoint (checkpoint1/checkpoint2) or pass --force")


# -- layout -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How the seed split the model: `pp` stages of `layers` decoder layers each (in `vpp` interleaved chunks), `ep`
    expert-parallel ranks of `experts` experts each (0: dense)."""

    files: tuple[Path, ...]
    pp: int
    ep: int
    vpp: int
    layers: int
    experts: int

    def rank(self, shard: int) -> tuple[int, int]:
        """(pipeline stage, expert-parallel rank) of a file (mp_ind = pp * EP + ep at TP 1)."""
        return divmod(shard, self.ep)

    def global_layer(self, stage: int, local: int) -> int:
        """The model's layer index of a stage's local layer: chunk v of stage p holds virtual stage v * PP + p."""
        chunk = self.layers // self.vpp
        return (local // chunk * self.pp + stage) * chunk + local % chunk


def _local_counts(state: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(local decoder layers, experts per layer) that one shard holds."""
    layers, experts = set(), 0
    for key in state:
        match = _LAYER.match(key.removeprefix("module."))
        if match:
            layers.add(int(match[1]))
            if m := _EXPERT.match(match[2]):
                experts = max(experts, int(m[1]) + 1)
            elif _MERGED.match(match[2]):
                experts = max(experts, state[key].shape[0])
    return len(layers), experts


def infer_layout(
    files: list[Path], first: dict[str, torch.Tensor], config: MulaConfig, pp: int | None, ep: int | None, vpp: int
) -> Layout:
    """The layout from the file count and the first shard's layers and experts, checked against --pp/--ep."""
    n, total = len(files), config.num_hidden_layers
    local_layers, local_experts = _local_counts(first)
    if local_layers == 0:
        raise ConversionError(f"{files[0]} holds no decoder layers (model.layers.N...): not a model of the seed")
    if pp is None:
        if total % local_layers:
            raise ConversionError(
                f"{files[0].name} holds {local_layers} decoder layers, which does not divide the "
                f"config's {total}: the config does not match the checkpoint"
            )
        pp = total // local_layers
    if ep is None:
        ep = n // pp if n % pp == 0 else 0
    if pp * ep != n:
        folder = files[0].parent
        if ep == 0:
            raise ConversionError(
                f"{folder} has {n} model files, which do not divide over {pp} pipeline stages "
                f"({files[0].name} holds {local_layers} of the config's {total} layers): give --pp "
                "and --ep"
            )
        detail = (
            f"{shard_name(n)} is missing"
            if n < pp * ep
            else "more files than that layout has (the seed never deletes the files of an earlier layout)"
        )
        raise ConversionError(f"{folder} has {n} model files, but pp {pp} x ep {ep} makes {pp * ep}: {detail}")
    if total % pp or (total // pp) % vpp:
        raise ConversionError(f"the config's {total} layers do not split into {pp} stages of {vpp} virtual chunks")
    if local_layers != total // pp:
        raise ConversionError(
            f"{files[0].name} holds {local_layers} decoder layers, but the config's {total} over pp "
            f"{pp} make {total // pp} per stage: the config or --pp does not match the files"
        )
    if config.num_experts and config.num_experts % ep:
        raise ConversionError(
            f"the config's {config.num_experts} experts do not divide over {ep} expert-parallel ranks"
        )
    experts = config.num_experts // ep
    if local_experts and not experts:
        raise ConversionError(
            f"{files[0].name} holds {local_experts} experts per layer, but the config's model is dense (num_experts 0)"
        )
    if local_experts and local_experts != experts:
        raise ConversionError(
            f"{files[0].name} holds {local_experts} experts per layer, but {config.num_experts} "
            f"experts over ep {ep} make {experts}: the config or --ep does not match the files"
        )
    return Layout(tuple(files), pp, ep, vpp, total // pp, experts)


# -- pass 1: every shard's names and shapes against the config ------------------------------------
@dataclass(frozen=True)
class Source:
    """Where a Mula tensor is in the checkpoint: the file, its key, a merged tensor's row."""

    shard: int
    key: str
    row: int | None = None


@dataclass
class Scan:
    """Pass 1's findings: where each tensor is, the replicas' checksums, the floating dtypes and each file's step."""

    plain: dict[str, list[Source]] = field(default_factory=dict)
    crcs: dict[str, int] = field(default_factory=dict)
    differing: list[str] = field(default_factory=list)
    experts: dict[tuple[int, str, int], Source] = field(default_factory=dict)
    dtypes: set = field(default_factory=set)
    steps: list[int | None] = field(default_factory=list)


def expected_shapes(config: MulaConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor of `MulaForCausalLM(config)`, in its order."""
    import torch

    from .modeling_mula import MulaForCausalLM

    with torch.device("meta"):
        model = MulaForCausalLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _target(key: str, stage: int, rank: int, layout: Layout, file: str) -> tuple:
    """What a shard's key (less `module.`) is in the Mula model: ("plain", name), ("expert", layer, part,
    expert) or ("merged", layer, part, first expert)."""
    match = _LAYER.match(key)
    if match is None:
        return ("plain", key)
    local, rest = int(match[1]), match[2]
    if local >= layout.layers:
        raise ConversionError(
            f"{file} holds local layer {local}, but {layout.pp} stages of the config's layers have "
            f"{layout.layers} each: the config or --pp does not match the files"
        )
    layer = layout.global_layer(stage, local)
    if layout.experts == 0 and (_EXPERT.match(rest) or _MERGED.match(rest)):
        raise ConversionError(f"unexpected tensor {key} in {file}: the config's model is dense")
    if expert := _EXPERT.match(rest):
        if int(expert[1]) >= layout.experts:
            raise ConversionError(
                f"{file} holds local expert {expert[1]} of layer {local}, but the config's experts "
                f"over ep {layout.ep} make {layout.experts} per file: the config or --ep does not "
                "fit"
            )
        return ("expert", layer, expert[2], rank * layout.experts + int(expert[1]))
    if merged := _MERGED.match(rest):
        return ("merged", layer, merged[1], rank * layout.experts)
    return ("plain", f"model.layers.{layer}.{rest}")


def _expert_shape(expected: dict, layer: int, part: str) -> tuple[int, ...] | None:
    """One expert's `part` weight shape in layer `layer` ([I, H] or [H, I]); None in a dense layer."""
    stacked = expected.get(f"model.layers.{layer}.mlp.experts.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}")
    if stacked is None:
        return None
    return (stacked[1], stacked[2]) if part == "down_proj" else (stacked[1] // 2, stacked[2])


def _check_shape(key: str, file: str, shape, want) -> None:
    if want is None:
        raise ConversionError(f"unexpected tensor {key} in {file}: the config's model has no such tensor")
    if tuple(shape) != tuple(want):
        differ = [(s, w) for s, w in zip(shape, want, strict=False) if s != w]
        split = len(shape) == len(want) and len(differ) == 1 and 0 < differ[0][0] < differ[0][1]
        hint = " (a tensor-parallel part? only TP 1 is read)" if split and differ[0][1] % differ[0][0] == 0 else ""
        raise ConversionError(f"tensor {key} in {file} has shape {list(shape)}, the config implies {list(want)}{hint}")


def _crc(tensor: torch.Tensor) -> int:
    import torch

    return zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _add_expert(scan: Scan, where: tuple[int, str, int], source: Source, layout: Layout) -> None:
    if where in scan.experts:
        files = layout.files
        raise ConversionError(
            f"expert {where[2]} of layer {where[0]} ({where[1]}) is in both "
            f"{files[scan.experts[where].shard].name} and {files[source.shard].name}"
        )
    scan.experts[where] = source


def scan_shard(
    index: int, state: dict[str, torch.Tensor], layout: Layout, expected: dict, skip_qk_norm: bool, scan: Scan
) -> None:
    """Record where each of one shard's tensors goes, checking its name and shape against `expected`."""
    stage, rank = layout.rank(index)
    file = layout.files[index].name
    for raw, tensor in state.items():
        key = raw.removeprefix("module.")
        target = _target(key, stage, rank, layout, file)
        if tensor.is_floating_point():
            scan.dtypes.add(tensor.dtype)
        if target[0] == "plain":
            name = target[1]
            if skip_qk_norm and _QK_NORM.search(name):
                continue  # SKIPQKNORM: stored, never applied
            _check_shape(raw, file, tensor.shape, None if _STACKED.match(name) else expected.get(name))
            copies = scan.plain.setdefault(name, [])
            if copies and layout.rank(copies[0].shard)[0] != stage:
                raise ConversionError(
                    f"{name} is in {layout.files[copies[0].shard].name} and {file}, of different "
                    "pipeline stages: --pp, --ep or the config does not match the files"
                )
            copies.append(Source(index, raw))
            if layout.ep > 1:  # replicas over the EP ranks: the seed's all-reduce keeps them equal
                crc = _crc(tensor)
                if scan.crcs.setdefault(name, crc) != crc and name not in scan.differing:
                    scan.differing.append(name)
        elif target[0] == "expert":
            _, layer, part, expert = target
            _check_shape(raw, file, tensor.shape, _expert_shape(expected, layer, part))
            _add_expert(scan, (layer, part, expert), Source(index, raw), layout)
        else:
            _, layer, part, first = target
            want = _expert_shape(expected, layer, part)
            _check_shape(raw, file, tensor.shape, want and (layout.experts, *want))
            for row in range(layout.experts):
                _add_expert(scan, (layer, part, first + row), Source(index, raw, row), layout)


def _holder(name: str, layout: Layout, owners: dict[int, int]) -> int:
    """The first file that should hold tensor `name` (embedding: stage 0; final norm and head: the last)."""
    match = _LAYER.match(name)
    stage = owners[int(match[1])] if match else (0 if name.startswith("model.embed_tokens.") else layout.pp - 1)
    return stage * layout.ep


def layer_owners(layout: Layout) -> dict[int, int]:
    """The pipeline stage of each decoder layer."""
    return {layout.global_layer(stage, local): stage for stage in range(layout.pp) for local in range(layout.layers)}


def check_complete(scan: Scan, expected: dict, layout: Layout, num_experts: int) -> None:
    """Every tensor of the model is in the shards; else an error naming the first missing one and its file."""
    owners, missing = layer_owners(layout), []
    for name in expected:
        stacked = _STACKED.match(name)
        if name.endswith(".mlp.gate.expert_bias"):
            continue  # the seed has no selection bias: it starts at zero
        if stacked is None:
            if name not in scan.plain:
                missing.append(f"{name} (in {layout.files[_holder(name, layout, owners)].name})")
            continue
        layer = int(stacked[1])
        for part in ("gate_proj", "up_proj") if stacked[2] == "gate_up_proj" else ("down_proj",):
            for expert in range(num_experts):
                if (layer, part, expert) not in scan.experts:
                    shard = owners[layer] * layout.ep + expert // layout.experts
                    missing.append(
                        f"model.layers.{layer}.mlp.experts.{expert}.{part} (local expert "
                        f"{expert % layout.experts} in {layout.files[shard].name})"
                    )
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"missing tensor {missing[0]}{more}")


def scan_checkpoint(
    files: list[Path],
    config: MulaConfig,
    pp: int | None,
    ep: int | None,
    vpp: int,
    skip_qk_norm: bool,
    progress: Callable[[str], None],
) -> tuple[Layout, Scan, dict]:
    """Pass 1: the layout and every tensor's place, one memory-mapped file at a time, no tensor kept."""
    expected = expected_shapes(config)
    scan, layout = Scan(), None
    for index, file in enumerate(files):
        step, state = load_shard(file)
        if layout is None:
            layout = infer_layout(files, state, config, pp, ep, vpp)
        scan.steps.append(step)
        if step != scan.steps[0]:
            raise ConversionError(
                f"{file.name} is from step {step}, {files[0].name} from step {scan.steps[0]}: the "
                "folder mixes two saves (the seed overwrites its files in place)"
            )
        scan_shard(index, state, layout, expected, skip_qk_norm, scan)
        del state
        progress(f"checked {file.name} ({index + 1}/{len(files)})")
    check_complete(scan, expected, layout, config.num_experts)
    return layout, scan, expected


# -- pass 2: one stage at a time into safetensors files -------------------------------------------
class FileWriter:
    """Tensors into safetensors files of at most `max_bytes` (a tensor is never cut); `finish` names them as
    `save_pretrained` does and writes the index."""

    def __init__(self, folder: Path, max_bytes: int | None = None) -> None:
        self.folder, self.max_bytes = folder, max_bytes or MAX_FILE_BYTES
        self.pending: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            path = self.folder / f"model-{len(self.written) + 1:05d}.safetensors.partial"
            save_file(self.pending, str(path), metadata={"format": "pt"})
            self.written.append((path, list(self.pending)))
            self.pending, self.size = {}, 0

    def finish(self) -> list[Path]:
        self.flush()
        count, weight_map, paths = len(self.written), {}, []
        for number, (path, names) in enumerate(self.written, 1):
            name = "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
            final = self.folder / name
            path.rename(final)
            weight_map.update(dict.fromkeys(names, final.name))
            paths.append(final)
        if count > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return paths


def _fetch(states: dict[int, dict], source: Source) -> torch.Tensor:
    tensor = states[source.shard][source.key]
    return tensor if source.row is None else tensor[source.row]


def assemble(name: str, shape: tuple[int, ...], states: dict[int, dict], scan: Scan, dtype) -> torch.Tensor:
    """Mula's tensor `name` as a `dtype` copy; stacked experts take gate rows, then up rows."""
    import torch

    if name.endswith(".mlp.gate.expert_bias"):
        return torch.zeros(shape, dtype=torch.float32)
    stacked = _STACKED.match(name)
    if stacked is None:
        return _fetch(states, scan.plain[name][0]).to(dtype=dtype, copy=True)
    layer = int(stacked[1])
    parts = ("gate_proj", "up_proj") if stacked[2] == "gate_up_proj" else ("down_proj",)
    out = torch.empty(shape, dtype=dtype)
    rows = shape[1] // len(parts)
    for expert in range(shape[0]):
        for i, part in enumerate(parts):
            out[expert, i * rows : (i + 1) * rows].copy_(_fetch(states, scan.experts[(layer, part, expert)]))
    return out


def write_weights(
    output_dir: Path, layout: Layout, scan: Scan, expected: dict, dtype, progress: Callable[[str], None]
) -> list[Path]:
    """Pass 2: each stage's files memory-mapped together, its tensors assembled in the model's order into a
    FileWriter."""
    owners, writer = layer_owners(layout), FileWriter(output_dir)
    for stage in range(layout.pp):
        states = {}
        for rank in range(layout.ep):
            index = stage * layout.ep + rank
            progress(f"reading {layout.files[index].name} ({index + 1}/{len(layout.files)}: pp {stage}, ep {rank})")
            states[index] = load_shard(layout.files[index])[1]
        for name, shape in expected.items():
            if _holder(name, layout, owners) == stage * layout.ep:
                writer.add(name, assemble(name, shape, states, scan, dtype))
        del states
    return writer.finish()


def read_tokenizer(path: Path, config: MulaConfig):
    """The tokenizer of folder `path` (no download), which must fit the model's vocabulary."""
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise ConversionError(f"--tokenizer {path} is not a folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # Transformers raises several kinds for a folder it cannot read
        raise ConversionError(f"--tokenizer {path}: cannot load a tokenizer from it ({_first_line(err)})") from None
    if len(tokenizer) > config.vocab_size:
        raise ConversionError(
            f"--tokenizer {path} has {len(tokenizer)} tokens, more than the model's vocab_size {config.vocab_size}"
        )
    return tokenizer


# -- the import ---------------------------------------------------------------------------------
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def output_dtype(dtype: str, found: set):
    """The torch dtype to write: bf16, fp32, or (`keep`) the one the shards hold."""
    import torch

    if dtype not in (*DTYPES, "keep"):
        raise ConversionError(f"--dtype must be bf16, fp32 or keep, got {dtype!r}")
    if dtype != "keep":
        return getattr(torch, DTYPES[dtype])
    if len(found) != 1:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in found)) or "none"
        raise ConversionError(
            f"the shards hold floating tensors of several dtypes ({names}): give --dtype bf16 or fp32"
        )
    return next(iter(found))


def write_folder(
    output_dir: Path,
    config: MulaConfig,
    layout: Layout,
    scan: Scan,
    expected: dict,
    dtype,
    tokenizer,
    progress: Callable[[str], None],
) -> None:
    """Write the Mula folder (config, model code, generation config, weights, tokenizer); on any failure what was
    written is removed."""
    import torch

    from .modeling_mula import MulaForCausalLM

    created = not output_dir.exists()
    try:
        with torch.device("meta"):
            model = MulaForCausalLM(config).to(dtype)  # save_pretrained writes the model's dtype into config.json
        save_folder(model, output_dir, state_dict={})  # an empty state dict writes no weights
        write_weights(output_dir, layout, scan, expected, dtype, progress)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
    except BaseException:
        if created:
            shutil.rmtree(output_dir, ignore_errors=True)
        else:  # it was empty before
            for path in output_dir.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        raise


def import_checkpoint(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    *,
    model_choice: str | None = None,
    config: str | Path | None = None,
    preset: str | None = None,
    pp: int | None = None,
    ep: int | None = None,
    vpp: int | None = 1,
    dtype: str = "keep",
    tokenizer: str | Path | None = None,
    force: bool = False,
    progress: Callable[[str], None] = print,
) -> Path:
    """Write the seed's checkpoint `checkpoint_dir` as the Mula folder `output_dir`; any problem is a one-line
    ConversionError before anything is written."""
    from .sizing import count_parameters

    checkpoint_dir, output_dir, vpp = Path(checkpoint_dir), Path(output_dir), 1 if vpp is None else vpp
    for flag, value in (("--pp", pp), ("--ep", ep), ("--vpp", vpp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConversionError(f"{flag} must be a positive integer, got {value!r}")
    mula, skip_qk_norm = model_config(model_choice, config, preset)
    files = find_model_files(checkpoint_dir, pp, ep)
    check_output(output_dir)
    tokens = read_tokenizer(Path(tokenizer), mula) if tokenizer is not None else None
    layout, scan, expected = scan_checkpoint(files, mula, pp, ep, vpp, skip_qk_norm, progress)
    note = check_marker(checkpoint_dir, scan.steps[0], force)
    if scan.differing and not force:
        more = f" (and {len(scan.differing) - 1} more)" if len(scan.differing) > 1 else ""
        raise ConversionError(
            f"the expert-parallel copies of {scan.differing[0]}{more} differ between the files of "
            "a stage (files of two runs?); pass --force to take each stage's first"
        )
    mula.dtype = torch_dtype = output_dtype(dtype, scan.dtypes)
    for line in filter(
        None,
        [
            note,
            *(
                f"note: the expert-parallel copies of {name} differ; each stage's first file's taken (--force)"
                for name in scan.differing[:3]
            ),
        ],
    ):
        progress(line)
    vpp_text = f" x vpp {vpp}" if vpp > 1 else ""
    step = f"step {scan.steps[0]}" if scan.steps[0] is not None else "no step recorded"
    progress(
        f"{checkpoint_dir}: {step}, {len(files)} file(s) as pp {layout.pp} x ep {layout.ep}{vpp_text}; "
        f"writing {count_parameters(mula)[0]:,} parameters in {str(torch_dtype).removeprefix('torch.')}"
    )
    write_folder(output_dir, mula, layout, scan, expected, torch_dtype, tokens, progress)
    if tokens is None:
        progress("note: no tokenizer written (--tokenizer): the seed trained with allenai/OLMoE-1B-7B-0924's")
    return output_dir


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    from ds_optimus.command_line import ArgumentParser

    parser = ArgumentParser(
        PROG,
        description="Import a checkpoint folder of the seed (Optimus: model_checkpoint"
        "[_shard-N].pth files) as a Mula Hugging Face folder. The seed stores no config: give "
        "the model's shape with --model-choice, --config or --preset.",
    )
    parser.add_argument("checkpoint", help="the seed's checkpoint folder (checkpoint1, checkpoint2, main, step...)")
    parser.add_argument("output", help="folder to write (must not exist or be empty)")
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument(
        "--model-choice",
        help="the run's --model_choice, e.g. "
        "allenai/OLMoE-1B-7B-0924--SA1.5-SH1.5-SE3.75-SI1.5-L64 or allenai/OLMo-1B-hf",
    )
    shape.add_argument("--config", help="a config.json (or its folder) of a Mula, OLMoE or OLMo model")
    shape.add_argument("--preset", help="a Mula preset, e.g. mula-7b-a1b")
    parser.add_argument("--pp", type=_positive, help="pipeline stages (default: from the first shard's layers)")
    parser.add_argument("--ep", type=_positive, help="expert-parallel ranks (default: files / stages)")
    parser.add_argument(
        "--vpp",
        type=_positive,
        default=1,
        help="virtual stages per pipeline stage (interleaved layers); the files cannot tell (default 1)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp32", "keep"),
        default="keep",
        help="weights' dtype in the folder (default: keep the checkpoint's, bf16 for the seed's runs)",
    )
    parser.add_argument("--tokenizer", help="a tokenizer folder to save with the model (nothing is downloaded)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="import without the `completed` marker (or with one "
        "naming another step), and with expert-parallel copies that differ (the first taken)",
    )
    parser.add_argument("--verbose", action="store_true", help="keep Transformers' and DeepSpeed's own output")
    args = parser.parse_args(argv)

    def convert() -> Path:
        return import_checkpoint(
            args.checkpoint,
            args.output,
            model_choice=args.model_choice,
            config=args.config,
            preset=args.preset,
            pp=args.pp,
            ep=args.ep,
            vpp=args.vpp,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            force=args.force,
            progress=lambda line: print(line, flush=True),
        )

    return 2 if run_conversion(PROG, convert, args.verbose) is None else 0


__all__ = ["ConversionError", "Layout", "config_from_model_choice", "import_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
