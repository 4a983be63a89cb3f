"""Heartbeats: each rank's last step boundary, in a fixed-size record of its own file under
`<output_dir>/heartbeats/`, read when a watchdog fires to name the ranks that did not reach the
collective the others wait in.

A beat is one `pwrite` of 128 bytes into a file opened once (no metadata operation on the shared
file system per step: at 12,288 ranks and a 4-s step, about 3,000 small writes a second spread over
the file system's storage targets). When a rank's watchdog fires it writes `fired` with whether its
main thread waits inside a collective; after a grace period the lowest rank that fired while
waiting reads every record and names the ranks that are behind: not at the step, not fired (dead,
or hung holding the interpreter), or fired outside any collective (busy elsewhere: the culprit).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RECORD = 128
FOLDER = "heartbeats"


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    fired: bool  # its watchdog fired
    waiting: bool  # ... while its main thread was inside a collective
    host: str
    time: float


class Heartbeat:
    """This rank's heartbeat file, opened once."""

    def __init__(self, output_dir: str | Path, rank: int, host: str) -> None:
        self.folder = Path(output_dir) / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.host, self.step = rank, host.replace(" ", "_"), -1
        self.fd = os.open(self.folder / f"rank-{rank:06d}", os.O_RDWR | os.O_CREAT, 0o644)
        self.beat(-1)

    def beat(self, step: int, fired: bool = False, waiting: bool = False) -> None:
        self.step = step if not fired else self.step
        text = f"{self.step} {int(fired)} {int(waiting)} {time.time():.3f} {self.host}"
        os.pwrite(self.fd, text.encode()[: RECORD - 1].ljust(RECORD - 1) + b"\n", 0)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def read_beat(path: Path) -> Beat | None:
    try:
        fields = path.read_bytes()[:RECORD].decode(errors="replace").split()
        return Beat(int(path.name.split("-")[1]), int(fields[0]), fields[1] == "1", fields[2] == "1", fields[4],
                    float(fields[3]))
    except (OSError, ValueError, IndexError):
        return None


def main_thread_in_collective() -> bool:
    """Whether the main thread's stack is inside torch.distributed or DeepSpeed's comm (waiting for
    the other ranks) rather than computing or sleeping elsewhere."""
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name or "/deepspeed/comm/" in name:
            return True
        frame = frame.f_back
    return False


def name_the_missing(heartbeat: Heartbeat, world: int, grace_s: float) -> tuple[list[Beat | int], bool]:
    """Called by a rank whose watchdog fired: say so, wait `grace_s` for the others to say so too,
    then (on the lowest rank that fired while waiting) return the ranks that are behind, each its
    last `Beat` or its rank number when it never beat; and whether this rank is the one to report."""
    waiting = main_thread_in_collective()
    heartbeat.beat(heartbeat.step, fired=True, waiting=waiting)
    time.sleep(grace_s)
    step = heartbeat.step
    for rank in range(world):  # the reporter: the lowest rank that fired waiting at this step
        beat = read_beat(heartbeat.folder / f"rank-{rank:06d}")
        if beat is not None and beat.fired and beat.waiting and beat.step == step:
            if rank != heartbeat.rank:
                return [], False
            break
    else:
        if not waiting:
            return [], False
    behind: list[Beat | int] = []
    for rank in range(world):
        beat = read_beat(heartbeat.folder / f"rank-{rank:06d}")
        if beat is None:
            behind.append(rank)
        elif beat.step < step or not beat.fired or not beat.waiting:
            behind.append(beat)
    return behind, True
