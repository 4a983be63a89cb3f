"""Pipeline stages as the planner sees them: the decoder layers each stage rank runs (the runtime's own
balanced split, `ds_optimus.parallel.stages`, so the planner's stages are the run's), the bubble of a
schedule, and how many micro-batches' activations a stage holds at once.

Stage s is the ranks [s·D, (s+1)·D) (D = world / P, the data-parallel size); chunk c of the P·V chunks
of layers runs on stage c mod P, or under the V-shaped schedules on stage c and then 2P - 1 - c; the
first chunk has the embedding, the last the final norm, LM head and loss (the last stage P - 1, or
under the V-shaped schedules stage 0 again).

The bubble and the activations in flight are closed forms where the literature gives them: for GPipe
and for the several-chunk schedules with m a multiple of P each agrees exactly with a replay of
PyTorch's own op lists (`replay`, forward, input- and weight-gradient passes of one unit each;
tests/test_plan.py holds them to it), and 1F1B's are the textbook's (PyTorch's op list for its
single-stage 1F1B is not the order its runtime runs). Where no closed form holds (several chunks with
m below P or not a multiple of it; the V-shaped schedules below m = 2P) the replay itself is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from types import SimpleNamespace

from ..parallel.stages import MULTI_STAGE_SCHEDULES, SCHEDULES, V_SCHEDULES, chunk_stage, layer_costs, split_layers
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
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim,
        num_hidden_layers=model.layers,
        num_experts=model.experts,
        num_experts_per_tok=model.top_k,
        moe_intermediate_size=model.expert_intermediate,
        intermediate_size=model.intermediate,
        vocab_size=model.vocab,
        moe_layer_freq=model.moe_layer_freq,
    )
    config.is_moe_layer = partial(MulaConfig.is_moe_layer, config)
    return config


@lru_cache(maxsize=512)
def stages(model: ModelShape, seq_len: int, pp: int, virtual: int = 1, v_shape: bool = False) -> tuple[Stage, ...]:
    """The `pp` stage ranks of `model` cut into pp x `virtual` chunks as the runtime cuts and places it
    (`v_shape`: the V-shaped schedules' placement)."""
    config = _config(model)
    costs, embedding, head = layer_costs(config, seq_len)
    split = split_layers(costs, embedding, head, pp * virtual)
    total = sum(costs)
    out = []
    for s in range(pp):
        chunks = [c for c in range(len(split)) if chunk_stage(c, pp, v_shape) == s]
        ids = [i for c in chunks for i in split[c]]
        out.append(
            Stage(
                index=s,
                layers=len(ids),
                moe_layers=sum(1 for i in ids if config.is_moe_layer(i)),
                first=0 in chunks,
                last=len(split) - 1 in chunks,
                layer_share=sum(costs[i] for i in ids) / total,
            )
        )
    return tuple(out)


def virtual_of(schedule: str, virtual: int) -> int:
    """Chunks per stage rank that the schedule runs (one for the single-stage schedules)."""
    return virtual if schedule in MULTI_STAGE_SCHEDULES else 1


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle share of a step of `micro_batches` on `pp` stages: `idle_slots` over the step's m slots plus them."""
    idle = idle_slots(schedule, pp, micro_batches, virtual)
    return idle / (micro_batches + idle)


def idle_slots(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """The schedule's fill and drain, in one micro-batch's forward and backward passes through a whole
    stage: P - 1 for GPipe and 1F1B, (P-1)/(m+P-1) of the step (Narayanan et al., 2021, "Efficient
    large-scale language model training on GPU clusters"); (P-1)/V for the interleaved and looped
    schedules of V chunks per rank (with m >= P: `interleaving`); a third of that for the interleaved
    zero-bubble schedule, which fills the bubble with the weight-gradient passes: the ZB-H1 bound
    (P-1)(F+B-W) against 1F1B's (P-1)(F+B+W) with the forward, input- and weight-gradient passes taken
    equal (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241). The V-shaped
    schedules: their replay ((P-1)/3 at m = P, falling to (P-1)/6 from m of about 1.5 P on)."""
    if pp <= 1:
        return 0.0
    if schedule in V_SCHEDULES:  # the replay's; its closed form from m >= 2P on (the replay of a long step is slow)
        return (pp - 1) / 6 if micro_batches >= 2 * pp else replay(schedule, pp, micro_batches, virtual)[0]
    if _replayed(schedule, pp, micro_batches, virtual):
        return replay(schedule, pp, micro_batches, virtual)[0]
    idle = (pp - 1) / 3 if schedule == "interleaved_zb" else pp - 1
    return idle / interleaving(schedule, pp, micro_batches, virtual)


def _replayed(schedule: str, pp: int, micro_batches: int, virtual: int) -> bool:
    """Whether a several-chunk schedule's figures come from the replay: m below P or not a multiple of it."""
    return virtual_of(schedule, virtual) > 1 and (micro_batches < pp or micro_batches % pp != 0)


@lru_cache(maxsize=256)
def replay(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> tuple[float, tuple[float, ...]]:
    """PyTorch's op lists of `schedule` (its own, as its runtime runs them), replayed with every chunk's
    forward, input-gradient and weight-gradient pass taking one unit (a full backward two) and each
    waiting for the passes it needs: (the slowest rank's idle time in whole-stage micro-batch slots,
    each stage's most micro-batches with activations held, in whole stages). Sends take no time here
    (`timing.p2p_seconds` counts them). GPipe and the several-chunk schedules only: PyTorch's op list for
    its single-stage 1F1B is not the order its runtime runs."""
    if schedule == "1f1b":
        raise ValueError(
            "replay: PyTorch's op list for 1f1b is not what its runtime runs; its figures are the "
            "textbook's (idle_slots, in_flight)"
        )
    import warnings

    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    v = virtual if schedule in MULTI_STAGE_SCHEDULES else 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(
            SCHEDULES[schedule].removeprefix("Schedule"),
            pp,
            micro_batches,
            v if schedule in MULTI_STAGE_SCHEDULES else None,
        )
    lists = [
        [
            sub
            for op in rank
            if op is not None
            for sub in (op.sub_actions or (op,))
            if sub.computation_type.value in "FIWB"
        ]
        for rank in ops
    ]
    last, cost = pp * v - 1, {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    done: dict[tuple[str, int, int], float] = {}
    free, at, held = [0.0] * pp, [0] * pp, []
    while any(at[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(lists[r]):
                op = lists[r][at[r]]
                kind, chunk, mb = op.computation_type.value, op.stage_index, op.microbatch_index
                needs = {
                    "F": [("F", chunk - 1)] if chunk else [],
                    "W": [("I", chunk)],
                    "I": [("F", chunk)] + ([("IB", chunk + 1)] if chunk < last else []),
                }.get(kind)
                if needs is None:  # a full backward waits as the input-gradient pass does
                    needs = [("F", chunk)] + ([("IB", chunk + 1)] if chunk < last else [])
                ready = [
                    done.get((k, c, mb)) if k != "IB" else done.get(("I", c, mb), done.get(("B", c, mb)))
                    for k, c in needs
                ]
                if None in ready:
                    break
                done[(kind, chunk, mb)] = free[r] = max([free[r], *ready]) + cost[kind] / v
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the replay of {schedule} ({pp} stages, {micro_batches} micro-batches) is stuck")
    for rank in lists:  # activations from a forward until the pass that ends the chunk's backward
        live = peak = 0
        for op in rank:
            live += {"F": 1, "W": -1, "B": -1}.get(op.computation_type.value, 0)
            peak = max(peak, live)
        held.append(peak / v)
    work = 3.0 * micro_batches
    return (max(free) - work) / 3.0, tuple(held)


def interleaving(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> int:
    """The V that divides the bubble in the closed form: the chunks per rank (m a multiple of P; other
    m take the replay)."""
    return virtual_of(schedule, virtual) if micro_batches >= pp else 1


def in_flight(schedule: str, pp: int, micro_batches: int, virtual: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations stage `stage` holds at once, in units of the whole stage's layers:
    GPipe and the looped (breadth-first) schedule run every forward before any backward (m); 1F1B
    holds P - s on stage s (at most m); the interleaved 1F1B holds PyTorch's warm-up forwards of a chunk,
    (V-1)·(micro-batches per round) + 2(P-1-s), and one more, each a V-th of the stage; the zero-bubble
    schedule min(P, m) on every stage (its graphs wait for their weight-gradient passes); the V-shaped
    schedules as `replay` counts them (P on every stage from m >= 2P on; DualPipeV P + 1/2)."""
    m = micro_batches
    if pp <= 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule == "1f1b" or virtual_of(schedule, virtual) == 1:
        return float(min(pp - stage, m))
    if schedule not in V_SCHEDULES and _replayed(schedule, pp, m, virtual):
        return replay(schedule, pp, m, virtual)[1][stage]
    if schedule == "interleaved_zb":  # warm-up of one round, each graph kept until its weight pass: every rank alike
        return float(min(pp, m))
    if schedule in V_SCHEDULES:  # the replay's: P (with m >= 2P) on every rank, balanced by the V placement
        if m >= 2 * pp:
            return pp + (0.5 if schedule == "dualpipev" else 0.0)
        return replay(schedule, pp, m, virtual)[1][stage]
    rounds = max(1, m // pp)
    warmup = (virtual - 1) * (m // rounds) + 2 * (pp - 1 - stage)
    return min(warmup + 1, virtual * m) / virtual
