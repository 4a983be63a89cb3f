"""Heartbeats: each rank's last step boundary, in a fixed-size record of its own file under
`<output_dir>/heartbeats/`, read when a watchdog fires to name the ranks that did not reach the
collective the others wait in.

A beat is one `pwrite` of 128 bytes into a file opened once (no metadata operation on the shared
file system per step: at 12,288 ranks and a 4-s step, about 3,000 small writes a second spread over
the file system's storage targets). When a rank's watchdog fires it writes `fired` with whether its
main thread waits on the others; the first waiting rank to claim the step's report reads the
records until every rank has fired, or a grace period has passed, and names the ranks that are
behind: not at the step, not fired (dead, or hung holding the interpreter), or fired while not
waiting (busy elsewhere: the culprit). The others stay up until its report is written. A rank whose
accelerator hangs inside a kernel waits at the step's read like the healthy ones, so it is named
only when its process stops answering too.

A rank also says its last word in its record as it leaves (`last_word`: `done`, `error`, or `signal`
when a launcher or scheduler asks it to stop), so that after a failed launch the ranks that left
without one, killed outright or with their node, can be told from the others (`silent_ranks`: the
supervisor names them).
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
        """Say how this rank leaves (one of WORDS), flushed: the first word stays (an error, then the
        launcher's SIGTERM, is an error). Safe in a signal handler and after `close` (then a no-op)."""
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
    """After a failed launch: the ranks of `attempt` that left without a word (none said, no watchdog
    fired), killed outright (SIGKILL, the out-of-memory killer) or with their node, while others of
    the attempt did say one. Empty when none said a word: a launcher that killed every rank at once
    leaves nothing to tell them apart by."""
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


def behind(beats: list[Beat | None], step: int) -> list[Beat | int]:
    """The ranks behind at `step`, from every rank's record (None: it never beat): each its last `Beat`,
    or its rank number when it never beat. Behind: not at the step, not fired (dead, or hung holding the
    interpreter), or fired while not waiting on the others (busy elsewhere: the culprit)."""
    out: list[Beat | int] = []
    for rank, beat in enumerate(beats):
        if beat is None:
            out.append(rank)
        elif beat.step < step or not beat.fired or not beat.waiting:
            out.append(beat)
    return out


def poll_seconds(world: int) -> float:
    """How often the reporter re-reads the records still missing: 0.2 s, slower with the world size
    (one 128-byte read a missing rank each time: at 12,288 ranks about 5,000 reads a second at most)."""
    return max(0.2, world / 5000)


def name_the_missing(
    heartbeat: Heartbeat, world: int, grace_s: float, sleep=time.sleep, clock=time.monotonic
) -> tuple[list[Beat | int], bool]:
    """Called by a rank whose watchdog fired: say so (flushed to the file system), and, when this rank
    waits on the others, try to be the one that reports this step (the first to create the step's
    `reporter-<step>` file). The reporter reads the records until every rank has said its watchdog
    fired, or `grace_s` has passed (a dead rank never says so), and returns the ranks `behind` and
    True. The others wait for the report to be written (`report_written`: a launcher stops every rank
    when the first exits), at most 2 x `grace_s` + 5 s, and return ([], False)."""
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
    if not reporter:
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
    """The reporter's last act before it exits: the others, waiting for it, may exit now."""
    os.close(os.open(heartbeat.folder / f"reported-{heartbeat.step}", os.O_CREAT | os.O_WRONLY))
