"""Transformers' own model-test mixins, taken from the source distribution of the installed version.

Those files are not part of this project and never enter it: `load()` downloads the sdist of the
installed Transformers once with pip (the package index is the only place it comes from) into a
cache outside the repository, `$DS_OPTIMUS_CACHE` or `~/.cache/ds_optimus`, keeps only its `tests/`
tree and imports that tree as the package `hf_sdist_tests`, a name that cannot clash with this
repository's own `tests` folder. Where the mixins import a file that the sdist does not ship, the
smallest stand-in of our own takes its place (`_STAND_INS` below, each saying what it replaces).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import transformers

PACKAGE = "hf_sdist_tests"


class SdistUnavailable(RuntimeError):
    """The sdist could not be fetched or unpacked; the message is one line."""


def cache_root() -> Path:
    """Where unpacked test trees live, one folder per Transformers version."""
    base = os.environ.get("DS_OPTIMUS_CACHE") or Path.home() / ".cache" / "ds_optimus"
    return Path(base) / f"transformers-{transformers.__version__}"


def _download(version: str, folder: Path) -> Path:
    """The sdist archive of `version`, fetched by pip (which honours the index configured for it)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"transformers=={version}",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(folder),
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise SdistUnavailable(f"pip download transformers=={version} timed out (package index unreachable?)") from None
    except subprocess.CalledProcessError as err:
        last = (err.stderr or err.stdout or "").strip().splitlines()
        raise SdistUnavailable(f"pip download transformers=={version} failed: {last[-1] if last else err}") from None
    archives = sorted(folder.glob("transformers-*.tar.gz"))
    if not archives:
        raise SdistUnavailable(f"pip download transformers=={version} left no .tar.gz in {folder}")
    return archives[0]


def _unpack_tests(archive: Path, target: Path) -> None:
    """Write the archive's `tests/` tree (nothing else) to `target`, atomically: a folder that exists
    is complete, also when two test runs fill the cache at the same time."""
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if len(parts) > 2 and parts[1] == "tests" and (member.isfile() or member.isdir()):
                    member.name = str(Path(*parts[1:]))
                    members.append(member)
            if not any(m.name == "tests/test_modeling_common.py" for m in members):
                raise SdistUnavailable(f"{archive.name} has no tests/test_modeling_common.py")
            tar.extractall(staging, members=members, filter="data")
        # The repository's tests/ is a package; the sdist leaves its marker out.
        (staging / "tests" / "__init__.py").touch()
        try:
            (staging / "tests").rename(target)
        except OSError:
            if not (target / "test_modeling_common.py").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def tests_dir() -> Path:
    """The unpacked `tests/` tree of the installed Transformers, fetched on first use."""
    root = cache_root()
    target = root / "tests"
    if (target / "test_modeling_common.py").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        _unpack_tests(_download(transformers.__version__, Path(tmp)), target)
    return target


# -- stand-ins for what the sdist does not ship ---------------------------------------------------------


class _NoExportTests:
    """Stands in for the export mixin (tests/exporters/test_export.py, not in the sdist): no export tests."""


class _NoGenerationTests:
    """Stands in for the generation mixin (tests/generation/test_utils.py, not in the sdist). It carries no
    tests; the model test checks only that generative models inherit it, so the test module runs its own
    generation checks."""


# A few PreTrainedConfig arguments with values other than their defaults, so that the config test can
# check they are stored (stands in for tests/utils/test_configuration_utils.py, not in the sdist).
_CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["SomeModelForCausalLM"],
    "id2label": {0: "no", 1: "yes"},
    "label2id": {"no": 0, "yes": 1},
    "problem_type": "single_label_classification",
}


def _in_rank(rank: int, world: int, module: str, name: str, args: tuple) -> None:
    """Run `module.name(rank, *args)` in a spawned rank; the sdist package is imported there first, since
    a spawned process does not know it."""
    load()
    getattr(importlib.import_module(module), name)(rank, *args)


def _run_distributed(world_size: int):
    """Stands in for tests/distributed_testing_utils.py's `run_distributed` (not in the sdist):
    `run_distributed(world_size=n)(fn)(*args)` runs `fn(rank, *args)` on n CPU processes with gloo,
    through this repository's own launcher (tests/distributed.py)."""
    from distributed import run_distributed

    def decorate(fn):
        def run(*args):
            run_distributed(_in_rank, world_size, fn.__module__, fn.__name__, args)

        return run

    return decorate


class _Expand:
    """Stands in for the `parameterized` package (not installed here) with the one decorator the mixins
    use: `@parameterized.expand(cases)` adds one test method per case to the class being defined."""

    @staticmethod
    def expand(cases, **_ignored):
        def decorate(func):
            namespace = sys._getframe(1).f_locals  # the class body the decorated method is defined in
            for i, case in enumerate(cases):
                args = tuple(case) if isinstance(case, (tuple, list)) else (case,)
                suffix = re.sub(r"\W+", "_", str(args[0])).strip("_") if args else ""

                def method(self, _args=args):
                    return func(self, *_args)

                method.__name__ = f"{func.__name__}_{i}" + (f"_{suffix}" if suffix else "")
                method.__doc__ = func.__doc__
                method.__dict__.update(func.__dict__)  # keeps pytest marks and unittest skips
                namespace[method.__name__] = method
            return None  # the undecorated name is not a test

        return decorate


# module (relative to the sdist's tests/) -> what the stand-in provides
_STAND_INS = {
    "exporters": {},
    "exporters.test_export": {"ExportTesterMixin": _NoExportTests},
    "generation": {},
    "generation.test_utils": {"GenerationTesterMixin": _NoGenerationTests},
    "utils": {},
    "utils.test_configuration_utils": {"config_common_kwargs": _CONFIG_COMMON_KWARGS},
    "distributed_testing_utils": {"run_distributed": _run_distributed},
}


def load() -> types.ModuleType:
    """Import the sdist's tests/ as the package `hf_sdist_tests` (fetching it on first use) and return it.
    Raises `SdistUnavailable` with a one-line reason when the package index cannot be reached."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    folder = tests_dir()
    for relative, attributes in _STAND_INS.items():
        path = folder / relative.replace(".", "/")
        if not path.with_suffix(".py").exists() and not path.is_dir():
            stand_in = types.ModuleType(f"{PACKAGE}.{relative}")
            stand_in.__dict__.update(attributes)
            if any(other.startswith(f"{relative}.") for other in _STAND_INS):
                stand_in.__path__ = []  # a package: a stand-in sits below it
            sys.modules[stand_in.__name__] = stand_in
    try:
        import parameterized  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("parameterized")
        stand_in.parameterized = _Expand
        sys.modules["parameterized"] = stand_in
    spec = importlib.util.spec_from_file_location(
        PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return package


def module(name: str) -> types.ModuleType:
    """Import one module of the sdist's tests/ (`load()` first). The marks Transformers registers in its
    own pytest configuration are unknown here; they only select tests there, so their warnings are dropped."""
    load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        return importlib.import_module(f"{PACKAGE}.{name}")
