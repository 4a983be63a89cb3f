"""The EP-aware sharded optimizer against DeepSpeed's ZeRO-1 and ZeRO-2 with MoE param groups.

4 CPU processes (gloo), an expert-heavy tiny Mula at expert parallelism 2 (so dense state is
sharded over 4 ranks and expert state over expert-data-parallel groups of 2), float32, one
micro-batch per step. Every process builds all contestants from the same initial weights and runs
them in turn (interleaved rounds, after warm-up); per contestant, on rank 0:

  backward   autograd alone: the same model, forward + backward in plain PyTorch (no DeepSpeed)
  reduction  engine.backward minus that: gradient copies and the communication not hidden
  update     engine.step: clipping, Adam, parameter all-gather
  messages   collectives per step (the MoE all-to-alls, the same for all, left out), the bytes of
             their inputs ("MB in") and what each rank sends with the bandwidth-optimal algorithm
             ("MB sent": an all-reduce sends 2(N-1)/N of its input, a reduce-scatter (N-1)/N)
  bf16_wire  ours with `reduce_dtype: "bf16"`: the gradient reduction carries bf16, accumulation
             stays fp32 (the model is fp32, so the parameter all-gather is fp32 in both)
  state      per-rank optimizer-state bytes, exact: fp32 master weights + Adam moments; and the
             gradient buffers: the reduced shard, full gradients kept between micro-steps (ZeRO-1),
             and the buckets gradients are copied into for communication
  inside / across
             the "MB sent" of collectives whose ranks lie in one simulated node of 2 consecutive
             ranks, and of the others (hybrid sharding moves the dense state's traffic inside)
  param wait the time from the end of the update to when the next forward pass has its parameters:
             the synchronous all-gather in the step (DeepSpeed's, and ours without overlap), or
             the launch in the step plus what the next forward waits for (ours overlapped)

DeepSpeed's AutoEP is tried on the same model and reported as refused when it does not accept it.

    python benchmarks/optimizer.py [--rounds 7] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

WORLD, EP, NODE = 4, 2, 2
SHAPE = dict(
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=512,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
)
MICRO, SEQ = 2, 64
# name: (sharded optimizer, ZeRO stage, options of the sharded optimizer)
CONTESTANTS = {
    "ours_zero2": (True, 2, {}),
    "ours_zero2_overlap": (True, 2, {"overlap_comm": True}),
    "ours_zero2_bf16_wire": (True, 2, {"reduce_dtype": "bf16"}),
    "ours_zero1": (True, 1, {}),
    "ours_zero1_bf16_wire": (True, 1, {"reduce_dtype": "bf16"}),
    "ours_zero1_gather_overlap": (True, 1, {"overlap_param_gather": True}),
    "ours_zero1_group2": (True, 1, {"shard_group_size": 2}),
    "ours_zero1_group2_gather_overlap": (True, 1, {"shard_group_size": 2, "overlap_param_gather": True}),
    "deepspeed_zero2": (False, 2, {}),
    "deepspeed_zero1": (False, 1, {}),
}
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_single",
    "broadcast",
    "all_to_all_single",
    "all_to_all",
)


def ds_config(sharded: bool, stage: int, options: dict | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
        "optimus": {
            "expert_parallel": {"size": EP},
            "moe": {"experts_backend": "looped"},
            "sharded_optimizer": {"enabled": sharded, "bucket_size": 5_000_000, **(options or {})},
        },
    }


def build_model():
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM

    torch.manual_seed(0)
    return MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", **SHAPE))


class Counter:
    """Counts collectives at the outermost call, whether through deepspeed.comm (DeepSpeed's ZeRO)
    or torch.distributed (ours); bytes are those of the input tensor (list)."""

    def __init__(self) -> None:
        import deepspeed.comm
        import deepspeed.comm.comm

        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.wire: dict[str, float] = {}
        self.where: dict[str, float] = {"inside": 0.0, "across": 0.0}  # wire bytes by the group's span
        self.active = False
        self.depth = 0
        self.skip: set[int] = set()  # ids of the expert-parallel exchange's groups: not the optimizer's
        for namespace in (dist, deepspeed.comm, deepspeed.comm.comm):
            for name in COLLECTIVES:
                if hasattr(namespace, name):
                    setattr(namespace, name, self._wrap(name, getattr(namespace, name)))

    def _wrap(self, name, original):
        def wrapped(*args, **kwargs):
            values = list(args) + list(kwargs.values())
            if self.active and self.depth == 0 and not any(id(a) in self.skip for a in values):
                tensors = [a for a in values if isinstance(a, torch.Tensor)]
                lists = [a for a in values if isinstance(a, list)]
                if (
                    name.endswith(("_into_tensor", "_tensor", "_single"))
                    and name != "all_to_all_single"
                    and len(tensors) >= 2
                ):
                    size = tensors[1].numel() * tensors[1].element_size()  # (output, input)
                elif tensors:
                    size = tensors[0].numel() * tensors[0].element_size()
                else:
                    size = sum(
                        t.numel() * t.element_size() for lst in lists[-1:] for t in lst if isinstance(t, torch.Tensor)
                    )
                groups = [a for a in values if isinstance(a, dist.ProcessGroup)]  # by keyword or position
                ranks = dist.get_process_group_ranks(groups[0]) if groups else list(range(dist.get_world_size()))
                n = len(ranks)
                # what a rank sends with the bandwidth-optimal algorithm (ring / pairwise)
                factor = {"all_reduce": 2 * (n - 1) / n}.get(name, (n - 1) if "gather" in name else (n - 1) / n)
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + size
                self.wire[name] = self.wire.get(name, 0) + size * factor
                self.where["inside" if len({r // NODE for r in ranks}) == 1 else "across"] += size * factor
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapped

    def take(self) -> dict[str, dict[str, int]]:
        out = {"calls": dict(self.calls), "bytes": dict(self.bytes), "wire": dict(self.wire), "where": dict(self.where)}
        self.calls, self.bytes, self.wire = {}, {}, {}
        self.where = {"inside": 0.0, "across": 0.0}
        return out


def deepspeed_state_bytes(engine) -> dict[str, int]:
    opt = engine.optimizer
    master = sum(t.numel() * t.element_size() for t in opt.single_partition_of_fp32_groups)
    moments = sum(
        v.numel() * v.element_size()
        for s in opt.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    grads = 0
    if engine.zero_optimization_stage() == 1:  # full gradients stay on the parameters until the step
        grads = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad)
    else:  # the reduced partition (kept in the parameters' dtype)
        grads = sum(p.numel() * p.element_size() for p in opt.single_partition_of_fp32_groups)
    # plus the reduce buckets the gradients are copied into (ZeRO-2)
    grads += sum(
        t.numel() * t.element_size() for b in getattr(opt, "ipg_buckets", {}).values() for t in getattr(b, "buffer", [])
    )
    return {"optimizer_state": master + moments, "gradient_buffers": grads}


def try_autoep() -> str:
    import deepspeed

    model = build_model()
    config = ds_config(False, 2)
    config.pop("optimus")
    # qwen3_moe: the preset whose stacked experts (gate_up_proj [E, 2I, H], down_proj) match Mula's
    config["expert_parallel"] = {"enabled": True, "autoep_size": EP, "preset_model": "qwen3_moe"}
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        ids = torch.randint(2, SHAPE["vocab_size"], (MICRO, SEQ))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    except Exception as err:  # the outcome is the figure here
        return f"refused: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
    return "accepted"


def worker(rank: int, port: int, out: str, rounds: int, warmup: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed
    import deepspeed.runtime.zero.stage_1_and_2 as zero

    import ds_optimus  # noqa: F401  (hooks DeepSpeed's engine)
    from ds_optimus.config import OptimusConfig
    from ds_optimus.parallel import moe_param_groups, setup_moe

    gathered = {"s": 0.0}  # DeepSpeed's parameter all-gather in its step, timed (synchronous on gloo)
    original_gather = zero.all_gather_dp_groups

    def timed_gather(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_gather(*args, **kwargs)
        finally:
            gathered["s"] += time.perf_counter() - start

    zero.all_gather_dp_groups = timed_gather
    engines = {}
    for name, (sharded, stage, options) in CONTESTANTS.items():
        model = build_model()
        config = ds_config(sharded, stage, options)
        setup_moe(model, OptimusConfig.from_ds_config(config))
        engines[name], *_ = deepspeed.initialize(
            model=model, config=config, model_parameters=moe_param_groups(model, weight_decay=0.1)
        )
    plain = build_model()
    setup_moe(plain, OptimusConfig.from_ds_config(ds_config(True, 2)))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(2, SHAPE["vocab_size"], (MICRO, SEQ), generator=g)
    counter = Counter()
    from ds_optimus.parallel.expert_parallel import expert_layouts

    counter.skip = {
        id(g)
        for m in [plain, *(e.module for e in engines.values())]
        for layout in expert_layouts(m)
        for g in (layout.ep_group, layout.intra_node_group, layout.inter_node_group)
        if g is not None
    }

    losses = {}

    def run_engine(name) -> tuple[float, float, float, float]:
        """Backward of the loss of the last forward, the step, and at once the next forward: (backward,
        step, forward seconds, parameter wait: the all-gather in the step, plus with ours overlapped
        what that forward waited for); ours keeps its own account of both parts."""
        engine = engines[name]
        ours = hasattr(engine.optimizer, "gather")
        if name not in losses:
            losses[name] = engine(input_ids=ids, labels=ids).loss
        dist.barrier()
        start = time.perf_counter()
        engine.backward(losses.pop(name))
        middle = time.perf_counter()
        gathered["s"] = 0.0
        engine.step()
        stepped = time.perf_counter()
        losses[name] = engine(input_ids=ids, labels=ids).loss
        end = time.perf_counter()
        wait = engine.optimizer.gather.launch_s + engine.optimizer.gather.wait_s if ours else gathered["s"]
        return middle - start, stepped - middle, end - stepped, wait

    def run_plain() -> float:
        dist.barrier()
        loss = plain(input_ids=ids, labels=ids).loss
        start = time.perf_counter()
        loss.backward()
        took = time.perf_counter() - start
        plain.zero_grad(set_to_none=True)
        return took

    for _ in range(warmup):
        run_plain()
        for name in engines:
            run_engine(name)
    times = {name: {"forward": [], "backward_engine": [], "step": [], "param_wait": []} for name in engines}
    times["plain"] = {"backward": []}
    for _ in range(rounds):
        times["plain"]["backward"].append(run_plain())
        for name in engines:
            b, s, f, w = run_engine(name)
            times[name]["forward"].append(f)
            times[name]["backward_engine"].append(b)
            times[name]["step"].append(s)
            times[name]["param_wait"].append(w)  # this round's forward wait + its step's own part
    counter.active = True
    run_plain()  # the MoE dispatch alone, the same in every contestant: subtracted below
    counter.active = False
    messages = {"plain": counter.take()}
    for name in engines:
        counter.active = True
        run_engine(name)
        counter.active = False
        messages[name] = counter.take()
    state = {}
    for name, engine in engines.items():
        if CONTESTANTS[name][0]:
            b = engine.optimizer.state_bytes()
            state[name] = {
                "optimizer_state": b["optimizer_state"],
                "gradient_buffers": b["gradient_shard"] + b["gradient_buckets"] + b["communication_buffers"],
            }
        else:
            state[name] = deepspeed_state_bytes(engine)
    autoep = try_autoep()  # collective: every rank tries
    torch.save(
        {
            "times": times,
            "messages": messages,
            "state": state,
            "autoep": autoep,
            "params": sum(p.numel() for p in plain.parameters()),
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(port, out, args.rounds, args.warmup), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    zero = ranks[0]
    backward = statistics.median(zero["times"]["plain"]["backward"])
    rows = {}
    for name in CONTESTANTS:
        t = zero["times"][name]
        engine_bwd, step = statistics.median(t["backward_engine"]), statistics.median(t["step"])
        per_round = [
            b + s - p
            for b, s, p in zip(t["backward_engine"], t["step"], zero["times"]["plain"]["backward"], strict=True)
        ]
        msgs, moe = zero["messages"][name], zero["messages"]["plain"]
        comm = {k: v - moe["calls"].get(k, 0) for k, v in msgs["calls"].items()}
        comm = {k: v for k, v in comm.items() if v}
        comm_bytes = {k: msgs["bytes"][k] - moe["bytes"].get(k, 0) for k in comm}
        wire = sum(msgs["wire"][k] - moe["wire"].get(k, 0) for k in comm)
        where = {k: msgs["where"][k] - moe["where"][k] for k in ("inside", "across")}
        rows[name] = {
            "backward_s": backward,
            "reduction_s": engine_bwd - backward,
            "update_s": step,
            "reduction_plus_update_s": statistics.median(per_round),
            "messages_per_step": sum(comm.values()),
            "message_bytes_per_step": sum(comm_bytes.values()),
            "wire_bytes_per_step": wire,
            "wire_bytes_inside_node": where["inside"],
            "wire_bytes_across_nodes": where["across"],
            "forward_s": statistics.median(t["forward"]),
            "param_wait_s": statistics.median(t["param_wait"]),
            "step_s": statistics.median(
                f + b + s for f, b, s in zip(t["forward"], t["backward_engine"], t["step"], strict=True)
            ),
            "collectives": comm,
            "optimizer_state_bytes_per_rank": [r["state"][name]["optimizer_state"] for r in ranks],
            "gradient_buffer_bytes_per_rank": [r["state"][name]["gradient_buffers"] for r in ranks],
        }
    best_ds = min(
        rows["deepspeed_zero1"]["optimizer_state_bytes_per_rank"][0],
        rows["deepspeed_zero2"]["optimizer_state_bytes_per_rank"][0],
    )
    speedup = rows["deepspeed_zero2"]["reduction_plus_update_s"] / rows["ours_zero2"]["reduction_plus_update_s"]
    print(f"{zero['params'] / 1e6:.1f}M parameters, {WORLD} processes, EP {EP}; medians of {args.rounds} rounds\n")
    head = (
        f"{'contestant':<33}{'reduce+update ms':>17}{'reduction ms':>13}{'update ms':>10}{'param wait ms':>14}"
        f"{'forward ms':>11}{'step ms':>8}{'messages':>9}{'MB in':>7}{'MB sent':>8}{'inside':>7}{'across':>7}"
        f"{'state MB/rank':>14}{'grad MB/rank':>13}"
    )
    print(head)
    for name, r in rows.items():
        state_mb = max(r["optimizer_state_bytes_per_rank"]) / 1e6
        grad_mb = max(r["gradient_buffer_bytes_per_rank"]) / 1e6
        print(
            f"{name:<33}{r['reduction_plus_update_s'] * 1e3:>17.1f}{r['reduction_s'] * 1e3:>13.1f}"
            f"{r['update_s'] * 1e3:>10.1f}{r['param_wait_s'] * 1e3:>14.1f}{r['forward_s'] * 1e3:>11.1f}"
            f"{r['step_s'] * 1e3:>8.1f}"
            f"{r['messages_per_step']:>9}{r['message_bytes_per_step'] / 1e6:>7.1f}"
            f"{r['wire_bytes_per_step'] / 1e6:>8.1f}{r['wire_bytes_inside_node'] / 1e6:>7.1f}"
            f"{r['wire_bytes_across_nodes'] / 1e6:>7.1f}{state_mb:>14.2f}{grad_mb:>13.2f}"
        )
    print(f"\nbackward alone: {backward * 1e3:.1f} ms")
    print(f"reduction + update, DeepSpeed ZeRO-2 / ours ZeRO-2: {speedup:.2f}x (target >= 1.5x)")
    ours_state = max(rows["ours_zero2"]["optimizer_state_bytes_per_rank"])
    print(f"optimizer state per rank, ours / best DeepSpeed: {ours_state / best_ds:.4f} (target <= 1)")
    print(f"DeepSpeed AutoEP on this model: {zero['autoep']}")
    hybrid, full = rows["ours_zero1_group2"], rows["ours_zero1"]
    across = hybrid["wire_bytes_across_nodes"] / full["wire_bytes_across_nodes"]
    state = max(hybrid["optimizer_state_bytes_per_rank"]) / max(full["optimizer_state_bytes_per_rank"])
    print(
        f"shard groups of {NODE} (one node): bytes across nodes x{across:.2f} of full sharding's, inside "
        f"{hybrid['wire_bytes_inside_node'] / 1e6:.1f} MB against {full['wire_bytes_inside_node'] / 1e6:.1f}; state "
        f"per rank x{state:.2f}"
    )
    wires = {}
    for stage in (1, 2):
        fp32, bf16 = rows[f"ours_zero{stage}"], rows[f"ours_zero{stage}_bf16_wire"]
        wires[stage] = {
            "bytes_in": bf16["message_bytes_per_step"] / fp32["message_bytes_per_step"],
            "reduction_plus_update": bf16["reduction_plus_update_s"] / fp32["reduction_plus_update_s"],
        }
        print(
            f"ZeRO-{stage}, bf16 on the wire / fp32: MB in x{wires[stage]['bytes_in']:.2f} (the parameter all-gather "
            f"stays fp32), reduction + update x{wires[stage]['reduction_plus_update']:.2f}"
        )
    waits = {
        name: rows[name]["param_wait_s"] * 1e3
        for name in ("ours_zero1", "ours_zero1_gather_overlap", "deepspeed_zero1", "deepspeed_zero2")
    }
    print("parameter wait per step (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in waits.items()))
    path = write_result(
        "optimizer_cpu",
        {
            "command": "python benchmarks/optimizer.py " + " ".join(sys.argv[1:]),
            "world_size": WORLD,
            "ep_size": EP,
            "shape": SHAPE,
            "micro_batch": MICRO,
            "seq_len": SEQ,
            "params": zero["params"],
            "rounds": args.rounds,
            "contestants": rows,
            "speedup_reduction_plus_update_vs_deepspeed_zero2": speedup,
            "state_ratio_vs_best_deepspeed": ours_state / best_ds,
            "autoep": zero["autoep"],
            "node_size": NODE,
            "across_node_bytes_group2_vs_full": across,
            "param_wait_ms": waits,
            "bf16_wire_vs_fp32": wires,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
