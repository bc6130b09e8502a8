"""The asyncio face of a remote producer: :class:`AsyncSink`.

Each call's outcome reaches the task that made it. ``await sink.write(batch)`` returns once
the server acknowledged that batch (queued in its table; stored, for a durable topic), and
raises that batch's own error: a batch refused for its data (NOT NULL, order) fails its own
write only, and the batches other tasks sent after it are sent again, so nothing but the
refused batch is lost. ``await sink.send(batch)`` returns as soon as the batch is queued, with
a future for its outcome, for a task that pipelines its own writes.

A thread sends the batches in order under the sync sink's window; between it and the loop is
a queue of :data:`SINK_QUEUED` items, so a slow server holds the awaiting tasks, never a
growing buffer. Every wait is bounded by the call's ``timeout`` and safe to cancel: a batch
not yet sent when its task stops waiting is never sent, and nothing is ever joined on the
loop or on its default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import janus
import pyarrow as pa

from pushtable.errors import PushTableError, SinkClosedError, WriteTimeoutError
from pushtable.flight import protocol
from pushtable.flight.client.aio_threads import deliver, off_loop, within
from pushtable.flight.client.outcome import Item, timed_out
from pushtable.flight.client.remote_sink import RemoteSink, RemoteSinkStats
from pushtable.producer import arrow_batches, check_timeout

__all__ = ["SINK_QUEUED", "AsyncSink"]

log = logging.getLogger(__name__)

#: items a sink's writer thread may have waiting beyond the one it sends (then ``write``
#: waits): enough that the loop and the thread do not take turns batch by batch
SINK_QUEUED = 4
#: how often a writer thread waiting for room looks whether its sink was left
_POLL_S = 0.2
#: seconds ``aclose`` gives the stream to end cleanly before it lets go of it
CLOSE_WAIT_S = 5.0


def _retrieve(future: asyncio.Future[None]) -> None:
    """Read the outcome of a write no task waits for (asyncio warns of one never read)."""
    if not future.cancelled():
        future.exception()


class _Job:
    """An item on its way to the writer thread; a task that stops waiting abandons it."""

    __slots__ = ("deadline", "item", "sent")

    def __init__(self, item: Item, deadline: float | None) -> None:
        self.item = item
        self.deadline = deadline
        self.sent = False

    @property
    def abandoned(self) -> bool:
        """Whether its task stopped waiting (the sink, seeing it, does not send it)."""
        return self.item.withdrawn


class _Call:
    """A blocking call the writer thread runs in order with the items before it."""

    __slots__ = ("abandoned", "deadline", "done", "fn")

    def __init__(
        self, fn: Callable[[float | None], Any], deadline: float | None, done: asyncio.Future[Any]
    ) -> None:
        self.fn = fn
        self.deadline = deadline
        self.done = done
        self.abandoned = False


#: what wakes a writer thread waiting for work: a stream ended with items in flight
_WAKE = object()
#: a sink with no ``retry`` (not an idempotent producer)
_PLAIN = object()


class _Writer:
    """The thread that sends a sink's items in order.

    It holds no reference to its :class:`AsyncSink`, so a sink a service drops is collected,
    and the sink's finalizer stops this thread and ends its stream.
    """

    def __init__(self, sync: RemoteSink, loop: asyncio.AbstractEventLoop) -> None:
        self.sync = sync
        self.loop = loop
        self.queue: janus.Queue[_Job | _Call | object] = janus.Queue(SINK_QUEUED)
        self.leaving = threading.Event()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.thread = threading.Thread(target=self._run, name="pushtable-aio-write", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sync.on_stream_end = self._wake
        try:
            while not self.leaving.is_set():
                try:
                    entry = self.queue.sync_q.get(timeout=_POLL_S)
                except janus.SyncQueueEmpty:
                    entry = None
                except janus.SyncQueueShutDown:
                    return
                if isinstance(entry, _Call):
                    self._answer(entry)
                elif isinstance(entry, _Job):
                    self._send(entry)
                if self.queue.sync_q.empty():  # nothing follows: settle what is sent
                    self._tend()
        finally:
            self.sync.on_stream_end = None
            # no put lands after this (a task waiting for room hears the sink closed: the
            # room its refusals free was taken by writes nobody read, for good)
            self.queue.shutdown()
            self._refuse_queued()
            deliver(self.loop, self.exited)

    def _wake(self) -> None:
        """A stream ended (the reader thread says): the writer settles what it had in flight."""
        with contextlib.suppress(janus.SyncQueueFull, janus.SyncQueueShutDown, RuntimeError):
            self.queue.sync_q.put_nowait(_WAKE)

    def _tend(self) -> None:
        with contextlib.suppress(PushTableError):  # what it raises is each item's outcome
            step = time.monotonic() + _POLL_S
            self.sync.request_acks(step)
            self.sync.tend(step)

    def _refuse_queued(self) -> None:
        """The sink was left: what is still queued is never sent, and its tasks hear so."""
        closed = SinkClosedError(f"async sink for '{self.sync.name}' was closed")
        while True:
            try:
                entry = self.queue.sync_q.get_nowait()
            except (janus.SyncQueueEmpty, janus.SyncQueueShutDown):
                return
            if isinstance(entry, _Call):
                deliver(self.loop, entry.done, error=closed)
            elif isinstance(entry, _Job):
                entry.item.settle(closed)

    def _polled(self, deadline: float | None, abandoned: Callable[[], bool]) -> float | None:
        """The next step's deadline: soon, so the thread sees it was left or abandoned."""
        if self.leaving.is_set() or abandoned():
            raise SinkClosedError(f"async sink for '{self.sync.name}' was closed")
        step = time.monotonic() + _POLL_S
        return step if deadline is None else min(deadline, step)

    def _send(self, job: _Job) -> None:
        # An idempotent producer keeps what it was given and rides out an outage of up to its
        # ``retry`` seconds (None: for good); a plain one reports the outage to the write.
        retry = getattr(self.sync, "retry", _PLAIN)
        outage_ends: float | None = None
        while True:
            try:
                if job.abandoned:
                    return
                self.sync.submit(job.item, self._polled(job.deadline, lambda: job.abandoned))
                job.sent = True
                return
            except WriteTimeoutError as exc:
                if job.item.claimed:
                    job.sent = True  # on its way: its outcome comes with its acknowledgement
                    return
                if job.deadline is not None and time.monotonic() >= job.deadline:
                    if job.item.withdraw():  # never sent, and never will be
                        said = exc if getattr(exc, "kept", None) is False else None
                        job.item.settle(said or timed_out(str(exc), 0, kept=False))
                    else:
                        job.sent = True  # claimed meanwhile: on its way
                    return
            except PushTableError as exc:
                now = time.monotonic()
                if getattr(exc, "refused_sequence", None) is not None and not job.item.settled:
                    continue  # the server refused an earlier item (told already); this one goes
                if getattr(exc, "gave_up", False):  # the sink's own ``retry`` ran out
                    gave_up = getattr(self.sync, "gave_up", None)
                    if gave_up is not None:  # kept: told so, its later error goes on
                        gave_up(job.item, exc)
                    else:
                        job.item.settle(exc)
                    return
                if retry is not _PLAIN and protocol.retriable(exc):
                    if outage_ends is None and isinstance(retry, (int, float)):
                        outage_ends = now + retry
                    if (outage_ends is None or now < outage_ends) and (
                        job.deadline is None or now < job.deadline
                    ):
                        continue  # the next step reconnects and sends again
                job.item.settle(exc)
                return
            except BaseException as exc:  # noqa: BLE001 (the item's task hears it)
                job.item.settle(exc)
                return

    def _answer(self, call: _Call) -> None:
        while True:
            try:
                if call.abandoned:
                    return
                step = self._polled(call.deadline, lambda: call.abandoned)
                value = call.fn(step)
            except WriteTimeoutError as exc:
                if call.deadline is None or time.monotonic() < call.deadline:
                    continue  # a step of a longer wait
                deliver(self.loop, call.done, error=exc)
                return
            except BaseException as exc:  # noqa: BLE001 (the call's task hears it)
                deliver(self.loop, call.done, error=exc)
                return
            deliver(self.loop, call.done, value)
            return

    def leave(self) -> None:
        """Stop the thread (from any thread): what is queued is refused, nothing joined."""
        self.leaving.set()
        self._wake()


def _left(writer: _Writer, end_stream: bool) -> None:
    """Let go of a sink that was left (``aclose``, or collected): its thread and its stream.

    The table stays open: a producer leaving is not end of stream.
    """
    writer.leave()
    if end_stream:
        threading.Thread(
            target=writer.sync._end_stream, name="pushtable-aio-leave", daemon=True
        ).start()


class AsyncSink:
    """A remote producer an event loop awaits: ``write``, ``send``, ``flush``, ``close``.

    Use it as ``async with``: end of stream on success, ``fail(exc)`` when the body raises.
    Each call takes ``timeout=`` (seconds, None: no bound) and may be cancelled; a batch not
    yet sent when its task stops waiting is never sent.

    Example:
        >>> import asyncio, pyarrow as pa
        >>> from pushtable.flight import Server
        >>> from pushtable.flight.client.aio import AsyncClient
        >>> server = Server()
        >>> async def main() -> dict[str, int]:
        ...     async with AsyncClient.connect(server.location) as client:
        ...         await client.create_table("t", pa.schema([("v", pa.int64())]))
        ...         async with await client.sink("t") as sink:
        ...             await asyncio.gather(*(sink.write(pa.record_batch({"v": [i]}))
        ...                                    for i in range(3)))
        ...             return {"acknowledged": (await sink.stats()).acknowledged_batches}
        >>> asyncio.run(main())
        {'acknowledged': 3}
        >>> _ = server.stop()
    """

    def __init__(self, sync: RemoteSink, loop: asyncio.AbstractEventLoop) -> None:
        #: the sync sink this one drives (its window, its stream)
        self.sync = sync
        self._loop = loop
        self._writer = _Writer(sync, loop)
        self._closed = False
        self._left = False  # left by aclose: a close after it raises
        #: a ``fail()`` that timed out while its call went on (``aclose`` waits for it)
        self._failing: asyncio.Future[None] | None = None
        self._finalizer = weakref.finalize(self, _left, self._writer, True)

    @property
    def name(self) -> str:
        """The remote table or topic's name."""
        return self.sync.name

    @property
    def closed(self) -> bool:
        """Whether :meth:`close`, :meth:`fail` or :meth:`aclose` was called."""
        return self._closed

    def _refuse_closed(self) -> None:
        if self._closed:
            raise SinkClosedError(f"async sink for '{self.name}' is closed")

    async def _queue(self, entry: _Job | _Call | object, deadline: float | None) -> None:
        """Hand ``entry`` to the writer thread, waiting (until ``deadline``) for room."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await within(self._writer.queue.async_q.put(entry), left, f"write to '{self.name}'")
        except janus.AsyncQueueShutDown:  # its writer thread stopped: the sink was left
            raise SinkClosedError(f"async sink for '{self.name}' was closed") from None

    # -- writing ----------------------------------------------------------------------------

    async def send(self, data: Any, *, timeout: float | None = None) -> asyncio.Future[None]:
        """Queue ``data`` (a batch, or each batch of a table) and return a future of its outcome.

        Returns once the batches are in the writer's queue (waiting while it is full, at most
        ``timeout`` seconds): the future is done when the server acknowledged them all, or
        holds the first error. Checked against the table's schema here, before queueing.
        """
        _, outcome = await self._send(data, timeout)
        return outcome

    async def _send(
        self, data: Any, timeout: float | None
    ) -> tuple[list[_Job], asyncio.Future[None]]:
        self._refuse_closed()
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        items = [self._item(b) for b in arrow_batches(data)]
        outcomes: list[asyncio.Future[None]] = [self._loop.create_future() for _ in items]
        jobs = []
        for item, outcome in zip(items, outcomes, strict=True):
            item.outcome = self._settler(outcome)
            jobs.append(_Job(item, deadline))
        try:
            for job in jobs:
                await self._queue(job, deadline)
        except WriteTimeoutError as exc:  # the writer's queue stayed full
            sent = self._abandon(jobs)
            raise timed_out(str(exc), sent, kept=sent > 0) from None
        except BaseException:
            self._abandon(jobs)  # the thread skips those not sent
            raise
        if len(outcomes) == 1:
            return jobs, outcomes[0]
        return jobs, self._loop.create_task(_all(outcomes))

    async def write(self, data: Any, *, timeout: float | None = None) -> None:
        """Write ``data`` and return once the server acknowledged it (stored, if durable).

        Raises this write's own error: ``SchemaMismatchError`` (before queueing, or the
        server's NOT NULL check), ``OrderViolationError``, ``ReaderGoneError``,
        ``SinkClosedError``, ``WriteTimeoutError`` (``timeout`` seconds passed). A batch not
        yet sent when the write times out or its task is cancelled is never sent; one already
        sent may still be stored (``flush`` waits for it).
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        jobs, outcome = await self._send(data, timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await within(asyncio.shield(outcome), left, f"write to '{self.name}'")
        except WriteTimeoutError as exc:
            if outcome.done() and not outcome.cancelled() and outcome.exception() is exc:
                raise  # the batch's own outcome (its stream's end, or never sent)
            sent = self._abandon(jobs)
            outcome.add_done_callback(_retrieve)  # an outcome no task reads any more
            raise timed_out(
                f"write to '{self.name}' timed out after {timeout}s waiting for its "
                "acknowledgement",
                sent,
                kept=sent > 0,
            ) from None
        except BaseException:
            if not outcome.done():  # the task stopped waiting (cancelled): not its outcome
                self._abandon(jobs)
                outcome.add_done_callback(_retrieve)
            raise

    def _abandon(self, jobs: list[_Job]) -> int:
        """Its task stopped waiting: what the writer has not sent yet, it never sends.

        Returns how many were sent already: each is on its way, and as no task waits for its
        outcome any more, an error it meets goes to the sink's next ``flush`` or ``close``.
        """
        sent = 0
        for job in jobs:
            if not job.item.withdraw():
                sent += 1
                if not job.item.settled:  # its outcome still to come, for nobody
                    self.sync.orphan(job.item)
        return sent

    def _item(self, batch: pa.RecordBatch) -> Item:
        return Item(protocol.to_wire(self.name, self.sync.schema, self.sync._wire_schema, batch))

    def _settler(self, outcome: asyncio.Future[None]) -> Callable[[BaseException | None], None]:
        loop = self._loop
        return lambda error: deliver(loop, outcome, error=error)

    async def advance(self, ts: Any, *, timeout: float | None = None) -> None:
        """Move the table's watermark to ``ts``, in order with the batches written before."""
        self._refuse_closed()
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        outcome: asyncio.Future[None] = self._loop.create_future()
        job = _Job(self.sync.advance_item(ts, self._settler(outcome)), deadline)
        try:
            await self._queue(job, deadline)
        except BaseException:
            self._abandon([job])
            raise
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        await within(asyncio.shield(outcome), left, f"advance of '{self.name}'")

    # -- calls in order with the writes -----------------------------------------------------

    async def _call(
        self, fn: Callable[[float | None], Any], timeout: float | None, what: str
    ) -> Any:
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        done: asyncio.Future[Any] = self._loop.create_future()
        call = _Call(fn, deadline, done)
        try:
            await self._queue(call, deadline)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return await within(asyncio.shield(done), left, what)
        except BaseException:
            call.abandoned = True  # the thread stops waiting for it at its next step
            raise

    async def flush(self, *, timeout: float | None = None) -> None:
        """Return once every batch written before is acknowledged (stored, if durable)."""
        self._refuse_closed()
        await self._call(self._flush_step, timeout, f"flush of '{self.name}'")

    def _flush_step(self, deadline: float | None) -> None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.sync.flush(left)

    async def close(self, *, timeout: float | None = None) -> None:
        """Flush, then end the table's stream (as :meth:`RemoteSink.close`).

        Bounded by ``timeout``: past it (a full table nobody reads) it raises
        ``WriteTimeoutError`` and the table stays open.
        """
        if self._left:
            raise SinkClosedError(
                f"async sink for '{self.name}' was left (aclose): its table stays open"
            )
        if self._closed:
            return
        await self._call(self._close_step, timeout, f"close of '{self.name}'")
        self._leave(end_stream=False)
        await self._exited(CLOSE_WAIT_S)

    def _close_step(self, deadline: float | None) -> None:
        self._flush_step(deadline)  # bounded: a step of the wait, then the close itself
        self.sync.close(None if deadline is None else max(0.0, deadline - time.monotonic()))

    async def fail(self, exc: BaseException, *, timeout: float | None = 10.0) -> None:
        """Make the table's reading query raise ``exc`` (``StreamFailedError`` naming it).

        It does not wait behind queued batches: those not yet sent are never sent.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"fail() takes an exception, got {type(exc).__name__}")
        self._refuse_closed()
        self._leave(end_stream=False)
        failing = self._failing = asyncio.ensure_future(off_loop(self.sync.fail, exc))
        failing.add_done_callback(_retrieve)
        await within(asyncio.shield(failing), timeout, f"fail of '{self.name}'")
        await self._exited(CLOSE_WAIT_S)

    def _leave(self, end_stream: bool) -> None:
        self._closed = True
        self._finalizer.detach()
        _left(self._writer, end_stream)

    async def aclose(self, *, timeout: float | None = CLOSE_WAIT_S) -> None:
        """Leave without ending the table (a producer going away), within ``timeout``.

        Queued batches are not sent, the writer thread stops and the stream on the server
        ends (freeing its slot), all before it returns: a stream the server holds (a batch
        waiting for room in a full table) is left half-way through ``timeout`` with the
        ``leave`` action. Raises :class:`~pushtable.WriteTimeoutError` naming what it could
        not free by then (a server that does not answer). Never joins a thread on the loop.
        """
        if self._closed:
            return await self._closed_already(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._leave(end_stream=False)
        self._left = True
        wait = CLOSE_WAIT_S if timeout is None else timeout
        held: list[str] = ["its stream (no answer)"]
        with contextlib.suppress(PushTableError):
            held = await within(off_loop(self.sync._end_stream, wait), timeout, "aclose")
        await self._exited(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not self._writer.exited.done():  # it says so as its last act: then it returns
            held.append(f"thread {self._writer.thread.name}")
        if held:
            raise WriteTimeoutError(
                f"aclose of '{self.name}' timed out after {wait:g}s with {', '.join(held)} "
                "still held"
            )

    async def _closed_already(self, timeout: float | None) -> None:
        """``aclose`` after ``close``, ``fail`` or ``aclose``: what is still held, it names.

        A ``fail()`` that timed out goes on (its call, the stream's end): returning at once
        said all was free while the stream and its threads were held.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        held: list[str] = []
        failing = self._failing
        if failing is not None and not failing.done():
            with contextlib.suppress(PushTableError):
                await within(asyncio.shield(failing), timeout, "aclose")
            if not failing.done():
                held.append("its stream (fail() has had no answer)")
        # a stream an earlier aclose (or one running now) let go, not ended yet
        wait = left()
        try:
            held += await within(
                off_loop(self.sync._end_stream, CLOSE_WAIT_S if wait is None else wait),
                wait,
                "aclose",
            )
        except WriteTimeoutError:  # its answer did not come in time: still held
            held.append("its stream (no answer)")
        except PushTableError:
            pass
        await self._exited(left())
        if not self._writer.exited.done():
            held.append(f"thread {self._writer.thread.name}")
        if held:
            wait = CLOSE_WAIT_S if timeout is None else timeout
            raise WriteTimeoutError(
                f"aclose of '{self.name}' timed out after {wait:g}s with "
                f"{', '.join(held)} still held"
            )

    async def _exited(self, timeout: float | None) -> None:
        """Wait (at most ``timeout`` seconds) for the writer thread to end."""
        with contextlib.suppress(WriteTimeoutError):
            await within(asyncio.shield(self._writer.exited), timeout, "aclose")

    # -- what it is -------------------------------------------------------------------------

    async def stats(self) -> RemoteSinkStats:
        """What this producer sent and had acknowledged, and the server table's counters."""
        return await off_loop(lambda: self.sync.stats)

    async def __aenter__(self) -> AsyncSink:
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            await self.close()
        elif not self._closed:
            try:  # the body's error is the one that propagates
                await self.fail(exc)
            except PushTableError as failing:
                log.warning("leaving '%s' after %r: %s", self.name, exc, failing)


async def _all(outcomes: list[asyncio.Future[None]]) -> None:
    """Every outcome, the first error raised (a table written in several batches)."""
    await asyncio.gather(*outcomes)
