"""DeepSpeed op builders of the routing kernels (`ops/routing.py`): the C++ CPU op (prebuilt at install with
`DS_BUILD_MOE_ROUTING=1`, else JIT-built once per environment) and the Triton kernels on accelerators.
Imports DeepSpeed: loaded only when the op is, never at `import ds_optimus.ops`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

NAME = "moe_routing"
SOURCE = Path(__file__).resolve().parent / "csrc" / "moe_routing.cpp"
PREBUILT = "ds_optimus.ops.moe_routing_op"  # the module setup.py builds


def prebuilt_available() -> bool:
    """Whether the CPU op was built at install."""
    try:
        return importlib.util.find_spec(PREBUILT) is not None
    except ImportError:  # ds_optimus.ops itself not importable as a package (setup.py's build)
        return False


class MoERoutingBuilder(CPUOpBuilder):
    """The routing op on the CPU, compiled from C++."""

    BUILD_VAR = "DS_BUILD_MOE_ROUTING"
    NAME = NAME

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return PREBUILT

    def sources(self) -> list[str]:
        return [str(SOURCE)]

    def include_paths(self) -> list[str]:
        return []

    @staticmethod
    def compiler() -> str:
        return os.environ.get("CXX", "c++")

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether a C++ compiler is found (DeepSpeed's own CPU ops do not check)."""
        if shutil.which(self.compiler()) is None:
            if verbose:
                self.warning(f"{self.NAME} needs a C++ compiler ({self.compiler()} is not found)")
            return False
        return super().is_compatible(verbose)

    def cxx_args(self) -> list[str]:
        # A multiply and an add round separately, as in the reference; C++17 for std::optional;
        # -fno-wrapv over Python's -fwrapv in setup.py builds (it slows the vectorised loops 2x); no -g:
        # debug info was a quarter of the build (23 s -> 17 s on 2 cores) and 93 % of the .so (7.4 MB).
        flags = [flag for flag in super().cxx_args() if flag != "-g"]
        return [*flags, "-std=c++17", "-ffp-contract=off", "-fno-wrapv"]

    def load(self, verbose: bool = False):
        """The prebuilt module if it loads with this PyTorch, else a JIT build."""
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        if prebuilt_available():
            try:
                module = importlib.import_module(PREBUILT)
            except (ImportError, OSError) as error:  # built against another PyTorch
                print(
                    f"ds_optimus: the prebuilt {self.name} op does not load ({error}); building it again",
                    file=sys.stderr,
                )
            else:
                OpBuilder._loaded_ops[self.name] = module
                return module
        return self.jit_load(verbose)


class MoERoutingTritonBuilder(OpBuilder):
    """The routing op on accelerators: Triton kernels, compiled by Triton itself."""

    BUILD_VAR = "DS_BUILD_MOE_ROUTING"
    NAME = NAME

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return "ds_optimus.ops._triton_routing"

    def sources(self) -> list[str]:
        return []

    def is_compatible(self, verbose: bool = False) -> bool:
        if importlib.util.find_spec("triton") is None:
            self.warning(f"{self.NAME} on accelerators needs Triton (pip install triton)")
            return False
        return True

    def builder(self):
        return None  # nothing to compile ahead of time

    def load(self, verbose: bool = False):
        return importlib.import_module(self.absolute_name())

    def jit_load(self, verbose: bool = True):
        return self.load(verbose)
