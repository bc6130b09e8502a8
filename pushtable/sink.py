"""The producer side of a streaming table: :class:`TableSink`.

A sink is what :func:`pushtable.register_streaming_table` returns. Threads call
:meth:`TableSink.write`, asyncio tasks ``await`` :meth:`TableSink.awrite`; both block (or
suspend) while ``capacity`` batches are queued, and both raise the same errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pyarrow as pa

from pushtable import _native
from pushtable.errors import (
    InvalidBatchError,
    PushTableError,
    ReaderGoneError,
    SchemaMismatchError,
    SinkClosedError,
    WriteTimeoutError,
)

__all__ = ["SinkStats", "TableSink"]

_ERRORS: dict[type[BaseException], type[PushTableError]] = {
    _native.ClosedError: SinkClosedError,
    _native.ReaderGoneError: ReaderGoneError,
    _native.SchemaError: SchemaMismatchError,
    _native.WriteTimeout: WriteTimeoutError,
    _native.InputError: InvalidBatchError,
}


def _public_error(exc: _native.NativeError) -> PushTableError:
    return _ERRORS.get(type(exc), PushTableError)(str(exc))


@dataclass(frozen=True)
class SinkStats:
    """A snapshot of a sink's counters.

    ``rows``/``batches``/``bytes`` count what was accepted; ``queued_*`` is what waits for
    the reader now; ``blocked_seconds`` is the total time producers spent waiting for room.
    """

    rows: int
    batches: int
    bytes: int
    queued_batches: int
    queued_bytes: int
    blocked_seconds: float
    closed: bool
    failed: bool
    reader_gone: bool


class TableSink:
    """Write end of a single-scan streaming table.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext
        >>> ctx = SessionContext()
        >>> sink = ctx.register_streaming_table("t", pa.schema([("v", pa.int64())]), capacity=4)
        >>> with sink:
        ...     sink.write(pa.record_batch([pa.array([1, 2, 3])], names=["v"]))
        >>> ctx.sql("SELECT sum(v) AS s FROM t").to_pydict()
        {'s': [6]}
    """

    def __init__(
        self,
        native: _native.Sink,
        name: str,
        schema: pa.Schema,
        capacity: int,
        max_bytes: int | None,
    ) -> None:
        self._native = native
        self.name = name
        self.schema = schema
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.error: BaseException | None = None
        self._async = _AsyncWriter(native)

    def __repr__(self) -> str:
        s = self.stats
        state = "failed" if s.failed else "closed" if s.closed else "open"
        return f"TableSink(name={self.name!r}, {state}, rows={s.rows}, queued={s.queued_batches})"

    def write(self, data: Any, timeout: float | None = None) -> None:
        """Enqueue a batch, blocking while the queue is full (the GIL is released meanwhile).

        ``data`` is a ``pa.RecordBatch``, a ``pa.Table`` (written batch by batch) or any
        object with ``__arrow_c_array__`` / ``__arrow_c_stream__``. A batch that does not
        match the schema raises :class:`SchemaMismatchError` and is not enqueued.

        Raises:
            WriteTimeoutError: ``timeout`` seconds passed with the queue still full.
            SinkClosedError: the sink was closed or failed (also when that happens while blocked).
            ReaderGoneError: the query reading the table stopped, or the table was dropped.
        """
        try:
            self._native.write(data, timeout)
        except _native.NativeError as exc:
            raise _public_error(exc) from None

    async def awrite(self, data: Any, timeout: float | None = None) -> None:
        """Asyncio counterpart of :meth:`write`: suspends instead of blocking the loop.

        Cancelling the awaiting task before the batch is enqueued leaves it unwritten.
        """
        await self._async.write(data, timeout)

    def close(self) -> None:
        """End of stream: the query finishes after the queued batches. Idempotent."""
        self._native.close()

    async def aclose(self) -> None:
        """Asyncio counterpart of :meth:`close` (it never blocks, so it never suspends)."""
        self.close()

    def fail(self, exc: BaseException) -> None:
        """Make the reading query raise ``exc``; never blocks, even on a full queue.

        The query's error message names the exception's type and text; :attr:`error` keeps
        the object. Queued batches are discarded. Ignored once the reader has finished.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"fail() takes an exception, got {type(exc).__name__}")
        if self._native.fail(f"{type(exc).__name__}: {exc}"):
            self.error = exc

    @property
    def stats(self) -> SinkStats:
        """Current counters (see :class:`SinkStats`)."""
        return SinkStats(**self._native.stats())

    @property
    def closed(self) -> bool:
        """True once :meth:`close` or :meth:`fail` was called."""
        return self.stats.closed

    def __enter__(self) -> TableSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.fail(exc)

    async def __aenter__(self) -> TableSink:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


# --- where asyncio meets the blocking native write ---------------------------------------

_SLICE = 0.05  # seconds a writer thread blocks before checking for cancellation
_IDLE = 1.0  # seconds without requests before the writer thread exits


class _Request:
    """One ``awrite`` call: its batches, deadline, and the future its task awaits."""

    def __init__(self, batches: list[Any], timeout: float | None, loop: asyncio.AbstractEventLoop):
        self.batches = batches
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.cancelled = threading.Event()

    def run(self, native: _native.Sink) -> None:
        try:
            for batch in self.batches:
                self._write_one(native, batch)
        except _native.NativeError as exc:
            self._settle(_public_error(exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            self._settle(exc)
        else:
            self._settle(None)

    def _write_one(self, native: _native.Sink, batch: Any) -> None:
        # Block in short slices so a cancelled task releases its batch unwritten.
        while not self.cancelled.is_set():
            remaining = None if self.deadline is None else self.deadline - time.monotonic()
            try:
                native.write(
                    batch, _SLICE if remaining is None else max(0.0, min(_SLICE, remaining))
                )
                return
            except _native.WriteTimeout:
                if remaining is not None and remaining <= _SLICE:
                    raise WriteTimeoutError(
                        f"awrite timed out after {self.timeout}s with the queue full"
                    ) from None

    def _settle(self, exc: BaseException | None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if exc is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(exc)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self.loop.call_soon_threadsafe(settle)


class _AsyncWriter:
    """Runs ``awrite`` requests, in order, on one helper thread per sink.

    Many tasks can wait on one sink without one thread each; each task learns the outcome
    of *its* batch (errors included), and the thread exits when idle.
    """

    def __init__(self, native: _native.Sink) -> None:
        self._native = native
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def write(self, data: Any, timeout: float | None) -> None:
        request = _Request(_split(data), timeout, asyncio.get_running_loop())
        self._requests.put(request)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pushtable-awrite", daemon=True
                )
                self._thread.start()
        try:
            await asyncio.shield(request.future)
        except asyncio.CancelledError:
            request.cancelled.set()
            raise

    def _run(self) -> None:
        while True:
            try:
                request = self._requests.get(timeout=_IDLE)
            except queue.Empty:
                with self._lock:
                    if self._requests.empty():
                        self._thread = None
                        return
                continue
            if not request.cancelled.is_set():
                request.run(self._native)


def _split(data: Any) -> list[Any]:
    """Turn ``data`` into whole batches so a cancelled request never leaves half a stream."""
    try:
        return _batches_of(data)
    except InvalidBatchError:
        raise
    except Exception as exc:  # a hostile object's attribute lookup or export failed
        raise InvalidBatchError(
            f"cannot read Arrow data from {type(data).__name__}: {exc}"
        ) from exc


def _batches_of(data: Any) -> list[Any]:
    if hasattr(data, "__arrow_c_array__"):
        return [data]
    if isinstance(data, pa.Table):
        return list(data.to_batches())
    if hasattr(data, "__arrow_c_stream__"):
        return list(pa.RecordBatchReader.from_stream(data))
    raise InvalidBatchError(
        "expected Arrow data (a pyarrow RecordBatch or Table, or an object with "
        f"__arrow_c_array__ / __arrow_c_stream__), got {type(data).__name__}"
    )
