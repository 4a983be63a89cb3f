"""The op build folder's lock (ds_optimus.integrations.build_lock): a lock whose builder ended is taken
over, a live builder's lock is waited on, with a fake clock where time passes (no test waits minutes)."""

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds_optimus.integrations import build_lock
from ds_optimus.integrations.build_lock import OwnedBaton, StaleBuildLock


def _ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _left_lock(folder, host: str, pid: int) -> str:
    """A lock as a builder that took it and died leaves it: the lock and its owner file."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = str(folder / "lock")
    open(lock, "w").close()
    with open(lock + ".owner", "w") as f:
        json.dump({"host": host, "pid": pid, "since": 0.0}, f)
    return lock


class FakeClock:
    """`time` for build_lock: `sleep` moves the clock on and runs what is due at the new time."""

    def __init__(self) -> None:
        self.now, self.due = 0.0, []

    def at(self, t: float, action) -> None:
        self.due.append((t, action))

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for item in [d for d in self.due if d[0] <= self.now]:
            self.due.remove(item)
            item[1]()


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(
        build_lock, "time", SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep, time=lambda: 0.0)
    )
    return fake


def test_the_holder_is_recorded_while_it_holds_the_lock_and_removed_with_it(tmp_path):
    baton = OwnedBaton(str(tmp_path / "lock"))
    assert baton.try_acquire()
    owner = json.loads((tmp_path / "lock.owner").read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert not OwnedBaton(str(tmp_path / "lock")).try_acquire()  # still a lock: the second waits
    baton.release()
    assert not (tmp_path / "lock").exists() and not (tmp_path / "lock.owner").exists()


def test_a_lock_whose_builder_on_this_host_ended_is_taken_over_at_once(tmp_path):
    lock = _left_lock(tmp_path / "op", socket.gethostname(), _ended_pid())
    with pytest.raises(StaleBuildLock, match=r"was left by pid \d+ on .*, which ended mid-build: removed"):
        OwnedBaton(lock).wait()
    assert not os.path.exists(lock) and not os.path.exists(lock + ".owner")
    assert OwnedBaton(lock).try_acquire()  # the build can start again


def test_a_live_holder_is_waited_on_and_named_and_one_that_stops_refreshing_is_taken_over(tmp_path, clock):
    """A holder on another host (its pid cannot be asked) refreshes its file every 10 s: waited on,
    named once after a minute; when the refreshes stop (its node lost), taken over two minutes later."""
    lock = _left_lock(tmp_path / "op", "another-node", 1)
    for k in range(1, 31):  # refreshed up to t = 300 s, then never again
        clock.at(10.0 * k, lambda k=k: os.utime(lock + ".owner", ns=(k * 10**9, k * 10**9)))
    said = []
    baton = OwnedBaton(lock, wait_seconds=1.0)
    baton.say = said.append
    stopped = r"pid 1 on another-node, which stopped refreshing .*lock.owner 12\d s ago"
    with pytest.raises(StaleBuildLock, match=stopped):
        baton.wait()
    assert 420 <= clock.now <= 422  # 300 s + STALE_AFTER_S, not before
    assert len(said) == 1 and "waiting 6" in said[0] and "held by pid 1 on another-node" in said[0]
    assert not os.path.exists(lock)


def test_a_refreshing_holder_that_finishes_is_never_taken_over(tmp_path, clock):
    lock = _left_lock(tmp_path / "op", socket.gethostname(), os.getpid())  # alive: this process
    for k in range(1, 50):
        clock.at(10.0 * k, lambda k=k: os.utime(lock + ".owner", ns=(k * 10**9, k * 10**9)))
    clock.at(495.0, lambda: (os.remove(lock + ".owner"), os.remove(lock)))  # the build ends
    OwnedBaton(lock, wait_seconds=1.0).wait()
    assert 495 <= clock.now <= 496


def test_a_lock_without_an_owner_is_waited_on_and_named_never_removed(tmp_path, clock):
    """Taken by a build outside ds_optimus: nothing says whether it lives, so it is only named."""
    (tmp_path / "op").mkdir()
    lock = str(tmp_path / "op" / "lock")
    open(lock, "w").close()
    clock.at(3600.0, lambda: os.remove(lock))
    said = []
    baton = OwnedBaton(lock, wait_seconds=5.0)
    baton.say = said.append
    baton.wait()
    assert clock.now == 3600.0
    assert len(said) == 1 and "a build outside ds_optimus (no owner recorded)" in said[0] and lock in said[0]


def test_of_waiters_that_find_it_stale_together_one_removes_it_and_none_removes_a_new_holders(tmp_path):
    lock = _left_lock(tmp_path / "op", socket.gethostname(), _ended_pid())
    stamp = build_lock._owner(lock)[1]
    first, second = OwnedBaton(lock), OwnedBaton(lock)
    assert first._take_over(stamp)
    assert first.try_acquire()  # the first starts the build again: a new holder
    assert not second._take_over(stamp)  # the second saw the old owner: it leaves the new one's lock
    assert os.path.exists(lock) and json.loads(open(lock + ".owner").read())["pid"] == os.getpid()
    first.release()


def test_pytorchs_extension_builds_take_this_lock():
    import deepspeed  # noqa: F401
    import torch.utils.cpp_extension as cpp_extension

    import ds_optimus  # noqa: F401  (installs it with DeepSpeed's op hooks)

    assert cpp_extension.FileBaton is OwnedBaton
