"""Pretraining data: sources (the embedded corpus, local files plain or compressed, `datasets`
folders and names, pre-tokenized token files), tokenizers, parallel and resumable tokenization
into memory-mapped token shards, and a resumable data-parallel loader over a weighted mixture.

Names are imported on first use: a tokenizing worker process imports neither PyTorch nor
Transformers."""

from .._lazy import lazy_exports

_EXPORTS = {
    "DataError": ".corpus", "Source": ".corpus", "describe": ".corpus", "embedded_documents": ".corpus",
    "iter_documents": ".corpus", "parse_source": ".corpus", "parse_sources": ".corpus",
    "TokenBatches": ".loader", "eval_batches": ".loader",
    "PreparedData": ".pack", "PreparedSource": ".pack", "prepare_data": ".pack", "token_dtype": ".pack",
    "load_tokenizer": ".tokenizer", "train_default_tokenizer": ".tokenizer",
    "TokenStream": ".tokens", "open_token_files": ".tokens",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
