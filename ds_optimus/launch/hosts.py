"""Host lists as job schedulers write them (Slurm node lists, PBS node files, hostfiles), as the ordered list
of distinct hosts. A leaf: the standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path


class HostListError(ValueError):
    """A host list that cannot be read (a one-line message naming it)."""


def expand_slurm_hostlist(text: str) -> list[str]:
    """`"nid[08-10,7],b"` -> `["nid08", "nid09", "nid10", "nid7", "b"]`; bracket groups expand left to right."""
    hosts: list[str] = []
    for name in _split_top_level(text.strip()):
        hosts.extend(_expand_one(name, text))
    return _distinct(hosts)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (part.strip() for part in parts) if p]


def _expand_one(name: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", name)
    if match is None:
        if "[" in name or "]" in name:
            raise HostListError(f"unbalanced brackets in the node list {whole!r}")
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    out = []
    for item in match.group(1).split(","):
        bounds = item.strip().split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values = [bounds[0]]
        elif len(bounds) == 2 and all(b.isdigit() for b in bounds) and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            values = [str(v).zfill(width) for v in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            raise HostListError(f"cannot read the range {item!r} in the node list {whole!r}")
        for value in values:
            out.extend(_expand_one(head + value + tail, whole))
    return out


def short_host(host: str) -> str:
    """`x4102c5s3b0n0.hostmgmt.example.gov` -> `x4102c5s3b0n0` (node files and `gethostname()` may differ)."""
    return host.split(".", 1)[0]


def read_hostfile(path: str | Path) -> list[str]:
    """The distinct hosts, in order, of a PBS node file or a `host slots=N` or `host:N` hostfile."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise HostListError(f"cannot read the host file {str(path)!r}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise HostListError(f"the host file {str(path)!r} is not text") from None
    hosts = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line.split()[0].split(":")[0])
    if not hosts:
        raise HostListError(f"the host file {str(path)!r} lists no host")
    return _distinct(hosts)


def _distinct(hosts: list[str]) -> list[str]:
    return list(dict.fromkeys(hosts))
