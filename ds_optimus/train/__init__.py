"""Pretraining: the `Trainer` behind the `deepspeed` launcher (`python -m ds_optimus.train`), its
callbacks, the pieces it assembles, and the Hugging Face `Trainer` glue (`hf_trainer`). Names are
imported on first use, so the entry point's `--help` imports no PyTorch."""

from .._lazy import lazy_exports

__all__ = [
    "Callback",
    "Preempted",
    "Trainer",
    "default_callbacks",
    "export",
    "init_distributed",
    "pretrain",
    "resolve_batch_sizes",
    "sample",
]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Callback": ".callbacks",
        "default_callbacks": ".callbacks",
        "export": ".end_of_run",
        "init_distributed": ".startup",
        "resolve_batch_sizes": "..config",
        "sample": ".end_of_run",
        "Preempted": ".trainer",
        "Trainer": ".trainer",
        "pretrain": ".trainer",
    },
)
