"""Pipeline stages: the `optimus.pipeline_parallel` section, the cost of each part of a Mula model,
and the split of its decoder layers into P·V chunks of balanced cost (`chunk_stage` places them).
The first chunk also pays the embedding and the last the head, about one MoE layer of Mula-220B-A10B.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import ConfigError, Section, need, positive_int

# The schedules of torch.distributed.pipelining a run can name: one stage per rank, or several.
SINGLE_STAGE_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
# The V-shaped schedules: two chunks per rank, placed down and back (`chunk_stage`)
V_SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
MULTI_STAGE_SCHEDULES = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    **V_SCHEDULES,
}
# the schedules that run the weight-gradient pass apart from the input-gradient pass (filling the bubble)
ZERO_BUBBLE_SCHEDULES = ("interleaved_zb", *V_SCHEDULES)
# the schedules that cut the micro-batches into rounds of at least `size` (and so need equal rounds)
ROUND_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")
SCHEDULES = {**SINGLE_STAGE_SCHEDULES, **MULTI_STAGE_SCHEDULES}


@dataclass(frozen=True)
class PipelineParallelConfig(Section):
    """`optimus.pipeline_parallel`: `size` stages run by `schedule`, `virtual_stages` chunks per rank."""

    size: int = 1  # pipeline stages; stage s is ranks [s x world / size, (s + 1) x world / size)
    # "gpipe", "1f1b", or with virtual stages "interleaved_1f1b", "looped_bfs" or "interleaved_zb" (zero bubble:
    # the weight gradients computed apart from the input gradients, filling the bubble), or with exactly two
    # virtual stages the V-shaped zero-bubble schedules "zbv" and "dualpipev"
    schedule: str = "1f1b"
    virtual_stages: int = 1  # chunks of layers per rank (the interleaved schedules)
    layers: list[int] | None = None  # decoder layers of each chunk, in order; null: split by cost

    def check(self, where: str) -> None:
        need(positive_int(self.size), f"{where}.size must be a positive integer, got {self.size!r}")
        need(
            self.schedule in SCHEDULES, f"{where}.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
        )
        need(
            positive_int(self.virtual_stages),
            f"{where}.virtual_stages must be a positive integer, got {self.virtual_stages!r}",
        )
        need(
            self.size > 1 or (self.virtual_stages == 1 and self.layers is None),
            f"{where}.virtual_stages and {where}.layers need pipeline stages ({where}.size > 1)",
        )
        need(
            self.size == 1 or self.virtual_stages > 1 or self.schedule in SINGLE_STAGE_SCHEDULES,
            f"{where}.schedule {self.schedule} runs several chunks of layers per rank: set {where}.virtual_stages "
            "to 2 or more, or use 1f1b",
        )
        need(
            self.virtual_stages == 1 or self.schedule in MULTI_STAGE_SCHEDULES,
            f"{where}.virtual_stages {self.virtual_stages} needs a schedule with several stages per rank "
            f"({', '.join(MULTI_STAGE_SCHEDULES)}); {self.schedule} runs one",
        )
        need(
            self.schedule not in V_SCHEDULES or self.virtual_stages == 2,
            f"{where}.schedule {self.schedule} runs exactly two chunks of layers per rank (down the pipeline and "
            f"back); set {where}.virtual_stages to 2, got {self.virtual_stages}",
        )
        if self.layers is not None:
            need(
                isinstance(self.layers, list) and all(positive_int(n) for n in self.layers),
                f"{where}.layers must be a list of positive integers (decoder layers per chunk), got {self.layers!r}",
            )
            need(
                len(self.layers) == self.chunks,
                f"{where}.layers has {len(self.layers)} entries; size {self.size} x virtual_stages "
                f"{self.virtual_stages} needs {self.chunks}",
            )

    def stage_of(self, chunk: int) -> int:
        """The stage rank that runs chunk `chunk`."""
        return chunk_stage(chunk, self.size, self.schedule in V_SCHEDULES)

    @property
    def chunks(self) -> int:
        """Chunks of layers in the whole pipeline."""
        return self.size * self.virtual_stages

    def split(self, config, seq_len: int) -> list[range]:
        """The decoder layers of each chunk of a `MulaConfig` model: `layers`, or the balanced split."""
        total = config.num_hidden_layers
        if self.layers is not None:
            if sum(self.layers) != total:
                raise ValueError(
                    f"optimus.pipeline_parallel.layers adds up to {sum(self.layers)} layers; the model has {total}"
                )
            bounds = [0]
            for n in self.layers:
                bounds.append(bounds[-1] + n)
            return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        if total < self.chunks:
            raise ValueError(
                f"optimus.pipeline_parallel: {self.chunks} chunks of layers (size {self.size} x "
                f"virtual_stages {self.virtual_stages}) need at least as many decoder layers; the model "
                f"has {total}"
            )
        return split_layers(*layer_costs(config, seq_len), self.chunks)


def layer_costs(config, seq_len: int) -> tuple[list[float], float, float]:
    """Forward FLOPs per token of each decoder layer, the embedding and the head (norm, LM head, loss)."""
    # backward is about twice the forward for every part alike, so the forward ranks parts as the step does
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    projections = 2 * hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    scores = 2 * 2 * seq_len * heads * head_dim / 2  # QK^T and AV, half the positions under the causal mask
    costs = []
    for index in range(config.num_hidden_layers):
        if config.is_moe_layer(index):
            experts = config.num_experts
            ffn = 2 * config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size + 2 * hidden * experts
        else:
            ffn = 2 * 3 * hidden * config.intermediate_size
        costs.append(float(projections + scores + ffn))
    embedding = float(2 * hidden)  # a row read and copied: small beside a layer, counted all the same
    head = float(2 * hidden * config.vocab_size + 4 * config.vocab_size)  # matmul, softmax and the loss
    return costs, embedding, head


def split_layers(costs: list[float], embedding: float, head: float, chunks: int) -> list[range]:
    """Cut layers of `costs` into `chunks` non-empty ranges minimising the costliest chunk (the first also
    paying `embedding`, the last `head`), exactly by dynamic programming."""
    n = len(costs)
    if not 1 <= chunks <= n:
        raise ValueError(f"cannot cut {n} layers into {chunks} non-empty chunks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, first: bool, last: bool) -> float:
        return prefix[b] - prefix[a] + (embedding if first else 0.0) + (head if last else 0.0)

    inf = float("inf")
    # best[k][i]: the least costliest chunk over cuts of layers [0, i) into k chunks; cut[k][i]: its last start
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(j, i, j == 0, i == n and k == chunks))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(chunks, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def chunk_stage(chunk: int, stages: int, v_shape: bool = False) -> int:
    """The stage rank of chunk `chunk`: c mod stages, or with `v_shape` c, then 2·stages - 1 - c."""
    if v_shape:
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk % stages


def check_pipeline(opt, ds_config: dict, model_config, accumulation: int) -> list[range]:
    """Check what a pipeline-parallel run of `opt` needs beyond the config's own checks (a ConfigError);
    the layers of every chunk."""
    pp = opt.pipeline_parallel
    if not opt.sharded_optimizer.enabled:
        raise ConfigError(
            "optimus.pipeline_parallel needs optimus.sharded_optimizer.enabled true (the pipeline "
            "schedule runs the backward passes; the sharded optimizer reduces their gradients)"
        )
    if model_config.tie_word_embeddings:
        raise ConfigError(
            "optimus.pipeline_parallel: the model ties its embedding and head, which sit in the first "
            "and the last chunk of layers; set tie_word_embeddings false (optimus.model.overrides)"
        )
    if opt.train.compile:
        raise ConfigError("optimus.pipeline_parallel does not run compiled layers yet; set optimus.train.compile false")
    if ds_config.get("fp16", {}).get("enabled"):
        raise ConfigError(
            "optimus.pipeline_parallel runs in bf16 or fp32: the pipeline schedule's backward passes "
            "do not scale the loss as fp16 needs; use bf16"
        )
    if pp.schedule == "1f1b" and accumulation < pp.size:
        raise ConfigError(
            f"optimus.pipeline_parallel: 1f1b needs at least as many micro-batches "
            f"(gradient_accumulation_steps, {accumulation}) as stages ({pp.size}); raise it, or use "
            'schedule "gpipe"'
        )
    if pp.schedule == "dualpipev" and accumulation < pp.chunks:
        raise ConfigError(
            f"optimus.pipeline_parallel: dualpipev needs at least as many micro-batches "
            f"(gradient_accumulation_steps, {accumulation}) as chunks of layers (2 x {pp.size} = "
            f'{pp.chunks}); raise it, or use schedule "zbv"'
        )
    rounds = max(1, accumulation // pp.size)
    if pp.schedule in ROUND_SCHEDULES and accumulation % rounds:
        raise ConfigError(
            f"optimus.pipeline_parallel: {pp.schedule} splits the micro-batches into rounds of at "
            f"least {pp.size}; gradient_accumulation_steps {accumulation} does not split into {rounds} "
            f"equal rounds (use a multiple of {pp.size}, or fewer than {2 * pp.size})"
        )
    try:
        return pp.split(model_config, opt.data.seq_len)
    except ValueError as err:
        raise ConfigError(str(err)) from None
