"""Run a function on N CPU processes with the gloo backend and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears its connections down while another still uses them
        # DeepSpeed's CPU backend (if a worker started it) leaves a shared-memory file per rank
        shm = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}"
        if os.path.exists(shm):
            os.unlink(shm)
    finally:
        from ds_optimus.parallel import destroy_expert_parallel_groups

        destroy_expert_parallel_groups()
        dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args) -> list:
    """`fn(rank, world, *args)` on `world` spawned processes (gloo); returns their results by rank.
    `fn` must be a module-level function of an importable module."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, _free_port(), out_dir, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
