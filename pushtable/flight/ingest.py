"""DoPut on ``pushtable serve``: remote producers' batches into tables (with backpressure end
to end), Spark task attempts' shares staged until their epoch is published, and idle streams
told to end."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors, metrics
from pushtable.errors import PushTableError, WriteTimeoutError
from pushtable.flight import protocol
from pushtable.flight.auth import ADMIN, WRITE, caller
from pushtable.flight.calls import POLL_S, audit, wire_errors
from pushtable.flight.limits import Limits, Usage
from pushtable.sink import TableSink
from pushtable.topic import Topic


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

    if TYPE_CHECKING:

        def _table(self, name: str) -> TableSink | Topic: ...

        def _call(self, context: Any) -> contextlib.AbstractContextManager[None]: ...

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
        if len(path) != 1:
            raise ValueError(
                f"unexpected DoPut path {path!r}: expected [table] or "
                "[table, 'stage', query, epoch, partition, attempt]"
            )
        record.table = path[0]
        grant.require(WRITE, "push to", path)
        producer = self._table(path[0])
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

    def _publish(self, body: dict[str, Any]) -> dict[str, Any]:
        """Write an epoch's staged batches (the attempts the driver names) once.

        Shares of other attempts (failed or speculative tasks) and of older epochs are
        dropped. If the table refuses a batch midway, the table is failed with that error:
        its reader learns the epoch is incomplete instead of silently missing rows.
        """
        table, query, epoch = str(body["table"]), str(body["query"]), int(body["epoch"])
        producer = self._table(table)
        named = {(int(p[0]), int(p[1])) for p in body["parts"]}
        released: list[_Share] = []
        with self._lock:
            stage = self._staged.pop((table, query, epoch), {})
            released.extend(stage.values())
            dropped = [k for k in self._staged if k[:2] == (table, query) and k[2] < epoch]
            for k in dropped:
                shares = self._staged.pop(k)
                self.dropped_shares += len(shares)
                released.extend(shares.values())
            newest = self._published.get((table, query), -1)
            if epoch <= newest:
                self.dropped_shares += len(stage)
                stage = {}
                reply: dict[str, Any] | None = {
                    "published": False,
                    "reason": f"epoch {epoch} was published already",
                }
            else:
                reply = None
                self._published[(table, query)] = epoch
                # Shares of attempts Spark did not keep (failed, speculative): never written.
                self.dropped_shares += len(stage.keys() - named)
        try:
            if reply is not None:
                return reply
            missing = [p for p in named if p not in stage]
            written = 0
            try:
                for part in sorted(named):
                    share = stage.get(part)
                    for batch in share.batches if share is not None else []:
                        producer.write(batch)
                        written += 1
                advance = body.get("advance")
                if advance is not None and producer.watermark_type is not None:
                    producer.advance(int(advance))  # the epoch is whole: its windows close
            except PushTableError as exc:
                if not isinstance(exc, (errors.SinkClosedError, errors.ReaderGoneError)):
                    producer.fail(exc)
                raise
            return {"published": True, "batches": written, "parts_without_data": len(missing)}
        finally:
            for share in released:
                share.release()


class _Acks:
    """A DoPut stream's metadata side: acknowledgements, and the stop / idle notices sent to
    it from another thread (one writer at a time, as gRPC requires)."""

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
        """Acknowledge ``count`` batches (returns it)."""
        with self._lock:
            self.last_active = time.monotonic()
            self._writer.write(protocol.ack(count))
        return count

    def stopping(self) -> None:
        self._notice(protocol.STOPPING)

    def idle(self) -> None:
        self.told_idle = True
        self._notice(protocol.IDLE)

    def _notice(self, notice: pa.Buffer) -> None:
        with self._lock, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            if not self._closed:  # the handler has not returned: the call is alive
                self._writer.write(notice)

    def close(self) -> None:
        with self._lock:
            self._closed = True


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
