"""The worker's main loop: ``python -m runtime.sandbox.worker FD`` (started by
:class:`runtime.sandbox.worker_process.WorkerProcess`).

Protocol over the socket FD (length-prefixed pickles): the controller sends an init message
``{"profile": WorkerProfile, "ids": (uid, gid) | None}``; the worker prepares (imports, opens the compile
cache and the timing lock), enters the sandbox and answers ``{"ready": True, "hardware": ...}``; then,
for each ``EvalRequest`` it receives, it sends back one ``EvalResult``. ``None`` or EOF ends it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from genome import canonical_json
from runtime.backends import WorkerContext, backend_for
from runtime.cascade import evaluate
from runtime.hardware import fingerprint
from runtime.result import EvalResult, Status
from runtime.sandbox.limits import arm_cpu_limit, enter_sandbox, make_undumpable, preload_modules
from runtime.sandbox.worker_process import WorkerProfile
from runtime.settings import TaskSpec
from runtime.task import Task, load_task_class
from runtime.timing import TimingLock

_PR_SET_PDEATHSIG = 1


class _Tasks:
    """Constructed tasks, cached by (name, args)."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, str], Task] = {}

    def get(self, spec: TaskSpec) -> Task:
        key = (spec.name, canonical_json(spec.args))
        if key not in self._tasks:
            self._tasks[key] = load_task_class(spec.name)(spec.args)
        return self._tasks[key]


def _add_paths(paths: tuple[str, ...]) -> None:
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)


def _internal_error(ctx: WorkerContext | None) -> EvalResult:
    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    return EvalResult(
        status=Status.INVALID,
        error=f"internal error in the worker:\n{text[-4000:]}",
        hardware=ctx.hardware if ctx else None,
    )


def _prepare(init: dict[str, Any], tasks: _Tasks) -> WorkerContext:
    profile: WorkerProfile = init["profile"]
    _add_paths(profile.sys_path)
    preload_modules(("runtime.sandbox.c_host",))  # what starts candidates' hosts, first used after the drop
    lock = TimingLock(profile.lock_file)
    prepared = []
    for spec in profile.preload:
        try:
            task = tasks.get(spec)
            backend_for(task).prepare_worker(task, lock)
            prepared.append(task)
        except Exception:  # noqa: BLE001 - reported when a request needs it
            traceback.print_exc()
    hardware = fingerprint(profile.cc)
    # The cache is reached through this descriptor: its path may not be searchable after the drop.
    cache_fd = os.open(profile.cache_dir, os.O_RDONLY | os.O_DIRECTORY)
    parent = os.getppid()
    enter_sandbox(profile.limits, init["ids"])
    make_undumpable()  # candidate hosts run as this user: none may read this process's memory
    # Die with the controller (set after the drop: changing credentials clears it).
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(0)
    ctx = WorkerContext(cache_dir=f"/proc/self/fd/{cache_fd}", work_dir=os.getcwd(), lock=lock, hardware=hardware,
                        cc=profile.cc)  # fmt: skip
    for task in prepared:
        try:
            backend_for(task).sandboxed(task, ctx)
        except Exception:  # noqa: BLE001 - reported when a request needs it
            traceback.print_exc()
    return ctx


def main(argv: list[str]) -> int:
    fd = int(argv[0])
    os.set_inheritable(fd, False)  # passed to us inheritable: no process this worker starts may reach it
    conn = Connection(fd)
    tasks = _Tasks()
    ctx = _prepare(conn.recv(), tasks)
    conn.send({"ready": True, "pid": os.getpid(), "hardware": ctx.hardware})
    libc = ctypes.CDLL(None)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return 0
        if request is None:
            return 0
        try:
            arm_cpu_limit(request.settings.sandbox.cpu_seconds)
            _add_paths(request.sys_path)
            result = evaluate(request, tasks.get(request.task), ctx)
        except Exception:  # noqa: BLE001 - any worker bug becomes a result, never a hang
            result = _internal_error(ctx)
        sys.stdout.flush()
        libc.fflush(None)  # what a kernel printf'd reaches the log now, not at exit
        conn.send(result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
