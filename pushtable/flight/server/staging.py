"""Spark epochs on ``pushtable serve``: staged by task attempts, written once when published.

Each task attempt's batches are staged (DoPut on a
``[table, 'stage', query, epoch, partition, attempt]`` path) and held in memory until the
driver publishes the epoch, naming the attempts Spark kept; then written once.

Shares of attempts Spark did not keep (failed or speculative tasks, aborted or replayed
epochs) are dropped, never written. Into a durable topic an epoch is appended under the
query's idempotent-producer key, so a replay after a crash skips what a commit holds already
and "published" means stored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pushtable import errors
from pushtable.durable import DurableLog
from pushtable.durable.producers import epoch_of, epoch_sequence
from pushtable.errors import PushTableError
from pushtable.flight import protocol
from pushtable.flight.server.actions import Epoch, Epochs, Publish
from pushtable.flight.server.auth import Grant
from pushtable.flight.server.calls import POLL_S
from pushtable.flight.server.limits import Usage
from pushtable.flight.server.tables import Tables
from pushtable.sink import TableSink
from pushtable.topic import Topic

#: the producer ids of Spark queries' epochs: reserved, no DoPut stream writes under one
SPARK_PREFIX = "spark:"


def spark_producer(query: str) -> str:
    """The idempotent-producer key of a Spark query's epochs in a durable topic.

    The key under which a Spark query's epochs go into a durable topic
    (one key per query: the stored sequence is its publish watermark).
    """
    return f"{SPARK_PREFIX}{query}"


class Staging:
    """Spark task attempts' shares, staged until their epoch is published (a server part)."""

    def __init__(self, tables: Tables, usage: Usage, stopping: threading.Event) -> None:
        self._tables = tables
        self._usage = usage
        self._stopping = stopping
        self._lock = threading.Lock()
        self._staged: dict[tuple[str, str, int], dict[tuple[int, int], _Share]] = {}
        self._published: dict[tuple[str, str], int] = {}
        self._publishing: set[tuple[str, str]] = set()
        #: staged shares never written: task attempts Spark did not keep, replayed epochs
        self.dropped_shares = 0

    @property
    def staged_epochs(self) -> int:
        """The epochs with shares staged and not yet published or discarded."""
        with self._lock:
            return len(self._staged)

    def stage(self, path: list[str], reader: Any, ack: Callable[[int], Any]) -> int:
        """Hold one Spark task attempt's batches until its epoch is published.

        Each batch is
        acknowledged by ``ack(count)`` once held.
        """
        table, _, query, epoch_text, partition_text, attempt_text = path
        try:
            epoch, partition, attempt = int(epoch_text), int(partition_text), int(attempt_text)
        except ValueError:
            raise ValueError(
                f"stage path {path!r}: epoch, partition and attempt must be integers"
            ) from None
        producer = self._tables.get(table)
        share = _Share((table, query), self._usage)
        check = self._usage.limits.batch_check(producer.schema)
        try:
            for batch in protocol.batches(reader.read_chunk):
                protocol.check_batch_schema(table, producer.schema, batch.schema)
                number = len(share.batches) + 1
                batch = protocol.checked(table, number, batch)  # valid before it is measured
                check(table, number, batch)
                share.add(batch)
                ack(len(share.batches))
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

    def discard(self, req: Epoch, grant: Grant) -> Any:
        """``discard``: drop every share staged for an epoch (Spark aborted it).

        None is ever
        written.
        """
        key = (req.table, req.query, req.epoch)
        with self._lock:
            stage = self._staged.pop(key, {})
            self.dropped_shares += len(stage)
        for share in stage.values():
            share.release()
        return {"discarded": len(stage)}

    def published(self, req: Epochs, grant: Grant) -> Any:
        """``published``: the newest epoch of a query published into a table."""
        return {"epoch": self.published_epoch(req.table, req.query)}

    def published_epoch(self, table: str, query: str) -> int:
        """The newest epoch of ``query`` published into ``table`` (-1: none).

        For a durable
        topic, the newest one a commit holds whole: it survives a restart.
        """
        producer = self._tables.find(table)
        log = producer.durable if isinstance(producer, Topic) else None
        if log is not None:
            return epoch_of(log.last_stored_sequence(spark_producer(query)))
        with self._lock:
            return self._published.get((table, query), -1)

    def publish(self, req: Publish, grant: Grant) -> Any:
        """``publish``: write an epoch's staged batches (the attempts the driver names) once.

        Shares of other attempts (failed or speculative tasks) and of older epochs are
        dropped. A part that is not staged here is an error unless the driver said it has no
        rows (``(partition, attempt, 0)``): after a restart lost the staged shares, nothing
        of the epoch is written, and Spark runs the batch again; an answer of True always
        means the epoch is written. Into a durable topic the epoch's batches are appended
        under the query's producer key with epoch-major sequence numbers
        (:func:`epoch_sequence`), so a replay after a crash skips what a commit already
        holds, and the answer waits for the commit: published means stored. A refusal midway
        (``max_data_bytes``, a bad batch, a failed commit) leaves the epoch unpublished and
        its shares staged, so the same publish may be retried; a plain table is failed with
        it instead, as its reader would otherwise miss rows silently.
        """
        table, query, epoch = req.table, req.query, req.epoch
        producer = self._tables.get(table)
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
        writing = False
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
            newest = self.published_epoch(table, query)
            if epoch <= newest:
                if log is not None and epoch == newest:
                    self._check_replay(log, query, epoch, parts, stage)
                self.dropped_shares += len(stage)
                return {"published": False, "reason": f"epoch {epoch} was published already"}
            # a part without a row count may have had rows: only a count of 0 says it had none
            lost = sorted(p for p, a, rows in parts if rows != 0 and (p, a) not in stage)
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
            writing = True  # a refusal from here on keeps the shares for a retry
            if log is not None:
                assert isinstance(producer, Topic)
                written = self._publish_durable(producer, log, query, epoch, batches, advance)
            else:
                written = self._publish_live(producer, batches, advance)
                with self._lock:
                    self._published[key] = epoch
            missing = [p for p in named if p not in stage]
            writing = False
            return {"published": True, "batches": written, "parts_without_data": len(missing)}
        finally:
            with self._lock:
                self._publishing.discard(key)
                if writing and (table, query, epoch) not in self._staged:
                    self._staged[(table, query, epoch)] = stage  # unpublished: retryable
                    kept = {id(share) for share in stage.values()}
                    released = [share for share in released if id(share) not in kept]
            for share in released:
                share.release()

    @staticmethod
    def _check_replay(
        log: DurableLog,
        query: str,
        epoch: int,
        parts: list[tuple[int, int, int | None]],
        stage: dict[tuple[int, int], _Share],
    ) -> None:
        """A replay of the newest stored epoch: refused if its rows are not the stored ones'.

        (:meth:`DurableLog.check_unit`: as many rows as the stored epoch.) Checked when
        every share with rows is staged; after a restart lost them there is nothing to
        compare, and the answer is "published already" as before.
        """
        if any(rows != 0 and (p, a) not in stage for p, a, rows in parts):
            return
        named = sorted({(p, a) for p, a, _ in parts})
        batches = [b for part in named if part in stage for b in stage[part].batches]
        if batches:
            last = len(batches) - 1
            sequences = [epoch_sequence(epoch, i, last=i == last) for i in range(len(batches))]
            log.check_unit(spark_producer(query), batches, sequences)

    def _publish_live(
        self, producer: TableSink | Topic, batches: list[pa.RecordBatch], advance: Any
    ) -> int:
        """Write an epoch into a table in memory.

        A refusal midway fails the table (its reader
        learns the epoch is incomplete instead of silently missing rows).
        """
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
        """Write an epoch into a durable topic, answered once a commit holds it.

        Batches a commit
        (or this log) holds already are skipped by their sequence numbers; a refusal or a
        failed commit is raised and ends nothing: the epoch stays retryable.
        """
        producer_id = spark_producer(query)
        last = len(batches) - 1
        sequences = [epoch_sequence(epoch, i, last=i == last) for i in range(len(batches))]
        stored = log.last_sequence(producer_id)
        written = sum(1 for sequence in sequences if sequence > stored)
        # One unit: a commit stores the whole epoch or none of it, so a replay after a crash
        # finds it all stored or all missing, however Spark splits the re-run batch.
        ticket = log.append_unit(batches, sequences, producer_id, POLL_S, self._stopping.is_set)
        if advance is not None and topic.watermark_type is not None:
            topic.advance(int(advance))
        if ticket < 0:  # nothing new: what an earlier attempt appended is what to wait for
            ticket = log.offsets()["next"] - 1
        while ticket >= 0 and not log.wait_committed(ticket, POLL_S):
            if self._stopping.is_set():
                raise errors.ServerStoppedError("the pushtable server stopped")
        return written


class _Share:
    """One task attempt's staged batches, counted against the staging limits until released."""

    def __init__(self, key: tuple[str, str], usage: Usage) -> None:
        self._key = key
        self._usage = usage
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0
        self._bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        """Hold ``batch``; :class:`ResourceLimitError` when the staging limits are reached."""
        nbytes = batch.get_total_buffer_size()
        self._usage.stage(self._key, nbytes)  # raises ResourceLimitError over a limit
        self._bytes += nbytes
        self.rows += batch.num_rows
        self.batches.append(batch)

    def release(self) -> None:
        """Give the share's bytes back to the staging limits (it is written or dropped)."""
        self._usage.unstage(self._key, self._bytes)
        self._bytes = 0
        self.batches = []
