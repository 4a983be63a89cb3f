"""Stateless orders and draws for a weighted mixture of sources (a keyed Feistel permutation, a Weyl
sequence), and what changed in a mixture since a checkpoint."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROUNDS = 6
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def stable_key(*parts) -> int:
    """A 64-bit key from `parts`, alike in every process and Python version."""
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
    """`offsets` in [0, n) under the keyed permutation of [0, n), as int64."""
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
    """Cut points in [0, 2^64) of the normalised cumulative weights, all but the last."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mixture weights must be non-negative with a positive sum, got {list(weights)}")
    cumulative = np.cumsum(w / w.sum())
    cumulative[np.flatnonzero(w)[-1] :] = 1.0  # sources of weight 0 at the end get no sliver of rounding
    return np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cumulative[:-1]], dtype=np.uint64)


def mixture_sources(positions, thresholds: np.ndarray, key: int) -> np.ndarray:
    """The source index (int64) of each global sample position."""
    p = np.asarray(positions, dtype=np.uint64)
    # Weyl sequence: n consecutive positions' shares are within O(log n) samples of the weights, no short period
    u = np.uint64(key) + p * GOLDEN
    return np.searchsorted(thresholds, u, side="right").astype(np.int64)


SHARE_CHANGE = "the share of source "  # how a derived change begins: the others are what the user did


def changed_data_message(changes: list[str], since: str = "the checkpoint") -> str:
    """The line a run resumed on changed data stops on."""
    done = [c for c in changes if not c.startswith(SHARE_CHANGE)]
    shares = [c for c in changes if c.startswith(SHARE_CHANGE)]
    parts = []
    if done:
        parts.append("; ".join(done[:3]) + (f" (and {len(done) - 3} more)" if len(done) > 3 else ""))
    if shares:
        more = f" (and {len(shares) - 1} more share{'s' if len(shares) > 2 else ''})" if len(shares) > 1 else ""
        parts.append(f"{'so ' if done else ''}{shares[0]}{more}")
    return (
        f"the data changed since {since}: {'; '.join(parts)}; set optimus.data.allow_change to true to continue "
        "on the new data"
    )


def data_changes(
    saved: dict, names: list[str], identities: list[str], shares, weights: list[float | None] | None = None
) -> list[str]:
    """How a checkpoint's sources (`state_dict()["sources"]`) differ from these: the user's changes, then
    the shares that moved; empty if none was added, dropped or holds other data and no share moved."""
    weights = list(weights) if weights is not None else [None] * len(names)
    current = dict(zip(names, zip(identities, shares, weights, strict=True), strict=True))
    added = [name for name in names if name not in saved]
    dropped = [name for name in saved if name not in current]
    renamed: dict[str, str] = {}  # new name -> old name: the same data (identity) under another name
    for old in dropped:
        new = next((n for n in added if n not in renamed and current[n][0] == saved[old].get("identity")), None)
        if new is not None:
            renamed[new] = old
    done = [f"source {renamed[name]!r} was renamed {name!r}" for name in added if name in renamed]
    done += [
        f"source {name!r} was added" + (f" (weight {current[name][2]:g})" if current[name][2] is not None else "")
        for name in added
        if name not in renamed
    ]
    done += [f"source {name!r} was dropped" for name in dropped if name not in renamed.values()]
    before = {name: saved[renamed.get(name, name)] for name in current if renamed.get(name, name) in saved}
    reweighted = _reweighted(
        {name: (record["weight"], current[name][2]) for name, record in before.items() if "weight" in record}
    )
    done += [f"source {name!r} was reweighted: {_weight(old)} -> {_weight(new)}" for name, (old, new) in reweighted]
    other, moved = [], []
    for name, record in before.items():
        identity, share, _ = current[name]
        if name in saved and record.get("identity") != identity:
            other.append(f"source {name!r} holds other data (its files, their sizes or times, or the tokenizer)")
        elif share is not None and abs(record.get("share", share) - share) > 1e-9:
            moved.append((name, f"{SHARE_CHANGE}{name!r} went from {record['share']:.4g} to {share:.4g}"))
    if not (added or dropped or other or moved):  # weights that moved no share are no change
        return []
    first = {name for name, _ in reweighted}  # the shares of the sources the user reweighted first
    return done + other + [text for name, text in sorted(moved, key=lambda m: m[0] not in first)]


def _reweighted(pairs: dict[str, tuple[float | None, float | None]]) -> list[tuple[str, tuple]]:
    """(name, (old, new)) of the sources reweighted beyond the scale factor most of them share."""
    ratios = [new / old for old, new in pairs.values() if old is not None and new is not None]
    scale = 1.0
    counts = {r: sum(1 for q in ratios if abs(q - r) <= 1e-9 * r) for r in ratios}
    if counts:
        best = max(counts.values())
        modes = {r for r, n in counts.items() if n == best}
        if best > 1 and max(modes) - min(modes) <= 1e-9 * max(modes):
            scale = min(modes)
    changed = []
    for name, (old, new) in pairs.items():
        if (old is None) != (new is None) or (old is not None and abs(new - old * scale) > 1e-9 * old * scale):
            changed.append((name, (old, new)))
    return changed


def _weight(weight: float | None) -> str:
    return "by size" if weight is None else f"{weight:g}"
