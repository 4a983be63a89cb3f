"""Heartbeats: each rank's last step boundary and last word, a 128-byte record under `<output_dir>/heartbeats/`,
read when watchdogs fire to name the ranks behind, and after a failed launch (`silent_ranks`).
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


WORDS = ("done", "error", "signal")  # a rank's last word: how it left (none: still running, or killed)


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    fired: bool  # its watchdog fired
    waiting: bool  # ... while its main thread was inside a collective
    host: str
    time: float
    attempt: int | None = None  # the supervisor's attempt (DS_OPTIMUS_ATTEMPT) that wrote it
    word: str = ""  # its last word, one of WORDS ("": none yet)


class Heartbeat:
    """This rank's heartbeat file, opened once."""

    def __init__(self, output_dir: str | Path, rank: int, host: str, attempt: int | None = None) -> None:
        self.folder = Path(output_dir) / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.host, self.step = rank, host.replace(" ", "_"), -1
        self.attempt = attempt if attempt is not None else _attempt()
        self.word = ""
        self.fired = self.waiting = False
        self.fd = os.open(self.folder / f"rank-{rank:06d}", os.O_RDWR | os.O_CREAT, 0o644)
        self.beat(-1)
        _OPEN.add(self)
        if rank == 0:  # an earlier launch's report claims (a watchdog fires long after every rank starts)
            for stale in [*self.folder.glob("reporter-*"), *self.folder.glob("reported-*")]:
                stale.unlink(missing_ok=True)

    def beat(self, step: int, fired: bool = False, waiting: bool = False) -> None:
        self.step = step if not fired else self.step
        self.fired, self.waiting = fired, waiting
        self._write()

    def last_word(self, word: str) -> None:
        """Say how this rank leaves (one of WORDS), flushed; the first word stays. Signal-safe; no-op after `close`."""
        if self.word or self.fd < 0:
            return
        self.word = word
        try:
            self._write()
            os.fsync(self.fd)
        except OSError:  # the file system is what failed: nothing more to say
            pass

    def _write(self) -> None:
        text = (
            f"{self.step} {int(self.fired)} {int(self.waiting)} {time.time():.3f} {self.host} {self.attempt} "
            f"{self.word or '-'}"
        )
        # One pwrite into a file opened once: no metadata operation per step on the shared file system.
        os.pwrite(self.fd, text.encode()[: RECORD - 1].ljust(RECORD - 1) + b"\n", 0)

    def close(self) -> None:
        _OPEN.discard(self)
        fd, self.fd = self.fd, -1
        try:
            os.close(fd)
        except OSError:
            pass


_OPEN: set[Heartbeat] = set()  # this process's open heartbeats (one a run), for `say_everywhere`


def say_everywhere(word: str) -> None:
    """`last_word(word)` on every open heartbeat of this process (a signal handler's)."""
    for heartbeat in list(_OPEN):
        heartbeat.last_word(word)


def _attempt() -> int:
    try:
        return int(os.environ.get("DS_OPTIMUS_ATTEMPT", "0") or 0)
    except ValueError:
        return 0


def read_beat(path: Path) -> Beat | None:
    try:
        fields = path.read_bytes()[:RECORD].decode(errors="replace").split()
        attempt = int(fields[5]) if len(fields) > 5 else None
        word = fields[6] if len(fields) > 6 and fields[6] in WORDS else ""
        return Beat(
            int(path.name.split("-")[1]),
            int(fields[0]),
            fields[1] == "1",
            fields[2] == "1",
            fields[4],
            float(fields[3]),
            attempt,
            word,
        )
    except (OSError, ValueError, IndexError):
        return None


def silent_ranks(output_dir: str | Path, attempt: int) -> list[Beat]:
    """Ranks of `attempt` that left without a word or a fired watchdog; empty unless another rank said one."""
    beats = [
        beat
        for path in sorted((Path(output_dir) / FOLDER).glob("rank-*"))
        if (beat := read_beat(path)) is not None and beat.attempt == attempt
    ]
    spoke = [beat for beat in beats if beat.word or beat.fired]
    return [beat for beat in beats if not (beat.word or beat.fired)] if spoke else []


_waiting = threading.Event()  # set by the trainer while its main thread waits for the step's reduction


@contextlib.contextmanager
def waiting_for_peers():
    """Marks the main thread as waiting on the other ranks."""
    # An accelerator's collective is queued: the host waits at the read, outside torch.distributed.
    _waiting.set()
    try:
        yield
    finally:
        _waiting.clear()


def main_thread_in_collective() -> bool:
    """Whether the main thread waits on other ranks: in `waiting_for_peers()` or in torch.distributed/DeepSpeed comm."""
    if _waiting.is_set():
        return True
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name or "/deepspeed/comm/" in name:
            return True
        frame = frame.f_back
    return False


def behind(beats: list[Beat | None], step: int) -> list[Beat | int]:
    """Ranks behind at `step` (their `Beat`, or the rank if it never beat): not at it, not fired, or not waiting."""
    out: list[Beat | int] = []
    for rank, beat in enumerate(beats):
        if beat is None:
            out.append(rank)
        elif beat.step < step or not beat.fired or not beat.waiting:
            out.append(beat)
    return out


def poll_seconds(world: int) -> float:
    """The reporter's re-read interval: 0.2 s, longer at scale."""
    return max(0.2, world / 5000)  # at most about 5,000 128-byte reads a second


def name_the_missing(
    heartbeat: Heartbeat, world: int, grace_s: float, sleep=time.sleep, clock=time.monotonic
) -> tuple[list[Beat | int], bool]:
    """For a rank whose watchdog fired: record it and, if waiting, try to become the step's reporter.
    The reporter returns (`behind`, True) once all fired or after `grace_s`; the others return ([], False)."""
    waiting = main_thread_in_collective()
    heartbeat.beat(heartbeat.step, fired=True, waiting=waiting)
    os.fsync(heartbeat.fd)  # other nodes read it (NFS shows a write to other clients once flushed)
    step = heartbeat.step
    reporter = False
    if waiting:
        try:
            os.close(os.open(heartbeat.folder / f"reporter-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            reporter = True
        except FileExistsError:
            pass
    deadline = clock() + (grace_s if reporter else 2 * grace_s + 5)
    if not reporter:  # a launcher stops every rank when the first exits: wait for the report
        while not (heartbeat.folder / f"reported-{step}").exists() and clock() < deadline:
            sleep(min(0.2, deadline - clock()))
        return [], False
    paths = [heartbeat.folder / f"rank-{rank:06d}" for rank in range(world)]
    beats: list[Beat | None] = [None] * world
    missing = list(range(world))  # not yet fired
    while True:
        for rank in missing:
            beats[rank] = read_beat(paths[rank])
        missing = [rank for rank in missing if beats[rank] is None or not beats[rank].fired]
        if not missing or clock() >= deadline:
            return behind(beats, step), True
        sleep(min(poll_seconds(world), max(0.0, deadline - clock())))


def report_written(heartbeat: Heartbeat) -> None:
    """The reporter's last act: the ranks waiting for it may exit."""
    os.close(os.open(heartbeat.folder / f"reported-{heartbeat.step}", os.O_CREAT | os.O_WRONLY))
