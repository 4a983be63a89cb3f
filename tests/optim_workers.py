"""Functions run on every rank by the sharded-optimizer tests, and the single-process reference."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import ds_optimus  # noqa: F401  (hooks DeepSpeed's engine)
from ds_optimus.config import OptimusConfig
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.parallel import moe_param_groups, setup_moe

SEQ = 16
LR, WEIGHT_DECAY, BETAS, EPS = 3e-3, 0.1, (0.9, 0.95), 1e-8


def tiny_model(seed: int = 0, **overrides) -> MulaForCausalLM:
    torch.manual_seed(seed)
    config = MulaConfig.from_preset(
        "mula-tiny-moe",
        **{
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "moe_intermediate_size": 64,
            "intermediate_size": 128,
            "vocab_size": 512,
            **overrides,
        },
    )
    return MulaForCausalLM(config)


def chunks(step: int, count: int, micro: int, vocab: int) -> list[torch.Tensor]:
    """The step's global batch as `count` micro-batches of `micro` sequences (the same for any layout)."""
    g = torch.Generator().manual_seed(1000 + step % 3)  # three batches, seen again and again: the loss falls
    ids = torch.randint(2, vocab, (count * micro, SEQ), generator=g)
    return list(ids.split(micro))


def ds_config(spec: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": spec["micro"],
        "gradient_accumulation_steps": spec["gas"],
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY, "torch_adam": True},
        },
        "zero_optimization": {"stage": spec["stage"], **spec.get("zero", {})},
        "gradient_clipping": spec.get("clip", 0.0),
        "steps_per_print": 10**9,
        "optimus": {
            "expert_parallel": {"size": spec["ep"], **spec.get("exchange", {})},
            "moe": {"experts_backend": "looped"},
            "sharded_optimizer": {
                "enabled": spec["sharded"],
                "bucket_size": spec.get("bucket", 20000),
                **spec.get("sharded_options", {}),
            },
        },
    }
    if spec.get("scheduler"):  # the learning rate changes every step: it must come back with a checkpoint
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3, "total_num_steps": 12},
        }
    if spec.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    if spec.get("grad_accum_dtype"):  # with bf16 and ZeRO-1, DeepSpeed would build its BF16 optimizer
        config["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    if spec.get("dtype") == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return {**config, **spec.get("deepspeed", {})}  # DeepSpeed's own top-level keys


def train(rank: int, world: int, spec: dict) -> dict:
    """Train `spec["steps"]` steps through `deepspeed.initialize`; returns the global mean loss per
    step and what the optimizer reports."""
    import deepspeed

    from ds_optimus.optim import sharded

    sharded.SQUARES_ROW = spec.get("squares_row", 4096)  # the gradient norm's partial sums (pool workers are reused)
    model = tiny_model(**spec.get("model", {}))
    config = ds_config(spec)
    setup_moe(model, OptimusConfig.from_ds_config(config))
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=moe_param_groups(model, weight_decay=WEIGHT_DECAY)
    )
    start, opened = 0, []
    if spec.get("load"):  # which of the checkpoint's files this rank opens, in order
        from ds_optimus.checkpoint import model_files
        from ds_optimus.checkpoint import optimizer_state as checkpointing

        real = checkpointing.load  # the same function in both modules: the optimizer's files and the model's
        checkpointing.load = model_files.load = lambda file, *a, **k: (
            opened.append(Path(file).name),
            real(file, *a, **k),
        )[1]
        try:
            path, client = engine.load_checkpoint(spec["load"])
        finally:
            checkpointing.load = model_files.load = real
        start = client["step"]
    losses, norms, lrs = {}, {}, {}
    vocab = model.config.vocab_size
    for step in range(start + 1, spec["steps"] + 1):
        batches = chunks(step, world * spec["gas"], spec["micro"], vocab)
        total = torch.zeros(())
        lrs[step] = engine.get_lr()[0]
        for a in range(spec["gas"]):
            ids = batches[a * world + rank]
            loss = engine(input_ids=ids, labels=ids).loss
            if spec.get("nan_at") == step and rank == spec.get("nan_rank", 0) and a == 0:
                loss = loss * float("nan")
            if spec.get("torch_backward"):  # PyTorch-style: the engine's hooks do what backward() does
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses[step] = total.item() / (world * spec["gas"])
        norms[step] = engine.get_global_grad_norm()
        if spec.get("save_at") == step:
            engine.save_checkpoint(spec["save_dir"], client_state={"step": step})
    result = {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "optimizer": type(engine.optimizer).__name__,
        "skipped_steps": engine.skipped_steps,
        "opened": opened,
    }
    if hasattr(engine.optimizer, "state_bytes"):
        result["state_bytes"] = engine.optimizer.state_bytes()
        result["comm_bytes"] = dict(engine.optimizer.comm_bytes)
        result["bucket_dtypes"] = sorted({str(engine.optimizer.bucket_dtype(s)) for s in engine.optimizer.spaces})
        result["gather"] = {
            "launch_s": engine.optimizer.gather.launch_s,
            "wait_s": engine.optimizer.gather.wait_s,
            "pending": len(engine.optimizer.gather.pending),
        }
    # through state_dict(): it waits for an overlapped parameter gather still on its way
    state = engine.module.state_dict()
    result["params"] = {n: state[n].detach().float().clone() for n, _ in engine.module.named_parameters()}
    return result


def hybrid_runs(rank: int, world: int, cases: dict[str, dict]) -> dict[str, dict]:
    """Several `train` runs in one launch (hybrid sharding, the overlapped gather: each case its own
    engine), each case's result without its parameters but with a digest of them."""
    from ds_optimus.optim.sharded import ShardedOptimizerError
    from ds_optimus.parallel.groups import LayoutError

    out = {}
    for name, spec in cases.items():
        if spec.get("expect_error"):
            try:
                train(rank, world, spec)
                out[name] = {"error": "accepted"}
            except (ShardedOptimizerError, LayoutError) as err:  # LayoutError: ds_optimus.train's one line
                out[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        result = train(rank, world, spec)
        params = result.pop("params")
        result["digest"] = {n: float(p.double().sum()) for n, p in params.items()}
        result["first_param"] = next(iter(params.values()))
        out[name] = result
    return out


def reference(spec: dict, world: int) -> dict:
    """The same run in one process, without DeepSpeed: the mean of every micro-batch's loss over
    the global batch, torch AdamW, clipping by the true global norm."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = tiny_model(**spec.get("model", {}))
    setup_moe(model, OptimusConfig.from_ds_config({"optimus": {"moe": {"experts_backend": "looped"}}}))
    optimizer = torch.optim.AdamW(moe_param_groups(model, weight_decay=WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
    losses, norms = {}, {}
    count = world * spec["gas"]
    for step in range(1, spec["steps"] + 1):
        optimizer.zero_grad()
        total = 0.0
        for ids in chunks(step, count, spec["micro"], model.config.vocab_size):
            loss = model(input_ids=ids, labels=ids).loss / count
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.get("clip") or float("inf"))
        optimizer.step()
        losses[step], norms[step] = total, norm.item()
    return {"losses": losses, "norms": norms}


def bad_settings(rank: int, world: int) -> list[str]:
    """The one-line messages of settings the sharded optimizer refuses."""
    import deepspeed

    from ds_optimus.config import ConfigError
    from ds_optimus.optim.sharded import ShardedOptimizerError

    messages = []
    base = dict(ep=2, stage=2, sharded=True, micro=1, gas=1)
    for change in (
        {"stage": 0},
        {"stage": 3},
        {"sgd": True},
        {"sharded_options": {"bucket_size": 0}},
        {"sharded": False, "sharded_options": {"shard_group_size": 2}},
        {"sharded": False, "sharded_options": {"overlap_param_gather": True}},
    ):
        spec = {**base, **change}
        model = tiny_model()
        config = ds_config(spec)
        if spec.get("sgd"):
            config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
            config["zero_allow_untested_optimizer"] = True
        setup_moe(model, OptimusConfig.from_ds_config({"optimus": {"expert_parallel": {"size": 2}}}))
        try:
            deepspeed.initialize(model=model, config=config, model_parameters=moe_param_groups(model))
            messages.append("accepted")
        except (ConfigError, ShardedOptimizerError) as err:
            messages.append(str(err))
    return messages


def fp16_direct(rank: int, world: int) -> dict:
    """fp16 with dynamic loss scaling, the optimizer driven directly (DeepSpeed's CPU accelerator
    refuses fp16): an infinite loss on one rank at step 3 is skipped everywhere, the scale halves."""
    from ds_optimus.optim.sharded import LossScaler, ShardedOptimizer

    model = tiny_model()
    options = {"optimus": {"expert_parallel": {"size": 2}, "moe": {"experts_backend": "looped"}}}
    groups = setup_moe(model, OptimusConfig.from_ds_config(options))
    model.half()
    inner = torch.optim.AdamW(moe_param_groups(model, weight_decay=WEIGHT_DECAY), lr=LR, betas=BETAS, eps=1e-4)
    optimizer = ShardedOptimizer(
        inner,
        param_names={p: n for n, p in model.named_parameters()},
        stage=2,
        expert_groups=[groups],
        clip_grad=1.0,
        bucket_size=20000,
        loss_scaler=LossScaler(2.0**10, dynamic=True, window=2, hysteresis=1),
    )
    losses, scales = {}, {}
    for step in range(1, 9):
        ids = chunks(step, world, 1, model.config.vocab_size)[rank]
        loss = model(input_ids=ids, labels=ids).loss.float()
        if step == 3 and rank == 1:
            loss = loss * float("inf")
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step], scales[step] = total.item() / world, optimizer.cur_scale
    return {
        "losses": losses,
        "scales": scales,
        "skipped": optimizer.skipped_steps,
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
    }


def direct_optimizer(stage: int, model: torch.nn.Module, **options):
    from ds_optimus.optim.sharded import ShardedOptimizer

    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    return ShardedOptimizer(
        inner,
        param_names={p: n for n, p in model.named_parameters()},
        stage=stage,
        bucket_size=options.pop("bucket_size", 1000),
        **options,
    )


def two_backwards(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    """Two backward passes before one step (two losses on a boundary) against one backward of their
    sum: the same update."""
    out = []
    for split in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        optimizer = direct_optimizer(stage, model)
        g = torch.Generator().manual_seed(rank)
        x1, x2 = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        if split:
            optimizer.backward(model(x1).square().mean())
            optimizer.backward(model(x2).square().mean())
        else:
            optimizer.backward(model(x1).square().mean() + model(x2).square().mean())
        optimizer.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def reentrant_twice(rank: int, world: int) -> str:
    """A parameter used in two reentrant-checkpointed regions gets two gradients in one backward."""
    from torch.utils.checkpoint import checkpoint

    from ds_optimus.optim.sharded import ShardedOptimizer, ShardedOptimizerError

    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8)
    optimizer = direct_optimizer(2, shared)
    assert isinstance(optimizer, ShardedOptimizer)
    x = torch.randn(4, 8, requires_grad=True)
    y = checkpoint(shared, x, use_reentrant=True)
    y = checkpoint(shared, y, use_reentrant=True)
    try:
        optimizer.backward(y.sum())
    except ShardedOptimizerError as err:
        return str(err)
    return "accepted"


def stale_use(rank: int, world: int) -> str:
    """With the gather overlapped, a weight read outside the forward of the module that owns it would
    be the last step's: its gradient is refused in one line, naming it."""
    from ds_optimus.optim.sharded import ShardedOptimizerError

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.a.weight) + self.b(x)  # a.weight without a's forward

    torch.manual_seed(0)
    model = Odd()
    optimizer = direct_optimizer(2, model, bucket_size=10, module=model, overlap_param_gather=True)
    x = torch.randn(3, 4)
    try:
        for _ in range(2):
            optimizer.backward(model(x).square().mean())
            optimizer.step()
    except ShardedOptimizerError as err:
        return str(err)
    return "accepted"
