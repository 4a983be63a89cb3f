"""Pretraining data: sources (the embedded corpus, local files plain or compressed, `datasets`
folders and names, pre-tokenized token files), tokenizers, parallel and resumable tokenization
into memory-mapped token shards, and a resumable data-parallel loader over a weighted mixture."""

from .corpus import DataError, Source, describe, embedded_documents, iter_documents, parse_source, parse_sources
from .loader import TokenBatches, eval_batches
from .pack import PreparedData, PreparedSource, prepare_data, token_dtype
from .tokenizer import load_tokenizer, train_default_tokenizer
from .tokens import TokenStream, open_token_files

__all__ = [
    "DataError",
    "PreparedData",
    "PreparedSource",
    "Source",
    "TokenBatches",
    "TokenStream",
    "describe",
    "embedded_documents",
    "eval_batches",
    "iter_documents",
    "load_tokenizer",
    "open_token_files",
    "parse_source",
    "parse_sources",
    "prepare_data",
    "token_dtype",
    "train_default_tokenizer",
]
