"""PyTorch's lock on an op's build folder, safe against a builder that dies mid-build.

`OwnedBaton` records its holder in `lock.owner` (host, pid), refreshed while building; a waiter takes over a lock
whose holder ended on this host or stopped refreshing (`STALE_AFTER_S`) instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time

from torch.utils.file_baton import FileBaton

BEAT_S = 10.0  # the holder refreshes its owner file this often
STALE_AFTER_S = 120.0  # twelve refreshes missed: the holder is gone
NOTICE_AFTER_S = 60.0  # a waiter says what it waits on after this long
# a waiter looks at the lock once a second, not PyTorch's ten times: with every rank of 1,000 nodes waiting
# on one shared folder, each look is a metadata request (two: the lock, and its owner file)
POLL_S = 1.0


class StaleBuildLock(RuntimeError):
    """A build lock whose builder ended; removed, so the build can start again."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _owner(lock: str) -> tuple[dict | None, tuple | None]:
    """The holder's record and its file's (inode, mtime, text), or (None, None)."""
    try:
        with open(lock + ".owner") as f:
            status, text = os.fstat(f.fileno()), f.read()
        return json.loads(text), (status.st_ino, status.st_mtime_ns, text)
    except (OSError, ValueError):  # none yet (the holder writes it just after taking the lock), or half-written
        return None, None


def _describe(owner: dict) -> str:
    return f"pid {owner.get('pid')} on {owner.get('host')}"


class OwnedBaton(FileBaton):
    """`FileBaton` that records its holder beside the lock (see the module)."""

    __wrapped__ = FileBaton  # the class it replaces in torch.utils.cpp_extension (ds_optimus.integrations.PATCHES)
    stale_after_s = STALE_AFTER_S
    notice_after_s = NOTICE_AFTER_S
    say = staticmethod(lambda text: print(text, file=sys.stderr, flush=True))

    def try_acquire(self) -> bool:
        if not super().try_acquire():
            return False
        path = self.lock_file_path + ".owner"
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        with open(path + f".{os.getpid()}", "w") as f:
            json.dump(record, f)
        os.replace(path + f".{os.getpid()}", path)  # a waiter never reads half of it
        self._done = threading.Event()
        threading.Thread(target=self._beat, args=(path, self._done), daemon=True, name="ds_optimus-build-lock").start()
        return True

    @staticmethod
    def _beat(path: str, done: threading.Event) -> None:
        while not done.wait(BEAT_S):
            with contextlib.suppress(OSError):
                os.utime(path)

    def release(self) -> None:
        done = getattr(self, "_done", None)
        if done is not None:
            done.set()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.lock_file_path + ".owner")
        super().release()

    def wait(self) -> None:
        """Wait until the lock is gone; raises `StaleBuildLock` (lock removed) when its holder ended."""
        start = changed = time.monotonic()
        seen, noticed = None, False
        while os.path.exists(self.lock_file_path):
            owner, stamp = _owner(self.lock_file_path)
            now = time.monotonic()
            if stamp != seen:
                seen, changed = stamp, now
            pid = owner.get("pid") if owner is not None else None
            ended = isinstance(pid, int) and pid > 0 and owner.get("host") == socket.gethostname() and not _alive(pid)
            if owner is not None and (ended or now - changed > self.stale_after_s):
                why = "ended" if ended else f"stopped refreshing {self.lock_file_path}.owner {now - changed:.0f} s ago"
                if self._take_over(stamp):
                    raise StaleBuildLock(
                        f"the build lock {self.lock_file_path} was left by {_describe(owner)}, "
                        f"which {why} mid-build: removed, the build starts again"
                    )
            if not noticed and now - start > self.notice_after_s:
                holder = _describe(owner) if owner else "a build outside ds_optimus (no owner recorded)"
                self.say(
                    f"ds_optimus: waiting {now - start:.0f} s on the build lock {self.lock_file_path}, held "
                    f"by {holder}; if no build runs there, delete that file"
                )
                noticed = True
            time.sleep(max(self.wait_seconds, POLL_S))

    def _take_over(self, stamp: tuple | None) -> bool:
        """Remove the lock if its owner file is still the stale one seen (`stamp`); False otherwise."""
        try:
            guard = os.open(self.lock_file_path + ".take", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)  # only the first waiter removes it, never a newer builder's lock
            if _owner(self.lock_file_path)[1] != stamp or not os.path.exists(self.lock_file_path):
                return False
            os.remove(self.lock_file_path + ".owner")
            os.remove(self.lock_file_path)
            return True
        except OSError:  # no file locks on this file system: never remove what another process may own
            return False
        finally:
            os.close(guard)


def forget_build(name: str) -> None:
    """Let this process's next `cpp_extension.load` of `name` build it (the stale-lock call recorded it built)."""
    import torch.utils.cpp_extension as cpp_extension

    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)


def install() -> None:
    """Make PyTorch's extension builds take `OwnedBaton` for their folder's lock. Idempotent."""
    import torch.utils.cpp_extension as cpp_extension

    cpp_extension.FileBaton = OwnedBaton
