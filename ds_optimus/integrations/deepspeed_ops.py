"""DeepSpeed's compiled ops and CPU communication backend as ds_optimus runs them (DeepSpeed 0.19.8, see
`ds_optimus.integrations.PATCHES`): per-environment, announced op builds (`prepare_op_builds`), the CPU backend's
shared-memory workspace unlinked (`release_shm_workspace`), ds_optimus' `moe_routing` op registered (`register_ops`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from . import build_lock
from .deepspeed_version import check_version

# Ops DeepSpeed builds at start-up that training never calls: the CPU shared-memory all-reduce serves
# `inference_all_reduce` (AutoTP inference) only, yet costs a ~75 s compile and a 69 MB /dev/shm
# workspace per rank.
UNNEEDED_OPS = ("deepspeed_shm_comm",)
_ADAM = "DeepSpeed's Adam on this device; optimizer.params.torch_adam: true uses PyTorch's, unbuilt"
_WHY = {
    "fused_adam": _ADAM,
    "cpu_adam": _ADAM,
    "moe_routing": "the MoE layer's routing, gather and combine on the CPU; DS_BUILD_MOE_ROUTING=1 at install "
    "prebuilds it",
}
OWN_OPS = ("moe_routing",)  # built by DeepSpeed's op builder, but ds_optimus' own
# The accelerator classes whose op lookup learns ds_optimus' builders (ROCm runs CUDA_Accelerator).
ACCELERATORS = (
    "cpu_accelerator:CPU_Accelerator",
    "cuda_accelerator:CUDA_Accelerator",
    "xpu_accelerator:XPU_Accelerator",
)


def extensions_dir() -> Path:
    """This environment's own folder for DeepSpeed's compiled ops, so environments do not rebuild each other's."""
    key = hashlib.sha256(f"{sys.prefix}|{torch.__version__}|{deepspeed.__version__}".encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "torch_extensions" / f"ds_optimus-{Path(sys.prefix).name}-{key}"


def prepare_op_builds(say=None) -> None:
    """Keep op builds per environment, skip `UNNEEDED_OPS`, take over stale build locks, and `say` (rank 0) what
    compiles and why. Idempotent."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    check_version()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    build_lock.install()
    for name in UNNEEDED_OPS:
        deepspeed.ops.__compatible_ops__[name] = False
    original = OpBuilder.jit_load
    if getattr(original, "says_builds", False):
        return
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))

    def jit_load(self, verbose=True):
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir()))
        # said by the world's rank 0 alone: each node's first rank builds (or waits on the folder's lock),
        # and a line per node says nothing more at 1,000 nodes
        rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
        first = rank == "0" and not any((root / self.name).glob(f"{self.name}*.so"))
        whose, takes = ("ds_optimus'", "under a minute") if self.name in OWN_OPS else ("DeepSpeed's", "a few minutes")
        if first:
            say(
                f"ds_optimus: compiling {whose} {self.name} op ({_WHY.get(self.name, 'this config needs it')}): "
                f"{takes}, once per environment, kept in {root}"
            )
        began = time.perf_counter()
        verbose = os.environ.get("DS_OPTIMUS_VERBOSE", "") not in ("", "0", "false")
        for attempt in range(3):  # a lock left by a builder that died is removed, and the build starts again
            try:
                module = original(self, verbose=verbose)
                break
            except build_lock.StaleBuildLock as stale:
                say(f"ds_optimus: {stale}")
                if attempt == 2:
                    raise
                build_lock.forget_build(self.name)
        if first:
            say(f"ds_optimus: {whose} {self.name} op is ready ({time.perf_counter() - began:.0f} s)")
        return module

    jit_load.says_builds = True
    jit_load.__wrapped__ = original
    OpBuilder.jit_load = jit_load


def release_shm_workspace() -> None:
    """Unlink this rank's 69 MB /dev/shm workspace of DeepSpeed's CPU backend (never removed). Collective; CPU only."""
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() or get_accelerator().device_name() != "cpu":
        return
    name = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    )
    dist.barrier()  # every rank has mapped every other's workspace by now; the mappings outlive the names
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def our_builders(accelerator_name: str) -> dict[str, type]:
    """ds_optimus' op builders by class name, for the accelerator named `accelerator_name`."""
    from ..ops.op_builder import MoERoutingBuilder, MoERoutingTritonBuilder

    return {"MoERoutingBuilder": MoERoutingBuilder if accelerator_name == "cpu" else MoERoutingTritonBuilder}


def _wrap_get_op_builder(cls) -> None:
    original = cls.get_op_builder
    if getattr(original, "__wrapped__", None) is not None:
        return

    def get_op_builder(self, class_name):
        return our_builders(self._name).get(class_name) or original(self, class_name)

    get_op_builder.__wrapped__ = original
    cls.get_op_builder = get_op_builder


def register_ops() -> None:
    """Make ds_optimus' op one of DeepSpeed's: in every accelerator's op lookup and in `ds_report`. Idempotent."""
    import importlib
    import importlib.util

    from deepspeed.accelerator import get_accelerator

    for target in ACCELERATORS:
        module, _, name = target.partition(":")
        try:
            _wrap_get_op_builder(getattr(importlib.import_module(f"deepspeed.accelerator.{module}"), name))
        except ImportError:  # an accelerator module that needs a package this machine lacks
            continue
    builders = sys.modules.get("ds_optimus.ops.op_builder")
    if builders is not None and not hasattr(builders, "MoERoutingTritonBuilder"):
        # Importing DeepSpeed from that module brought us here, before its builders exist: the lookup
        # above finds them at call time, and `python -m ds_optimus.ds_report` registers again before it
        # reports (ds_optimus.ops.routing imports DeepSpeed before that module: a direct import only).
        return
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    from ..ops.op_builder import NAME, prebuilt_available

    builder = get_accelerator().create_op_builder("MoERoutingBuilder")
    if builder is not None and NAME not in ALL_OPS:
        ALL_OPS[NAME] = builder
        cpu = get_accelerator()._name == "cpu"  # elsewhere nothing is built ahead: Triton compiles at first call
        installed_ops[NAME] = prebuilt_available() if cpu else importlib.util.find_spec("triton") is not None


# Importing this module hooks the op builds (`import ds_optimus` imports it right after `import deepspeed`),
# before anything of DeepSpeed's builds or loads an op.
prepare_op_builds()
try:
    register_ops()
except Exception as error:  # never at the cost of the engine hooks that follow this module's import
    print(
        f"ds_optimus: the moe_routing op is not registered with DeepSpeed ({type(error).__name__}: {error})",
        file=sys.stderr,
    )
