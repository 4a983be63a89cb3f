"""The "optimus" section of a DeepSpeed JSON config: what DeepSpeed does not know, parsed and
validated once, up front. An unknown key or a bad value is a one-line `ConfigError` naming the key.

Each section is declared beside the component it configures (`ds_optimus.schema.Section`); this module
assembles them and holds the run's own (model, train, wandb, profile). Keys and defaults: docs/reference/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint.manager import CheckpointConfig
from .data.sources import DataConfig
from .evaluate.downstream_config import EvalConfig
from .moe.experts import MoEConfig
from .optim.engine_section import ShardedOptimizerConfig
from .parallel.expert_parallel import ExpertParallelConfig
from .parallel.stages import PipelineParallelConfig
from .parallel.tensor_parallel import TensorParallelConfig
from .reliability.guards import GuardsConfig
from .reliability.supervise import DEFAULT_OUTPUT_DIR
from .reliability.watchdog import WatchdogConfig
from .schema import (
    ConfigError,
    Section,
    apply_overrides,
    load_json_config,
    need,
    non_negative_int,
    number,
    positive_int,
)

__all__ = [
    "ConfigError",
    "OptimusConfig",
    "apply_overrides",
    "check_optimizer_section",
    "check_run_config",
    "load_json_config",
    "resolve_batch_sizes",
    "batch_keys",
    "resolve_schedule",
]

DEFAULT_PRESET = "mula-tiny-moe"


@dataclass(frozen=True)
class ModelConfig(Section):
    """`optimus.model`: an HF folder or a preset, with MulaConfig fields over either; a path wins over the preset."""

    preset: str | None = None  # a Mula preset (`ds_optimus.hf_models.mula.PRESETS`), used when no path is given
    # an HF folder of a Mula, OLMoE or OLMo model (its config; its weights too if it has them); wins over the preset
    path: str | None = None
    # MulaConfig fields over the preset's or the folder's (an unknown name is a one-line error)
    overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.path is not None:
            object.__setattr__(self, "preset", None)
        elif self.preset is None:
            object.__setattr__(self, "preset", DEFAULT_PRESET)

    def check(self, where: str) -> None:
        from .hf_models.mula import PRESETS

        need(
            self.preset is None or self.preset in PRESETS,
            f"{where}.preset {self.preset!r} is not one of {', '.join(PRESETS)}",
        )

    def build(
        self, tokenizer=None, *, ep_size: int = 1, ep_rank: int = 0, seed: int = 0, stage=None, tensor_parallel=None
    ):
        """The fp32 Mula model on the meta device, with only this EP rank's experts and (`tensor_parallel`:
        group, size, rank) its part of each split weight."""
        from .parallel.model_source import build

        return build(
            self, tokenizer, ep_size=ep_size, ep_rank=ep_rank, seed=seed, stage=stage, tensor_parallel=tensor_parallel
        )

    def mula_config(self, tokenizer=None, seq_len: int | None = None):
        """The `MulaConfig` of the model `build` makes (`parallel.model_source.mula_config`)."""
        from .parallel.model_source import mula_config

        return mula_config(self, tokenizer, seq_len)

    def describe(self) -> str:
        """What the model comes from, in words."""
        from .parallel.model_source import describe

        return describe(self)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class TrainConfig(Section):
    """`optimus.train`: the run's length, seed, output, evaluation, logging and schedule."""

    steps: int | None = 100  # optimizer steps of the whole run (the LR schedule's length); null: from `tokens`
    seed: int = 0  # initial weights, data order and every random generator of the run
    output_dir: str = DEFAULT_OUTPUT_DIR  # metrics, logs, checkpoints, plots and the exported model
    eval_interval: int = 50  # held-out loss every this many steps and at the end; 0: only at the end
    eval_batches: int = 8  # held-out micro-batches per rank in each evaluation
    log_interval: int = 1  # metrics reach the host, metrics.jsonl and wandb every this many steps
    peak_tflops: float | None = None  # per device, for model FLOPs utilisation; null: not reported
    # The schedule's length in tokens instead of steps: steps = ceil(tokens / tokens of one optimizer
    # step), e.g. "100B", "4T" or an integer. Give steps or tokens, not both (steps: null with tokens).
    tokens: int | str | None = None
    # Without a "scheduler" section in the DeepSpeed config, the LR schedule is a linear warm-up to the
    # optimizer's lr over warmup_steps, then a cosine decay to min_lr_ratio x lr (`optim.schedule`):
    # "cosine" reaches it at the last step; "optimus" is the seed's formula (warm-up from the minimum
    # LR, the decay reaching it one step after the last).
    lr_schedule: str = "cosine"
    warmup_steps: int = 0  # steps of linear LR warm-up (without a "scheduler" section)
    # the LR of the first warm-up step: null (lr / warmup_steps; "optimus": "min"), "min" (min_lr_ratio
    # x lr, the seed's), or a number (an LR)
    warmup_start_lr: float | str | None = None
    min_lr_ratio: float = 0.1  # the cosine decay's final LR, as a fraction of lr (without a "scheduler" section)
    # no gradient clipping during the LR warm-up: the config's `gradient_clipping` applies from the step
    # after it on (Optimus' recipe)
    clip_after_warmup: bool = False
    # weight decay on every parameter, norms and biases too (Optimus' recipe); by default
    # parameters of one dimension are not decayed
    decay_all_params: bool = False
    # the decoupled weight decay applied after the Adam update, to the updated weights (the seed's
    # p -= lr x wd x p after p -= lr x m / (sqrt(v) + eps)); false: before it, as torch's AdamW does
    decay_after_update: bool = False
    # End this invocation cleanly (with a checkpoint) after this many steps, e.g. to fit a job's
    # time limit; the next invocation resumes. null: run to `steps`.
    stop_after_steps: int | None = None
    # End the run cleanly (with a checkpoint) once this many tokens are trained in all (counted from the
    # run's start, not this invocation's), e.g. "100B" of a schedule sized for more, as the seed's
    # 100B-token runs were; the next invocation goes no further. null: run to `steps`.
    stop_after_tokens: int | str | None = None
    sample_prompt: str | None = None  # the end-of-run sample's prompt; null: the first words of a held-out document
    sample_tokens: int = 48  # tokens sampled from the exported model at the end; 0: no sample
    # At the end: the Hugging Face folder <output_dir>/hf (every expert) and a sample from it. false:
    # neither (summary.json is still written), for throughput measurements of big models.
    export: bool = True
    # the run's plots (PNGs in <output_dir>/plots) on rank 0 at the end of an invocation that did not
    # fail; false: none (`python -m ds_optimus.report <output_dir>` draws them at any time)
    plots: bool = True
    # Recompute activations in the backward pass instead of keeping them: true, each decoder layer
    # whole; a list, those parts of each layer (selective recomputation, `recompute_parts`).
    activation_checkpointing: bool | list[str] = False
    # Compile each decoder layer with torch.compile (the first steps pay for the compilation).
    compile: bool = False
    # Record each rank's peak tensor memory over the first `measure_memory_steps` steps into the
    # summary (on CPU through the profiler's allocation events, which slows those steps; on
    # accelerators from the allocator's statistics). 0: off.
    measure_memory_steps: int = 0
    # [first, last]: record steps first..last with torch.profiler; rank 0 writes the operators and
    # kernels by device time to <output_dir>/profile.txt. null: off.
    profile_steps: list[int] | None = None

    # "moe": the FFN after the post-attention norm (router, experts, their expert-parallel exchange);
    # "attention": the attention after the input norm; "norms": the layer norms
    recompute_parts = ("moe", "attention", "norms")

    @property
    def recompute(self) -> bool | tuple[str, ...]:
        """`activation_checkpointing` as `Layout.checkpointing`: a bool, or parts in `recompute_parts`' order."""
        value = self.activation_checkpointing
        return value if isinstance(value, bool) else tuple(p for p in self.recompute_parts if p in value)

    def check(self, where: str) -> None:
        from .optim.schedule import SCHEDULES, token_count

        for key in ("tokens", "stop_after_tokens"):
            token_count(getattr(self, key), f"{where}.{key}")
        need(
            self.lr_schedule in SCHEDULES,
            f"{where}.lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}",
        )
        start = self.warmup_start_lr
        need(
            start is None or start == "min" or (number(start) and start >= 0),
            f'{where}.warmup_start_lr must be null, "min" or an LR >= 0, got {start!r}',
        )
        value, key, allowed = (
            self.activation_checkpointing,
            f"{where}.activation_checkpointing",
            ", ".join(f'"{p}"' for p in self.recompute_parts),
        )
        need(
            isinstance(value, (bool, list)),
            f"{key} must be true, false or a list of parts to recompute ({allowed}), got {value!r}",
        )
        if isinstance(value, list):
            need(bool(value), f"{key} is an empty list; name parts to recompute ({allowed}) or use false")
            for i, part in enumerate(value):
                need(part in self.recompute_parts, f"{key}: unknown part {part!r} (allowed: {allowed})")
                need(part not in value[:i], f"{key}: {part!r} is listed twice (allowed: {allowed})")
        need(
            positive_int(self.steps) or (self.steps is None and self.tokens is not None),
            f"{where}.steps must be a positive integer (or null, with {where}.tokens giving the run's length), got "
            f"{self.steps!r}",
        )
        need(
            number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            f"{where}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}",
        )
        for key in ("eval_interval", "sample_tokens", "warmup_steps", "measure_memory_steps"):
            value = getattr(self, key)
            need(non_negative_int(value), f"{where}.{key} must be an integer >= 0, got {value!r}")
        for key in ("eval_batches", "log_interval"):
            value = getattr(self, key)
            need(positive_int(value), f"{where}.{key} must be a positive integer, got {value!r}")
        value = self.profile_steps
        need(
            value is None
            or (isinstance(value, list) and len(value) == 2 and all(map(positive_int, value)) and value[0] <= value[1]),
            f"{where}.profile_steps must be null or [first, last] steps (1 <= first <= last), got {value!r}",
        )
        need(
            self.stop_after_steps is None or positive_int(self.stop_after_steps),
            f"{where}.stop_after_steps must be null or a positive integer, got {self.stop_after_steps!r}",
        )
        need(
            self.peak_tflops is None or (number(self.peak_tflops) and self.peak_tflops > 0),
            f"{where}.peak_tflops must be null or a positive number, got {self.peak_tflops!r}",
        )


@dataclass(frozen=True)
class WandbConfig(Section):
    """`optimus.wandb`: where the metrics go besides metrics.jsonl."""

    mode: str | None = None  # online | offline | disabled; null: online with WANDB_API_KEY, else offline
    project: str = "ds_optimus"  # the wandb project
    name: str | None = None  # the wandb run's name; null: wandb's own
    entity: str | None = None  # the wandb team or user; null: the account's default

    def check(self, where: str) -> None:
        need(
            self.mode in (None, "online", "offline", "disabled"),
            f"{where}.mode must be online, offline, disabled or null, got {self.mode!r}",
        )


# declared here, not beside the profiler: this module may not import the training code
@dataclass(frozen=True)
class ProfileConfig(Section):
    """`optimus.profile`: the phase profiler (`ds_optimus.train.phase_profile`), into metrics.jsonl."""

    enabled: bool = False  # time the phases of every `interval`-th step (off: not a mark nor a wrapper)
    interval: int = 1  # profile every this many steps (1: every step; a log step reports its interval's mean)
    # count torch.distributed's collectives on profiled steps (their functions wrapped for the step)
    collectives: bool = True

    def check(self, where: str) -> None:
        need(positive_int(self.interval), f"{where}.interval must be a positive integer, got {self.interval!r}")


@dataclass(frozen=True)
class OptimusConfig(Section):
    """The whole `optimus` section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    pipeline_parallel: PipelineParallelConfig = field(default_factory=PipelineParallelConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    sharded_optimizer: ShardedOptimizerConfig = field(default_factory=ShardedOptimizerConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @classmethod
    def from_ds_config(cls, config: dict[str, Any] | str | Path) -> OptimusConfig:
        """Parse the "optimus" section of a DeepSpeed config (a dict or a JSON file's path)."""
        return cls.parse(load_json_config(config).get("optimus", {}), "optimus")


def check_run_config(ds_config: dict[str, Any]):
    """The parsed `optimus` section, after the checks that need no process group."""
    from .integrations.deepspeed_config import check_config_keys

    opt = OptimusConfig.from_ds_config(ds_config)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(f"zero_optimization.stage {stage!r} is not supported by ds_optimus.train (use 0, 1 or 2)")
    check_optimizer_section(ds_config)
    check_config_keys(ds_config)
    check_schedule_keys(ds_config, opt)
    kept = [
        key
        for key, on in (
            ("optimus.train.export", opt.train.export),
            ("optimus.checkpoint.enabled", opt.checkpoint.enabled),
        )
        if on
    ]
    if opt.moe.force_uniform_routing and kept:  # the routing is not learned: no model of it is worth keeping
        raise ConfigError(
            "optimus.moe.force_uniform_routing is a benchmark mode (the routing is not learned) for "
            f"runs that keep no model: set {' and '.join(f'{key} false' for key in kept)}"
        )
    if opt.train.clip_after_warmup:  # something to clip, and a warm-up to wait for
        from .optim.warmup_clipping import delayed_clipping

        delayed_clipping(ds_config, opt.train.warmup_steps)
    return opt


def check_schedule_keys(ds_config: dict[str, Any], opt) -> None:
    """One-line errors for schedule keys that contradict each other or the DeepSpeed config."""
    given = ds_config.get("optimus", {}).get("train", {})
    if given.get("steps") is not None and given.get("tokens") is not None:
        raise ConfigError(
            "optimus.train.steps and optimus.train.tokens both give the run's length; set one: "
            "--set optimus.train.steps=null to size it in tokens (steps = tokens / tokens per step), "
            "or --set optimus.train.tokens=null to give steps"
        )
    if "scheduler" in ds_config:
        ours = [k for k in ("lr_schedule", "warmup_start_lr") if k in given and given[k] is not None]
        if ours:
            raise ConfigError(
                f"optimus.train.{ours[0]} shapes ds_optimus' own LR schedule, but the config has a "
                '"scheduler" section (DeepSpeed\'s schedule); remove one of them'
            )
    kind = str(ds_config.get("optimizer", {}).get("type", "")).lower()
    if opt.train.decay_after_update and kind not in ("adam", "adamw"):
        raise ConfigError(
            "optimus.train.decay_after_update applies to Adam and AdamW; the config's optimizer is "
            f"{ds_config.get('optimizer', {}).get('type')!r}"
        )


def resolve_schedule(opt, tokens_per_step: int):
    """`opt` with `train.steps` from `train.tokens` (when given) at `tokens_per_step` tokens per optimizer step."""
    from dataclasses import replace

    from .optim.schedule import steps_for_tokens, token_count

    tokens = token_count(opt.train.tokens, "optimus.train.tokens")
    if tokens is None:
        return opt
    return replace(opt, train=replace(opt.train, steps=steps_for_tokens(tokens, tokens_per_step)))


def resolve_batch_sizes(
    ds_config: dict[str, Any], world_size: int, stages: int = 1, tensor: int = 1
) -> tuple[int, int]:
    """(micro-batch per rank, accumulation steps) consistent with train_batch_size over `world_size`
    data-parallel ranks; a one-line ConfigError when they cannot be. `ds_config` is left as it is
    (`batch_keys` gives the three keys that agree)."""
    cut = " / ".join(
        part
        for part in (
            f"{stages} pipeline stages" if stages > 1 else "",
            f"tensor parallel size {tensor}" if tensor > 1 else "",
        )
        if part
    )
    ranks = (
        f"{world_size} ranks"
        if not cut
        else f"{world_size} data-parallel ranks ({world_size * stages * tensor} ranks / {cut})"
    )
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps")
    total = ds_config.get("train_batch_size")
    for key, value in (
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", accumulation),
        ("train_batch_size", total),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if micro is None and total is None:
        raise ConfigError("the config needs train_micro_batch_size_per_gpu or train_batch_size")
    if accumulation is None and micro is not None and total is not None:
        if total % (micro * world_size):
            raise ConfigError(
                f"train_batch_size {total} does not divide by train_micro_batch_size_per_gpu {micro} x {ranks}"
            )
        accumulation = total // (micro * world_size)
    accumulation = accumulation or 1
    if micro is None:
        if total % (accumulation * world_size):
            raise ConfigError(
                f"train_batch_size {total} does not divide by gradient_accumulation_steps {accumulation} x {ranks}"
            )
        micro = total // (accumulation * world_size)
    if total is not None and total != micro * accumulation * world_size:
        raise ConfigError(
            f"train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accumulation} x {ranks} (change one of them with "
            "--set; train_batch_size=null lets the other two decide)"
        )
    return micro, accumulation


def batch_keys(micro: int, accumulation: int, world_size: int) -> dict[str, int]:
    """DeepSpeed's three batch keys, agreeing, over `world_size` data-parallel ranks."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
    }


def check_optimizer_section(ds_config: dict[str, Any]) -> None:
    """Check the "optimizer" section's lr > 0, betas in [0, 1), eps > 0 and weight decay >= 0 up front
    (else they train silently wrong or fail deep in the engine)."""
    section = ds_config.get("optimizer")
    need(isinstance(section, dict), 'the config needs an optimizer section (e.g. {"type": "AdamW", "params": {...}})')
    params = section.get("params", {})
    need(isinstance(params, dict), "optimizer.params must be a JSON object")
    lr = params.get("lr")
    if lr is not None:
        need(number(lr) and lr > 0, f"optimizer.params.lr must be a positive number, got {lr!r}")
    betas = params.get("betas")
    if betas is not None:
        need(
            isinstance(betas, list) and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas),
            f"optimizer.params.betas must be two numbers in [0, 1), got {betas!r}",
        )
    eps = params.get("eps")
    if eps is not None:
        need(number(eps) and eps > 0, f"optimizer.params.eps must be a positive number, got {eps!r}")
    decay = params.get("weight_decay")
    if decay is not None:
        need(number(decay) and decay >= 0, f"optimizer.params.weight_decay must be a number >= 0, got {decay!r}")
