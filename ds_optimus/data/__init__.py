"""Pretraining data: sources, tokenizers, token shards and a resumable data-parallel loader.

Each module imports only earlier ones (`ORDER`, tests/test_data_imports.py); names load on first use, so a
tokenizing worker imports neither PyTorch nor Transformers."""

from .._lazy import lazy_exports

_EXPORTS = {  # in the order of the pipeline: sources -> work units -> tokenizing workers -> shards -> loader
    "DataError": ".errors",
    "Source": ".sources",
    "parse_source": ".sources",
    "parse_sources": ".sources",
    "embedded_documents": ".documents",
    "iter_documents": ".documents",
    "load_tokenizer": ".tokenizer",
    "train_default_tokenizer": ".tokenizer",
    "describe": ".units",
    "token_dtype": ".tokenize_workers",
    "PreparedData": ".shards",
    "PreparedSource": ".shards",
    "TokenStream": ".shards",
    "open_token_files": ".shards",
    "TokenBatches": ".loader",
    "eval_batches": ".loader",
    "prepare_data": ".prepare",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
