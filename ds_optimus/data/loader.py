"""A resumable, data-parallel loader over a packed token file.

The token stream is cut into sequences of `seq_len` tokens. Each epoch visits every sequence once
in an order fixed by (seed, epoch). Global sample position p maps to epoch p // N and to the
(p % N)-th sequence of that epoch's order, so the loader's whole state is the number of tokens
consumed: a resumed run sees exactly the batches the uninterrupted one would have. A global
micro-batch holds `micro_batch_size * dp_size` consecutive positions; rank r takes its block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .corpus import DataError


def sequence(tokens: np.ndarray, seq_len: int, index: int) -> torch.Tensor:
    """The `index`-th sequence of `seq_len` tokens of a packed token stream, as int64."""
    start = index * seq_len
    return torch.from_numpy(np.asarray(tokens[start:start + seq_len], dtype=np.int64))


class TokenBatches:
    """Micro-batches `[micro_batch_size, seq_len]` (int64) for one data-parallel rank."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True, split: str = "train") -> None:
        if seq_len < 2 or micro_batch_size < 1:
            raise DataError(f"seq_len must be >= 2 and micro_batch_size >= 1, got {seq_len} and {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.tokens = tokens
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.num_sequences = len(tokens) // seq_len
        if self.num_sequences < micro_batch_size * dp_size:
            raise DataError(f"the {split} split has {len(tokens):,} tokens: {self.num_sequences} sequences of "
                            f"{seq_len}, fewer than one global micro-batch ({micro_batch_size} x {dp_size} ranks)")
        self.position = 0  # global samples consumed
        self._epoch, self._order = -1, None

    @property
    def tokens_consumed(self) -> int:
        return self.position * self.seq_len

    @property
    def epoch(self) -> int:
        return self.position // self.num_sequences

    def _sequence_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_sequences)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.num_sequences, generator=gen).numpy()
            self._epoch = epoch
        return int(self._order[offset])

    def next_batch(self) -> torch.Tensor:
        """This rank's next micro-batch; every rank advances by one global micro-batch."""
        first = self.position + self.dp_rank * self.micro_batch_size
        rows = [sequence(self.tokens, self.seq_len, self._sequence_index(p))
                for p in range(first, first + self.micro_batch_size)]
        self.position += self.micro_batch_size * self.dp_size
        return torch.stack(rows)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_consumed": self.tokens_consumed, "seq_len": self.seq_len, "seed": self.seed,
                "global_micro_batch": self.micro_batch_size * self.dp_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seq_len"] != self.seq_len or state["seed"] != self.seed:
            raise DataError(f"the loader state was saved with seq_len {state['seq_len']} and seed {state['seed']}, "
                            f"this run uses {self.seq_len} and {self.seed}")
        if state["tokens_consumed"] % self.seq_len:
            raise DataError(f"tokens_consumed {state['tokens_consumed']} is not a multiple of seq_len {self.seq_len}")
        self.position = state["tokens_consumed"] // self.seq_len


def eval_batches(tokens: np.ndarray, seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 max_batches: int) -> list[torch.Tensor]:
    """This rank's share of the first held-out sequences, in order: the same every evaluation."""
    loader = TokenBatches(tokens, seq_len, micro_batch_size, dp_rank, dp_size, shuffle=False, split="held-out")
    count = min(max_batches, loader.num_sequences // (micro_batch_size * dp_size))
    return [loader.next_batch() for _ in range(count)]
