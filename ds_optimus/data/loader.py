"""A resumable, data-parallel loader over a weighted mixture of token streams.

Position p draws a source by a low-discrepancy draw on the weights; its k-th draw is sequence
`permute(k % N, N, key(seed, source, k // N))`, a keyed bijection (no memory, a new order each epoch). The state
resumes exactly the uninterrupted run's batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import DataError
from .mixture import changed_data_message, data_changes, mixture_sources, mixture_thresholds, permute, stable_key
from .shards import TokenStream


def _parts(data, split: str) -> list[tuple[str, TokenStream, float | None, str]]:
    """(name, stream, weight, identity) of each source of `data` with tokens of `split`."""
    if isinstance(data, TokenStream):
        return [("data", data, None, "")]
    if isinstance(data, np.ndarray):
        return [("data", TokenStream([data]), None, "")]
    parts = []
    for source in data.sources:
        stream = source.train if split == "train" else source.val
        if stream is not None:
            parts.append((source.name, stream, source.weight, source.identity))
    return parts


class TokenBatches:
    """Int64 micro-batches `[micro_batch_size, seq_len]` for one data-parallel rank from a `PreparedData`,
    `TokenStream` or token array."""

    def __init__(
        self,
        data,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        split: str = "train",
        vocab_size: int | None = None,
    ) -> None:
        if seq_len < 2 or micro_batch_size < 1:
            raise DataError(f"seq_len must be >= 2 and micro_batch_size >= 1, got {seq_len} and {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        parts = _parts(data, split)
        if split != "train":  # a source whose held-out split is under one sequence is left out of it
            parts = [p for p in parts if p[1].num_sequences(seq_len) > 0] or parts
        self.names = [name for name, *_ in parts]
        self.streams = [stream for _, stream, *_ in parts]
        self.identities = [identity for *_, identity in parts]
        self.given_weights = [weight for _, _, weight, _ in parts]  # as the config gives them (None: by size)
        self.sizes = np.array([s.num_sequences(seq_len) for s in self.streams], dtype=np.int64)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.vocab_size = seed, shuffle, vocab_size
        self.num_sequences = int(self.sizes.sum())
        total = sum(s.total for s in self.streams)
        if self.num_sequences < micro_batch_size * dp_size:
            raise DataError(
                f"the {split} split has {total:,} tokens: {self.num_sequences} sequences of "
                f"{seq_len}, fewer than one global micro-batch ({micro_batch_size} x {dp_size} ranks)"
            )
        given = [w for _, _, w, _ in parts]
        if all(w is not None for w in given):
            for name, size in zip(self.names, self.sizes, strict=True):
                if size == 0:
                    raise DataError(
                        f"source {name!r} has fewer than {seq_len} {split} tokens: not one sequence "
                        "to draw (give it more data, or leave it out)"
                    )
            weights = np.array(given, dtype=np.float64)
        else:  # in proportion to the sizes: one uniform order over all the sources' sequences
            weights = self.sizes.astype(np.float64)
        self.weights = weights / weights.sum()
        if vocab_size is not None:  # the first tokens of each source: another tokenizer's files fail here, once
            for name, stream in zip(self.names, self.streams, strict=True):
                head = stream.head(1 << 16)
                if head.size and head.max() >= vocab_size:
                    raise DataError(
                        f"source {name!r} holds token id {int(head.max())} in its first {head.size:,} "
                        f"tokens, outside the model's vocabulary of {vocab_size} (tokenized with another "
                        "tokenizer?)"
                    )
        self._thresholds = mixture_thresholds(self.weights)
        self._mix_key = stable_key(seed, "mixture", split)
        self.position = 0  # global samples consumed
        self.drawn = np.zeros(len(self.streams), dtype=np.int64)  # sequences each source has given
        self._epochs_said = np.zeros(len(self.streams), dtype=np.int64)
        self.events: list[str] = []  # what the log should say once (a source starting another epoch)

    @property
    def tokens_consumed(self) -> int:
        return self.position * self.seq_len

    def source_tokens(self) -> dict[str, int]:
        """Tokens each source has given (over all ranks)."""
        return {name: int(n) * self.seq_len for name, n in zip(self.names, self.drawn, strict=True)}

    def source_epochs(self) -> dict[str, float]:
        """Epochs of each source so far."""
        return {
            name: float(n) / max(int(size), 1) for name, n, size in zip(self.names, self.drawn, self.sizes, strict=True)
        }

    def _draws(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and per-source draw index of the next `count` global positions."""
        positions = np.arange(self.position, self.position + count, dtype=np.int64)
        sources = (
            mixture_sources(positions, self._thresholds, self._mix_key)
            if len(self.streams) > 1
            else np.zeros(count, dtype=np.int64)
        )
        draws = np.empty(count, dtype=np.int64)
        for s in np.unique(sources):
            mask = sources == s
            draws[mask] = self.drawn[s] + np.arange(int(mask.sum()))
        return sources, draws

    def _rows(self, sources: np.ndarray, draws: np.ndarray) -> np.ndarray:
        rows = np.empty((len(sources), self.seq_len), dtype=np.int64)
        for row, (s, k) in enumerate(zip(sources.tolist(), draws.tolist(), strict=True)):
            size = int(self.sizes[s])
            epoch, offset = divmod(k, size)
            index = (
                int(permute([offset], size, stable_key(self.seed, self.names[s], epoch))[0]) if self.shuffle else offset
            )
            rows[row] = self.streams[s].read(index * self.seq_len, self.seq_len)
            if self.vocab_size is not None and rows[row].max() >= self.vocab_size:
                raise DataError(
                    f"source {self.names[s]!r} holds token id {int(rows[row].max())}, outside the model's "
                    f"vocabulary of {self.vocab_size} (tokenized with another tokenizer?)"
                )
        return rows

    def sample(self, index: int) -> torch.Tensor:
        """Sequence `index` by random access (the HF Trainer's sampler): sources own consecutive index ranges by
        weight."""
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} of {self.num_sequences}")
        ends = np.floor(np.cumsum(self.weights) * self.num_sequences).astype(np.int64)
        ends[-1] = self.num_sequences  # not a float's rounding short of it
        s = int(np.searchsorted(ends, index, side="right"))
        draw = index - (int(ends[s - 1]) if s else 0)
        return torch.from_numpy(self._rows(np.array([s]), np.array([draw]))[0])

    def next_batch(self) -> torch.Tensor:
        """This rank's next micro-batch; every rank advances by one global micro-batch."""
        count = self.micro_batch_size * self.dp_size
        sources, draws = self._draws(count)
        mine = slice(self.dp_rank * self.micro_batch_size, (self.dp_rank + 1) * self.micro_batch_size)
        rows = self._rows(sources[mine], draws[mine])
        self.position += count
        self.drawn += np.bincount(sources, minlength=len(self.streams))
        self._note_epochs()
        return torch.from_numpy(rows)

    def _note_epochs(self) -> None:
        started = np.where(self.drawn > 0, (self.drawn - 1) // np.maximum(self.sizes, 1), 0)
        for s in np.flatnonzero(started > self._epochs_said):
            self.events.append(
                f"data: source {self.names[s]!r} ran through its {int(self.sizes[s]):,} sequences; "
                f"epoch {int(started[s]) + 1} of it goes on in a new order"
            )
        self._epochs_said = np.maximum(self._epochs_said, started)

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "tokens_consumed": self.tokens_consumed,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "global_micro_batch": self.micro_batch_size * self.dp_size,
            "sources": {
                name: {
                    "drawn": int(n),
                    "identity": identity,
                    "share": float(w),
                    "weight": weight,
                    "sequences": int(size),
                }
                for name, n, identity, w, weight, size in zip(
                    self.names, self.drawn, self.identities, self.weights, self.given_weights, self.sizes, strict=True
                )
            },
        }

    def load_state_dict(self, state: dict[str, Any], allow_change: bool = False) -> list[str]:
        """Continue from `state`; returns the data's changes, a `DataError` unless `allow_change`."""
        if state["seq_len"] != self.seq_len or state["seed"] != self.seed:
            raise DataError(
                f"the loader state was saved with seq_len {state['seq_len']} and seed {state['seed']}, "
                f"this run uses {self.seq_len} and {self.seed}"
            )
        if state["tokens_consumed"] % self.seq_len:
            raise DataError(f"tokens_consumed {state['tokens_consumed']} is not a multiple of seq_len {self.seq_len}")
        self.position = state["tokens_consumed"] // self.seq_len
        saved = state.get("sources")
        if saved is None:  # a checkpoint from before per-source records: one stream, all of it drawn in order
            saved = (
                {self.names[0]: {"drawn": self.position, "identity": self.identities[0], "share": 1.0}}
                if len(self.names) == 1
                else {}
            )
        changes = data_changes(saved, self.names, self.identities, self.weights, self.given_weights)
        if changes and not allow_change:
            raise DataError(changed_data_message(changes))
        self.drawn = np.array([saved.get(name, {}).get("drawn", 0) for name in self.names], dtype=np.int64)
        self._epochs_said = np.where(self.drawn > 0, (self.drawn - 1) // np.maximum(self.sizes, 1), 0)
        return changes


def eval_batches(
    data, seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int, max_batches: int
) -> list[torch.Tensor]:
    """This rank's share of the first held-out sequences: the same every evaluation."""
    loader = TokenBatches(data, seq_len, micro_batch_size, dp_rank, dp_size, shuffle=False, split="val")
    count = min(max_batches, loader.num_sequences // (micro_batch_size * dp_size))
    return [loader.next_batch() for _ in range(count)]
