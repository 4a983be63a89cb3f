"""Pipeline parallelism for Mula models on `torch.distributed.pipelining`.

Each rank keeps its chunks of decoder layers under the whole model's parameter names, so optimizer
state and checkpoints do not depend on the layout. Chunks pass each MoE layer's router statistics on,
so the last chunk computes every layer's router losses as the unpipelined model does (`PipelineLoss`).
The sharded optimizer reduces buckets in the schedule's drain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..hf_models.mula.modeling_mula import CACHE_NAME, combine_router_stats, create_causal_mask, router_layer_stats
from .expert_parallel import readable_as_umask
from .groups import PipelineGroups
from .stages import MULTI_STAGE_SCHEDULES, SCHEDULES, SINGLE_STAGE_SCHEDULES, PipelineParallelConfig


def stage_chunks(config: PipelineParallelConfig, model_config, seq_len: int, stage: int) -> list[tuple[int, range]]:
    """(chunk index, its decoder layers) of every chunk stage rank `stage` runs, in order."""
    split = config.split(model_config, seq_len)
    return [(c, layers) for c, layers in enumerate(split) if config.stage_of(c) == stage]


def keep_stage(model: nn.Module, layers: list[int], first: bool, last: bool) -> None:
    """Drop from a meta-device `MulaForCausalLM` the decoder layers not in `layers` (the rest keep their
    numbers), the embedding unless `first`, the final norm and head unless `last`."""
    inner = model.model
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        model.lm_head = None


class StageChunk(nn.Module):
    """Consecutive decoder layers run as `MulaModel.forward` runs them: token ids or hidden states (and
    MoE router statistics) in; hidden states, or logits on the last chunk (and statistics), out."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner, self.config = model.model, model.config
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList([inner.layers[str(i)] for i in layers])
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = inner.rotary_emb
        moe = self.config.moe_layers  # a row each in the router statistics
        self.rows = [moe.index(i) for i in layers if i in moe]  # this chunk's rows in the statistics
        self.num_rows = len(moe)
        self.width = 2 * self.config.num_experts + 2 if moe else 0

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None):
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(x)
            if self.num_rows:
                stats = torch.zeros(self.num_rows, self.width, dtype=torch.float32, device=hidden.device)
        else:
            hidden = x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, position_ids=None, **{CACHE_NAME: None}
        )
        position_embeddings = self.rotary_emb(hidden, position_ids)
        rows = []
        for layer in self.layers:
            hidden, _, logits, index = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=False,
                position_embeddings=position_embeddings,
                **{CACHE_NAME: None},
            )
            if index is None:
                continue
            if layer.training and layer.mlp.gate.uses_bias:  # the model's mode (eval() does not reach a chunk)
                layer.mlp.gate.record_load(index)
            mean_prob, z, count, tokens = router_layer_stats(
                logits, index, self.config.num_experts, self.config.router_scoring_func
            )
            rows.append(torch.cat([count, tokens, mean_prob, z.reshape(1)]))
        if rows:  # contiguous rows: this chunk's MoE layers are consecutive
            a, b = self.rows[0], self.rows[-1] + 1
            stats = torch.cat([stats[:a], torch.stack(rows), stats[b:]])
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden if stats is None else (hidden, stats)


class PipelineLoss:
    """A micro-batch's LM plus router loss on the last chunk, over `micro_batches` (so backward passes sum
    to the step's mean); each micro-batch's parts go to `records`."""

    def __init__(self, model: nn.Module, micro_batches: int, group=None, router_share: float = 1.0) -> None:
        self.model, self.micro_batches, self.group = model, micro_batches, group
        self.router_share = router_share  # under sequence parallelism over T ranks, 1/T: its tokens' router losses
        self.records: list[dict[str, torch.Tensor | None]] = []

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        config = self.model.config
        logits, stats = output if isinstance(output, tuple) else (output, None)
        lm_loss = self.model.loss_function(logits, target, config.vocab_size)
        loss, record = (
            lm_loss,
            {"lm_loss": lm_loss.detach(), "aux_loss": None, "z_loss": None, "tokens_per_expert": None},
        )
        if stats is not None:
            experts = config.num_experts
            counts = [row[:experts].detach() for row in stats]
            tokens = [row[experts : experts + 1].detach() for row in stats]
            mean_probs = [row[experts + 1 : 2 * experts + 1] for row in stats]
            zloss = [row[2 * experts + 1] for row in stats]
            group = self.group if getattr(config, "router_aux_loss_scope", "micro_batch") == "global_batch" else None
            aux, z, tokens_per_expert = combine_router_stats(
                mean_probs,
                zloss,
                counts,
                tokens,
                config.num_experts_per_tok,
                group if self.model.training else None,
                getattr(config, "router_aux_loss_type", "mula"),
            )
            record.update(aux_loss=aux.detach(), z_loss=z.detach(), tokens_per_expert=tokens_per_expert)
            if self.model.training:
                router = (config.router_aux_loss_coef * aux + config.router_z_loss_coef * z) * self.router_share
                loss = loss + router.to(loss.device)
        record["loss"] = loss.detach()
        self.records.append(record)
        return loss / self.micro_batches if self.model.training else loss


def _reducing_stage(pipelining) -> type:
    """PyTorch's pipeline stage, telling the sharded optimizer of each last backward pass and handing it
    the gradients the zero-bubble weight pass writes into `.grad` (which its hooks never see)."""

    class ReducingStage(pipelining.PipelineStage):
        optimizer = None  # set by build_schedule: the sharded optimizer, or None
        each_micro_batch = False  # ZeRO-2 with one chunk per rank: every backward pass reduces its own

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            optimizer = self.optimizer
            if last_backward and optimizer is not None:
                optimizer.last_gradients(self.submod.parameters())
            if self.each_micro_batch:
                optimizer.backward_prologue()
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
            if self.each_micro_batch:
                optimizer.backward_epilogue()

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            if last_backward and self.optimizer is not None:
                self.optimizer.last_gradients(self.submod.parameters())
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.optimizer is not None:
                self.optimizer.gradients_ready(self.submod.parameters())

    return ReducingStage


def each_micro_batch_reduction(optimizer, config: PipelineParallelConfig) -> bool:
    """Whether `optimizer` reduces each micro-batch's gradients (ZeRO-2, one chunk per rank)."""
    return optimizer is not None and optimizer.stage == 2 and config.schedule in SINGLE_STAGE_SCHEDULES


def build_schedule(
    chunks: list[tuple[int, StageChunk]],
    config: PipelineParallelConfig,
    pipeline: PipelineGroups,
    micro_batches: int,
    loss: PipelineLoss,
    device,
    micro: int,
    seq_len: int,
    optimizer=None,
) -> Any:
    """PyTorch's schedule `config.schedule` over this rank's (chunk index, module) `chunks`, for
    micro-batches of `micro` x `seq_len` tokens."""
    from torch.distributed import pipelining

    device = torch.device(device)
    stage_class = _reducing_stage(pipelining)
    stages = [
        stage_class(
            module,
            index,
            config.chunks,
            device,
            group=pipeline.group,
            input_args=_example(module, index == 0, False, micro, seq_len, device),
            output_args=_example(module, False, index == config.chunks - 1, micro, seq_len, device),
        )
        for index, module in chunks
    ]  # shapes given: shape inference would run placeholder passes that count router loads and add gradients
    # ZeRO-2 keeps no full-size gradients: with one chunk per rank each backward pass is one micro-batch's,
    # reduced into the shards as it goes (as without stages); with several chunks a bucket can hold
    # parameters of two chunks, whose backward passes interleave, so the step's gradients add up in fp32
    # buckets and each is reduced in the drain
    each = each_micro_batch_reduction(optimizer, config)
    for stage in stages:
        stage.optimizer, stage.each_micro_batch = optimizer, each
    schedule = getattr(pipelining, SCHEDULES[config.schedule])
    if config.schedule in MULTI_STAGE_SCHEDULES:
        return schedule(stages, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    return schedule(stages[0], n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)


def _example(module: StageChunk, ids: bool, logits: bool, micro: int, seq_len: int, device) -> tuple:
    """Placeholders of a chunk's inputs or outputs."""
    if ids:
        return (torch.empty(micro, seq_len, dtype=torch.long, device=device),)
    dtype = next(module.parameters()).dtype
    width = module.config.vocab_size if logits else module.config.hidden_size
    # requires_grad: gradients travel back with both (the statistics' mean probabilities and z-losses)
    hidden = torch.empty(micro, seq_len, width, dtype=dtype, device=device, requires_grad=True)
    if not module.num_rows:
        return (hidden,)
    return hidden, torch.empty(module.num_rows, module.width, dtype=torch.float32, device=device, requires_grad=True)


def run_schedule(schedule, batch: torch.Tensor, first: bool, last: bool) -> None:
    """One step of `schedule` over `batch` (token ids, also the labels)."""
    args = (batch,) if first else ()
    schedule.step(*args, target=batch if last else None, return_outputs=False)


@torch.no_grad()
def forward_only(
    chunks: list[tuple[int, StageChunk]],
    pipeline: PipelineGroups,
    config: PipelineParallelConfig,
    batch: torch.Tensor,
    loss: PipelineLoss,
) -> torch.Tensor | None:
    """The loss of `batch` without a schedule (evaluation), on the last chunk's rank (else None).
    Collective over the pipeline."""
    mine = dict(chunks)
    total_chunks, x, stats, result = config.chunks, batch, None, None
    for c in range(total_chunks):
        if c not in mine:
            continue
        module = mine[c]
        source = pipeline.ranks[config.stage_of(c - 1)] if c > 0 else None
        if source is not None and source != dist.get_rank():
            x, stats = _receive(module, batch, source)
        out = module(x, stats) if stats is not None else module(x)
        x, stats = out if isinstance(out, tuple) else (out, None)
        if c == total_chunks - 1:
            result = loss(out, batch)
            continue
        target = pipeline.ranks[config.stage_of(c + 1)]
        if target != dist.get_rank():
            dist.send(x.contiguous(), target)
            if stats is not None:
                dist.send(stats.contiguous(), target)
    return result


def _receive(module: StageChunk, batch: torch.Tensor, source: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = next(module.parameters()).dtype
    hidden = torch.empty(*batch.shape, module.config.hidden_size, dtype=dtype, device=batch.device)
    dist.recv(hidden, source)
    stats = None
    if module.num_rows:
        stats = torch.empty(module.num_rows, module.width, dtype=torch.float32, device=batch.device)
        dist.recv(stats, source)
    return hidden, stats


def write_stage_weights(
    folder, state: dict[str, torch.Tensor] | None, pipeline: PipelineGroups, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write a pipelined model's weights into Hugging Face folder `folder`: each stage's first rank writes
    its `state` (every expert) as safetensors shards, rank 0 the index. Collective over every rank."""
    from safetensors.torch import save_file

    writer = dist.get_rank() == pipeline.stage_ranks[0]
    shards: list[dict[str, torch.Tensor]] = []
    if writer:
        size = max_shard_bytes
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if size + nbytes > max_shard_bytes and (not shards or shards[-1]):
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
    plans: list[Any] = [None] * pipeline.size
    if writer:  # the stages' first ranks are exactly the pipeline of global rank 0: only they take part
        mine = (
            pipeline.stage,
            [list(shard) for shard in shards],
            sum(t.numel() * t.element_size() for t in state.values()),
        )
        dist.all_gather_object(plans, mine, group=pipeline.group)
    plans = sorted(plans) if writer else []  # one per stage, in stage order
    total = sum(len(names) for _, names, _ in plans)
    weight_map, files, number = {}, [], 0
    for stage, names, _ in plans:
        for shard_names in names:
            number += 1
            file = f"model-{number:05d}-of-{total:05d}.safetensors"
            weight_map.update(dict.fromkeys(shard_names, file))
            if writer and stage == pipeline.stage:
                files.append(file)
    for file, shard in zip(files, shards, strict=True):
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in shard.items()},
            str(Path(folder) / file),
            metadata={"format": "pt"},
        )
    readable_as_umask([Path(folder) / file for file in files])
    if dist.get_rank() == 0:  # rank 0 is stage 0's writer
        index = {
            "metadata": {"total_size": sum(size for _, _, size in plans)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dist.barrier()  # the folder is complete when any rank returns
