"""Pretraining: the `Trainer` behind the `deepspeed` launcher (`python -m ds_optimus.train`), its
callbacks, the pieces it assembles, and the Hugging Face `Trainer` glue (`hf_trainer`)."""

from .callbacks import Callback, default_callbacks
from .components import export, init_distributed, resolve_batch_sizes, sample
from .trainer import Preempted, Trainer, pretrain

__all__ = ["Callback", "Preempted", "Trainer", "default_callbacks", "export", "init_distributed", "pretrain",
           "resolve_batch_sizes", "sample"]
