"""``evo serve --follow FACTORY_DIR``: serve what a factory promotes, swapping to each new promotion.

A thread polls the factory's promotions (read through :class:`archive.FactoryDir`); a new last one is built
and warmed beside the engine being served and then swapped in through the same path as ``POST /admin/elite``
(requests in flight finish on the old engine, none fails). Each swap, or a failed one and why, is appended to
the factory's swaps.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from archive import FactoryDir
from serving._runner import ServedEngine

__all__ = ["Follower"]

log = logging.getLogger("serving")


class Follower:
    """Swaps ``engine`` to each new promotion of ``factory_dir`` (every ``every_s`` seconds, in a thread)."""

    def __init__(self, engine: ServedEngine, factory_dir: Path, served: dict[str, Any] | None, *,
                 every_s: float = 2.0) -> None:  # fmt: skip
        self.engine, self.factory_dir, self.every_s = engine, factory_dir, every_s
        self._files = FactoryDir(factory_dir)
        self._served = (served or {}).get("run_dir"), (served or {}).get("elite")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="evoforge-follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a failed poll is logged; the served engine stays
                log.exception("following %s", self.factory_dir)

    def check(self) -> bool:
        """Swaps to the latest promotion if it is new; True when it swapped."""
        latest = self._files.latest_promotion()
        if latest is None or (latest["run_dir"], latest["elite"]) == self._served:
            return False
        record: dict[str, Any] = {"round": latest.get("round"), "run_dir": latest["run_dir"], "elite": latest["elite"]}
        t0 = time.perf_counter()
        try:
            self.engine.switch(latest["elite"], run_dir=Path(latest["run_dir"]))
        except Exception as exc:  # noqa: BLE001 - recorded; the old engine keeps serving
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            log.error("cannot swap to %s of %s: %s", latest["elite"][:12], latest["run_dir"], exc)
        else:
            record.update(ok=True)
            log.info("following %s: now serving %s of %s", self.factory_dir, latest["elite"][:12], latest["run_dir"])
        self._served = latest["run_dir"], latest["elite"]  # a failed one is not retried in a loop
        record.update(at=time.time(), swap_s=time.perf_counter() - t0)
        self._files.add_swap(record)
        return bool(record["ok"])
