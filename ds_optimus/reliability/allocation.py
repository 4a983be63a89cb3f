"""The nodes a supervised run launches on: the allocation's hosts less those faults struck out,
spares taking their places first, then fewer nodes (a smaller data-parallel size) where the layout
allows it.

    allocation = Allocation(hosts, spares=2)
    hosts = allocation.choose(strikes={"x3": 1}, strikes_to_leave_out=1, fits=fits)

`fits(nodes) -> str | None` says why a node count cannot run the layout (None: it can); the
supervisor asks the trainer's `--check` in a subprocess. The launch command's placeholders
(`{hostfile}`, `{hosts}`, `{nodes}`, `{ranks}`) are filled from the chosen hosts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..launch.hosts import short_host


class AllocationError(RuntimeError):
    """Too few healthy nodes for the layout; the message says how many and why, in one line."""


PLACEHOLDERS = ("{hostfile}", "{hosts}", "{nodes}", "{ranks}")


class Allocation:
    """`hosts` in the allocation's order; the last `spares` of them are held back until a node is
    struck out. `out` grows as faults strike nodes; a node once out stays out."""

    def __init__(self, hosts: list[str], spares: int = 0) -> None:
        if spares < 0 or spares >= len(hosts):
            raise AllocationError(
                f"{spares} spare node{'s' if spares != 1 else ''} leaves none of the allocation's "
                f"{len(hosts)} to run on"
            )
        self.hosts, self.spares = list(hosts), spares
        self.out: list[str] = []
        self.nodes = len(hosts) - spares  # the node count the run is meant to have

    def choose(
        self, strikes: dict[str, int], strikes_to_leave_out: int, fits: Callable[[int], str | None] | None = None
    ) -> list[str]:
        """The hosts of the next attempt: the first `nodes` healthy ones in allocation order (spares
        after the others); fewer when not enough are healthy, as many as the layout allows."""
        for host in self.hosts:  # `strikes` by short name (fault_log.strikes)
            if strikes.get(short_host(host), 0) >= strikes_to_leave_out and host not in self.out:
                self.out.append(host)
        healthy = [host for host in self.hosts if host not in self.out]
        if len(healthy) >= self.nodes:
            return healthy[: self.nodes]
        reasons = []
        for count in range(len(healthy), 0, -1):
            reason = fits(count) if fits is not None else None
            if reason is None:
                return healthy[:count]
            reasons.append(f"{count}: {reason}")
            if not _names_a_size(reason):  # a reason no smaller count changes (data, a key): stop asking
                break
        left = f"{len(healthy)} healthy node{'s' if len(healthy) != 1 else ''} left"
        raise AllocationError(
            f"{left} (left out: {', '.join(self.out)}) and the layout runs on none of "
            f"{len(healthy)} down to 1 ({reasons[0] if reasons else 'no node at all'}); stopping"
        )


def _names_a_size(reason: str) -> bool:
    """Whether a `--check` refusal is about the world's size (it says a rank or world count)."""
    return any(word in reason for word in ("rank", "world", "divide", "fit", "GiB"))


def fill(command: list[str], hosts: list[str], ranks_per_node: int, hostfile: Path) -> list[str]:
    """`command` with its placeholders filled for `hosts` (the host file written, one host a line)."""
    hostfile.parent.mkdir(parents=True, exist_ok=True)
    hostfile.write_text("".join(f"{host}\n" for host in hosts))
    values = {
        "{hostfile}": str(hostfile),
        "{hosts}": ",".join(hosts),
        "{nodes}": str(len(hosts)),
        "{ranks}": str(len(hosts) * ranks_per_node),
    }
    out = []
    for arg in command:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out
