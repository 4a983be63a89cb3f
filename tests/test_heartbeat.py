"""Naming the ranks behind a hang from their heartbeat records (`ds_optimus.reliability.heartbeat`): each
way a rank can be behind (never beat, at an earlier step, not fired, fired while busy), the reporter
reading until every rank has fired or the grace period is over, the others waiting for its report, and
the watchdog's order (attribution, message, report written, exit). The waits run on a fake clock."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds_optimus.reliability.heartbeat import (
    Beat,
    Heartbeat,
    behind,
    name_the_missing,
    poll_seconds,
    read_beat,
    report_written,
    silent_ranks,
    waiting_for_peers,
)
from ds_optimus.reliability.watchdog import EXIT_HUNG
from ds_optimus.train.callbacks.reliability import WatchdogCallback, _state


class FakeClock:
    """`sleep` moves `now`; `on_sleep` runs at each sleep (another rank's beat, say)."""

    def __init__(self, on_sleep=None) -> None:
        self.now, self.sleeps, self.on_sleep = 0.0, [], on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


def beat(rank, step, fired=True, waiting=True):
    return Beat(rank=rank, step=step, fired=fired, waiting=waiting, host=f"n{rank}", time=0.0)


def test_each_way_of_being_behind_is_named():
    beats = [
        beat(0, 5),
        None,
        beat(2, 4),
        beat(3, 5, fired=False, waiting=False),
        beat(4, 5, waiting=False),
        beat(5, 6),
    ]
    found = behind(beats, 5)
    assert found == [1, beats[2], beats[3], beats[4]]  # rank 5, a step ahead and waiting, is not behind
    assert [_state(b, 5) for b in found[1:]] == [
        "last at step 4",
        "not answering (dead, or hung holding the interpreter)",
        "busy outside any collective",
    ]
    assert behind([beat(0, 5), beat(1, 5)], 5) == []  # every rank waits: nobody to name


def test_records_round_trip_and_a_torn_one_reads_as_none(tmp_path):
    heartbeat = Heartbeat(tmp_path, 3, "node 7")
    heartbeat.beat(12)
    heartbeat.beat(12, fired=True, waiting=False)
    got = read_beat(tmp_path / "heartbeats" / "rank-000003")
    assert (got.rank, got.step, got.fired, got.waiting, got.host) == (3, 12, True, False, "node_7")
    (tmp_path / "heartbeats" / "rank-000004").write_bytes(b"12 1")
    assert read_beat(tmp_path / "heartbeats" / "rank-000004") is None
    assert read_beat(tmp_path / "heartbeats" / "rank-000009") is None
    heartbeat.close()


def _ranks(tmp_path, world, step):
    beats = [Heartbeat(tmp_path, rank, f"n{rank}") for rank in range(world)]
    for heartbeat in beats:
        heartbeat.beat(step)
    return beats


def test_the_reporter_names_the_busy_rank_as_soon_as_every_rank_has_fired(tmp_path):
    ranks = _ranks(tmp_path, 3, 5)
    ranks[2].beat(5, fired=True, waiting=False)  # hung in its own code: its watchdog fired first

    def answers(n):  # rank 1, waiting too, fires while the reporter reads
        if n == 1:
            ranks[1].beat(5, fired=True, waiting=True)

    fake = FakeClock(answers)
    with waiting_for_peers():
        found, reporter = name_the_missing(ranks[0], 3, grace_s=30.0, sleep=fake.sleep, clock=fake.clock)
    assert reporter and [b.rank for b in found] == [2] and not found[0].waiting
    assert fake.sleeps == [poll_seconds(3)]  # one poll, not the grace period
    assert (tmp_path / "heartbeats" / "reporter-5").exists()


def test_a_rank_that_never_answers_is_named_after_the_grace_period(tmp_path):
    ranks = _ranks(tmp_path, 3, 5)
    ranks[1].beat(5, fired=True, waiting=True)
    fake = FakeClock()
    with waiting_for_peers():
        found, reporter = name_the_missing(ranks[0], 4, grace_s=3.0, sleep=fake.sleep, clock=fake.clock)
    assert reporter and fake.now == pytest.approx(3.0)
    assert found[0].rank == 2 and not found[0].fired and found[1] == 3  # rank 3 never beat at all


def test_the_others_wait_for_the_report_then_go(tmp_path):
    ranks = _ranks(tmp_path, 2, 5)
    (tmp_path / "heartbeats" / "reporter-5").touch()  # rank 0 claimed the report

    def reported(n):
        if n == 3:
            report_written(ranks[0])

    fake = FakeClock(reported)
    with waiting_for_peers():
        assert name_the_missing(ranks[1], 2, grace_s=10.0, sleep=fake.sleep, clock=fake.clock) == ([], False)
    assert len(fake.sleeps) == 3
    # a rank busy outside any collective never reports, and without a report waits 2 x grace + 5 s
    fake = FakeClock()
    ranks[1].step = 6
    assert name_the_missing(ranks[1], 2, grace_s=10.0, sleep=fake.sleep, clock=fake.clock) == ([], False)
    assert fake.now == pytest.approx(25.0) and not (tmp_path / "heartbeats" / "reporter-6").exists()
    assert read_beat(tmp_path / "heartbeats" / "rank-000001").fired  # it said it fired, busy
    assert not read_beat(tmp_path / "heartbeats" / "rank-000001").waiting


def test_a_new_launch_clears_the_last_ones_report_claims(tmp_path):
    ranks = _ranks(tmp_path, 2, 5)
    (tmp_path / "heartbeats" / "reporter-5").touch()
    report_written(ranks[0])
    Heartbeat(tmp_path, 0, "n0")
    assert sorted(p.name for p in (tmp_path / "heartbeats").iterdir()) == ["rank-000000", "rank-000001"]


def test_the_reporting_rank_says_whom_and_records_it(tmp_path):
    """WatchdogCallback's note on the reporter, its fault record, and its report marked only after it."""
    from ds_optimus.reliability.fault_log import read_faults
    from ds_optimus.reliability.watchdog import WatchdogConfig

    ranks = _ranks(tmp_path, 3, 7)
    ranks[1].beat(7, fired=True, waiting=False)
    ranks[2].beat(7, fired=True, waiting=True)
    callback = WatchdogCallback(WatchdogConfig(heartbeat_grace_s=5.0))
    callback.trainer = SimpleNamespace(world=3, output_dir=tmp_path, rank_hosts=["n0", "n1", "n2"])
    callback.heartbeat = ranks[0]
    callback.watchdog = SimpleNamespace(after_fire=[], describe=lambda: "step 7 exceeded its 20 s time-out")
    with waiting_for_peers():
        note = callback._name_the_missing()
    assert note == (
        f"[ds_optimus watchdog] step 7: rank 1 (host n1) did not reach the collective the others wait in "
        f"(rank 1: busy outside any collective); recorded in {tmp_path}/faults.jsonl"
    )
    assert [(f["step"], f["kind"], f["ranks"], f["hosts"]) for f in read_faults(tmp_path)] == [(7, "hang", [1], ["n1"])]
    log = (tmp_path / "log.txt").read_text()  # the run's record has the naming and the stop
    assert note in log and "the watchdog stopped the run: step 7 exceeded its 20 s time-out (exit 124" in log
    assert not (tmp_path / "heartbeats" / "reported-7").exists()  # the message is not out yet
    [mark] = callback.watchdog.after_fire
    mark()
    assert (tmp_path / "heartbeats" / "reported-7").exists()


WATCHDOG_SCRIPT = """
import sys, time
from ds_optimus.reliability.watchdog import Watchdog
dog = Watchdog(3, log=sys.stdout, grace_s=600)
dog.on_fire.append(lambda: "attributed")
dog.after_fire.append(lambda: print("after the stacks", flush=True))
dog.beat(0.05, "step 9")
while True:
    time.sleep(1)
"""


def test_the_watchdog_writes_attribution_message_and_stacks_then_its_hooks_then_exits():
    proc = subprocess.run([sys.executable, "-c", WATCHDOG_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_HUNG, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line]
    assert lines[0] == "[rank 3] attributed"
    assert lines[1].startswith("[rank 3] [ds_optimus watchdog] rank 3: step 9 exceeded its 0.05 s time-out")
    assert any("in <module>" in line for line in lines) and lines[-1] == "after the stacks"


# -- last words, and the ranks that left without one ----------------------------------------------


def test_the_first_last_word_stays_and_survives_later_beats(tmp_path):
    heartbeat = Heartbeat(tmp_path, 2, "n2", attempt=4)
    heartbeat.beat(7)
    heartbeat.last_word("error")
    heartbeat.last_word("signal")  # the launcher's SIGTERM after the error: still an error
    heartbeat.beat(7, fired=True, waiting=True)
    got = read_beat(tmp_path / "heartbeats" / "rank-000002")
    assert (got.step, got.attempt, got.word, got.fired) == (7, 4, "error", True)
    heartbeat.close()
    heartbeat.last_word("done")  # closed: nothing written, nothing raised
    assert read_beat(tmp_path / "heartbeats" / "rank-000002").word == "error"


def test_a_record_of_before_last_words_reads_without_them(tmp_path):
    folder = tmp_path / "heartbeats"
    folder.mkdir()
    (folder / "rank-000001").write_bytes(b"5 0 0 100.000 n1".ljust(127) + b"\n")
    got = read_beat(folder / "rank-000001")
    assert (got.step, got.host, got.attempt, got.word) == (5, "n1", None, "")


def test_silent_ranks_are_those_of_the_attempt_that_said_nothing_while_others_did(tmp_path):
    def rank(r, attempt, word="", fired=False):
        heartbeat = Heartbeat(tmp_path, r, f"n{r // 2 + 1}", attempt=attempt)
        heartbeat.beat(7)
        if fired:
            heartbeat.beat(7, fired=True, waiting=True)
        if word:
            heartbeat.last_word(word)
        heartbeat.close()

    rank(0, 1, "error")
    rank(1, 1, "signal")
    rank(2, 1)  # killed outright
    rank(3, 1)
    rank(4, 1, fired=True)  # its watchdog fired: it spoke
    rank(5, 0)  # an earlier attempt's record (a larger world then)
    assert [(b.rank, b.host, b.step) for b in silent_ranks(tmp_path, 1)] == [(2, "n2", 7), (3, "n2", 7)]
    assert silent_ranks(tmp_path, 0) == []  # nobody of attempt 0 spoke: nothing to tell the silent apart by
    assert silent_ranks(tmp_path, 2) == []


def test_a_signal_is_said_while_the_main_thread_is_elsewhere(tmp_path):
    """The preemption handler's wake-up thread writes `signal` as the signal arrives, without the main
    thread's Python handler (replaced here by one that does nothing, as a main thread blocked in a
    collective would never run it)."""
    import os
    import signal
    import time

    from ds_optimus.reliability.signals import PreemptionHandler

    heartbeat = Heartbeat(tmp_path, 0, "n1", attempt=0)
    handler = PreemptionHandler()
    try:
        signal.signal(signal.SIGTERM, lambda *_: None)
        os.kill(os.getpid(), signal.SIGTERM)
        path = tmp_path / "heartbeats" / "rank-000000"
        for _ in range(3000):  # the thread's read is immediate; up to 5 min on a machine busy elsewhere
            if read_beat(path).word:
                break
            time.sleep(0.1)
        assert read_beat(path).word == "signal" and handler.received is None  # the thread, not the handler
    finally:
        handler.close()
        heartbeat.close()
    assert signal.set_wakeup_fd(-1) == -1  # closed: the wake-up fd put back
