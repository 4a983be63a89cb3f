"""Build a Mula model on the meta device and materialise only what this rank holds (its expert slice is cut on meta).

Initial values do not depend on the layout; from a folder a rank reads only its rows of the expert tensors.
"""

from __future__ import annotations

import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from ..hf_models.mula.modeling_mula import MulaExperts, MulaForCausalLM, MulaRotaryEmbedding
from .pipeline import keep_stage
from .tensor_parallel import apply_tensor_parallel, is_part

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_OLMOE_EXPERT = "{prefix}.{expert}.{kind}.weight"


class WeightsError(ValueError):
    """A folder's weights do not fit the model: one line naming the first tensor."""


def build_model(
    config,
    *,
    ep_size: int = 1,
    ep_rank: int = 0,
    seed: int = 0,
    folder: str | Path | None = None,
    kind: str = "mula",
    stage: tuple[list[int], bool, bool] | None = None,
    tensor_parallel: tuple[object, int, int] | None = None,
) -> MulaForCausalLM:
    """fp32 `MulaForCausalLM(config)` with only experts [ep_rank*E/ep_size, (ep_rank+1)*E/ep_size) of each layer.

    Values: seeded random ones, or `folder`'s (`kind` "mula"/"olmoe"). `stage` (decoder layers, has embedding,
    has head) keeps a pipeline stage's part, `tensor_parallel` (group, size, rank) this rank's split weights.
    """
    if not (isinstance(ep_size, int) and ep_size >= 1 and isinstance(ep_rank, int) and 0 <= ep_rank < ep_size):
        raise ValueError(f"build_model: ep_rank must be in [0, ep_size={ep_size}), got {ep_rank!r}")
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    if stage is not None:
        keep_stage(model, *stage)
    if tensor_parallel is not None:
        apply_tensor_parallel(model, *tensor_parallel)
    experts = [m for m in model.modules() if isinstance(m, MulaExperts)]
    for module in experts:
        if module.num_experts % ep_size:
            raise ValueError(f"build_model: {module.num_experts} experts do not divide over ep_size {ep_size}")
        local = module.num_experts // ep_size
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            setattr(module, name, nn.Parameter(torch.empty((local, *full.shape[1:]), device="meta")))
        module.num_local_experts = local
        module.expert_offset = ep_rank * local
    model.to_empty(device="cpu")
    model.tie_weights()
    if folder is None:
        initialise(model, seed)
    else:
        reset_buffers(model)
        load_slices(model, Path(folder), kind)
    return model


def seed_of(seed: int, name: str) -> int:
    """A generator seed from the run's seed and a tensor's name, the same on every rank and layout."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialise(model: MulaForCausalLM, seed: int) -> None:
    """Fill a `build_model` model: `_init_weights` per module seeded by its name, experts by their global index."""
    std = model.config.initializer_range
    done: set[int] = set()
    draws = []  # (tensor, seed) per expert: drawn by a pool of threads (normal_ releases the GIL)
    for name, module in model.named_modules():
        if isinstance(module, MulaExperts):
            for weight in EXPERT_WEIGHTS:
                tensor = getattr(module, weight)
                draws += [
                    (tensor[j], seed_of(seed, f"{name}.{weight}[{module.expert_offset + j}]"))
                    for j in range(tensor.shape[0])
                ]
            continue
        own = list(module.parameters(recurse=False))
        if all(id(p) in done for p in own) and not any(True for _ in module.buffers(recurse=False)):
            continue  # nothing of its own, or a tied head whose weight the embedding drew
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_of(seed, name))
            if is_part(module):  # a tensor-parallel part: drawn whole, as without the split, then cut
                with torch.device("meta"):  # made as the whole model's modules are: no draws of its own
                    whole = module.whole()
                whole.to_empty(device=module.weight.device)
                model._init_weights(whole)
                module.take(whole)
            else:
                model._init_weights(module)
        done.update(id(p) for p in own)

    def draw(job) -> None:
        tensor, key = job
        with torch.no_grad():  # grad mode is per thread
            tensor.normal_(0.0, std, generator=torch.Generator().manual_seed(key))

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(draw, draws))
    reset_buffers(model)
    model.tie_weights()


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """Zero the buffers `to_empty` left uninitialised and recompute the derived ones (RoPE frequencies)."""
    for module in model.modules():
        if isinstance(module, MulaRotaryEmbedding):
            model._init_weights(module)
            continue
        for buffer in module.buffers(recurse=False):
            if buffer.is_floating_point() or buffer.dtype in (torch.int32, torch.int64):
                buffer.zero_()


# -- reading a folder's slices -------------------------------------------------------------------------


class _Folder:
    """An HF folder's tensors by name, read lazily: whole, some rows, or some columns."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.where: dict[str, Path] = {}
        files = _weight_files(folder)
        self._open: dict[Path, object] = {}
        for file in files:
            try:
                names = list(self._handle(file).keys())
            except Exception as err:  # a corrupt or truncated file: safetensors' own error type, OSError, ...
                text = str(err).strip()
                detail = text.splitlines()[0][:200] if text else type(err).__name__
                raise WeightsError(f"{file.name} cannot be read ({detail})") from None
            self.where.update(dict.fromkeys(names, file))

    def _handle(self, file: Path):
        if file not in self._open:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[file] = safe_open(str(file), framework="pt")
            else:  # memory-mapped: a slice reads only its pages
                self._open[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._handle(self.where[name])
        if isinstance(handle, dict):
            return tuple(handle[name].shape)
        return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        handle = self._handle(self.where[name])
        index = (rows or slice(None),) if cols is None else (rows or slice(None), cols)
        if isinstance(handle, dict):  # memory-mapped: the slice's pages only, copied out
            tensor = handle[name]
            return tensor if rows is None and cols is None else tensor[index].clone()
        return handle.get_tensor(name) if rows is None and cols is None else handle.get_slice(name)[index]


def _weight_files(folder: Path) -> list[Path]:
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
            except (OSError, ValueError, AttributeError) as err:
                raise WeightsError(f"{index} is not a readable JSON index ({type(err).__name__})") from None
            files = [folder / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.is_file():
                    raise WeightsError(f"weight shard {file.name} listed in {index} is missing")
            return files
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise WeightsError("no weights (*.safetensors or *.bin)")
    return files


def folder_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an HF folder's weight files; a `WeightsError` where a file does not open."""
    source = _Folder(folder)
    return {name: source.shape(name) for name in source.where}


@torch.no_grad()
def load_slices(model: MulaForCausalLM, folder: Path, kind: str = "mula") -> None:
    """Copy `folder`'s weights into a `build_model` model, reading only this rank's expert rows.
    A missing or misshapen tensor is a `WeightsError` naming it."""
    source = _Folder(folder)
    tied = model.config.tie_word_embeddings
    experts = {name: module for name, module in model.named_modules() if isinstance(module, MulaExperts)}
    parts = {name: module for name, module in model.named_modules() if is_part(module)}
    missing, wrong = [], []
    for name, param in model.named_parameters(remove_duplicate=True):
        if tied and name == "lm_head.weight":
            continue
        owner, _, leaf = name.rpartition(".")
        if owner in experts and leaf in EXPERT_WEIGHTS:
            module = experts[owner]
            rows = slice(module.expert_offset, module.expert_offset + module.num_local_experts)
            value = _expert_rows(source, owner, leaf, module.num_experts, rows, kind, missing, wrong)
        elif owner in parts and name in source:  # a tensor-parallel part: this rank's slice of the whole
            value = _part_of(parts[owner], leaf, source, name, wrong)
        elif name in source:
            if source.shape(name) != tuple(param.shape):
                wrong.append(name)
                continue
            value = source.read(name)
        else:
            missing.append(name)
            continue
        if value is not None:
            param.copy_(value)
    if missing or wrong:
        names = missing or wrong
        what = "has no weights for" if missing else "has weights of another shape for"
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise WeightsError(f"{what} {', '.join(names[:3])}{more}")
    model.tie_weights()


def _part_of(part: nn.Module, leaf: str, source: _Folder, name: str, wrong: list[str]) -> torch.Tensor | None:
    """A TP part's slice of the folder's tensor `name`; None, with `name` in `wrong`, if it has another shape."""
    if leaf == "bias" and not part.bias_split:  # a row-split linear keeps its bias whole
        expected = tuple(part.bias.shape)
    else:
        expected = tuple(part.whole_shape) if leaf == "weight" else (part.whole_shape[0],)
    if source.shape(name) != expected:
        wrong.append(name)
        return None
    if leaf == "bias" and not part.bias_split:
        return source.read(name)
    if leaf == "bias" or part.dim == 0:
        return source.read(name, rows=slice(part.start, part.stop))
    return source.read(name, cols=slice(part.start, part.stop))


def _expert_rows(
    source: _Folder,
    owner: str,
    leaf: str,
    num_experts: int,
    rows: slice,
    kind: str,
    missing: list[str],
    wrong: list[str],
) -> torch.Tensor | None:
    """Rows `rows` of a stacked expert tensor: a slice, or stacked from an OLMoE folder's per-expert tensors."""
    name = f"{owner}.{leaf}"
    if name in source:
        if source.shape(name)[0] != num_experts:
            wrong.append(name)
            return None
        return source.read(name, rows)
    if kind != "olmoe":
        missing.append(name)
        return None
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    out = []
    for expert in range(rows.start, rows.stop):
        keys = [_OLMOE_EXPERT.format(prefix=owner, expert=expert, kind=part) for part in parts]
        absent = [k for k in keys if k not in source]
        if absent:
            missing.append(absent[0])
            return None
        out.append(torch.cat([source.read(k) for k in keys]))
    return torch.stack(out)
