"""Shared test set-up: no network, no wandb, deterministic CPU runs."""

import os

# Nothing downloads at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's CPU interpreter (read when they are first imported).
if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ds_optimus  # noqa: E402,F401  (registers Mula with the Auto classes)

# DeepSpeed's own tests run in a pytest process of their own (test_deepspeed_upstream_subset.py), which
# sets this: they leave DeepSpeed's process group and environment behind in the process that ran them.
UPSTREAM = "DS_OPTIMUS_UPSTREAM_TESTS"
collect_ignore = [] if os.environ.get(UPSTREAM) else ["deepspeed_upstream"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module", autouse=True)
def _workers_within_memory():
    """After a test module, stop the kept worker processes of `distributed.run_distributed` (one pool per
    world size, grown by every run they served) when less than a third of the machine's memory is free:
    the next run starts fresh workers instead of being killed for memory beside them."""
    yield
    import sys

    import psutil

    memory = psutil.virtual_memory()
    if memory.available < memory.total / 3 and "distributed" in sys.modules:
        sys.modules["distributed"].close_pools()
