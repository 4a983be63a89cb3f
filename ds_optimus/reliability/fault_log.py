"""The run's fault log `<output_dir>/faults.jsonl` (JSON lines), read by the supervisor to leave nodes out.

Kinds: `nonfinite` (a rank's own NaN/Inf loss), `hang` (ranks the watchdog found missing from a collective),
`straggler` (informational), `probe` (a failed pre-launch probe), `lost` (ranks that ended without a word).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..launch.hosts import short_host

FAULTS_FILE = "faults.jsonl"
STRIKING = ("nonfinite", "hang", "probe", "lost")  # the kinds that count against a node


def append_fault(
    output_dir: str | Path,
    step: int | None,
    kind: str,
    ranks: list[int],
    hosts: list[str],
    detail: str = "",
    attempt: int | None = None,
) -> dict:
    """Append one record in one `write` (appenders never interleave); `attempt` defaults to DS_OPTIMUS_ATTEMPT."""
    if attempt is None:
        attempt = int(os.environ.get("DS_OPTIMUS_ATTEMPT", "0") or 0)
    record = {
        "step": step,
        "kind": kind,
        "ranks": sorted(ranks),
        "hosts": sorted(set(hosts)),
        "attempt": attempt,
        "time": round(time.time(), 3),
        "detail": detail,
    }
    path = Path(output_dir) / FAULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def read_faults(output_dir: str | Path) -> list[dict]:
    """The log's records, skipping a torn last line."""
    path = Path(output_dir) / FAULTS_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


MAX_HOSTS_STRUCK = 2  # a fault naming more hosts than this spread from one (a NaN through the exchange)


def strikes(records: list[dict], since: float | None = None) -> dict[str, int]:
    """Striking faults per short host name since `since`, in records naming at most MAX_HOSTS_STRUCK hosts."""
    counts: dict[str, int] = {}
    for record in records:
        if record.get("kind") not in STRIKING or (since is not None and record.get("time", 0) < since):
            continue
        # Short names: node files hold full names where `gethostname()` may give short ones.
        hosts = {short_host(h) for h in record.get("hosts", [])}
        if len(hosts) <= MAX_HOSTS_STRUCK:
            for host in hosts:
                counts[host] = counts.get(host, 0) + 1
    return counts


def describe(ranks: list[int], hosts: list[str], limit: int = 8) -> str:
    """`rank 3 (host n2)` / `ranks 3, 9 (hosts n2, n5)`, long lists cut with a count."""

    def cut(items: list) -> str:
        shown = ", ".join(map(str, items[:limit]))
        return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")

    distinct = sorted(set(hosts))
    return (
        f"rank{'s' if len(ranks) != 1 else ''} {cut(sorted(ranks))} "
        f"(host{'s' if len(distinct) != 1 else ''} {cut(distinct)})"
    )
