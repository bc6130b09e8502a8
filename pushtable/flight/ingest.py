"""DoPut on ``pushtable serve``: remote producers' batches into tables (with backpressure end
to end), into durable topics (acknowledged once committed, idempotent producers), Spark task
attempts' shares staged until their epoch is published, and idle streams told to end."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors, metrics
from pushtable.durable import DurableLog
from pushtable.durable.log import epoch_of, epoch_sequence
from pushtable.errors import PushTableError, WriteTimeoutError
from pushtable.flight import protocol
from pushtable.flight.actions import Epoch, Publish
from pushtable.flight.auth import ADMIN, WRITE, caller
from pushtable.flight.calls import POLL_S, audit, wire_errors
from pushtable.flight.limits import Limits, Usage
from pushtable.sink import TableSink
from pushtable.topic import Topic


def spark_producer(query: str) -> str:
    """The idempotent-producer key under which a Spark query's epochs go into a durable topic
    (one key per query: the stored sequence is its publish watermark)."""
    return f"spark:{query}"


class Ingest:
    """The server's DoPut side (a part of :class:`pushtable.flight.Server`)."""

    limits: Limits
    usage: Usage
    dropped_shares: int
    _lock: threading.Lock
    _stopping: threading.Event
    _acks: set[_Acks]
    _staged: dict[tuple[str, str, int], dict[tuple[int, int], _Share]]
    _published: dict[tuple[str, str], int]
    _publishing: set[tuple[str, str]]
    _tables: dict[str, TableSink | Topic]

    if TYPE_CHECKING:

        def _table(self, name: str) -> TableSink | Topic: ...

        def _call(self, context: Any) -> contextlib.AbstractContextManager[None]: ...

        def sql_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None: ...

    def _end_idle_streams(self) -> None:
        """Tell each DoPut stream idle for ``idle_timeout`` to end (pushtable's clients do,
        and reopen on their next write); the server's thread for it is then free."""
        timeout = self.limits.idle_timeout
        while not self._stopping.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [
                    a
                    for a in self._acks
                    if not (a.told_idle or a.writing) and now - a.last_active > timeout
                ]
            for acks in idle:
                self.usage.refused("idle_timeout")
                acks.idle()

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        if descriptor.descriptor_type == flight.DescriptorType.CMD:  # Flight SQL: parameters
            with wire_errors(), audit(context, "flight_sql_put"), self._call(context):
                self.sql_put(context, descriptor, reader, writer)
            return
        acks = _Acks(writer)
        with self._lock:
            self._acks.add(acks)
        try:
            with wire_errors(), audit(context, "do_put") as record, self._call(context):
                self._do_put(context, descriptor, reader, acks, record)
        finally:
            acks.close()  # before the call ends: no stop notice may touch a finished call
            with self._lock:
                self._acks.discard(acks)

    def _do_put(
        self, context: Any, descriptor: Any, reader: Any, writer: _Acks, record: Any
    ) -> None:
        path = [p.decode(errors="replace") for p in descriptor.path]
        grant = caller(context)
        if len(path) == 6 and path[1] == protocol.STAGE:
            record.action, record.table = "stage", path[0]
            grant.require(ADMIN, "stage Spark shares for", [path[0]])
            record.rows = self._stage(context, path, reader, writer)
            return
        identity = protocol.producer_path(path)
        if len(path) != 1 and identity is None:
            raise ValueError(
                f"unexpected DoPut path {path!r}: expected [table], "
                "[table, 'producer', producer_id, first_sequence] or "
                "[table, 'stage', query, epoch, partition, attempt]"
            )
        record.table = path[0]
        grant.require(WRITE, "push to", path[:1])
        producer = self._table(path[0])
        if isinstance(producer, Topic) and producer.durable is not None:
            record.rows = self._durable_put(context, producer, identity, reader, writer)
            return
        if identity is not None:
            raise ValueError(
                f"'{path[0]}' is not a durable topic: a producer_id (idempotent producer) needs "
                "one (create_topic(..., durable=True))"
            )
        count = acked = 0
        for batch, metadata in protocol.chunks(reader.read_chunk):
            if batch is None:  # a metadata-only message: the client asks where we are
                if metadata != protocol.SYNC:
                    raise ValueError(f"unexpected DoPut app_metadata: {metadata!r}")
                acked = writer.send(count)
                continue
            arrived = time.perf_counter()
            count += 1
            writer.writing = True
            try:
                if (watermark := protocol.advance_value(metadata)) is not None:
                    producer.advance(watermark)
                else:
                    batch = protocol.checked(path[0], count, batch)
                    self._write(context, producer, batch)
                    record.rows += batch.num_rows
            finally:
                writer.done()
            if not protocol.is_later(metadata):
                # Counted before it is sent: a client that has its acknowledgement finds it in
                # the metrics (the histogram's time ends where the acknowledgement leaves).
                metrics.WRITE_ACK.observe(time.perf_counter() - arrived)
                acked = writer.send(count)
        if acked != count:  # the stream ended: everything it carried is queued
            writer.send(count)

    def _durable_put(
        self,
        context: Any,
        topic: Topic,
        identity: tuple[str, int] | None,
        reader: Any,
        writer: _Acks,
    ) -> int:
        """A producer's stream into a durable topic: each batch is acknowledged once a commit
        stores it (the stream's own sender writes the counts, :class:`_CommitAcks`). A
        producer with an id numbers its batches from ``identity``'s first sequence: one stored
        already is acknowledged, not appended. Returns the rows appended."""
        log = topic.durable
        assert log is not None
        acks = _CommitAcks(
            writer, topic.name, self.limits.ack_timeout, lambda: self.usage.refused("ack_timeout")
        )
        log.listen(acks.on_commit)
        rows = count = 0
        producer_id, sequence = identity if identity is not None else (None, None)
        try:
            for batch, metadata in protocol.chunks(reader.read_chunk):
                acks.raise_failure()
                if batch is None:  # SYNC: the client waits for acknowledgements: commit now
                    if metadata != protocol.SYNC:
                        raise ValueError(f"unexpected DoPut app_metadata: {metadata!r}")
                    log.commit_soon()
                    continue
                count += 1
                writer.writing = True
                try:
                    if (watermark := protocol.advance_value(metadata)) is not None:
                        topic.advance(watermark)
                        ticket = log.offsets()["next"] - 1
                    else:
                        batch = protocol.checked(topic.name, count, batch)
                        ticket = self._append(context, log, batch, producer_id, sequence)
                        rows += batch.num_rows
                        if sequence is not None:
                            sequence += 1
                finally:
                    writer.done()
                if not protocol.is_later(metadata):  # the client waits for this one: group
                    log.commit_soon()  # everything pending into the next commit, now
                acks.expect(count, ticket, log.committed)
            while not log.wait_committed(acks.last_ticket, POLL_S):  # the stream ended
                if context.is_cancelled() or self._stopping.is_set():
                    raise errors.ServerStoppedError("the pushtable server stopped")
            acks.on_commit(log.committed, None)
            acks.drain()  # the last count reaches the client before the call ends
            acks.raise_failure()
            return rows
        finally:
            log.unlisten(acks.on_commit)
            acks.done()

    def _append(
        self,
        context: Any,
        log: DurableLog,
        batch: pa.RecordBatch,
        producer_id: str | None,
        sequence: int | None,
    ) -> int:
        """Append, waiting for room without end, unless the client left or the server stops."""
        while True:
            try:
                return log.append(batch, POLL_S, producer=producer_id, sequence=sequence)
            except WriteTimeoutError:
                if context.is_cancelled() or self._stopping.is_set():
                    raise

    def _write(self, context: Any, producer: TableSink | Topic, batch: pa.RecordBatch) -> None:
        """Write, waiting for room without end, unless the client left or the server stops."""
        while True:
            try:
                producer.write(batch, timeout=POLL_S)
                return
            except WriteTimeoutError:
                if context.is_cancelled() or self._stopping.is_set():
                    raise

    def _stage(self, context: Any, path: list[str], reader: Any, writer: _Acks) -> int:
        """Hold one Spark task attempt's batches until its epoch is published; returns rows."""
        table, _, query, epoch_text, partition_text, attempt_text = path
        try:
            epoch, partition, attempt = int(epoch_text), int(partition_text), int(attempt_text)
        except ValueError:
            raise ValueError(
                f"stage path {path!r}: epoch, partition and attempt must be integers"
            ) from None
        producer = self._table(table)
        share = _Share((table, query), self.usage)
        try:
            for batch in protocol.batches(reader.read_chunk):
                protocol.check_batch_schema(table, producer.schema, batch.schema)
                share.add(protocol.checked(table, len(share.batches) + 1, batch))
                writer.send(len(share.batches))
        except BaseException:
            share.release()
            raise
        with self._lock:
            stage = self._staged.setdefault((table, query, epoch), {})
            replaced = stage.pop((partition, attempt), None)
            stage[(partition, attempt)] = share
        if replaced is not None:
            replaced.release()
        return share.rows

    def _discard(self, req: Epoch) -> dict[str, Any]:
        """Drop every share staged for an epoch (Spark aborted it): none is ever written."""
        key = (req.table, req.query, req.epoch)
        with self._lock:
            stage = self._staged.pop(key, {})
            self.dropped_shares += len(stage)
        for share in stage.values():
            share.release()
        return {"discarded": len(stage)}

    def published_epoch(self, table: str, query: str) -> int:
        """The newest epoch of ``query`` published into ``table`` (-1: none). For a durable
        topic, the newest one a commit holds whole: it survives a restart."""
        with self._lock:
            producer = self._tables.get(table)
        log = producer.durable if isinstance(producer, Topic) else None
        if log is not None:
            return epoch_of(log.last_stored_sequence(spark_producer(query)))
        with self._lock:
            return self._published.get((table, query), -1)

    def _publish(self, req: Publish) -> dict[str, Any]:
        """Write an epoch's staged batches (the attempts the driver names) once.

        Shares of other attempts (failed or speculative tasks) and of older epochs are
        dropped. A part the driver says has rows but that is not staged here (the server
        restarted since) is an error: nothing of the epoch is written, and Spark runs the
        batch again. Into a durable topic the epoch's batches are appended under the query's
        producer key with epoch-major sequence numbers (:func:`epoch_sequence`), so a
        replay after a crash skips what a commit already holds, and the answer waits for the
        commit: published means stored. A refusal midway leaves the epoch unpublished and
        retryable there; a plain table is failed with it instead, as its reader would
        otherwise miss rows silently.
        """
        table, query, epoch = req.table, req.query, req.epoch
        producer = self._table(table)
        if producer.closed:  # before anything is marked: the epoch stays unpublished
            raise errors.SinkClosedError(
                f"live table {table!r} is closed (end of stream), so it takes no more epochs "
                f"(epoch {epoch} of query {query!r}): a Spark sink's table stays open across "
                "query runs; close it once no query writes to it again, or give the next run "
                "a new table"
            )
        parts = [(int(p[0]), int(p[1]), int(p[2]) if len(p) > 2 else None) for p in req.parts]
        named = {(p, a) for p, a, _ in parts}
        log = producer.durable if isinstance(producer, Topic) else None
        key = (table, query)
        released: list[_Share] = []
        with self._lock:
            if key in self._publishing:
                raise RuntimeError(
                    f"epoch {epoch} of query {query!r}: a publish into {table!r} is in progress; "
                    "retry once it has answered"
                )
            stage = self._staged.pop((table, query, epoch), {})
            released.extend(stage.values())
            dropped = [k for k in self._staged if k[:2] == key and k[2] < epoch]
            for k in dropped:
                shares = self._staged.pop(k)
                self.dropped_shares += len(shares)
                released.extend(shares.values())
            self._publishing.add(key)
        try:
            newest = self.published_epoch(table, query) if log is not None else None
            with self._lock:
                if newest is None:
                    newest = self._published.get(key, -1)
            if epoch <= newest:
                self.dropped_shares += len(stage)
                return {"published": False, "reason": f"epoch {epoch} was published already"}
            lost = sorted(p for p, a, rows in parts if rows and (p, a) not in stage)
            if lost:
                raise errors.SharesLostError(
                    f"epoch {epoch} of query {query!r} cannot be published into {table!r}: the "
                    f"staged shares of partition(s) {lost} are not on the server (it restarted "
                    "after they were staged; staging is kept in memory). Nothing of the epoch "
                    "was written: run the batch again (Spark does, when the query restarts)"
                )
            self.dropped_shares += len(stage.keys() - named)  # attempts Spark did not keep
            batches = [b for part in sorted(named) if part in stage for b in stage[part].batches]
            advance = req.options.get("advance")
            if log is not None:
                assert isinstance(producer, Topic)
                written = self._publish_durable(producer, log, query, epoch, batches, advance)
            else:
                written = self._publish_live(producer, batches, advance)
                with self._lock:
                    self._published[key] = epoch
            missing = [p for p in named if p not in stage]
            return {"published": True, "batches": written, "parts_without_data": len(missing)}
        finally:
            with self._lock:
                self._publishing.discard(key)
            for share in released:
                share.release()

    def _publish_live(
        self, producer: TableSink | Topic, batches: list[pa.RecordBatch], advance: Any
    ) -> int:
        """An epoch into a table in memory: a refusal midway fails the table (its reader
        learns the epoch is incomplete instead of silently missing rows)."""
        written = 0
        try:
            for batch in batches:
                producer.write(batch)
                written += 1
            if advance is not None and producer.watermark_type is not None:
                producer.advance(int(advance))  # the epoch is whole: its windows close
        except PushTableError as exc:
            if not isinstance(exc, (errors.SinkClosedError, errors.ReaderGoneError)):
                producer.fail(exc)
            raise
        return written

    def _publish_durable(
        self,
        topic: Topic,
        log: DurableLog,
        query: str,
        epoch: int,
        batches: list[pa.RecordBatch],
        advance: Any,
    ) -> int:
        """An epoch into a durable topic, answered once a commit holds it. Batches a commit
        (or this log) holds already are skipped by their sequence numbers; a refusal or a
        failed commit is raised and ends nothing: the epoch stays retryable."""
        producer_id, ticket, written = spark_producer(query), -1, 0
        for i, batch in enumerate(batches):
            sequence = epoch_sequence(epoch, i, last=i == len(batches) - 1)
            while True:  # room in the log, unless the server stops
                try:
                    offset = log.append(
                        batch, POLL_S, producer=producer_id, sequence=sequence, gaps=True
                    )
                    break
                except WriteTimeoutError:
                    if self._stopping.is_set():
                        raise
            if offset >= 0:
                ticket, written = max(ticket, offset), written + 1
        if advance is not None and topic.watermark_type is not None:
            topic.advance(int(advance))
        if ticket < 0:  # nothing new: what an earlier attempt appended is what to wait for
            ticket = log.offsets()["next"] - 1
        while ticket >= 0 and not log.wait_committed(ticket, POLL_S):
            if self._stopping.is_set():
                raise errors.ServerStoppedError("the pushtable server stopped")
        return written


#: seconds a write to a DoPut stream's metadata side may wait for the client before another
#: thread gives up on it (a client that stopped reading: its notices are skipped)
NOTICE_WAIT_S = 1.0


class _Acks:
    """A DoPut stream's metadata side: acknowledgements, and the stop / idle notices sent to
    it from another thread (one writer at a time, as gRPC requires). A thread other than the
    call's own never waits long for it: a client that stops reading must not hold up the
    idle sweep, a stopping server or a committer."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._closed = False
        self.last_active = time.monotonic()
        self.told_idle = False
        self.writing = False  # a batch is being written (maybe waiting for room): not idle

    def done(self) -> None:
        """The chunk that set ``writing`` is handled: idle time counts from now."""
        self.writing = False
        self.last_active = time.monotonic()

    def send(self, count: int) -> int:
        """Acknowledge ``count`` batches (returns it), on the call's own thread."""
        with self._lock:
            self.last_active = time.monotonic()
            self._writer.write(protocol.ack(count))
        return count

    def send_if_open(self, count: int) -> None:
        """Acknowledge ``count`` batches from another thread (nothing once the call ended).
        It may wait for a client that does not read: only a stream's own sender calls it."""
        with self._lock, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            if not self._closed:
                self.last_active = time.monotonic()
                self._writer.write(protocol.ack(count))

    def stopping(self) -> None:
        self._notice(protocol.STOPPING)

    def failed(self) -> None:
        self._notice(protocol.FAILED)

    def idle(self) -> None:
        self.told_idle = True
        self._notice(protocol.IDLE)

    def _notice(self, notice: pa.Buffer) -> None:
        """A notice from another thread; skipped when the stream's writer is stuck on a client
        that does not read (it would not read the notice either)."""
        if not self._lock.acquire(timeout=NOTICE_WAIT_S):
            return
        try:
            with contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
                if not self._closed:  # the handler has not returned: the call is alive
                    self._writer.write(notice)
        finally:
            self._lock.release()

    def close(self) -> None:
        """The handler is returning: no write may touch the call after this (gRPC forbids a
        write to a finished call), so it waits for one in progress. A writer stuck on a client
        that does not read holds the lock until gRPC cancels the call; only this stream's
        handler waits for it, never the committer or a stopping server."""
        with self._lock:
            self._closed = True


class _CommitAcks:
    """A durable stream's acknowledgements: each batch's count is sent once the commit that
    holds its offset is done; a failed commit ends the stream with its error.

    The committer only notes the count (:meth:`on_commit`); the stream's own sender thread
    writes it (the newest count only: a later one covers every earlier one), so a client
    that stops reading its acknowledgements stalls nothing but itself. Unread for ``stall``
    seconds (``Limits.ack_timeout``), its stream is cut off with :class:`ResourceLimitError`.
    """

    def __init__(
        self, writer: _Acks, topic: str, stall: float, cut_off: Callable[[], None]
    ) -> None:
        self._writer = writer
        self._topic = topic
        self._stall = stall
        self._cut_off = cut_off  # counts the refusal (the server's ``ack_timeout`` refusals)
        self._lock = threading.Condition()
        self._waiting: collections.deque[tuple[int, int]] = collections.deque()
        self._sent = 0  # the newest count the sender was given
        self._to_send: int | None = None
        self._notify_failure = False
        self._writing_since: float | None = None
        self._finished = False
        self.failure: BaseException | None = None
        self.last_ticket = -1
        self._sender = threading.Thread(
            target=self._send_loop, name=f"pushtable-acks-{topic}", daemon=True
        )
        self._sender.start()

    def expect(self, count: int, ticket: int, committed: int) -> None:
        """Batch ``count`` of the stream is acknowledged once offset ``ticket`` is stored."""
        with self._lock:
            self._waiting.append((count, ticket))
            self.last_ticket = max(self.last_ticket, ticket)
        self.on_commit(committed, None)

    def on_commit(self, committed: int, failure: BaseException | None) -> None:
        """After a commit attempt (on the committer's thread): note what to send, never wait."""
        with self._lock:
            if self._finished:
                return
            count = self._sent
            while self._waiting and self._waiting[0][1] < committed:
                count = self._waiting.popleft()[0]
            if count > self._sent:
                self._sent = self._to_send = count
                self._lock.notify_all()
            if failure is not None and self._waiting and self.failure is None:
                self.failure = failure
                self._notify_failure = True  # the client ends its side: the error reaches it
                self._lock.notify_all()
            self._check_stall()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(
                    lambda: self._finished or self._to_send is not None or self._notify_failure
                )
                if self._finished:
                    return
                count, self._to_send = self._to_send, None
                notify, self._notify_failure = self._notify_failure, False
                self._writing_since = time.monotonic()
            try:
                if count is not None:
                    self._writer.send_if_open(count)
                if notify:
                    self._writer.failed()
            finally:
                with self._lock:
                    self._writing_since = None
                    self._lock.notify_all()

    def drain(self) -> None:
        """Wait until the sender wrote the newest count: the stream is ending and its client
        waits for it (bounded: a client that does not read is cut off anyway)."""
        with self._lock:
            self._lock.wait_for(
                lambda: (
                    self._finished
                    or (
                        self._to_send is None
                        and not self._notify_failure
                        and not self._writing_since
                    )
                ),
                timeout=self._stall,
            )

    def _check_stall(self) -> None:
        """Cut the stream off once an acknowledgement waited unread too long (under the lock)."""
        since = self._writing_since
        if self.failure is None and since is not None and time.monotonic() - since > self._stall:
            self.failure = errors.ResourceLimitError(
                f"a producer of durable topic '{self._topic}' did not read its acknowledgements "
                f"for {self._stall:g} s (ack_timeout): its stream is cut off (what was "
                "acknowledged is stored; an idempotent producer resends the rest on a new stream)"
            )
            self._cut_off()

    def raise_failure(self) -> None:
        with self._lock:
            self._check_stall()
            failure = self.failure
        if failure is not None:
            raise failure

    def done(self) -> None:
        """The stream ended: stop its sender (it may be stuck on a client that does not read:
        it ends with the call, which gRPC finishes once the handler returns)."""
        with self._lock:
            self._finished = True
            self._lock.notify_all()
        self._sender.join(timeout=NOTICE_WAIT_S)


class _Share:
    """One task attempt's staged batches, counted against the staging limits until released."""

    def __init__(self, key: tuple[str, str], usage: Usage) -> None:
        self._key = key
        self._usage = usage
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0
        self._bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        nbytes = batch.get_total_buffer_size()
        self._usage.stage(self._key, nbytes)  # raises ResourceLimitError over a limit
        self._bytes += nbytes
        self.rows += batch.num_rows
        self.batches.append(batch)

    def release(self) -> None:
        self._usage.unstage(self._key, self._bytes)
        self._bytes = 0
        self.batches = []
