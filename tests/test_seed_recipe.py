"""The seed system's training recipe as options: gradient clipping only after the LR warm-up
(`optimus.train.clip_after_warmup`) and weight decay on every parameter (`optimus.train.decay_all_params`)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from train_workers import tiny_config

from ds_optimus.config import OptimusConfig
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.optim.warmup_clipping import clip_for_step, delayed_clipping
from ds_optimus.parallel import moe_param_groups
from ds_optimus.schema import ConfigError
from ds_optimus.train import Callback, Trainer


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


class UpdateSizes(Callback):
    """Per step: the norm of the change of every parameter, and the clip value the step ran with (the
    engine's and its optimizer's)."""

    def __init__(self) -> None:
        self.sizes, self.clips = {}, {}

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten().double() for p in self.trainer.engine.module.parameters()])

    def pre_step(self, step: int) -> None:
        self.before = self._flat()

    def post_step(self, step: int) -> None:
        engine = self.trainer.engine
        self.sizes[step] = (self._flat() - self.before).norm().item()
        self.clips[step] = (engine.gradient_clipping(), getattr(engine.optimizer, "clip_grad", None))


def update_sizes_worker(rank: int, world: int, config: dict) -> tuple[dict, dict, str]:
    sizes = UpdateSizes()
    trainer = Trainer(config, callbacks=[sizes])
    trainer.train()
    return sizes.sizes, sizes.clips, type(trainer.engine.optimizer).__name__


PATHS = {  # zero stage, sharded optimizer, the optimizer DeepSpeed's engine then runs
    "deepspeed-basic": (0, False, "AdamW"),  # the engine clips the fp32 gradients itself
    "deepspeed-zero1": (1, False, "DeepSpeedZeroOptimizer"),
    "sharded-zero1": (1, True, "ShardedOptimizer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_clipping_waits_for_the_end_of_the_warm_up(tmp_path, cache, path):
    """One process, 5 steps, warm-up 2, clipping at 1e-4 (far below the gradient norm): with the option
    the first 2 updates are those of a run without clipping (bitwise), the 3rd and later are clipped.
    Adam with beta1 0 and eps 1 makes the update proportional to the (clipped) gradient."""
    stage, sharded, optimizer = PATHS[path]

    def config(name: str, clip: float, after_warmup: bool) -> dict:
        c = tiny_config(
            tmp_path / name,
            cache,
            sharded_optimizer={"enabled": sharded},
            train={"steps": 5, "warmup_steps": 2, "eval_interval": 0, "clip_after_warmup": after_warmup},
            checkpoint={"interval": 0},
        )
        c["zero_optimization"] = {"stage": stage}
        c["gradient_clipping"] = clip
        c["optimizer"]["params"].update(lr=0.05, betas=[0.0, 0.999], eps=1.0, weight_decay=0.0)
        return c

    plain, plain_clips, _ = run_distributed(update_sizes_worker, 1, config("plain", 0.0, False))[0]
    delayed, clips, used = run_distributed(update_sizes_worker, 1, config("delayed", 1e-4, True))[0]
    assert used == optimizer
    assert [delayed[s] for s in (1, 2)] == [plain[s] for s in (1, 2)]  # the same updates, bitwise
    assert plain[3] > 0 and all(delayed[s] < 0.01 * plain[3] for s in (3, 4, 5))  # clipped from step 3
    assert clips[1] == clips[2] == (0.0, None if stage == 0 else 0.0)
    assert clips[3] == clips[5] == (1e-4, None if stage == 0 else 1e-4)
    assert plain_clips[4] == (0.0, None if stage == 0 else 0.0)


def test_clip_after_warmup_reads_the_warm_up_and_the_clip_value():
    assert delayed_clipping({"gradient_clipping": 1.0}, 2500) == (1.0, 2500)
    assert delayed_clipping(
        {"gradient_clipping": 0.5, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 40}}}, 2500
    ) == (0.5, 40)
    assert delayed_clipping({"gradient_clipping": 1, "scheduler": {"type": "WarmupLR"}}, 0) == (1.0, 1000)
    assert [clip_for_step(s, 1.0, 2) for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]  # the seed: step_id >= warmup
    with pytest.raises(ConfigError, match=r"needs a warm-up, but optimus.train.warmup_steps is 0 \(clipping would "):
        delayed_clipping({"gradient_clipping": 1.0}, 0)


@pytest.mark.parametrize(
    "ds_config, message",
    [
        ({}, "optimus.train.clip_after_warmup needs gradient_clipping > 0, got none"),
        ({"gradient_clipping": None}, "optimus.train.clip_after_warmup needs gradient_clipping > 0, got none"),
        (
            {"gradient_clipping": 1.0, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            "optimus.train.clip_after_warmup needs a warm-up, but the scheduler's warmup_num_steps is 0",
        ),
        ({"gradient_clipping": 0}, "optimus.train.clip_after_warmup needs gradient_clipping > 0, got 0"),
        (
            {"gradient_clipping": 1.0, "scheduler": {"type": "OneCycle"}},
            "optimus.train.clip_after_warmup needs a warm-up, but scheduler 'OneCycle' has none",
        ),
    ],
)
def test_clip_after_warmup_refuses_a_config_with_nothing_to_wait_for(ds_config, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        delayed_clipping(ds_config, 10)
    # up front, where the run and `--check` read the config (before any process group or model)
    from ds_optimus.config import check_run_config

    config = tiny_config(tmp_path, tmp_path, train={"clip_after_warmup": True})
    config.pop("gradient_clipping", None)
    with pytest.raises(ConfigError, match=message):
        check_run_config({**config, **ds_config})


@pytest.mark.parametrize("key", ["clip_after_warmup", "decay_all_params"])
def test_the_options_are_flags(key):
    assert getattr(OptimusConfig.from_ds_config({}).train, key) is False  # ours is the default
    assert getattr(OptimusConfig.from_ds_config({"optimus": {"train": {key: True}}}).train, key) is True
    with pytest.raises(ConfigError, match=rf"^optimus\.train\.{key} must be true or false, got 'yes'$"):
        OptimusConfig.from_ds_config({"optimus": {"train": {key: "yes"}}})


def test_decay_all_params_puts_norms_and_biases_in_a_decayed_group():
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", attention_bias=True))
    one_d = {id(p) for p in model.parameters() if p.ndim < 2}
    names = [n for n, p in model.named_parameters() if p.ndim < 2]
    assert any(".bias" in n for n in names) and any("norm" in n for n in names)

    def decay_of(groups):
        return {id(p): g["weight_decay"] for g in groups for p in g["params"]}

    ours = decay_of(moe_param_groups(model, weight_decay=0.1))
    assert {ours[i] for i in one_d} == {0.0}  # the default: norms and biases not decayed
    everything = moe_param_groups(model, weight_decay=0.1, decay_all=True, lr=0.01)
    assert [g["name"] for g in everything] == ["dense"]  # the tiny model is not expert-parallel here
    assert set(decay_of(everything).values()) == {0.1} and len(decay_of(everything)) == len(list(model.parameters()))
    assert everything[0]["lr"] == 0.01


# -- the seed's LR schedule, token-based length, and weight decay after the update -----------------


def seed_learning_rate(k: int, steps: int, warmup: int, lr: float, min_lr: float) -> float:
    """The seed's LR for optimizer step k (0-based), restated from its dist_train.get_learning_rate: a
    linear warm-up from the minimum LR, then a cosine over the remaining steps of its schedule."""
    import math

    if k < warmup:
        return min_lr + (lr - min_lr) * k / max(1, warmup)
    ratio = (k - warmup) / (steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@pytest.mark.parametrize("steps, warmup", [(100, 10), (2000, 250), (7, 0), (5, 4)])
def test_the_optimus_schedule_is_the_seeds_formula(steps, warmup):
    from ds_optimus.optim.schedule import lr_factor, warmup_start

    lr, ratio = 4e-4, 0.1
    factor = lr_factor("optimus", steps, warmup, ratio, warmup_start("optimus", None, ratio, lr))
    for k in range(steps):  # float64 both ways, the same operations up to their order: a few ulps
        assert factor(k) * lr == pytest.approx(seed_learning_rate(k, steps, warmup, lr, ratio * lr), rel=1e-12)
    assert factor(0) * lr == pytest.approx(ratio * lr if warmup else lr, rel=1e-12)  # a warm-up starts at the minimum


def test_warmup_start_lr_sets_the_first_step_of_the_cosine_schedule():
    from ds_optimus.optim.schedule import lr_factor, warmup_start

    lr = 1e-3
    default = lr_factor("cosine", 20, 4, 0.1, warmup_start("cosine", None, 0.1, lr))
    assert [default(k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]  # ours: lr / W at the first step
    assert default(19) == pytest.approx(0.1)  # the minimum at the last step
    from_min = lr_factor("cosine", 20, 4, 0.1, warmup_start("cosine", "min", 0.1, lr))
    assert [from_min(k) for k in range(5)] == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0])
    given = lr_factor("cosine", 20, 4, 0.1, warmup_start("cosine", 2e-4, 0.1, lr))
    assert given(0) == pytest.approx(0.2) and given(4) == 1.0


@pytest.mark.parametrize(
    "value, tokens",
    [
        ("4T", 4 * 10**12),
        ("100B", 10**11),
        ("2.5e9", 2_500_000_000),
        (123456, 123456),
        (" 7m ", 7_000_000),
        ("1.5K", 1500),
        ("4.1T", 4_100_000_000_000),
        ("8.2B", 8_200_000_000),
        (1e9, 10**9),
    ],
)
def test_token_counts_read_as_written(value, tokens):
    from ds_optimus.optim.schedule import token_count

    assert token_count(value, "k") == tokens


@pytest.mark.parametrize(
    "train, message",
    [
        (
            {"tokens": "lots"},
            r"^optimus\.train\.tokens must be a token count such as 100000000000, \"100B\" or \"4T\", "
            r"got 'lots'$",
        ),
        ({"tokens": 0}, r"^optimus\.train\.tokens must be a whole, positive number of tokens, got 0$"),
        ({"stop_after_tokens": "0.5"}, r"^optimus\.train\.stop_after_tokens must be a whole, positive number"),
        ({"lr_schedule": "linear"}, r"^optimus\.train\.lr_schedule must be one of cosine, optimus, got 'linear'$"),
        ({"warmup_start_lr": "max"}, r"^optimus\.train\.warmup_start_lr must be null, \"min\" or an LR >= 0"),
        ({"decay_after_update": 1}, r"^optimus\.train\.decay_after_update must be true or false, got 1$"),
    ],
)
def test_schedule_keys_refuse_bad_values_in_one_line(train, message):
    with pytest.raises(ConfigError, match=message):
        OptimusConfig.from_ds_config({"optimus": {"train": train}})


def test_schedule_keys_that_contradict_each_other_are_refused(tmp_path):
    from ds_optimus.config import check_run_config

    config = tiny_config(tmp_path, tmp_path, train={"tokens": "1M"})  # tiny_config gives steps too
    with pytest.raises(ConfigError) as err:
        check_run_config(config)
    assert str(err.value) == (
        "optimus.train.steps and optimus.train.tokens both give the run's length; set one: "
        "--set optimus.train.steps=null to size it in tokens (steps = tokens / tokens per step), "
        "or --set optimus.train.tokens=null to give steps"
    )
    # the first way out, taken from the command line: steps null, the length in tokens
    from ds_optimus.config import resolve_schedule
    from ds_optimus.schema import apply_overrides

    switched = apply_overrides(config, ["optimus.train.steps=null"])
    assert resolve_schedule(check_run_config(switched), 1024).train.steps == 977  # ceil(1M / 1,024)
    neither = apply_overrides(switched, ["optimus.train.tokens=null"])
    with pytest.raises(
        ConfigError,
        match=r"^optimus\.train\.steps must be a positive integer \(or null, with "
        r"optimus\.train\.tokens giving the run's length\), got None$",
    ):
        check_run_config(neither)
    config = tiny_config(tmp_path, tmp_path, train={"lr_schedule": "optimus"})
    config["scheduler"] = {"type": "WarmupLR"}
    with pytest.raises(ConfigError, match=r"^optimus\.train\.lr_schedule shapes ds_optimus' own LR schedule, but"):
        check_run_config(config)
    config = tiny_config(tmp_path, tmp_path, train={"decay_after_update": True})
    config["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match=r"^optimus\.train\.decay_after_update applies to Adam and AdamW; the conf"):
        check_run_config(config)


class Schedule(Callback):
    """Per step: the LR the step ran with, and the fp32 weights after the first update."""

    def __init__(self) -> None:
        self.lrs, self.after_first = {}, None

    def post_step(self, step: int) -> None:
        self.lrs[step] = self.trainer.lr
        if step == 1:
            self.after_first = {n: p.detach().clone() for n, p in self.trainer.engine.module.named_parameters()}


def schedule_worker(rank: int, world: int, config: dict) -> dict:
    seen = Schedule()
    trainer = Trainer(config, callbacks=[seen])
    summary = trainer.train()
    return {
        "lrs": seen.lrs,
        "after_first": seen.after_first,
        "steps": trainer.opt.train.steps,
        "tokens_per_step": trainer.tokens_per_step,
        "finished": summary["finished"],
        "end": getattr(trainer, "step", summary["start_step"]),
        "nothing_to_do": summary.get("nothing_to_do"),
    }


def _run_config(tmp_path, cache, name, train, sharded=True, stage=1):
    c = tiny_config(
        tmp_path / name,
        cache,
        sharded_optimizer={"enabled": sharded},
        train={"eval_interval": 0, "export": False, **train},
        checkpoint={"interval": 0},
    )
    c["zero_optimization"] = {"stage": stage}
    return c


@pytest.mark.slow
def test_a_run_follows_the_seeds_schedule_over_its_tokens(tmp_path, cache):
    """`train.tokens` sizes the schedule (steps = tokens / tokens per step, rounded up), the "optimus"
    schedule gives each step the seed's LR, and `stop_after_tokens` ends the run at its step: finished."""
    c = _run_config(tmp_path, cache, "tokens", {"lr_schedule": "optimus", "warmup_steps": 3, "min_lr_ratio": 0.1})
    del c["optimus"]["train"]["steps"]
    per_step = 4 * 32  # tiny_config: micro-batch 4 of 32 tokens, one rank, no accumulation
    c["optimus"]["train"].update(tokens=9 * per_step - 5, stop_after_tokens=6 * per_step)
    out = run_distributed(schedule_worker, 1, c)[0]
    assert out["tokens_per_step"] == per_step and out["steps"] == 9  # 9 x 128 - 5 tokens: 9 steps
    assert out["end"] == 6 and out["finished"] is True and sorted(out["lrs"]) == [1, 2, 3, 4, 5, 6]
    lr = c["optimizer"]["params"]["lr"]
    for step, got in out["lrs"].items():
        assert got == pytest.approx(seed_learning_rate(step - 1, 9, 3, lr, 0.1 * lr), rel=1e-12)
    again = run_distributed(schedule_worker, 1, c)[0]  # launched again: the run is over
    assert again["end"] == 6 and again["lrs"] == {} and again["nothing_to_do"] is True


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_decay_after_update_shrinks_the_updated_weights(tmp_path, cache, path):
    """The seed's order: p1 = (p0 - lr u) (1 - lr wd), i.e. the weights of the same first step without
    weight decay, times (1 - lr wd); torch's AdamW gives p0 (1 - lr wd) - lr u instead, lr^2 wd u away.
    One process, fp32: the same gradients at step 1 in all three runs."""
    stage, sharded, optimizer = PATHS[path]
    lr, wd = 0.05, 0.5  # lr^2 wd = 1.25e-3 times |u| ~ 1 at the first Adam step: far above fp32 rounding

    def run(name, weight_decay, after):
        c = _run_config(
            tmp_path,
            cache,
            name,
            {"steps": 1, "warmup_steps": 0, "decay_after_update": after},
            sharded=sharded,
            stage=stage,
        )
        c["optimizer"]["params"].update(lr=lr, weight_decay=weight_decay)
        return run_distributed(schedule_worker, 1, c)[0]["after_first"]

    plain, before, after = run("plain", 0.0, False), run("before", wd, False), run("after", wd, True)
    decayed = set(n for n, p in plain.items() if p.ndim >= 2)  # 1-D weights are in the group without decay
    moved_apart = 0.0
    for name, p in plain.items():
        shrink = 1.0 - lr * wd if name in decayed else 1.0
        # one fp32 multiply after the same Adam step (fused kernels with and without their own decay term):
        # a few ulps of the weight
        torch.testing.assert_close(after[name], p * shrink, rtol=4e-6, atol=1e-7)
        moved_apart = max(moved_apart, (before[name] - after[name]).abs().max().item())
    assert moved_apart > 1e-4  # torch's order is measurably another update


def test_stop_after_tokens_counts_the_tokens_trained_before_a_resume():
    """A resume with another global batch: the end is where the tokens reach the count, from those the
    data gave so far (100 steps of 1,000 tokens, then 500 a step), not steps x today's batch."""
    from ds_optimus.train.resume import last_step

    opt = OptimusConfig.from_ds_config({"optimus": {"train": {"steps": 10_000, "stop_after_tokens": "150K"}}})
    assert last_step(opt, 1000) == 150  # from the start: 150 steps of 1,000
    assert last_step(opt, 500, start_step=100, trained=100_000) == 200  # 50,000 more at 500 a step
    assert last_step(opt, 500, start_step=400, trained=200_000) == 400  # past it already: no step more
    assert last_step(OptimusConfig.from_ds_config({}), 500, 3, 1500) == 100  # without it: train.steps
