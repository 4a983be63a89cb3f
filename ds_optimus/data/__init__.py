"""Pretraining data: sources (embedded corpus, local files, HF datasets), tokenizers, tokenize and
pack into cached token files, and a resumable data-parallel loader."""

from .corpus import DataError, Source, describe, embedded_documents, iter_documents, parse_source
from .loader import TokenBatches, eval_batches
from .pack import PackedData, prepare, token_dtype
from .tokenizer import load_tokenizer, train_default_tokenizer

__all__ = [
    "DataError",
    "PackedData",
    "Source",
    "TokenBatches",
    "describe",
    "embedded_documents",
    "eval_batches",
    "iter_documents",
    "load_tokenizer",
    "parse_source",
    "prepare",
    "token_dtype",
    "train_default_tokenizer",
]
