"""The hosts a supervised run launches on, less those faults struck out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..launch.hosts import short_host


class AllocationError(RuntimeError):
    """Too few healthy nodes for the layout."""


PLACEHOLDERS = ("{hostfile}", "{hosts}", "{nodes}", "{ranks}")


class Allocation:
    """`hosts` in order, the last `spares` held back; a node once in `out` stays out."""

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
        """The next attempt's hosts: the first `nodes` healthy ones, else as many as `fits` allows."""
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
    """Whether a `--check` refusal is about the world's size."""
    return any(word in reason for word in ("rank", "world", "divide", "fit", "GiB"))


def fill(command: list[str], hosts: list[str], ranks_per_node: int, hostfile: Path) -> list[str]:
    """`command` with its placeholders filled for `hosts`."""
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
