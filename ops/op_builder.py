"""DeepSpeed op builders of the routing kernels (`ops/routing.py`), as DeepSpeed builds its own ops.

- `MoERoutingBuilder`: the compiled CPU op (`csrc/moe_routing.cpp`), a `CPUOpBuilder` with DeepSpeed's
  CPU flags (-O3, -march=native, OpenMP) without -g, plus -ffp-contract=off and -fno-wrapv. `load()` imports
  the op prebuilt at install (`DS_BUILD_MOE_ROUTING=1`, or `DS_BUILD_OPS=1`, see setup.py) and JIT-builds it otherwise,
  once per environment (`ds_optimus.integrations.deepspeed_ops` keeps the build folder per
  environment and says a build in one line).
- `MoERoutingTritonBuilder`: the same op on accelerators, whose kernels are Triton's (compiled by
  Triton at first call): nothing to prebuild, `load()` returns the kernels' module.

`ds_optimus.integrations.deepspeed_ops.register_ops` makes `get_accelerator().create_op_builder(
"MoERoutingBuilder")` return the one for the accelerator, and lists the op in `ds_report`. Imports
DeepSpeed: loaded only when the op is (ops/routing.py), never at `import ds_optimus.ops`.
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
    """Whether the CPU op was built at install (its module is on the path)."""
    try:
        return importlib.util.find_spec(PREBUILT) is not None
    except ImportError:  # ds_optimus.ops itself not importable as a package (setup.py's build)
        return False


class MoERoutingBuilder(CPUOpBuilder):
    """The routing/gather/combine op on the CPU, compiled from C++."""

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
        """Whether it can be built here: a C++ compiler (DeepSpeed's own CPU ops do not check)."""
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
        """The prebuilt module where it was built at install and loads with this PyTorch; else a JIT
        build (kept per environment)."""
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
    """The routing/gather/combine op on accelerators: Triton kernels, compiled by Triton itself."""

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
