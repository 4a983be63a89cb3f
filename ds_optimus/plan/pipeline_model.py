"""Pipeline stages as the planner sees them: the decoder layers each stage rank runs (the runtime's own
balanced split, `ds_optimus.parallel.stages`, so the planner's stages are the run's), the bubble of a
schedule, and how many micro-batches' activations a stage holds at once.

Stage s is the ranks [s·D, (s+1)·D) (D = world / P, the data-parallel size); chunk c of the P·V chunks
of layers runs on stage c mod P; the first chunk has the embedding, the last the final norm, LM head
and loss (so the last stage is stage P - 1 and the first stage 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from types import SimpleNamespace

from ..parallel.stages import MULTI_STAGE_SCHEDULES, chunk_stage, layer_costs, split_layers
from .model import ModelShape


@dataclass(frozen=True)
class Stage:
    index: int
    layers: int  # decoder layers, over all of its chunks
    moe_layers: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the LM head and the loss
    layer_share: float  # of the decoder layers' forward FLOPs


def _config(model: ModelShape) -> SimpleNamespace:
    """The `MulaConfig` fields `layer_costs` reads, from a model shape; which layers have experts is
    `MulaConfig.is_moe_layer`'s own rule, not a copy of it (imported here: `--help` imports no torch)."""
    from ..hf_models.mula.configuration_mula import MulaConfig

    config = SimpleNamespace(
        hidden_size=model.hidden, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim, num_hidden_layers=model.layers, num_experts=model.experts,
        num_experts_per_tok=model.top_k, moe_intermediate_size=model.expert_intermediate,
        intermediate_size=model.intermediate, vocab_size=model.vocab, moe_layer_freq=model.moe_layer_freq)
    config.is_moe_layer = partial(MulaConfig.is_moe_layer, config)
    return config


@lru_cache(maxsize=512)
def stages(model: ModelShape, seq_len: int, pp: int, virtual: int = 1) -> tuple[Stage, ...]:
    """The `pp` stage ranks of `model` cut into pp x `virtual` chunks as the runtime cuts it."""
    config = _config(model)
    costs, embedding, head = layer_costs(config, seq_len)
    split = split_layers(costs, embedding, head, pp * virtual)
    total = sum(costs)
    out = []
    for s in range(pp):
        chunks = [c for c in range(len(split)) if chunk_stage(c, pp) == s]
        ids = [i for c in chunks for i in split[c]]
        out.append(Stage(index=s, layers=len(ids), moe_layers=sum(1 for i in ids if config.is_moe_layer(i)),
                         first=0 in chunks, last=len(split) - 1 in chunks,
                         layer_share=sum(costs[i] for i in ids) / total))
    return tuple(out)


def virtual_of(schedule: str, virtual: int) -> int:
    """Chunks per stage rank that the schedule runs (one for the single-stage schedules)."""
    return virtual if schedule in MULTI_STAGE_SCHEDULES else 1


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle share of a step of `micro_batches` on `pp` stages: (P-1)/(m+P-1) for GPipe and 1F1B
    (Narayanan et al., 2021, "Efficient large-scale language model training on GPU clusters"), and
    (P-1)/(V·m+P-1) for the interleaved and looped schedules of V chunks per rank (with m >= P:
    `interleaving`). The zero-bubble
    schedule fills the bubble with the weight-gradient passes: a third of the interleaved one's, the
    ZB-H1 bound (P-1)(F+B-W) against 1F1B's (P-1)(F+B+W) with the forward, input- and weight-gradient
    passes taken equal (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241)."""
    if pp <= 1:
        return 0.0
    v = interleaving(schedule, pp, micro_batches, virtual)
    idle = (pp - 1) / 3 if schedule == "interleaved_zb" else pp - 1
    return idle / (v * micro_batches + idle)


def interleaving(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> int:
    """The V that divides the bubble: the chunks per rank, where a round of micro-batches fills the
    pipeline (m >= P); with fewer micro-batches than stages every switch between a rank's chunks waits
    for the pipeline (PyTorch's op lists, simulated, idle more than the single-chunk schedule's
    (P-1)/(m+P-1) for interleaved 1F1B), so no gain is counted."""
    return virtual_of(schedule, virtual) if micro_batches >= pp else 1


def in_flight(schedule: str, pp: int, micro_batches: int, virtual: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations stage `stage` holds at once, in units of the whole stage's layers:
    GPipe and the looped (breadth-first) schedule run every forward before any backward (m); 1F1B
    holds P - s on stage s (at most m); the interleaved 1F1B holds PyTorch's warm-up forwards of a chunk,
    (V-1)·(micro-batches per round) + 2(P-1-s), and one more, each a V-th of the stage; the zero-bubble
    schedule min(P, m) on every stage (its graphs wait for their weight-gradient passes)."""
    m = micro_batches
    if pp <= 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule == "1f1b" or virtual_of(schedule, virtual) == 1:
        return float(min(pp - stage, m))
    if schedule == "interleaved_zb":  # warm-up of one round, each graph kept until its weight pass: every rank alike
        return float(min(pp, m))
    rounds = max(1, m // pp)
    warmup = (virtual - 1) * (m // rounds) + 2 * (pp - 1 - stage)
    return min(warmup + 1, virtual * m) / virtual
