"""``evo serve`` of chat engines with evolved kernels: this process binds the port and holds the model; each
engine serves from a confined child process of its own on that port (:func:`runtime.sandbox.chat_host.serve_confined`:
the worker's chat hosts' confinement), and this one never loads an evolved kernel.

With ``--follow FACTORY_DIR`` it swaps to each new promotion: it compiles the new engine's kernels, starts its
child on the same listening socket, waits until that child serves, then stops the old one, which stops accepting
and lets every request in flight finish (streams included) before it exits. Between the two, both accept, so no
connection is refused and none is cut. Each swap, or a failed one and why, is appended to the factory's swaps.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import select
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archive import FactoryDir
from serving._runner import ServeError
from serving._state import Limits

__all__ = ["ConfinedChatServer", "Engine", "follow_promotions", "record_swap"]

log = logging.getLogger("serving")

_PR_SET_PDEATHSIG = 1
_READY_TIMEOUT_S = 600.0  # building and warming an engine, packing its weights included


@dataclass(frozen=True)
class Engine:
    """What one child serves: the engine, the evolved kernels it names, and what it is (for the log)."""

    engine: Any  # runtime.decoder.engine.ChatEngine
    kernels: Mapping[str, Any]  # slot -> runtime.engine.kernel_runs.KernelSource
    what: str
    source: tuple[str, str] | None = None  # (run_dir, elite) where it came from a factory's promotion
    round: int | None = None  # that promotion's round


class ConfinedChatServer:
    """The port, the model and the child serving on them now."""

    def __init__(self, model: Any, model_ids: tuple[str, ...], listener: socket.socket, *, api_key: str | None,
                 limits: Limits | None, budgets: Any, drain_timeout: float) -> None:  # fmt: skip
        from runtime.decoder.kernels import DEFAULT_CACHE
        from runtime.sandbox.filters import compiled_filters
        from runtime.toolchain.cc import hold_libgomp

        self.model, self.model_ids, self.listener = model, model_ids, listener
        self.api_key, self.limits, self.budgets, self.drain_timeout = api_key, limits, budgets, drain_timeout
        self.cache_dir = str(DEFAULT_CACHE)
        self.filters = compiled_filters()
        hold_libgomp()  # the children's kernels may use OpenMP, and a child may not look for the library
        self.child: int | None = None
        self.serving: Engine | None = None
        self._stopping: list[int] = []

    def start(self, engine: Engine) -> None:
        """Starts a child serving ``engine`` and returns once it serves; then stops the old child (it drains).
        Raises :class:`ServeError` (the old child, if any, serves on)."""
        from runtime.decoder.engine import EngineUnfit, compile_engine
        from runtime.toolchain.cc import CompileError

        try:
            built = compile_engine(engine.engine, engine.kernels, cache_dir=self.cache_dir)
        except EngineUnfit as exc:
            raise ServeError(str(exc)) from None
        except CompileError as exc:
            raise ServeError(f"the engine's kernels do not compile: {exc.stderr[:500]}") from None
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            self._child(engine, built, ready_w)
        os.close(ready_w)
        try:
            ready, _, _ = select.select([ready_r], [], [], _READY_TIMEOUT_S)
            served = os.read(ready_r, 1) if ready else b""
        finally:
            os.close(ready_r)
        if served != b"R":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._reap(pid, block=True)
            raise ServeError(f"{engine.what} did not come up (its process said why above)")
        old, self.child, self.serving = self.child, pid, engine
        if old is not None:
            self._stop(old)
        log.info("serving %s", engine.what)

    def _child(self, engine: Engine, built: Mapping[str, Any], ready_fd: int) -> None:
        from runtime.sandbox.chat_host import serve_confined
        from runtime.settings import CompilerSettings

        code = 1
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # it dies with this process
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            serve_confined(self.listener, self.model, self.model_ids, engine.engine, built, filters=self.filters,
                           cache_dir=self.cache_dir, compiler=CompilerSettings(), budgets=self.budgets,
                           api_key=self.api_key, limits=self.limits, drain_timeout=self.drain_timeout,
                           ready_fd=ready_fd)  # fmt: skip
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr, then the process ends
            traceback.print_exc()
        finally:
            os._exit(code)

    def _stop(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # it stops accepting and drains what it holds
        self._stopping.append(pid)

    def _reap(self, pid: int, *, block: bool = False) -> int | None:
        try:
            got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return 0
        return os.waitstatus_to_exitcode(status) if got else None

    def run(self, follow: Callable[[], Engine | None] | None = None, *, every_s: float = 2.0,
            swapped: Callable[[Engine, str | None, float], None] | None = None) -> int:  # fmt: skip
        """Serves until SIGTERM or SIGINT (then the child drains and this returns 0, or 130 after SIGINT);
        ``follow`` is asked every ``every_s`` seconds for an engine to swap to (``None``: none new), and
        ``swapped(engine, why it failed or None, seconds)`` told how each swap went."""
        stop: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _: stop.append(s))
        while not stop:
            self._stopping = [p for p in self._stopping if self._reap(p) is None]
            if self.child is not None and (code := self._reap(self.child)) is not None:
                log.error("the engine's process ended (%s): evo serve stops", code)
                return 1
            try:
                found = follow() if follow is not None else None
            except ServeError as exc:
                log.error("%s", exc)
                found = None
            if found is not None:
                t0, why = time.perf_counter(), None
                try:
                    self.start(found)
                except ServeError as exc:
                    why = str(exc)
                    log.error("cannot swap to %s: %s", found.what, why)
                if swapped is not None:
                    swapped(found, why, time.perf_counter() - t0)
            time.sleep(every_s if follow is not None else 0.2)
        if self.child is not None:
            self._stop(self.child)
        for pid in self._stopping:  # each was told to stop: it drains what it holds, then ends
            self._reap(pid, block=True)
        return 130 if signal.SIGINT in stop else 0


def follow_promotions(factory_dir: Path, engine_of: Callable[[str, str], Engine],
                      served: Callable[[], Engine | None]) -> Callable[[], Engine | None]:
    """A ``follow`` for :meth:`ConfinedChatServer.run`: the factory's latest promotion when it is not the one
    ``served()`` (``engine_of(run_dir, elite)``), each tried once."""
    files = FactoryDir(factory_dir)
    tried: set[tuple[str, str]] = set()

    def poll() -> Engine | None:
        latest = files.latest_promotion()
        if latest is None:
            return None
        key = (latest["run_dir"], latest["elite"])
        now = served()
        if (now is not None and now.source == key) or key in tried:
            return None
        tried.add(key)  # a failed one is not retried in a loop
        return dataclasses.replace(engine_of(*key), round=latest.get("round"))

    return poll


def record_swap(factory_dir: Path, engine: Engine, error: str | None, seconds: float) -> None:
    """Appends one swap (or a failed one and why) to the factory's swaps (a ``swapped`` for
    :meth:`ConfinedChatServer.run`, its first argument bound)."""
    run_dir, elite = engine.source or ("", "")
    record: dict[str, Any] = {"round": engine.round, "run_dir": run_dir, "elite": elite, "ok": error is None,
                              "at": time.time(), "swap_s": seconds}  # fmt: skip
    if error is not None:
        record["error"] = error
    FactoryDir(factory_dir).add_swap(record)
