"""A run's data: tokenized once on every node, described in the log, a prompt from held-out text."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..command_line import said_by_every_rank


def prepare_everywhere(data, tokenizer):
    """Open the run's data, tokenizing what is not prepared: rank 0 plans and broadcasts, each rank tokenizes its
    share."""
    from ..data import DataError, parse_sources, prepare_data
    from ..data.units import plan_sources

    sources = parse_sources(data.sources)
    prepare = functools.partial(
        prepare_data, sources, tokenizer, data.cache_dir, data.val_fraction, workers=data.workers
    )
    if not dist.is_initialized():  # the Hugging Face Trainer's script prepares before its group exists
        from ..data.prepare import launch_world

        rank, world = launch_world()
        return prepare(rank=rank, world=world, progress=rank == 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:
        check_shared_folder(Path(data.cache_dir), "optimus.data.cache_dir")
    found: list[Any] = [None]
    if rank == 0:
        try:
            found[0] = ("plan", plan_sources(sources, tokenizer, data.cache_dir, data.val_fraction))
        except Exception as err:  # whatever it is, the ranks waiting below must hear of it
            found[0] = ("error", str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}")
    if world > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0][0] == "error":
        raise said_by_every_rank(DataError(found[0][1]))
    return prepare(rank=rank, world=world, progress=rank == 0, plan=found[0][1])


def describe_data(packed, loader) -> str:
    """One line on the run's data: tokens, documents, source shares."""
    tokens_only = sum(1 for s in packed.sources if s.documents is None)
    docs = f" from {packed.documents:,} documents" if packed.documents else ""
    if tokens_only:
        docs += f"{' and' if docs else ' from'} {tokens_only} pre-tokenized source{'s' if tokens_only > 1 else ''}"
    line = f"data: {packed.train_tokens:,} train / {packed.val_tokens:,} held-out tokens{docs} ({packed.root})"
    if len(loader.names) > 1:
        line += "; drawn " + ", ".join(
            f"{name} {share:.1%}" for name, share in zip(loader.names, loader.weights, strict=True)
        )
    return line


def check_shared_folder(folder: Path, what: str) -> None:
    """Raise on every rank unless all ranks see rank 0's files in `folder` (collective)."""
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f".shared-probe-{token[0]}").write_text(token[0])
        except OSError as err:
            token[0] = f"error: {err}"
    dist.broadcast_object_list(token, src=0)
    if token[0].startswith("error: "):
        raise said_by_every_rank(ValueError(f"{what} {str(folder)!r}: {token[0][7:]}"))
    probe = folder / f".shared-probe-{token[0]}"  # one launch's own, beside another's that started with it
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else socket.gethostname())
    blind = sorted({host for host in blind if host is not None})
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    if blind:
        raise said_by_every_rank(
            ValueError(
                f"{what} {str(folder)!r} is not shared: rank 0's files there are not seen on {', '.join(blind[:4])}"
                f"{' ...' if len(blind) > 4 else ''}; put it on a filesystem every node mounts"
            )
        )


def data_prompt(packed, tokenizer, tokens: int = 6) -> str:
    """The first held-out (else training) document's first `tokens` tokens, up to its end."""
    for split in ("val", "train"):
        ids = packed.tokens(split).head(tokens).tolist()
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        if ids:
            return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.eos_token
