"""Checkpoints in the seed's format (Optimus, IntelLabs/Optimus-LM), written from a whole model's weights,
for the tests of `ds_optimus.hf_models.mula.convert_optimus`.

What it follows in the seed's code (read for this, none of it copied):
- `dist_train.py`, `save_checkpoint()`: each model-parallel rank of data-parallel replica 0 saves
  `{"train_step_id": S, "state_dict": model.state_dict()}` as `model_checkpoint_shard-{mp_ind}.pth`
  (`model_checkpoint.pth` when PP = EP = TP = 1); the sharded optimizers save one
  `optimizer_checkpoint_shard-{global rank}.pth` per rank, the others `optimizer_checkpoint.pth` from rank 0;
  rank 0 writes `completed`, holding the step, after the last barrier. Under DDP (the PyTorch optimizer)
  every key starts with `module.`.
- `optimus/mapper.py`, `ParallelDpPpEpTpMapper`: `mp_ind = pp * EP * TP + ep * TP + tp` (TP = 1 here),
  global rank `dp * PP * EP + pp * EP + ep` in the default order.
- `optimus/models/olmoe/modeling_olmoe.py` (`OlmoeParallelForCausalLM` and its sparse MoE block): the stage's
  layers under local indices 0..L/PP-1, contiguous stages; the rank's experts `ep * E/EP + j` under local
  index j; the router `mlp.gate` [E, H], attention, QK-norms and layer norms replicated over EP; the
  embedding only on the first stage, `model.norm` and `lm_head` only on the last. `modeling_olmoe_new.py` and
  `optimus/models/olmo/modeling_olmo.py`: under virtual stages local layer l of stage p is layer
  `(l // LV * PP + p) * LV + l % LV`, LV = L / PP / VPP.
- `optimus/models/common/moe.py`, `MergedMLP`: with the fast merged MoE each layer's local experts are stacked,
  `mlp.experts.{gate,up,down}_proj_merged_weight` [E/EP, out, in].
- the optimizers (`optimus/optimizers.py`): parameters are views into one flat buffer, so a saved shard stores
  one storage that every tensor is a view of (`flat_buffer=True`).
- `evals/convert_olmoe_ppep_om_checkpoint_to_hf.py`: the seed's own inverse (local to global layer and expert
  indices), which `seed_names` below mirrors from the Mula side.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch

EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def seed_names(mula_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Mula state dict under the seed's whole-model names: the same names, but one module per expert, its
    `gate_proj.weight` [I, H], `up_proj.weight` and `down_proj.weight` [H, I] together, in place of the
    stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]."""
    out: dict[str, torch.Tensor] = OrderedDict()
    for name, tensor in mula_state.items():
        if name.endswith(".mlp.experts.down_proj"):
            continue  # written with gate_up_proj
        if not name.endswith(".mlp.experts.gate_up_proj"):
            out[name] = tensor.detach().clone()
            continue
        prefix = name[: -len("gate_up_proj")]
        down = mula_state[f"{prefix}down_proj"]
        for e, weight in enumerate(tensor):
            gate, up = weight.chunk(2, dim=0)
            out[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
            out[f"{prefix}{e}.up_proj.weight"] = up.clone()
            out[f"{prefix}{e}.down_proj.weight"] = down[e].detach().clone()
    return out


def stage_layers(stage: int, pp: int, layers: int, vpp: int = 1) -> list[int]:
    """The model's layer index of each local layer of pipeline stage `stage` (`layers` in all)."""
    chunk = layers // pp // vpp
    return [(local // chunk * pp + stage) * chunk + local % chunk for local in range(layers // pp)]


def rank_state(
    whole: dict[str, torch.Tensor],
    stage: int,
    rank: int,
    *,
    pp: int,
    ep: int,
    layers: int,
    experts: int,
    vpp: int = 1,
    merged: bool = False,
) -> dict[str, torch.Tensor]:
    """The state dict the rank of pipeline stage `stage` and expert-parallel rank `rank` saves: its layers
    under local indices, its experts under local indices (or stacked as MergedMLP stores them), the
    replicated tensors, the embedding on the first stage and the final norm and head on the last."""
    local_of = {layer: local for local, layer in enumerate(stage_layers(stage, pp, layers, vpp))}
    per_rank = experts // ep if experts else 0
    out: dict[str, torch.Tensor] = OrderedDict()
    merged_parts: dict[str, list[torch.Tensor]] = {}
    for name, tensor in whole.items():
        layer_match = LAYER.match(name)
        if layer_match is None:  # the embedding on the first stage, the final norm and the head on the last
            if stage == (0 if name.startswith("model.embed_tokens.") else pp - 1):
                out[name] = tensor
            continue
        layer = int(layer_match[1])
        if layer not in local_of:
            continue
        local = local_of[layer]
        expert = EXPERT.match(name)
        if expert is None:
            out[f"model.layers.{local}.{layer_match[2]}"] = tensor
            continue
        e, part = int(expert[2]), expert[3]
        if e // per_rank != rank:
            continue
        if merged:
            merged_parts.setdefault(f"model.layers.{local}.mlp.experts.{part}_merged_weight", []).append(tensor)
            if e % per_rank == per_rank - 1 and part == "down_proj":  # the layer's last local expert: stack them
                for kind in ("gate_proj", "up_proj", "down_proj"):
                    key = f"model.layers.{local}.mlp.experts.{kind}_merged_weight"
                    out[key] = torch.stack(merged_parts.pop(key))
        else:
            out[f"model.layers.{local}.mlp.experts.{e % per_rank}.{part}.weight"] = tensor
    return out


def as_flat_views(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as views into one flat buffer padded to a multiple of 512, as the seed's optimizers
    leave the parameters (torch.save then stores that buffer once)."""
    total = sum(t.numel() for t in state.values())
    flat = torch.zeros(-(-total // 512) * 512, dtype=next(iter(state.values())).dtype)
    out, start = OrderedDict(), 0
    for name, tensor in state.items():
        view = flat[start : start + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        out[name] = view
        start += tensor.numel()
    return out


def write_checkpoint(
    folder: Path,
    whole: dict[str, torch.Tensor],
    *,
    layers: int,
    experts: int = 0,
    pp: int = 1,
    ep: int = 1,
    vpp: int = 1,
    merged: bool = False,
    module_prefix: bool = False,
    step: int = 1000,
    dtype: torch.dtype = torch.bfloat16,
    flat_buffer: bool = True,
    optimizer: str | None = None,
    dp: int = 1,
    completed: bool = True,
) -> Path:
    """Write `whole` (the seed's whole-model names: `seed_names`) into `folder` as the seed saves a
    checkpoint on PP x EP ranks (TP 1): the model files, optionally the optimizer files ("sharded": one per
    global rank of DP x PP x EP, "ddp": one), and the `completed` marker. Returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    whole = OrderedDict((name, t.detach().to(dtype)) for name, t in whole.items())
    for stage in range(pp):
        for rank in range(ep):
            state = rank_state(whole, stage, rank, pp=pp, ep=ep, layers=layers, experts=experts, vpp=vpp, merged=merged)
            if flat_buffer:
                state = as_flat_views(state)
            if module_prefix:
                state = OrderedDict((f"module.{name}", t) for name, t in state.items())
            name = "model_checkpoint.pth" if pp * ep == 1 else f"model_checkpoint_shard-{stage * ep + rank}.pth"
            torch.save({"train_step_id": step, "state_dict": state}, folder / name)
    if optimizer is not None:
        write_optimizer(folder, whole, optimizer, ranks=dp * pp * ep, step=step)
    if completed:
        (folder / "completed").write_text(str(step))  # no newline, as the seed writes it
    return folder


def write_optimizer(folder: Path, whole: dict[str, torch.Tensor], kind: str, ranks: int, step: int) -> None:
    """Optimizer files of the seed's shapes (fp32 flat moment and master buffers, zeros here): the importer
    must leave them alone."""
    numel = sum(t.numel() for t in whole.values())
    if kind == "ddp":
        state = {name: torch.zeros(numel) for name in ("flat_exp_avg", "flat_exp_avg_sq", "flat_fp32_master_param")}
        torch.save({"state_dict": {**state, "step_id": step}}, folder / "optimizer_checkpoint.pth")
        return
    shard = -(-numel // (ranks * 512)) * 512
    for rank in range(ranks):
        state = {
            f"{name}_shard": torch.zeros(shard)
            for name in ("flat_exp_avg", "flat_exp_avg_sq", "flat_fp32_master_param")
        }
        torch.save({"state_dict": {**state, "step_id": step}}, folder / f"optimizer_checkpoint_shard-{rank}.pth")
