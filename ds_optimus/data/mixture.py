"""The weighted mixture of sources: orders and draws that cost nothing per sequence (a keyed
bijection instead of a permutation array, and a low-discrepancy draw of sources instead of a
sampled list), and what changed in a mixture since a checkpoint recorded it.

`permute(offsets, n, key)` maps offsets in [0, n) to a pseudo-random permutation of [0, n) with a
balanced Feistel network over the smallest even power of two >= n, walking the cycle until the
value falls inside [0, n). Nothing is stored: the i-th sequence of an epoch of 2x10^9 sequences is
a dozen integer operations away, on every rank alike.

`mixture_sources(positions, weights, key)` gives the source of each global sample position from a
Weyl sequence u_p = key + p * 2^64/phi (mod 2^64), cut at the cumulative weights. The shares of
any window of n consecutive positions are within O(log n) samples of the weights, and no source
falls into a short period with the data-parallel ranks (as a round robin would).

`data_changes` compares a checkpoint's record of the sources (`TokenBatches.state_dict()["sources"]`)
with the sources of now; `changed_data_message` is the one line a resumed run stops on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROUNDS = 6
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def stable_key(*parts) -> int:
    """A 64-bit key from `parts` (their str), the same in every process and Python version."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def permute(offsets, n: int, key: int) -> np.ndarray:
    """The images of `offsets` (ints in [0, n)) under the keyed permutation of [0, n), as int64."""
    x = np.asarray(offsets, dtype=np.int64)
    if n < 1:
        raise ValueError(f"cannot permute an empty range (n = {n})")
    if x.size and (x.min() < 0 or x.max() >= n):
        raise ValueError(f"offsets must lie in [0, {n})")
    if n == 1:
        return np.zeros_like(x)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 * half bits cover [0, n)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    round_keys = [np.uint64(stable_key(key, r)) for r in range(ROUNDS)]
    out = x.astype(np.uint64)
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():  # cycle walking: at most a few passes, the domain is under 4n
        v = out[todo]
        left, right = v >> shift, v & mask
        for k in round_keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        out[todo] = (left << shift) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


def mixture_thresholds(weights: Sequence[float]) -> np.ndarray:
    """The cut points in [0, 2^64) of the normalised cumulative weights (all but the last)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mixture weights must be non-negative with a positive sum, got {list(weights)}")
    cumulative = np.cumsum(w / w.sum())
    cumulative[np.flatnonzero(w)[-1]:] = 1.0  # sources of weight 0 at the end get no sliver of rounding
    return np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cumulative[:-1]], dtype=np.uint64)


def mixture_sources(positions, thresholds: np.ndarray, key: int) -> np.ndarray:
    """The source index (int64) of each global sample position."""
    p = np.asarray(positions, dtype=np.uint64)
    u = np.uint64(key) + p * GOLDEN
    return np.searchsorted(thresholds, u, side="right").astype(np.int64)


def changed_data_message(changes: list[str], since: str = "the checkpoint") -> str:
    more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
    return (f"the data changed since {since}: {changes[0]}{more}; set optimus.data.allow_change to true to continue "
            "on the new data")


def data_changes(saved: dict, names: list[str], identities: list[str], shares) -> list[str]:
    """What differs between a checkpoint's sources (`state_dict()["sources"]`) and these (a share of
    None: not known, not compared)."""
    changes = [f"source {name!r} was dropped" for name in saved if name not in names]
    for name, identity, share in zip(names, identities, shares, strict=True):
        if name not in saved:
            changes.append(f"source {name!r} was added")
        elif saved[name].get("identity") != identity:
            changes.append(f"source {name!r} holds other data (its files, their sizes or times, or the tokenizer)")
        elif share is not None and abs(saved[name].get("share", share) - share) > 1e-9:
            changes.append(f"the share of source {name!r} went from {saved[name]['share']:.4g} to {share:.4g}")
    return changes
