"""Process groups, seen from the controller: every process of a group listed, killed until the group is gone,
and the orphans a candidate left reaped; working directories named for the process that owns them, swept
once it is gone."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["group_members", "kill_group", "owned_work_dir", "process_table", "reap_orphans", "sweep_work_dirs"]


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process (``/proc/PID/stat``)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(entry)] = (int(fields[1]), int(fields[2]), fields[0])
    return out


def group_members(pgid: int) -> list[int]:
    """Pids (zombies included) whose process group is ``pgid``."""
    return [pid for pid, (_, group, _) in process_table().items() if group == pgid]


def kill_group(pgid: int, leader: subprocess.Popen[Any] | None = None, patience: float = 10.0) -> bool:
    """SIGKILLs process group ``pgid`` until it is gone (a fork loop keeps refilling it), reaping the
    leader and any orphans that were reparented to us. True when the group is gone."""
    end = time.monotonic() + patience
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        if leader is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                leader.wait(timeout=0.01)
        me = os.getpid()
        for pid in group_members(pgid):
            if leader is not None and pid == leader.pid:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                if _ppid(pid) == me:
                    os.waitpid(pid, os.WNOHANG)
        if time.monotonic() > end:
            return False
        time.sleep(0.002)


def reap_orphans(workers: Iterable[int]) -> None:
    """Reaps this process's children that ended in the process group of one of ``workers`` (a worker leads
    its group), the worker itself excepted: the processes a candidate orphaned, reparented to this process
    (the subreaper) and killed by their worker. No other child is touched (its Popen reaps it). Reads only
    this process's own child lists: cheap enough after every evaluation."""
    groups = set(workers)
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
    for pid in found - groups:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pgrp = int(f.read().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if pgrp in groups:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


_WORK_DIR_PREFIX = "evoforge-worker-"


def owned_work_dir() -> str:
    """A new private temporary directory named for this process (its owner): :func:`sweep_work_dirs` removes it
    once this process is gone, even killed without removing it."""
    return tempfile.mkdtemp(prefix=f"{_WORK_DIR_PREFIX}{os.getpid()}-")


def sweep_work_dirs(tmp: str | None = None) -> list[str]:
    """Removes the workers' working directories in ``tmp`` (default: the temporary directory) whose owner, the
    process that started the worker, is gone without removing them (it was killed); returns them. A directory
    is named for its owner's pid; a live owner's, or one named otherwise, is left alone."""
    removed = []
    tmp = tmp or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(tmp):
            owner = entry.name.removeprefix(_WORK_DIR_PREFIX).split("-", 1)[0]
            if not (entry.name.startswith(_WORK_DIR_PREFIX) and owner.isdigit()) or entry.is_symlink():
                continue
            try:
                os.kill(int(owner), 0)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
            except OSError:  # alive, as another user
                continue
    return removed
