"""Blocking calls awaited from an event loop without ever joining a thread on it.

pyarrow Flight blocks a thread per call. :func:`off_loop` runs a call on a daemon thread of
its own and hands its outcome to the loop through a future: a task that stops waiting
(cancelled, timed out) abandons the thread instead of joining it, and a call that never
returns holds no worker of the loop's default executor, so it cannot starve
``asyncio.to_thread`` elsewhere in the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pushtable.errors import WriteTimeoutError

__all__ = ["deliver", "off_loop", "within"]

T = TypeVar("T")


def deliver(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    value: Any = None,
    error: BaseException | None = None,
) -> None:
    """Settle ``future`` (of ``loop``) from any thread (nothing if it is done or the loop gone)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    if loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(settle)


async def off_loop(fn: Callable[..., T], *args: Any, name: str = "pushtable-aio-call") -> T:
    """``fn(*args)`` on a daemon thread; cancelling the await abandons the thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task)
            deliver(loop, future, error=exc)
        else:
            deliver(loop, future, value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


async def within(awaitable: Any, timeout: float | None, what: str) -> Any:
    """``await awaitable`` for at most ``timeout`` seconds (None: no bound).

    Past it, :class:`~pushtable.WriteTimeoutError` naming ``what`` (a ``PushTableError``,
    where ``asyncio.TimeoutError`` would not say which call).
    """
    if timeout is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise WriteTimeoutError(f"{what} timed out after {timeout:g}s") from None
