"""Heartbeats: each rank's last step boundary, in a fixed-size record of its own file under
`<output_dir>/heartbeats/`, read when a watchdog fires to name the ranks that did not reach the
collective the others wait in.

A beat is one `pwrite` of 128 bytes into a file opened once (no metadata operation on the shared
file system per step: at 12,288 ranks and a 4-s step, about 3,000 small writes a second spread over
the file system's storage targets). When a rank's watchdog fires it writes `fired` with whether its
main thread waits on the others; the first waiting rank to claim the step's report waits a grace
period, reads every record once and names the ranks that are behind: not at the step, not fired
(dead, or hung holding the interpreter), or fired while not waiting (busy elsewhere: the culprit).
A rank whose accelerator hangs inside a kernel waits at the step's read like the healthy ones, so
it is named only when its process stops answering too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
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
        if rank == 0:  # an earlier launch's report claims (a watchdog fires long after every rank starts)
            for stale in self.folder.glob("reporter-*"):
                stale.unlink(missing_ok=True)

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


_waiting = threading.Event()  # set by the trainer while its main thread waits for the step's reduction


@contextlib.contextmanager
def waiting_for_peers():
    """Around a host wait on the other ranks (the step's all-reduce and its read to the host: on an
    accelerator the collective is queued and the host waits at the read, outside torch.distributed)."""
    _waiting.set()
    try:
        yield
    finally:
        _waiting.clear()


def main_thread_in_collective() -> bool:
    """Whether the main thread waits on the other ranks: inside `waiting_for_peers()`, or with
    torch.distributed or DeepSpeed's comm on its stack (a blocking collective), rather than
    computing or sleeping elsewhere."""
    if _waiting.is_set():
        return True
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name or "/deepspeed/comm/" in name:
            return True
        frame = frame.f_back
    return False


def name_the_missing(heartbeat: Heartbeat, world: int, grace_s: float) -> tuple[list[Beat | int], bool]:
    """Called by a rank whose watchdog fired: say so (flushed to the file system), and, when this rank
    waits on the others, try to be the one that reports this step (the first to create the step's
    `reporter-<step>` file); the reporter waits `grace_s` for the others to say so too, then reads
    every rank's record and returns the ranks that are behind, each its last `Beat` or its rank
    number when it never beat, and True. The others read nothing and wait long enough for the report
    to be written before their exit ends the launch."""
    waiting = main_thread_in_collective()
    heartbeat.beat(heartbeat.step, fired=True, waiting=waiting)
    os.fsync(heartbeat.fd)  # other nodes read it (NFS shows a write to other clients once flushed)
    reporter = False
    if waiting:
        try:
            os.close(os.open(heartbeat.folder / f"reporter-{heartbeat.step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            reporter = True
        except FileExistsError:
            pass
    if not reporter:  # stay up past the report (a launcher stops every rank when the first exits)
        time.sleep(2 * grace_s + 5)
        return [], False
    time.sleep(grace_s)
    step = heartbeat.step
    behind: list[Beat | int] = []
    for rank in range(world):
        beat = read_beat(heartbeat.folder / f"rank-{rank:06d}")
        if beat is None:
            behind.append(rank)
        elif beat.step < step or not beat.fired or not beat.waiting:
            behind.append(beat)
    return behind, True
