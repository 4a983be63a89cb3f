"""Tokenizers: any Hugging Face tokenizer by name or folder, or the shipped default byte-level BPE
(`default_tokenizer.json`, rebuilt by `python -m ds_optimus.data.tokenizer`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

DEFAULT_TOKENIZER_FILE = Path(__file__).with_name("default_tokenizer.json")
DEFAULT_VOCAB_SIZE = 4096
PAD, EOS = "<pad>", "<eos>"


def train_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train the default byte-level BPE on the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .documents import embedded_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(embedded_documents(), trainer)
    return tokenizer


def load_tokenizer(name_or_path: str | None = None, local_files_only: bool = False):
    """The default tokenizer for None/"default", else `AutoTokenizer.from_pretrained(name_or_path)`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name_or_path in (None, "default"):
        return PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_TOKENIZER_FILE), eos_token=EOS, pad_token=PAD)
    local = Path(name_or_path).expanduser()
    if not local.exists() and looks_like_a_path(name_or_path):
        raise ValueError(f"tokenizer folder {name_or_path!r} does not exist")
    if local.exists() and not local.is_dir():
        raise ValueError(f"tokenizer {name_or_path!r} is a file; give the folder that holds it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            local if local.exists() else name_or_path, local_files_only=local_files_only
        )
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = "" if local.exists() else " (no such folder here; tried it as a Hub name)"
        raise ValueError(f"cannot load tokenizer {name_or_path!r}{where}: {first}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no end-of-text token; documents could not be separated")
    return tokenizer


def looks_like_a_path(name: str) -> bool:
    """Whether `name` can only be a local path, not a Hub id."""
    return (
        name.startswith(("/", ".", "~"))
        or "\\" in name
        or name.endswith("/")
        or name.count("/") > 1
        or Path(name).suffix in (".json", ".model")
    )


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides how the tokenizer encodes text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{state}|eos={tokenizer.eos_token_id}".encode()).hexdigest()


def main() -> None:
    tokenizer = train_default_tokenizer()
    tokenizer.save(str(DEFAULT_TOKENIZER_FILE))
    print(f"wrote {DEFAULT_TOKENIZER_FILE} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
