"""A one-way channel from the engine thread to one consumer, which waits on it in a thread or in asyncio.

The engine never blocks on it: :meth:`Channel.put` appends and wakes the consumer (a thread waiting in
:meth:`Channel.get`, or a coroutine awaiting :meth:`Channel.aget`, woken through its event loop). An
exception put on the channel is raised to the consumer when it gets there.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

__all__ = ["Channel"]

T = TypeVar("T")


class Channel(Generic[T]):
    """Items in order from one producer thread to one consumer (sync or async)."""

    def __init__(self) -> None:
        self._items: deque[T | BaseException] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def put(self, item: T | BaseException) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()
            waker, self._waker = self._waker, None
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass

    def get(self, timeout: float | None = None) -> T:
        """The next item, waiting up to ``timeout`` seconds (``TimeoutError`` then)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"nothing came within {timeout} s")
            return self._unwrap(self._items.popleft())

    async def aget(self) -> T:
        """The next item, awaited without blocking the event loop."""
        while True:
            with self._cond:
                if self._items:
                    return self._unwrap(self._items.popleft())
                event = asyncio.Event()
                self._waker = (asyncio.get_running_loop(), event)
            await event.wait()

    @staticmethod
    def _unwrap(item: T | BaseException) -> T:
        if isinstance(item, BaseException):
            raise item
        return item
