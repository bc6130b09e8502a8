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
- :meth:`AsyncClient.sink` gives an :class:`AsyncSink`: ``await sink.write(batch)`` hands the
  batch to the sink's writer thread through a queue of :data:`SINK_QUEUED` batches; the
  thread sends it under the sync sink's own window (and, with ``producer_id``, its resends):
  a slow server makes the awaiting task wait, never a buffer grow. ``await sink.flush()``
  returns once everything written is acknowledged (stored, for a durable topic).
- Every other call (``create_table``, ``publish``, ``offsets``, ...) runs the sync client's
  call on a worker thread.

Errors cross by class (the same :mod:`pushtable.errors`). One state, two faces: an
:class:`AsyncClient` wraps a :class:`~pushtable.flight.client.Client` (``.sync``), as janus
gives one queue a sync and an async side. After :meth:`AsyncClient.aclose` no thread of it is
left.

Example:
    >>> import asyncio, pyarrow as pa
    >>> from pushtable.flight import Server
    >>> from pushtable.flight.aio import AsyncClient
    >>> server = Server()
    >>> async def main() -> list[int]:
    ...     async with await AsyncClient.connect(server.location) as client:
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
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import janus
import pyarrow as pa

from pushtable.flight.client import Client, RemoteResult, connect
from pushtable.flight.remote_sink import RemoteSink

__all__ = ["AsyncClient", "AsyncResult", "AsyncSink"]

T = TypeVar("T")

#: batches a result's reader thread may hold ahead of the loop
MAX_QUEUED = 8
#: batches a sink's writer thread may have waiting beyond the one it sends (then ``write``
#: waits): enough that the loop and the thread do not take turns batch by batch
SINK_QUEUED = 4


class _End:
    """The reader thread's last item: the stream ended, or ``error`` ended it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class AsyncResult:
    """A remote query's result as an async iterator of Arrow record batches.

    Iterate it (``async for``), or ``await read_all()``. Use it as an async context manager,
    or call :meth:`aclose`, to stop the server's query as soon as the loop is done with it;
    a task cancelled while it waits for a batch stops it too.
    """

    def __init__(self, start: Callable[[], RemoteResult], max_queued: int = MAX_QUEUED) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        self._start = start
        self._max_queued = max_queued
        self._result: RemoteResult | None = None
        self._queue: janus.Queue[pa.RecordBatch | _End] | None = None
        self._thread: threading.Thread | None = None
        self._done = False
        self._stop = threading.Event()

    # -- the reader thread ----------------------------------------------------------------

    def _read(self, queue: janus.Queue[pa.RecordBatch | _End]) -> None:
        end = _End()
        try:
            assert self._result is not None
            for batch in self._result:
                if self._stop.is_set():
                    return
                queue.sync_q.put(batch)  # waits while the loop is behind: bounded
        except janus.SyncQueueShutDown:
            return  # the loop side closed the stream
        except BaseException as exc:  # noqa: BLE001 (handed to the task that reads)
            end = _End(exc)
        with contextlib.suppress(janus.SyncQueueShutDown):  # the loop side closed it
            queue.sync_q.put(end)

    async def _open(self) -> janus.Queue[pa.RecordBatch | _End]:
        if self._queue is None:
            self._result = await asyncio.to_thread(self._start)
            self._queue = janus.Queue(self._max_queued)
            self._thread = threading.Thread(
                target=self._read, args=(self._queue,), name="pushtable-aio-read", daemon=True
            )
            self._thread.start()
            weakref.finalize(self, _cancel, self._result, self._queue, self._stop)
        return self._queue

    # -- the loop's side ------------------------------------------------------------------

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
            await self._join()
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        return item

    async def read_all(self) -> pa.Table:
        """The rest of the result as one table: waits until the query ends."""
        batches = [batch async for batch in self]
        assert self._result is not None
        return pa.Table.from_batches(batches, schema=self._result.schema)

    async def aclose(self) -> None:
        """Stop the query on the server (if it still runs) and end the reader thread."""
        self._done = True
        if self._queue is not None:
            _cancel(self._result, self._queue, self._stop)
            await self._join()

    async def _join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join)
        if self._queue is not None:
            self._queue.shutdown(immediate=True)
            await self._queue.aclose()

    async def __aenter__(self) -> AsyncResult:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _cancel(result: RemoteResult | None, queue: janus.Queue[Any], stop: threading.Event) -> None:
    """Stop the stream from any thread: the server's query, then the queue between."""
    stop.set()
    if result is not None:
        result.cancel()
    if not queue.closed:
        queue.shutdown(immediate=True)


class _Call:
    """A call the writer thread runs in order with the batches before it."""

    def __init__(self, fn: Callable[[], Any], done: asyncio.Future[Any]) -> None:
        self.fn = fn
        self.done = done


class AsyncSink:
    """A remote producer an event loop awaits: ``write``, ``flush``, ``close``.

    ``await write(batch)`` returns once the batch is in the writer thread's queue (at most
    :data:`SINK_QUEUED` batches); that thread sends under the sync sink's window, so ``write``
    waits while the window and the queue are full (a slow server holds the task, never a
    growing buffer). An error the thread meets (the
    server refused a batch, it stopped) is raised by the next ``write``, ``flush`` or
    ``close``, with ``batches_written`` counting the batches sent before it. ``flush`` and
    ``close`` wait for every batch written before them.
    """

    def __init__(self, sync: RemoteSink, loop: asyncio.AbstractEventLoop) -> None:
        #: the sync sink this one drives (its stats, its window)
        self.sync = sync
        self._loop = loop
        self._queue: janus.Queue[pa.RecordBatch | _Call | None] = janus.Queue(SINK_QUEUED)
        self._error: BaseException | None = None
        self._sent = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._write_loop, name="pushtable-aio-write", daemon=True
        )
        self._thread.start()

    @property
    def name(self) -> str:
        """The remote table or topic's name."""
        return self.sync.name

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.sync_q.get()
            except janus.SyncQueueShutDown:
                return
            if item is None:
                return
            if isinstance(item, _Call):
                self._answer(item)
                continue
            if self._error is not None:
                continue  # after an error nothing more is sent; the next call raises it
            try:
                self.sync.write(item)
                self._sent += 1
            except BaseException as exc:  # noqa: BLE001 (raised by the next call)
                self._error = exc

    def _answer(self, call: _Call) -> None:
        def settle(value: Any, error: BaseException | None) -> None:
            if call.done.cancelled():
                return
            if error is not None:
                call.done.set_exception(error)
            else:
                call.done.set_result(value)

        try:
            if self._error is not None:
                raise self._error
            value, error = call.fn(), None
        except BaseException as exc:  # noqa: BLE001 (set on the awaiting future)
            value, error = None, exc
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(settle, value, error)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error = self._error
            error.batches_written = self._sent  # type: ignore[attr-defined]
            raise error

    async def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Hand ``batch`` (or each batch of a table) to the writer thread.

        Waits while the sink's window is full.
        """
        if self._closed:
            raise RuntimeError(f"async sink for '{self.name}' is closed")
        self._raise_pending()
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        for b in batches:
            await self._queue.async_q.put(b)

    async def _call(self, fn: Callable[[], T]) -> T:
        done: asyncio.Future[T] = self._loop.create_future()
        await self._queue.async_q.put(_Call(fn, done))
        return await done

    async def flush(self, timeout: float | None = None) -> None:
        """Return once every batch written is acknowledged (stored, for a durable topic)."""
        await self._call(lambda: self.sync.flush(timeout))

    async def close(self) -> None:
        """Flush, end the table's stream (as :meth:`RemoteSink.close`), and stop the thread."""
        if self._closed:
            return
        try:
            await self._call(self.sync.close)
        finally:
            await self._stop()

    async def _stop(self) -> None:
        self._closed = True
        if not self._queue.closed:
            await self._queue.async_q.put(None)
        await asyncio.to_thread(self._thread.join)
        self._queue.shutdown(immediate=True)
        await self._queue.aclose()

    async def aclose(self) -> None:
        """Stop the writer thread without ending the remote table (a producer leaving)."""
        if not self._closed:
            await self._stop()

    async def __aenter__(self) -> AsyncSink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is None:
            await self.close()
        else:
            await self.aclose()


class AsyncClient:
    """The asyncio face of :class:`~pushtable.flight.client.Client` (one state, two faces).

    Make one with ``await AsyncClient.connect(uri, token=...)`` and use it as ``async with``.
    """

    def __init__(self, sync: Client) -> None:
        #: the sync client this one drives
        self.sync = sync
        self._results: weakref.WeakSet[AsyncResult] = weakref.WeakSet()
        self._sinks: list[AsyncSink] = []

    @classmethod
    async def connect(cls, uri: str, **options: Any) -> AsyncClient:
        """Connect as :func:`pushtable.flight.connect` does (``token``, ``tls_root_certs``...)."""
        return cls(await asyncio.to_thread(connect, uri, **options))

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    # -- streams ----------------------------------------------------------------------------

    def sql(self, query: str, *, max_queued: int = MAX_QUEUED) -> AsyncResult:
        """The result of ``query`` as it streams: ``async for batch in client.sql(...)``."""
        result = AsyncResult(lambda: self.sync.sql(query), max_queued)
        self._results.add(result)
        return result

    def read(
        self, topic: str, start: int, end: int, *, max_queued: int = MAX_QUEUED
    ) -> AsyncResult:
        """Committed offsets ``[start, end)`` of a durable topic (as :meth:`Client.read`)."""
        result = AsyncResult(lambda: self.sync.read(topic, start, end), max_queued)
        self._results.add(result)
        return result

    async def sink(self, name: str, **options: Any) -> AsyncSink:
        """A producer for table or topic ``name`` (the options of :meth:`Client.sink`)."""
        sync = await self._run(self.sync.sink, name, **options)
        sink = AsyncSink(sync, asyncio.get_running_loop())
        self._sinks.append(sink)
        return sink

    # -- calls ------------------------------------------------------------------------------

    async def create_table(self, name: str, schema: pa.Schema, **options: Any) -> None:
        """As :meth:`Client.create_table`."""
        await self._run(self.sync.create_table, name, schema, **options)

    async def create_topic(self, name: str, schema: pa.Schema, **options: Any) -> None:
        """As :meth:`Client.create_topic`."""
        await self._run(self.sync.create_topic, name, schema, **options)

    async def subscribe(self, topic: str, name: str, **options: Any) -> Any:
        """As :meth:`Client.subscribe`: then ``client.sql(...)`` reads the subscription."""
        return await self._run(self.sync.subscribe, topic, name, **options)

    async def tables(self) -> list[dict[str, Any]]:
        """As :meth:`Client.tables`."""
        return await self._run(self.sync.tables)

    async def stats(self, name: str) -> dict[str, Any]:
        """As :meth:`Client.stats`."""
        return await self._run(self.sync.stats, name)

    async def offsets(self, topic: str) -> dict[str, int]:
        """As :meth:`Client.offsets`."""
        return await self._run(self.sync.offsets, topic)

    async def schema(self, name: str) -> pa.Schema:
        """As :meth:`Client.schema`."""
        return await self._run(self.sync.schema, name)

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`Client.publish` (the Spark path's driver side)."""
        return await self._run(self.sync.publish, *args, **kwargs)

    async def published(self, table: str, query: str) -> int:
        """As :meth:`Client.published`."""
        return await self._run(self.sync.published, table, query)

    # -- ending -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop every open result's query and the sinks' threads, and close the connection.

        The sinks' tables are not ended (as a producer leaving); no thread of this client is
        left.
        """
        for result in list(self._results):
            await result.aclose()
        for sink in self._sinks:
            await sink.aclose()
        await self._run(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
