"""Run a function on N CPU processes with the gloo backend and collect what each rank returns.

The processes are kept between calls (one pool per world size, for the whole pytest session): a
fresh process pays 2 to 10 s of imports (PyTorch, DeepSpeed, Transformers) before it does anything,
and the suite calls this some 80 times. Each call gets a process group of its own (a new port) and a
worker as a fresh process would be: torch's generator, torch's thread count, DeepSpeed's group
registry and communication backend, torch.compile's caches and ds_optimus' expert-parallel groups
are put back to how they were at the worker's start, and the environment and working directory are
the caller's at the time of the call (as a spawned process inherits them). A call
that fails or hangs takes its pool down (the next call starts a new one) and raises with the rank's
traceback. `DS_OPTIMUS_TEST_FRESH_PROCESSES=1` spawns new processes for every call instead."""

from __future__ import annotations

import atexit
import importlib
import os
import queue
import shutil
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 540  # one call, all ranks: a hang fails the test with the ranks named, before pytest-timeout's 600 s
# pytest-timeout's limit for the few tests that run a dozen processes one after another (1.5-2 min on 2 idle
# cores; 6-9 min beside a 2-process load, which took them past the 600 s of pytest.ini): still a hang's end
LONG_TEST_TIMEOUT_S = 1200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_task(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
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


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    _run_task(rank, world, port, out_dir, fn, args)  # mp.spawn's entry: one call, a fresh process


def _serve(rank: int, world: int, tasks, results) -> None:
    """A pool worker: run tasks until told to stop, each in the state the worker started in."""
    start = {"rng": torch.get_rng_state(), "threads": torch.get_num_threads()}
    while True:
        try:
            task = tasks.get()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:  # told to stop: flush the results, then leave without the interpreter's teardown,
            results.close()  # which in a worker grown by many runs (its modules' exit hooks, its heap) took
            results.join_thread()  # 10 s and more, past close_pools' wait, on every kept pool
            os._exit(0)
        port, out_dir, fn, args, environment, cwd = task
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(cwd)
        torch.set_rng_state(start["rng"])
        try:
            _run_task(rank, world, port, out_dir, fn, args)
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
            results.put((rank, traceback.format_exc()))
        finally:
            _reset_libraries()
            torch.set_num_threads(start["threads"])
            _release_memory()


def _reset_libraries() -> None:
    """What a process keeps of a call that a fresh one would not have: DeepSpeed's registry of
    process groups and its communication backend (both name the call's destroyed groups), and
    torch.compile's caches and counters."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        importlib.reload(groups)
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    _destroy_engines()


def _destroy_engines() -> None:
    """Detach the call's DeepSpeed engines and sharded optimizers from their parameters' gradient hooks
    (the trainer does so itself; a test that builds an engine by hand does not): the hooks sit on
    autograd nodes the garbage collector cannot see through, so an engine left hooked would live on in
    the worker with its model and its process groups' polling threads, and slow every later call."""
    import gc

    kinds = tuple(
        getattr(sys.modules.get(module), name, None)
        for module, name in (
            ("deepspeed.runtime.engine", "DeepSpeedEngine"),
            ("ds_optimus.optim.sharded", "ShardedOptimizer"),
        )
    )
    kinds = tuple(kind for kind in kinds if kind is not None)
    if not kinds:
        return
    for held in [o for o in gc.get_objects() if issubclass(type(o), kinds)]:  # no __instancecheck__ hooks run
        try:
            held.destroy()
        except Exception:  # noqa: BLE001, S110 - half-built by a failed call: nothing more to release
            pass


def _release_memory() -> None:
    """Give the call's freed memory back to the system (glibc keeps it otherwise): a kept worker stays
    near its starting size instead of growing with every run it served."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class _Pool:
    def __init__(self, world: int) -> None:
        context = mp.get_context("spawn")
        self.world = world
        self.tasks = [context.Queue() for _ in range(world)]
        self.results = context.Queue()
        self.processes = [
            context.Process(
                target=_serve, args=(rank, world, self.tasks[rank], self.results), name=f"ds_optimus-test-rank{rank}"
            )
            for rank in range(world)
        ]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable, args: tuple, out_dir: str) -> None:
        port = _free_port()
        for q in self.tasks:
            q.put((port, out_dir, fn, args, dict(os.environ), os.getcwd()))
        pending = set(range(self.world))
        waited = 0.0
        while pending:
            try:
                rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead or waited > TIMEOUT_S:
                    self.close()
                    why = f"{', '.join(dead)} died" if dead else f"no result within {TIMEOUT_S} s"
                    raise RuntimeError(f"run_distributed({fn.__name__}, {self.world}): {why}") from None
                continue
            if error is not None:
                self.close()  # the other ranks may wait on the failed one forever
                raise RuntimeError(f"run_distributed({fn.__name__}, {self.world}): rank {rank} failed:\n{error}")
            pending.discard(rank)

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():  # a run's preemption handler takes SIGTERM as a request to checkpoint
                process.kill()
                process.join(timeout=10)
        _POOLS.pop(self.world, None)


_POOLS: dict[int, _Pool] = {}


def run_distributed(fn: Callable, world: int, *args) -> list:
    """`fn(rank, world, *args)` on `world` processes (gloo); returns their results by rank. `fn` must
    be a module-level function of an importable module."""
    out_dir = tempfile.mkdtemp(prefix="run_distributed-")
    try:
        if os.environ.get("DS_OPTIMUS_TEST_FRESH_PROCESSES", "") not in ("", "0"):
            mp.spawn(_worker, args=(world, _free_port(), out_dir, fn, args), nprocs=world, join=True)
        else:
            pool = _POOLS.get(world)
            if pool is None:
                pool = _POOLS[world] = _Pool(world)
            pool.run(fn, args, out_dir)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


@atexit.register
def close_pools() -> None:
    """Stop every pool's workers (at exit; non-daemonic, so a task may start processes of its own)."""
    for pool in list(_POOLS.values()):
        for q in pool.tasks:
            q.put(None)
        for process in pool.processes:
            process.join(timeout=10)
        pool.close()  # terminates, then kills, what did not stop
