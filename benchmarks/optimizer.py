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
  state      per-rank optimizer-state bytes, exact: fp32 master weights + Adam moments; and the
             gradient buffers: the reduced shard, full gradients kept between micro-steps (ZeRO-1),
             and the buckets gradients are copied into for communication

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

WORLD, EP = 4, 2
SHAPE = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=512, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
             max_position_embeddings=512, pad_token_id=0, eos_token_id=1)
MICRO, SEQ = 2, 64
# name: (sharded optimizer, ZeRO stage, overlap_comm of the sharded optimizer; None: its default)
CONTESTANTS = {"ours_zero2": (True, 2, None), "ours_zero2_overlap": (True, 2, True), "ours_zero1": (True, 1, None),
               "deepspeed_zero2": (False, 2, None), "deepspeed_zero1": (False, 1, None)}
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce_scatter_single",
               "all_gather_into_tensor", "all_gather", "all_gather_single", "broadcast", "all_to_all_single",
               "all_to_all")


def ds_config(sharded: bool, stage: int, overlap: bool | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
        "optimus": {"expert_parallel": {"size": EP}, "moe": {"experts_backend": "looped"},
                    "sharded_optimizer": {"enabled": sharded, "bucket_size": 5_000_000, "overlap_comm": overlap}},
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
        self.active = False
        self.depth = 0
        for namespace in (dist, deepspeed.comm, deepspeed.comm.comm):
            for name in COLLECTIVES:
                if hasattr(namespace, name):
                    setattr(namespace, name, self._wrap(name, getattr(namespace, name)))

    def _wrap(self, name, original):
        def wrapped(*args, **kwargs):
            if self.active and self.depth == 0:
                values = list(args) + list(kwargs.values())
                tensors = [a for a in values if isinstance(a, torch.Tensor)]
                lists = [a for a in values if isinstance(a, list)]
                if name.endswith(("_into_tensor", "_tensor", "_single")) and name != "all_to_all_single" \
                        and len(tensors) >= 2:
                    size = tensors[1].numel() * tensors[1].element_size()  # (output, input)
                elif tensors:
                    size = tensors[0].numel() * tensors[0].element_size()
                else:
                    size = sum(t.numel() * t.element_size() for lst in lists[-1:] for t in lst
                               if isinstance(t, torch.Tensor))
                groups = [a for a in values if isinstance(a, dist.ProcessGroup)]  # by keyword or position
                n = dist.get_world_size(groups[0]) if groups else dist.get_world_size()
                # what a rank sends with the bandwidth-optimal algorithm (ring / pairwise)
                factor = {"all_reduce": 2 * (n - 1) / n}.get(name, (n - 1) if "gather" in name else (n - 1) / n)
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + size
                self.wire[name] = self.wire.get(name, 0) + size * factor
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapped

    def take(self) -> dict[str, dict[str, int]]:
        out = {"calls": dict(self.calls), "bytes": dict(self.bytes), "wire": dict(self.wire)}
        self.calls, self.bytes, self.wire = {}, {}, {}
        return out


def deepspeed_state_bytes(engine) -> dict[str, int]:
    opt = engine.optimizer
    master = sum(t.numel() * t.element_size() for t in opt.single_partition_of_fp32_groups)
    moments = sum(v.numel() * v.element_size() for s in opt.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    grads = 0
    if engine.zero_optimization_stage() == 1:  # full gradients stay on the parameters until the step
        grads = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad)
    else:  # the reduced partition (kept in the parameters' dtype)
        grads = sum(p.numel() * p.element_size() for p in opt.single_partition_of_fp32_groups)
    # plus the reduce buckets the gradients are copied into (ZeRO-2)
    grads += sum(t.numel() * t.element_size() for b in getattr(opt, "ipg_buckets", {}).values()
                 for t in getattr(b, "buffer", []))
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed

    import ds_optimus  # noqa: F401  (hooks DeepSpeed's engine)
    from ds_optimus.config import OptimusConfig
    from ds_optimus.parallel import moe_param_groups, setup_moe

    engines = {}
    for name, (sharded, stage, overlap) in CONTESTANTS.items():
        model = build_model()
        config = ds_config(sharded, stage, overlap)
        setup_moe(model, OptimusConfig.from_ds_config(config))
        engines[name], *_ = deepspeed.initialize(model=model, config=config,
                                                 model_parameters=moe_param_groups(model, weight_decay=0.1))
    plain = build_model()
    setup_moe(plain, OptimusConfig.from_ds_config(ds_config(True, 2)))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(2, SHAPE["vocab_size"], (MICRO, SEQ), generator=g)
    counter = Counter()

    def run_engine(engine) -> tuple[float, float]:
        dist.barrier()
        loss = engine(input_ids=ids, labels=ids).loss
        start = time.perf_counter()
        engine.backward(loss)
        middle = time.perf_counter()
        engine.step()
        return middle - start, time.perf_counter() - middle

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
        for engine in engines.values():
            run_engine(engine)
    times = {name: {"backward_engine": [], "step": []} for name in engines}
    times["plain"] = {"backward": []}
    for _ in range(rounds):
        times["plain"]["backward"].append(run_plain())
        for name, engine in engines.items():
            b, s = run_engine(engine)
            times[name]["backward_engine"].append(b)
            times[name]["step"].append(s)
    counter.active = True
    run_plain()  # the MoE dispatch alone, the same in every contestant: subtracted below
    counter.active = False
    messages = {"plain": counter.take()}
    for name, engine in engines.items():
        counter.active = True
        run_engine(engine)
        counter.active = False
        messages[name] = counter.take()
    state = {}
    for name, engine in engines.items():
        if CONTESTANTS[name][0]:
            b = engine.optimizer.state_bytes()
            state[name] = {"optimizer_state": b["optimizer_state"],
                           "gradient_buffers": b["gradient_shard"] + b["gradient_buckets"] + b["communication_buffers"]}
        else:
            state[name] = deepspeed_state_bytes(engine)
    autoep = try_autoep()  # collective: every rank tries
    torch.save({"times": times, "messages": messages, "state": state, "autoep": autoep,
                "params": sum(p.numel() for p in plain.parameters())}, os.path.join(out, f"rank{rank}.pt"))
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
        per_round = [b + s - p for b, s, p in zip(t["backward_engine"], t["step"], zero["times"]["plain"]["backward"],
                                                   strict=True)]
        msgs, moe = zero["messages"][name], zero["messages"]["plain"]
        comm = {k: v - moe["calls"].get(k, 0) for k, v in msgs["calls"].items()}
        comm = {k: v for k, v in comm.items() if v}
        comm_bytes = {k: msgs["bytes"][k] - moe["bytes"].get(k, 0) for k in comm}
        wire = sum(msgs["wire"][k] - moe["wire"].get(k, 0) for k in comm)
        rows[name] = {
            "backward_s": backward, "reduction_s": engine_bwd - backward, "update_s": step,
            "reduction_plus_update_s": statistics.median(per_round),
            "messages_per_step": sum(comm.values()), "message_bytes_per_step": sum(comm_bytes.values()),
            "wire_bytes_per_step": wire,
            "collectives": comm,
            "optimizer_state_bytes_per_rank": [r["state"][name]["optimizer_state"] for r in ranks],
            "gradient_buffer_bytes_per_rank": [r["state"][name]["gradient_buffers"] for r in ranks],
        }
    best_ds = min(rows["deepspeed_zero1"]["optimizer_state_bytes_per_rank"][0],
                  rows["deepspeed_zero2"]["optimizer_state_bytes_per_rank"][0])
    speedup = rows["deepspeed_zero2"]["reduction_plus_update_s"] / rows["ours_zero2"]["reduction_plus_update_s"]
    print(f"{zero['params'] / 1e6:.1f}M parameters, {WORLD} processes, EP {EP}; medians of {args.rounds} rounds\n")
    head = f"{'contestant':<19}{'reduce+update ms':>17}{'reduction ms':>13}{'update ms':>10}{'messages':>9}" \
           f"{'MB in':>7}{'MB sent':>8}{'state MB/rank':>14}{'grad MB/rank':>13}"
    print(head)
    for name, r in rows.items():
        state_mb = max(r["optimizer_state_bytes_per_rank"]) / 1e6
        grad_mb = max(r["gradient_buffer_bytes_per_rank"]) / 1e6
        print(f"{name:<19}{r['reduction_plus_update_s'] * 1e3:>17.1f}{r['reduction_s'] * 1e3:>13.1f}"
              f"{r['update_s'] * 1e3:>10.1f}{r['messages_per_step']:>9}{r['message_bytes_per_step'] / 1e6:>7.1f}"
              f"{r['wire_bytes_per_step'] / 1e6:>8.1f}{state_mb:>14.2f}{grad_mb:>13.2f}")
    print(f"\nbackward alone: {backward * 1e3:.1f} ms")
    print(f"reduction + update, DeepSpeed ZeRO-2 / ours ZeRO-2: {speedup:.2f}x (target >= 1.5x)")
    ours_state = max(rows["ours_zero2"]["optimizer_state_bytes_per_rank"])
    print(f"optimizer state per rank, ours / best DeepSpeed: {ours_state / best_ds:.4f} (target <= 1)")
    print(f"DeepSpeed AutoEP on this model: {zero['autoep']}")
    path = write_result("optimizer_cpu", {
        "command": "python benchmarks/optimizer.py " + " ".join(sys.argv[1:]), "world_size": WORLD, "ep_size": EP,
        "shape": SHAPE, "micro_batch": MICRO, "seq_len": SEQ, "params": zero["params"], "rounds": args.rounds,
        "contestants": rows, "speedup_reduction_plus_update_vs_deepspeed_zero2": speedup,
        "state_ratio_vs_best_deepspeed": ours_state / best_ds, "autoep": zero["autoep"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
