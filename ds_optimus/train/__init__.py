"""Pretraining: the loop behind the `deepspeed` launcher (`python -m ds_optimus.train`), its
metrics, and the Hugging Face export."""

from .trainer import build_model, export, init_distributed, pretrain, resolve_batch_sizes, sample

__all__ = ["build_model", "export", "init_distributed", "pretrain", "resolve_batch_sizes", "sample"]
