"""The asyncio face of the remote client: ``await`` and ``async for`` over ``pushtable serve``.

pyarrow Flight has no asyncio API: its calls block a thread. This module puts a thread on
the far side of a bounded janus queue for each stream — a result's reader, a sink's writer —
so an event loop awaits them, and memory never depends on how fast either side is:

- :meth:`AsyncClient.sql` (and :meth:`~AsyncClient.read`) give an :class:`AsyncResult`:
  ``async for batch in ...`` streams batches as the server sends them. A reader thread pulls
  them from Flight into a queue of ``max_queued`` batches; when the loop falls behind, the
  thread stops reading, and gRPC's flow control holds the server. Leaving the loop early
  (``break``, ``async with``'s end, ``aclose()``) or cancelling the task that waits stops the
  server's query, as :meth:`RemoteResult.cancel` does.
- :meth:`AsyncClient.sink` gives an :class:`~pushtable.flight.client.aio_sink.AsyncSink`:
  ``await sink.write(batch)`` returns once the server acknowledged that batch and raises
  that batch's own error (see :mod:`pushtable.flight.client.aio_sink`).
- Every other call (``create_table``, ``publish``, ``offsets``, ...) runs the sync client's
  call, with the same typed arguments, on a thread of its own.

Every wait is bounded where it takes ``timeout=`` and safe to cancel; no call joins a thread
on the loop or occupies the loop's default executor. Leaving a result, a sink or a
subscription (``async with``, ``aclose()``, or dropping it) frees its query, stream or name
on the server. Errors cross by class (the same :mod:`pushtable.errors`). One state, two
faces: an :class:`AsyncClient` wraps a :class:`~pushtable.flight.client.client.Client` (``.sync``),
as janus gives one queue a sync and an async side.

Example:
    >>> import asyncio, pyarrow as pa
    >>> from pushtable.flight import Server
    >>> from pushtable.flight.client.aio import AsyncClient
    >>> server = Server()
    >>> async def main() -> list[int]:
    ...     async with AsyncClient.connect(server.location) as client:
    ...         await client.create_table("events", pa.schema([("v", pa.int64())]))
    ...         async with client.sql("SELECT v * 10 AS x FROM events") as rows:
    ...             sink = await client.sink("events")
    ...             await sink.write(pa.record_batch({"v": [1, 2]}))
    ...             await sink.close()  # ends the table: the query ends after its rows
    ...             return [x for batch in [b async for b in rows] for x in batch["x"].to_pylist()]
    >>> asyncio.run(main())
    [10, 20]
    >>> _ = server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Generator
from datetime import datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import janus
import pyarrow as pa

from pushtable.errors import ClientClosedError, UnknownTableError, WriteTimeoutError
from pushtable.flight.client.aio_sink import SINK_QUEUED, AsyncSink
from pushtable.flight.client.aio_threads import deliver, off_loop, within
from pushtable.flight.client.client import Client, RemoteResult, connect
from pushtable.producer import OnSlow

__all__ = ["SINK_QUEUED", "AsyncClient", "AsyncResult", "AsyncSink", "AsyncSubscription"]

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

#: batches a result's reader thread may hold ahead of the loop
MAX_QUEUED = 8
#: seconds ``aclose`` waits for a reader thread (it never joins one on the loop)
CLOSE_WAIT_S = 5.0


class _End:
    """The reader thread's last item: the stream ended, or ``error`` ended it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def _read(
    result: RemoteResult,
    queue: janus.Queue[pa.RecordBatch | _End],
    stop: threading.Event,
    loop: asyncio.AbstractEventLoop,
    exited: asyncio.Future[None],
) -> None:
    """A result's reader thread: batches into ``queue`` (waiting while it is full).

    It holds no reference to its :class:`AsyncResult`, so a result the loop drops without
    closing is collected, and its finalizer stops the query.
    """
    try:
        end = _End()
        try:
            for batch in result:
                if stop.is_set():
                    return
                queue.sync_q.put(batch)  # waits while the loop is behind: bounded
        except janus.SyncQueueShutDown:
            return  # the loop side closed the stream
        except BaseException as exc:  # noqa: BLE001 (handed to the task that reads)
            end = _End(exc)
        with contextlib.suppress(janus.SyncQueueShutDown):  # the loop side closed it
            queue.sync_q.put(end)
    finally:
        deliver(loop, exited)


def _cancel(result: RemoteResult | None, queue: janus.Queue[Any], stop: threading.Event) -> None:
    """Stop the stream from any thread: the server's query, then the queue between."""
    stop.set()
    if result is not None:
        with contextlib.suppress(Exception):  # a closed client: its query is gone already
            result.cancel()
    if not queue.closed:
        queue.shutdown(immediate=True)


class AsyncResult:
    """A remote query's result as an async iterator of Arrow record batches.

    Iterate it (``async for``), or ``await read_all()``. Use it as an async context manager,
    or call :meth:`aclose`, to stop the server's query as soon as the loop is done with it;
    a task cancelled while it waits for a batch stops it too, and so does dropping it
    (``break`` out of a bare ``async for``, then letting it go).
    """

    def __init__(
        self,
        start: Callable[[], RemoteResult],
        max_queued: int = MAX_QUEUED,
        refuse_closed: Callable[[], None] | None = None,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        self._start = start
        self._max_queued = max_queued
        self._refuse_closed = refuse_closed
        self._result: RemoteResult | None = None
        #: the query's open, on a thread: shared by the tasks that wait for it (one query)
        self._opening: asyncio.Future[RemoteResult] | None = None
        self._queue: janus.Queue[pa.RecordBatch | _End] | None = None
        self._exited: asyncio.Future[None] | None = None
        self._done = False
        self._stop = threading.Event()

    async def _open(self) -> janus.Queue[pa.RecordBatch | _End]:
        if self._queue is None:
            if self._opening is None:
                if self._refuse_closed is not None:
                    self._refuse_closed()
                self._opening = asyncio.ensure_future(off_loop(self._start))
                self._opening.add_done_callback(self._opened)
            try:  # shielded: a cancelled wait leaves the open to its callback
                result = await asyncio.shield(self._opening)
            except asyncio.CancelledError:
                self._done = True  # the task gave up: so does the query, once open
                raise
            if self._done:  # left (aclose) while the query opened: it stopped as it opened
                raise StopAsyncIteration
            self._result = result
            loop = asyncio.get_running_loop()
            self._queue = janus.Queue(self._max_queued)
            self._exited = loop.create_future()
            threading.Thread(
                target=_read,
                args=(self._result, self._queue, self._stop, loop, self._exited),
                name="pushtable-aio-read",
                daemon=True,
            ).start()
            weakref.finalize(self, _cancel, self._result, self._queue, self._stop)
        return self._queue

    def _opened(self, opening: asyncio.Future[RemoteResult]) -> None:
        """The query opened: if the result was left meanwhile, it stops now (no task takes it)."""
        if self._done and not opening.cancelled() and opening.exception() is None:
            with contextlib.suppress(Exception):  # a closed client: its query is gone already
                opening.result().cancel()

    @property
    def schema(self) -> pa.Schema | None:
        """The result's schema once the stream is open (after the first batch is awaited)."""
        return None if self._result is None else self._result.schema

    def __aiter__(self) -> AsyncResult:
        return self

    async def __anext__(self) -> pa.RecordBatch:
        if self._done:
            raise StopAsyncIteration
        queue = await self._open()
        try:
            item = await queue.async_q.get()
        except asyncio.CancelledError:
            _cancel(self._result, queue, self._stop)  # the task gave up: so does the query
            self._done = True
            raise
        except janus.AsyncQueueShutDown:
            self._done = True
            raise StopAsyncIteration from None
        if isinstance(item, _End):
            self._done = True
            await self._let_go(CLOSE_WAIT_S)
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        return item

    async def read_all(self) -> pa.Table:
        """The rest of the result as one table: waits until the query ends."""
        batches = [batch async for batch in self]
        assert self._result is not None
        return pa.Table.from_batches(batches, schema=self._result.schema)

    async def aclose(self, *, timeout: float | None = CLOSE_WAIT_S) -> None:
        """Stop the query on the server (if it still runs) and let the reader thread go.

        Waits at most ``timeout`` seconds for the thread to end; never joins it on the loop.
        """
        self._done = True
        opening = self._opening
        if self._queue is None and opening is not None and opening.done():
            self._opened(opening)  # opened, and no task took it: it stops
        if self._queue is not None:
            _cancel(self._result, self._queue, self._stop)
            await self._let_go(timeout)

    async def _let_go(self, timeout: float | None) -> None:
        if self._exited is not None:
            with contextlib.suppress(Exception):
                await within(asyncio.shield(self._exited), timeout, "aclose")
        if self._queue is not None:
            self._queue.shutdown(immediate=True)
            with contextlib.suppress(Exception):
                await within(self._queue.aclose(), timeout, "aclose")

    async def __aenter__(self) -> AsyncResult:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSubscription:
    """A subscription registered on the server: ``client.sql`` reads it by :attr:`name`.

    The server lets it go when the query reading it ends (or is refused its slot); leave it
    before that (``async with``'s end, :meth:`aclose`) and its name is free and it holds none
    of the topic's producers. Dropping the object does not unsubscribe: the common
    ``await client.subscribe(...)`` ignores it, and its query has yet to start.
    """

    def __init__(self, client: AsyncClient, topic: str, name: str) -> None:
        self.topic = topic
        self.name = name
        self._client = client
        self._left = False

    def __repr__(self) -> str:
        return f"AsyncSubscription(topic={self.topic!r}, name={self.name!r})"

    async def aclose(self) -> None:
        """Drop the subscription on the server (nothing if its query already let it go)."""
        if self._left:
            return
        self._left = True
        with contextlib.suppress(UnknownTableError):
            await self._client.unsubscribe(self.name)

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _awaited(
    call: Callable[Concatenate[Client, P], T],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """``call`` of the sync client as a coroutine method, with its typed arguments."""

    @functools.wraps(call)
    async def run(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        self._refuse_closed()
        return await off_loop(functools.partial(call, self.sync, *args, **kwargs))

    run.__doc__ = f"As :meth:`Client.{call.__name__}`, awaited (on a thread of its own)."
    return run


class _Connecting:
    """What :meth:`AsyncClient.connect` returns: ``await`` it, or ``async with`` it."""

    def __init__(self, opening: Coroutine[Any, Any, AsyncClient]) -> None:
        self._opening = opening
        self._client: AsyncClient | None = None

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._opening.__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._opening
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()


class AsyncClient:
    """The asyncio face of :class:`~pushtable.flight.client.client.Client` (one state, two faces).

    ``async with AsyncClient.connect(uri, token=...) as client:`` (or
    ``client = await AsyncClient.connect(...)``, then ``await client.aclose()``).
    """

    def __init__(self, sync: Client) -> None:
        #: the sync client this one drives
        self.sync = sync
        self._results: weakref.WeakSet[AsyncResult] = weakref.WeakSet()
        self._sinks: weakref.WeakSet[AsyncSink] = weakref.WeakSet()
        self._subscriptions: weakref.WeakSet[AsyncSubscription] = weakref.WeakSet()
        self._closed = False

    @classmethod
    def connect(
        cls,
        uri: str,
        *,
        token: str | None = None,
        tls_root_certs: str | Path | bytes | None = None,
        timeout: float | None = 30.0,
    ) -> _Connecting:
        """Connect as :func:`pushtable.flight.connect` does: ``await`` it or ``async with`` it."""

        async def opening() -> AsyncClient:
            client = await off_loop(
                functools.partial(
                    connect, uri, token=token, tls_root_certs=tls_root_certs, timeout=timeout
                )
            )
            return cls(client)

        return _Connecting(opening())

    def _refuse_closed(self) -> None:
        if self._closed:
            raise ClientClosedError(f"the async client of {self.sync.uri} is closed")

    # -- streams ----------------------------------------------------------------------------

    def sql(self, query: str, *, max_queued: int = MAX_QUEUED) -> AsyncResult:
        """The result of ``query`` as it streams: ``async for batch in client.sql(...)``."""
        self._refuse_closed()
        result = AsyncResult(lambda: self.sync.sql(query), max_queued, self._refuse_closed)
        self._results.add(result)
        return result

    def read(
        self, topic: str, start: int, end: int, *, max_queued: int = MAX_QUEUED
    ) -> AsyncResult:
        """Committed offsets ``[start, end)`` of a durable topic (as :meth:`Client.read`)."""
        self._refuse_closed()
        result = AsyncResult(
            lambda: self.sync.read(topic, start, end), max_queued, self._refuse_closed
        )
        self._results.add(result)
        return result

    async def sink(
        self,
        name: str,
        *,
        window: int | None = None,
        producer_id: str | None = None,
        retry: float = 60.0,
        window_bytes: int | None = None,
    ) -> AsyncSink:
        """A producer for table or topic ``name`` (the options of :meth:`Client.sink`)."""
        self._refuse_closed()
        sync = await off_loop(
            functools.partial(
                self.sync.sink,
                name,
                window=window,
                producer_id=producer_id,
                retry=retry,
                window_bytes=window_bytes,
            )
        )
        sink = AsyncSink(sync, asyncio.get_running_loop())
        self._sinks.add(sink)
        return sink

    async def subscribe(
        self,
        topic: str,
        name: str,
        capacity: int = 16,
        *,
        start: str | int | datetime = "now",
        on_slow: OnSlow = "block",
        slow_timeout: float = 5.0,
    ) -> AsyncSubscription:
        """As :meth:`Client.subscribe`; returns the subscription (``async with`` drops it)."""
        self._refuse_closed()
        await off_loop(
            functools.partial(
                self.sync.subscribe,
                topic,
                name,
                capacity,
                start=start,
                on_slow=on_slow,
                slow_timeout=slow_timeout,
            )
        )
        subscription = AsyncSubscription(self, topic, name)
        self._subscriptions.add(subscription)
        return subscription

    # -- calls ------------------------------------------------------------------------------

    create_table = _awaited(Client.create_table)
    create_topic = _awaited(Client.create_topic)
    unsubscribe = _awaited(Client.unsubscribe)
    tables = _awaited(Client.tables)
    stats = _awaited(Client.stats)
    offsets = _awaited(Client.offsets)
    consumed = _awaited(Client.consumed)
    schema = _awaited(Client.schema)
    publish = _awaited(Client.publish)
    published = _awaited(Client.published)
    discard = _awaited(Client.discard)

    # -- ending -----------------------------------------------------------------------------

    async def aclose(self, *, timeout: float | None = CLOSE_WAIT_S) -> None:
        """Stop every open result's query and the sinks' threads, and close the connection.

        The subscriptions it made that are still held are dropped; the sinks' tables are not
        ended (as a producer leaving). Bounded by ``timeout`` as a whole (subscriptions,
        then results and sinks at once, then the connection, all under one deadline; no
        thread is joined on the loop); later calls raise
        :class:`~pushtable.ClientClosedError`. Everything is let go first; then, if a sink's
        stream or thread was still held (a server that does not answer), it raises
        :class:`~pushtable.WriteTimeoutError` naming them (``async with`` logs it instead
        when its body raised, so the body's error is the one that propagates).
        """
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:  # one bound for the whole call (it took one per step)
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        leaving = [s.aclose() for s in list(self._subscriptions)]  # before calls are refused
        with contextlib.suppress(WriteTimeoutError):
            await within(asyncio.gather(*leaving, return_exceptions=True), timeout, "aclose")
        self._closed = True
        results = [r.aclose(timeout=left()) for r in list(self._results)]
        sinks = [s.aclose(timeout=left()) for s in list(self._sinks)]
        outcomes = await asyncio.gather(*results, *sinks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await within(off_loop(self.sync.close), left(), "aclose")
        held = [str(o) for o in outcomes[len(results) :] if isinstance(o, WriteTimeoutError)]
        if held:
            raise WriteTimeoutError(f"aclose: {len(held)} sink(s) not freed: {'; '.join(held)}")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            await self.aclose()
            return
        try:  # the body's error is the one that propagates
            await self.aclose()
        except WriteTimeoutError as unfreed:
            log.warning("leaving after %r: %s", exc, unfreed)
