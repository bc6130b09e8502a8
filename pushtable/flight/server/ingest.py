"""DoPut on ``pushtable serve``: remote producers' batches into tables and durable topics.

Batches go into tables (with backpressure end
to end) and into durable topics (acknowledged once committed, idempotent producers); Spark
task attempts' shares handed to :mod:`pushtable.flight.server.staging`; idle streams told to end.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pyarrow as pa

from pushtable import errors, metrics
from pushtable.durable import DurableLog
from pushtable.durable.producers import MAX_PRODUCERS
from pushtable.errors import WriteTimeoutError
from pushtable.flight import protocol
from pushtable.flight.server.acks import Acks, CommitAcks
from pushtable.flight.server.auth import ADMIN, WRITE, caller
from pushtable.flight.server.calls import POLL_S, Calls, audit, wire_errors
from pushtable.flight.server.staging import SPARK_PREFIX, Staging
from pushtable.flight.server.tables import Tables
from pushtable.sink import TableSink
from pushtable.topic import Topic


class Ingest:
    """The server's DoPut side: producers' streams into its tables (a server part).

    It owns the thread that tells idle streams to end; :meth:`stopping` tells every open
    stream the server is stopping, and :meth:`join` waits for that thread.
    """

    def __init__(self, tables: Tables, staging: Staging, calls: Calls) -> None:
        self._tables = tables
        self._staging = staging
        self._calls = calls
        self._lock = threading.Lock()
        self._acks: set[Acks] = set()  # the open DoPut streams
        #: topic -> producer id -> [the token that first used it, its open streams] (see
        #: :meth:`_claim`)
        self._owners: dict[str, dict[str, list[Any]]] = {}
        self._idle_sweep = threading.Thread(
            target=self._end_idle_streams, name="pushtable-idle", daemon=True
        )
        self._idle_sweep.start()

    @property
    def open_streams(self) -> int:
        """The DoPut streams open now."""
        with self._lock:
            return len(self._acks)

    def stopping(self) -> None:
        """Tell every open stream the server stops.

        An idle producer's client ends its stream on this notice. ``Calls.stopping`` is set
        already, so the idle sweep ends too: :meth:`join` it once the server has shut down
        (a notice stuck on a client that does not read ends with the call).
        """
        with self._lock:
            streams = list(self._acks)
        for acks in streams:
            acks.stopping()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the idle sweep to end (after :meth:`stopping`)."""
        self._idle_sweep.join(timeout)

    def _end_idle_streams(self) -> None:
        """Tell each DoPut stream idle for ``idle_timeout`` to end.

        Pushtable's clients do,
        and reopen on their next write; the server's thread for it is then free.
        """
        timeout = self._calls.usage.limits.idle_timeout
        while not self._calls.stopping.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [
                    a
                    for a in self._acks
                    if not (a.told_idle or a.writing) and now - a.last_active > timeout
                ]
            for acks in idle:
                self._calls.usage.refused("idle_timeout")
                acks.idle()

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """A producer's stream (a path descriptor): into a table, a durable topic, or staged."""
        acks = Acks(writer)
        with self._lock:
            self._acks.add(acks)
        try:
            with wire_errors(), audit(context, "do_put") as record, self._calls.held(context):
                if self._calls.stopping.is_set():  # registered after the notices went out
                    raise errors.ServerStoppedError("the pushtable server stopped")
                try:
                    self._do_put(context, descriptor, reader, acks, record)
                except (errors.SinkClosedError, errors.StreamFailedError) as exc:
                    # The server's stop closed the table under the stream: an outage to the
                    # producer (an idempotent one resends once the server is back), not the
                    # end of the table's stream.
                    if self._calls.stopping.is_set():
                        raise errors.ServerStoppedError("the pushtable server stopped") from exc
                    raise
        finally:
            acks.close()  # before the call ends: no stop notice may touch a finished call
            with self._lock:
                self._acks.discard(acks)

    def _do_put(
        self, context: Any, descriptor: Any, reader: Any, writer: Acks, record: Any
    ) -> None:
        path = [p.decode(errors="replace") for p in descriptor.path]
        grant = caller(context)
        if len(path) == 6 and path[1] == protocol.STAGE:
            record.action, record.table = "stage", path[0]
            grant.require(ADMIN, "stage Spark shares for", [path[0]])
            record.rows = self._staging.stage(path, reader, writer.send)
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
        producer = self._tables.get(path[0])
        if isinstance(producer, Topic) and producer.durable is not None:
            record.rows = self._durable_put(context, producer, identity, reader, writer)
            return
        if identity is not None:
            raise ValueError(
                f"'{path[0]}' is not a durable topic: a producer_id (idempotent producer) needs "
                "one (create_topic(..., durable=True))"
            )
        count = acked = 0
        check: Any = None  # the limits' check for this stream's schema, made at its first batch
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
                    check = check or self._calls.usage.limits.batch_check(batch.schema)
                    check(path[0], count, batch)
                    self._write(context, producer, batch)
                    record.rows += batch.num_rows
            except protocol.BATCH_REFUSALS as exc:
                # Every batch before this one is queued; the client sends again those it sent
                # after it, which nobody took.
                protocol.refusing(exc, count)
                raise
            except WriteTimeoutError:
                # Given up waiting for room (the client left, the server stops): every batch
                # before this one is queued, and acknowledged now, so the client knows which
                # of its batches are in the table (it told them "may not be stored").
                if count - 1 > acked:
                    with contextlib.suppress(Exception):  # the stream may be gone already
                        acked = writer.send(count - 1)
                raise
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
        writer: Acks,
    ) -> int:
        """A producer's stream into a durable topic; returns the rows appended.

        Each batch is acknowledged once a commit
        stores it (the stream's own sender writes the counts, :class:`CommitAcks`). A
        producer with an id numbers its batches from ``identity``'s first sequence: one stored
        already is acknowledged, not appended. Returns the rows appended.
        """
        log = topic.durable
        assert log is not None
        if identity is not None:
            self._claim(topic.name, identity[0], caller(context).name, log)
        try:
            return self._durable_stream(context, topic, log, identity, reader, writer)
        finally:
            if identity is not None:
                self._unclaim(topic.name, identity[0])

    def _durable_stream(
        self,
        context: Any,
        topic: Topic,
        log: DurableLog,
        identity: tuple[str, int] | None,
        reader: Any,
        writer: Acks,
    ) -> int:
        """:meth:`_durable_put`'s stream, its producer id claimed."""
        acks = CommitAcks(
            writer,
            topic.name,
            self._calls.usage.limits.ack_timeout,
            lambda: self._calls.usage.refused("ack_timeout"),
        )
        log.listen(acks.on_commit)
        rows = count = 0
        check: Any = None  # as in _do_put
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
                        check = check or self._calls.usage.limits.batch_check(batch.schema)
                        check(topic.name, count, batch)
                        ticket = self._append(context, log, batch, producer_id, sequence)
                        rows += batch.num_rows
                        if sequence is not None:
                            sequence += 1
                except protocol.BATCH_REFUSALS as exc:
                    # As a table's stream does, once the batches before it are stored.
                    self._stored(context, log, acks)
                    protocol.refusing(exc, count)
                    raise
                finally:
                    writer.done()
                if not protocol.is_later(metadata):  # the client waits for this one: group
                    log.commit_soon()  # everything pending into the next commit, now
                acks.expect(count, ticket, log.committed)
            self._stored(context, log, acks)  # the stream ended
            return rows
        finally:
            log.unlisten(acks.on_commit)
            acks.done()

    def _claim(self, topic: str, producer_id: str, token: str, log: DurableLog) -> None:
        """Bind ``producer_id`` of ``topic`` to the token that first used it (fencing).

        Another token's batches under it would be taken for the first producer's resends
        (acknowledged and dropped) or move its sequence past the first's: refused by name.
        The ids of Spark queries' epochs (``spark:<query>``) are the server's own (its
        staged publishes append under them): no stream may write under one. A binding lives
        while its producer does: once the topic keeps ``MAX_PRODUCERS`` bindings, those with
        no open stream whose producer the topic no longer knows (it stored nothing, or was
        forgotten idle) go. After a restart, the first token to use the id again holds it.
        """
        if producer_id.startswith(SPARK_PREFIX):
            raise errors.PermissionDeniedError(
                f"producer id {producer_id!r} of topic '{topic}': ids starting with "
                f"{SPARK_PREFIX!r} are reserved for Spark queries' epochs, which the server "
                "appends itself: give this producer another id"
            )
        with self._lock:
            bindings = self._owners.setdefault(topic, {})
            if producer_id not in bindings and len(bindings) >= MAX_PRODUCERS:
                for known, (_, streams) in list(bindings.items()):
                    if not streams and log.last_sequence(known) < 0:
                        del bindings[known]
            binding = bindings.setdefault(producer_id, [token, 0])
            if binding[0] == token:
                binding[1] += 1
        if binding[0] != token:
            raise errors.PermissionDeniedError(
                f"producer id {producer_id!r} of topic '{topic}' belongs to token "
                f"{binding[0]!r}: token {token!r} may not write under it (give each producer "
                "its own id)"
            )

    def _unclaim(self, topic: str, producer_id: str) -> None:
        """A stream under ``producer_id`` ended: its binding may go once nothing holds it."""
        with self._lock:
            binding = self._owners.get(topic, {}).get(producer_id)
            if binding is not None:
                binding[1] -= 1

    def bindings(self, topic: str) -> int:
        """How many producer ids of ``topic`` are bound to a token."""
        with self._lock:
            return len(self._owners.get(topic, {}))

    def _stored(self, context: Any, log: DurableLog, acks: CommitAcks) -> None:
        """Wait until a commit holds every batch of the stream so far, and acknowledge them."""
        while not log.wait_committed(acks.last_ticket, POLL_S):
            if self._calls.give_up(context):
                raise errors.ServerStoppedError("the pushtable server stopped")
        acks.on_commit(log.committed, None)
        acks.drain()  # the last count reaches the client before the call ends
        acks.raise_failure()

    def _append(
        self,
        context: Any,
        log: DurableLog,
        batch: pa.RecordBatch,
        producer_id: str | None,
        sequence: int | None,
    ) -> int:
        """Append, waiting for room without end, unless the client left or the server stops.

        The batch counts what it holds as received (every buffer, referenced or not), not
        only what it references: a network batch's unreferenced bytes take memory too.
        """
        nbytes = batch.get_total_buffer_size()
        while True:
            try:
                return log.append(
                    batch, POLL_S, producer=producer_id, sequence=sequence, nbytes=nbytes
                )
            except WriteTimeoutError:
                if self._calls.give_up(context):
                    raise

    def _write(self, context: Any, producer: TableSink | Topic, batch: pa.RecordBatch) -> None:
        """Write, waiting for room without end, unless the client left or the server stops."""
        while True:
            try:
                producer.write(batch, timeout=POLL_S)
                return
            except WriteTimeoutError:
                if self._calls.give_up(context):
                    raise
