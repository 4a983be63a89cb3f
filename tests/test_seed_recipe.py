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
        c = tiny_config(tmp_path / name, cache, sharded_optimizer={"enabled": sharded},
                        train={"steps": 5, "warmup_steps": 2, "eval_interval": 0, "clip_after_warmup": after_warmup},
                        checkpoint={"interval": 0})
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
    assert delayed_clipping({"gradient_clipping": 0.5, "scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 40}}}, 2500) == (0.5, 40)
    assert delayed_clipping({"gradient_clipping": 1, "scheduler": {"type": "WarmupLR"}}, 0) == (1.0, 1000)
    assert [clip_for_step(s, 1.0, 2) for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]  # the seed: step_id >= warmup
    with pytest.raises(ConfigError, match=r"needs a warm-up, but optimus.train.warmup_steps is 0 \(clipping would "):
        delayed_clipping({"gradient_clipping": 1.0}, 0)


@pytest.mark.parametrize("ds_config, message", [
    ({}, "optimus.train.clip_after_warmup needs gradient_clipping > 0, got none"),
    ({"gradient_clipping": None}, "optimus.train.clip_after_warmup needs gradient_clipping > 0, got none"),
    ({"gradient_clipping": 1.0, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
     "optimus.train.clip_after_warmup needs a warm-up, but the scheduler's warmup_num_steps is 0"),
    ({"gradient_clipping": 0}, "optimus.train.clip_after_warmup needs gradient_clipping > 0, got 0"),
    ({"gradient_clipping": 1.0, "scheduler": {"type": "OneCycle"}},
     "optimus.train.clip_after_warmup needs a warm-up, but scheduler 'OneCycle' has none"),
])
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
