"""What the converter tests (test_convert_olmo, test_convert_olmoe) share: prompts, logits, a folder loaded
and checked complete, and a command line's one-line error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

VOCAB = 112  # the tiny models' vocabulary


def random_ids(seed: int = 1, batch: int = 2, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=g)  # no pad/eos ids in the prompt


@torch.no_grad()
def logits(model, ids, **kwargs) -> torch.Tensor:
    return model(input_ids=ids, **kwargs).logits.float()


def load(folder: Path, cls=AutoModelForCausalLM, **kwargs):
    """`cls.from_pretrained(folder)`, every weight found and used, in eval mode."""
    model, info = cls.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def expect_error(capsys, main: Callable[[list[str]], int], prog: str, argv) -> str:
    """main(argv) must return 2 and print exactly one '<prog>: error: ...' line to stderr; returns it."""
    capsys.readouterr()  # drop what the test's own set-up printed (save_pretrained progress bars)
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: ") and len(lines[0]) > len(f"{prog}: error: ") + 5
    return lines[0]
