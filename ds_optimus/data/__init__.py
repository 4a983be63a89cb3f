"""Pretraining data: sources (the embedded corpus, local files plain or compressed, `datasets`
folders and names, pre-tokenized token files), tokenizers, parallel and resumable tokenization
into memory-mapped token shards, and a resumable data-parallel loader over a weighted mixture.

Data flows one way, and each module imports only modules before it in this list (never a later
one, also not inside a function; tests/test_data_imports.py checks it):

    errors            DataError
    sources           the `optimus.data` section (`DataConfig`), its sources, and the files each names
    token_files       pre-tokenized token files: where each file's ids lie, from its header
    compressed        readers of .gz and .zst text
    documents         the text documents of a source
    tokenizer         tokenizers: a Hugging Face one, or the shipped default
    units             each source's identity, shard folder and work units (`plan_sources`)
    tokenize_workers  the pending units tokenized into shards, by the processes of a launch
    shards            every source opened from its shards (or its token files) as token streams
    mixture           the weighted draw of sources, the order of each, changes since a checkpoint
    loader            the resumable data-parallel loader (`TokenBatches`)
    prepare           `prepare_data` (plan, tokenize, open) and its command line

Names are imported on first use: a tokenizing worker process imports neither PyTorch nor
Transformers."""

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
