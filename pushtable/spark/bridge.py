"""The Spark bridge: a ``foreachBatch`` callable that persists and publishes each epoch.

For each micro-batch (epoch) of a Structured Streaming query the bridge

1. commits it to a Lance dataset exactly once (:mod:`pushtable.lance_epochs`), then
2. pushes it to live streaming tables (:class:`pushtable.TableSink`), so SQL readers see
   only durable data, each epoch once per process.

When the query terminates the sinks are closed; when it fails they are failed with Spark's
error, so a live reader never hangs. See docs/spark.md.

Spark's Python workers run the interpreter that imported this module (``sys.executable``,
so a virtualenv's pyarrow is found) unless ``PYSPARK_PYTHON`` is already set.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pushtable.errors import (
    IncompatibleSinkError,
    PushTableError,
    ReaderGoneError,
    SinkClosedError,
    SlowReaderError,
    StreamingQueryFailedError,
    WriteTimeoutError,
)
from pushtable.lance_epochs import (
    MODES,
    CommitResult,
    LanceEpochWriter,
    Mode,
    SchemaDriftError,
    conform_to,
    write_fragments,
)
from pushtable.producer import OnSlow
from pushtable.sink import TableSink
from pushtable.spark.arrow import arrow_schema
from pushtable.spark.session import ensure_worker_python
from pushtable.topic import Subscription, Topic

if TYPE_CHECKING:
    import datafusion
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = [
    "EpochReport",
    "ForeachBatchBridge",
    "IncompatibleSinkError",
    "SlowReaderError",
    "StreamingQueryFailedError",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochReport:
    """What the bridge did with one epoch, and how long each step took (seconds)."""

    query_id: str
    epoch_id: int
    rows: int
    to_arrow_s: float
    commit_s: float
    push_s: float
    committed: bool
    pushed: bool
    reason: str


class ForeachBatchBridge:
    """Persist each epoch to Lance exactly once and push it to live tables.

    Pass it to ``writeStream.foreachBatch``. Either half is optional: ``sinks`` only (live
    SQL, no persistence) or ``lance_uri`` only. Every sink receives every epoch.

    Args:
        sinks: live tables to feed (from ``register_streaming_table``).
        lance_uri: Lance dataset to commit epochs to; created on the first epoch.
        mode: the query's output mode: ``"append"`` (Append commits), ``"complete"`` (each
            epoch Overwrites the dataset) or ``"update"`` (appended, see docs/spark.md).
        query_id: the id stamped on commits for replay detection; default Spark's query id,
            which is stable across restarts on one checkpoint.
        executor_writes: executors write Lance fragments and the driver commits them, so
            data does not pass through the driver (unless live sinks need it).
        compact_every: compact the dataset after every N committed epochs (off by default).
        cleanup_older_than: with ``compact_every``, also remove versions older than this;
            the newest commit of every query that used this bridge stays (it is tagged).
        push_timeout: seconds an epoch's write to one live table may wait for its reader
            (default 30). Finite, so a slow or absent reader cannot stall Spark for good.
        on_slow_reader: ``"detach"`` (default): after ``push_timeout`` the table is failed
            with :class:`SlowReaderError` (its reader learns it missed data) and gets no more
            epochs, while the query goes on persisting; ``"block"``: wait without limit, so
            the reader paces Spark.
        key: with ``mode="update"``: each epoch is an upsert (Lance ``merge_insert``) by these
            columns, so the dataset holds the latest row per key; without it, update mode
            appends a log of updates.
        epoch_column: stamp every row pushed to the live tables and subscriptions with its
            epoch id in this ``int64`` column (not persisted to Lance). Declare the live
            tables ``order_by=epoch_column``: the bridge then advances their watermark when
            each epoch is pushed, so ``GROUP BY epoch`` emits each epoch's result as it lands.

    Example:
        >>> from pushtable import SessionContext
        >>> from pushtable.spark import ForeachBatchBridge
        >>> import pyarrow as pa, tempfile
        >>> ctx = SessionContext()
        >>> live = ctx.register_streaming_table("events", pa.schema([("n", pa.int64())]))
        >>> bridge = ForeachBatchBridge(sinks=[live], lance_uri=tempfile.mkdtemp() + "/e.lance")
        >>> # query = df.writeStream.foreachBatch(bridge).option("checkpointLocation", ...).start()
        >>> # bridge.watch(query)   # closes / fails the sinks when the query ends
    """

    def __init__(
        self,
        sinks: Sequence[TableSink] = (),
        lance_uri: str | Path | None = None,
        mode: Mode = "append",
        *,
        query_id: str | None = None,
        executor_writes: bool = False,
        compact_every: int | None = None,
        cleanup_older_than: timedelta | None = None,
        max_commit_retries: int = 8,
        storage_options: dict[str, str] | None = None,
        push_timeout: float = 30.0,
        on_slow_reader: OnSlow = "detach",
        key: Sequence[str] | None = None,
        epoch_column: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if not sinks and lance_uri is None:
            raise ValueError(
                "ForeachBatchBridge needs somewhere to send epochs: pass lance_uri=..., "
                "sinks=[...], or both"
            )
        for sink in sinks:
            if not isinstance(sink, TableSink):
                raise TypeError(f"sinks must be TableSink objects, got {type(sink).__name__}")
        if sinks and mode != "append":
            # A live table appends what it is given: in complete mode each epoch is the whole
            # result again (N epochs -> N copies), in update mode keys repeat. A reader would
            # see silently duplicated results, so the combination is refused.
            raise ValueError(
                f"live sinks need mode='append': in {mode!r} mode every epoch restates "
                "results (complete: the whole table; update: changed keys), and a live table "
                "would show them duplicated; persist with lance_uri=... only, and query the "
                "Lance dataset for the latest state"
            )
        if cleanup_older_than is not None and compact_every is None:
            raise ValueError("cleanup_older_than runs during upkeep: set compact_every too")
        if query_id is not None and not query_id:
            raise ValueError("query_id must be a non-empty string or None")
        if key is not None and executor_writes:
            raise ValueError(
                "key= upserts run on the driver: it cannot be combined with executor_writes=True"
            )
        if on_slow_reader not in ("detach", "block"):
            raise ValueError(f"on_slow_reader must be 'detach' or 'block', got {on_slow_reader!r}")
        if not push_timeout > 0 or push_timeout == float("inf"):
            raise ValueError(
                f"push_timeout must be a finite number of seconds > 0, got {push_timeout}"
            )
        if epoch_column is not None:
            for sink in sinks:
                field = (
                    sink.schema.field(epoch_column) if epoch_column in sink.schema.names else None
                )
                if field is None or not pa.types.is_integer(field.type):
                    raise ValueError(
                        f"live table {sink.name!r} needs an integer column {epoch_column!r} "
                        f"for epoch_column= (its schema: {sink.schema})"
                    )
        self.epoch_column = epoch_column
        self.push_timeout = float(push_timeout)
        self.on_slow_reader = on_slow_reader
        self.sinks = list(sinks)
        self.lance_uri = None if lance_uri is None else str(lance_uri)
        self.mode: Mode = mode
        self.query_id = query_id
        self.executor_writes = executor_writes
        self._writer_options: dict[str, Any] = {
            "max_retries": max_commit_retries,
            "compact_every": compact_every,
            "cleanup_older_than": cleanup_older_than,
            "storage_options": storage_options,
            "key": key,
        }
        self.last_report: EpochReport | None = None
        self._writers: dict[str, LanceEpochWriter] = {}
        self._pushed: dict[str, int] = {}  # newest epoch pushed, per query id
        self._detached: set[int] = set()  # sinks whose reader went away
        self._checked: set[str] = set()  # epoch schemas already checked against the sinks
        # Spark query ids watched for their end -> the key of the manager listening for it
        self._watched: dict[str, str] = {}
        self._ended: set[str] = set()
        self._listeners: dict[str, tuple[Any, Any]] = {}  # manager key -> (manager, listener)
        # Subscriptions (history + live tail): the topic every committed epoch is published to,
        # and the Lance version up to which every epoch has been published (the history a new
        # subscription reads is the dataset as of this version).
        self._topic: Topic | None = None
        self._covered = 0
        self._epoch_schema: pa.Schema | None = None
        self._closed = False
        self._lock = threading.Lock()  # one epoch (or one subscription) at a time
        self._watch_lock = threading.Lock()  # listener bookkeeping: never waits on an epoch
        #: test hook: called as fault(step, epoch_id) at each step of an epoch
        self.fault: Callable[[str, int], None] | None = None

    # -- the foreachBatch callable ------------------------------------------------------

    def __call__(self, batch_df: DataFrame, epoch_id: int) -> None:
        """The foreachBatch callback: commit the epoch to Lance (if set), then push it to sinks."""
        spark = batch_df.sparkSession
        spark_query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
        query_id = self.query_id or spark_query_id
        if not query_id:
            raise ValueError(
                "no streaming query id: call the bridge from writeStream.foreachBatch, "
                "or pass query_id=... when calling it directly"
            )
        if spark_query_id:
            self._watch_epoch(batch_df, spark_query_id)
        with self._lock:
            self._run_epoch(batch_df, int(epoch_id), query_id)

    def _step(self, step: str, epoch_id: int) -> None:
        if self.fault is not None:
            self.fault(step, epoch_id)

    def _run_epoch(self, batch_df: DataFrame, epoch_id: int, query_id: str) -> None:
        self._step("before_arrow", epoch_id)
        table: pa.Table | None = None
        to_arrow_s = commit_s = push_s = 0.0
        result = CommitResult(False, None, None, "no Lance dataset configured")
        if self._live_sinks() or self.lance_uri is None:
            self._check_sinks(batch_df, epoch_id)  # also notes the schema for subscriptions
        if self.lance_uri is not None:
            writer = self._writer(query_id)
            if self.executor_writes:
                # Live sinks read the epoch too: cache it, so both reads see one computation
                # (a non-deterministic column would otherwise differ between Lance and live).
                live = (
                    bool(self._live_sinks()) and epoch_id > self._pushed.get(query_id, -1)
                ) or self._topic is not None
                if live:
                    batch_df = batch_df.persist()
                try:
                    started = time.perf_counter()
                    result = self._commit_on_executors(batch_df, writer, epoch_id)
                    commit_s = time.perf_counter() - started
                    if live:
                        started = time.perf_counter()
                        table = batch_df.toArrow()
                        to_arrow_s = time.perf_counter() - started
                finally:
                    if live:
                        batch_df.unpersist()
            else:
                started = time.perf_counter()
                if skipped := writer.replayed(epoch_id):  # no need to convert a replay
                    result = skipped
                else:
                    table = batch_df.toArrow()
                    to_arrow_s = time.perf_counter() - started
                    started = time.perf_counter()
                    result = writer.commit(epoch_id, table)
                    commit_s = time.perf_counter() - started
        if self._publishes(result, epoch_id, query_id):
            if table is None:
                started = time.perf_counter()
                table = batch_df.toArrow()
                to_arrow_s += time.perf_counter() - started
            self._publish(table, result, epoch_id)
        pushed = False
        if self._live_sinks() and epoch_id > self._pushed.get(query_id, -1):
            if table is None:
                started = time.perf_counter()
                table = batch_df.toArrow()
                to_arrow_s += time.perf_counter() - started
            self._step("before_push", epoch_id)
            started = time.perf_counter()
            self._push(table, epoch_id)
            push_s = time.perf_counter() - started
            self._pushed[query_id] = epoch_id
            pushed = True
        computed = table is not None or (self.executor_writes and not result.replay)
        if not computed:
            # A replay nobody needed to read. Spark still wants the whole batch processed:
            # a stateful query validates its state-store commit at the end of the epoch.
            batch_df.write.format("noop").mode("overwrite").save()
        self._step("after_push", epoch_id)
        rows = table.num_rows if table is not None else -1
        self.last_report = EpochReport(
            query_id,
            epoch_id,
            rows,
            to_arrow_s,
            commit_s,
            push_s,
            result.committed,
            pushed,
            result.reason,
        )

    def _writer(self, query_id: str) -> LanceEpochWriter:
        writer = self._writers.get(query_id)
        if writer is None:
            assert self.lance_uri is not None
            writer = LanceEpochWriter(self.lance_uri, query_id, self.mode, **self._writer_options)
            writer._fault = self._step
            self._writers[query_id] = writer
        return writer

    # -- live sinks ---------------------------------------------------------------------

    def _live_sinks(self) -> list[TableSink]:
        return [s for s in self.sinks if id(s) not in self._detached]

    def _detach(self, sink: TableSink, error: PushTableError | None, why: str) -> None:
        """Stop feeding ``sink``; with ``error``, its reader's query raises it."""
        log.warning("live table %r detached: %s", sink.name, why)
        self._detached.add(id(sink))
        if error is not None:
            sink.fail(error)

    def _check_sinks(self, batch_df: DataFrame, epoch_id: int) -> None:
        """Before the commit, once per epoch schema: detach sinks that cannot take it."""
        schema = self._stamped_schema(arrow_schema(batch_df.schema))
        self._epoch_schema = schema
        key = schema.to_string()
        if key in self._checked:
            return
        self._checked.add(key)
        for sink in self._live_sinks():
            try:
                conform_to(schema.empty_table(), sink.schema)
            except (SchemaDriftError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                error = IncompatibleSinkError(
                    f"live table {sink.name!r} cannot take epoch {epoch_id} of this query: {exc}"
                )
                self._detach(sink, error, str(exc))

    def _stamped_schema(self, schema: pa.Schema) -> pa.Schema:
        return stamped_schema(schema, self.epoch_column)

    def _stamped(self, table: pa.Table, epoch_id: int) -> pa.Table:
        return stamp_epoch(table, self.epoch_column, epoch_id)

    def _advance(self, sink: TableSink | Topic, epoch_id: int) -> None:
        """After epoch ``epoch_id``: no row of an earlier epoch will come (ordered sinks)."""
        if self.epoch_column is not None and sink.watermark_type is not None:
            sink.advance(epoch_id + 1)

    def _push(self, table: pa.Table, epoch_id: int) -> None:
        timeout = None if self.on_slow_reader == "block" else self.push_timeout
        table = self._stamped(table, epoch_id)
        for sink in self._live_sinks():
            try:
                # Names and types are conformed here; NOT NULL is checked by the sink on the
                # data, with a message naming the field.
                relaxed = pa.schema([f.with_nullable(True) for f in sink.schema])
                sink.write(conform_to(table, relaxed), timeout=timeout)
                self._advance(sink, epoch_id)
            except (ReaderGoneError, SinkClosedError) as exc:
                # A reader that stopped early must not stop the persisting query.
                self._detach(sink, None, str(exc))
            except WriteTimeoutError as exc:
                slow = SlowReaderError(
                    f"live table {sink.name!r} missed epoch {epoch_id}: its reader did not take "
                    f"it within push_timeout={self.push_timeout:g}s, so it gets no more epochs "
                    f"(on_slow_reader='detach'); the query goes on persisting"
                )
                self._detach(sink, slow, str(exc))
            except (PushTableError, ValueError) as exc:  # SchemaDriftError, ArrowInvalid too
                # The epoch is committed already: a sink that rejects it (a NOT NULL column
                # with a null, say) is detached with the error for its reader, or the epoch
                # would fail on every restart and wedge the query.
                error = IncompatibleSinkError(
                    f"live table {sink.name!r} rejected epoch {epoch_id}: {exc}"
                )
                self._detach(sink, error, str(exc))

    # -- subscriptions: history + live tail ---------------------------------------------

    def subscribe(
        self,
        ctx: datafusion.SessionContext,
        name: str,
        *,
        history: bool = True,
        capacity: int = 16,
        schema: pa.Schema | None = None,
    ) -> Subscription:
        """Register a live table ``name`` in ``ctx``, at any moment, even mid-query.

        With ``history=True`` its query first reads the Lance dataset as of the newest
        version whose epochs were all published (the newest version, unless an epoch is being
        retried), then every epoch committed after it: no gap and no duplicate. Taken after
        the query ended, it reads the history, then ends. ``history=False`` starts at the
        next epoch. A reader that falls behind is treated as ``on_slow_reader`` says
        (``"detach"``: after ``push_timeout`` its query raises ``SlowSubscriberError``).
        ``schema`` is needed only before the first epoch when no Lance dataset exists yet.

        Example:
            >>> import tempfile
            >>> from pushtable import SessionContext
            >>> from pushtable.spark import ForeachBatchBridge
            >>> bridge = ForeachBatchBridge(lance_uri=tempfile.mkdtemp() + "/e.lance")
            >>> ctx = SessionContext()
            >>> # any time after start(): all committed rows so far, then each new epoch
            >>> # live = bridge.subscribe(ctx, "events"); ctx.sql("SELECT ... FROM events")
        """
        if self.mode != "append":
            raise ValueError(
                f"subscriptions need mode='append': in {self.mode!r} mode every epoch "
                "restates results, which a live table would show duplicated"
            )
        if history and self.lance_uri is None:
            raise ValueError("history=True reads the Lance dataset: pass lance_uri=... too")
        if history and self.epoch_column is not None:
            raise ValueError(
                "the Lance history has no epoch column: subscribe with history=False when the "
                "bridge has epoch_column="
            )
        with self._lock:
            topic = self._ensure_topic(schema)
            prelude = None
            if history and self._covered > 0:
                assert self.lance_uri is not None
                import lance

                options = self._writer_options["storage_options"]
                ds = lance.dataset(self.lance_uri, version=self._covered, storage_options=options)
                prelude = ds.scanner().to_reader()
                if not prelude.schema.equals(topic.schema):
                    prelude = prelude.cast(topic.schema)
            return topic.subscribe(
                ctx,
                name,
                capacity,
                on_slow="block" if self.on_slow_reader == "block" else "detach",
                slow_timeout=self.push_timeout,
                history=prelude,
            )

    def close(self) -> None:
        """End of stream for every live table and subscription (queued data stays readable).

        Done for you when the Spark query terminates; call it when feeding the bridge by
        hand. Idempotent.
        """
        with self._lock:
            self._closed = True
            for sink in self.sinks:
                sink.close()
            if self._topic is not None:
                self._topic.close()

    def _ensure_topic(self, schema: pa.Schema | None) -> Topic:
        """The topic subscriptions read, created on the first subscription (under the lock)."""
        if self._topic is not None:
            return self._topic
        ds = None
        if self.lance_uri is not None:
            from pushtable.lance_commits import open_dataset

            ds = open_dataset(self.lance_uri, self._writer_options["storage_options"])
        if schema is None:
            if ds is not None:
                schema = ds.schema
            elif self._epoch_schema is not None:
                schema = self._epoch_schema
            else:
                raise ValueError(
                    "no schema yet (no epoch seen and no Lance dataset): pass schema=..."
                )
        relaxed = pa.schema([f.with_nullable(True) for f in self._stamped_schema(schema)])
        self._topic = Topic(
            f"bridge:{self.lance_uri or id(self)}", relaxed, order_by=self.epoch_column
        )
        # Every epoch committed so far is in the dataset now: history covers it.
        self._covered = ds.version if ds is not None else 0
        if self._closed or (self._ended and not self._watched):
            self._topic.close()  # the query already ended: history, then end of stream
        return self._topic

    def _publishes(self, result: CommitResult, epoch_id: int, query_id: str) -> bool:
        """Whether the topic gets this epoch: exactly the epochs its history does not cover."""
        if self._topic is None:
            return False
        if self.lance_uri is None:
            return epoch_id > self._pushed.get(query_id, -1)
        return result.version is not None and result.version > self._covered

    def _publish(self, table: pa.Table, result: CommitResult, epoch_id: int) -> None:
        """Write a committed epoch to the subscriptions (before anything else can fail)."""
        assert self._topic is not None
        try:
            data = conform_to(self._stamped(table, epoch_id), self._topic.schema)
        except (SchemaDriftError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            self._topic.fail(
                IncompatibleSinkError(f"subscriptions cannot take epoch {epoch_id}: {exc}")
            )
            return
        try:
            self._topic.write(data)
            self._advance(self._topic, epoch_id)
        except SinkClosedError as exc:
            log.warning("epoch %s not published: %s", epoch_id, exc)
        if result.version is not None:
            self._covered = result.version

    # -- executor-side writes -----------------------------------------------------------

    def _commit_on_executors(
        self, batch_df: DataFrame, writer: LanceEpochWriter, epoch_id: int
    ) -> CommitResult:
        from lance.fragment import FragmentMetadata

        if skipped := writer.replayed(epoch_id):
            return skipped
        ensure_worker_python(batch_df.sparkSession)
        target = writer.schema_for(arrow_schema(batch_df.schema))  # no Spark job for it
        uri, options = writer.uri, writer.storage_options

        def write_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            fragments = write_fragments(batches, uri, target, options)
            if fragments:  # an empty partition writes nothing
                yield pa.record_batch(
                    [pa.array([json.dumps(f.to_json()) for f in fragments], pa.string())],
                    names=["fragment"],
                )

        rows = batch_df.mapInArrow(write_partition, "fragment string").collect()
        fragments = [FragmentMetadata.from_json(r["fragment"]) for r in rows]
        self._step("after_fragments", epoch_id)
        return writer.commit_fragments(epoch_id, fragments, target)

    # -- query termination --------------------------------------------------------------

    def watch(self, query: StreamingQuery, spark: SparkSession | None = None) -> None:
        """Close the sinks when ``query`` terminates, fail them when it fails.

        The bridge does this by itself from the query's first epoch on, whichever session
        started it; call ``watch`` right after ``start()`` to also cover a query that fails
        before its first epoch. ``spark`` is accepted for compatibility and not needed.
        """
        jsession = query._jsq.sparkSession()  # the session that started the query
        self._watch(jsession, str(query.id))
        if not query.isActive:
            error = query.exception()
            self._on_terminated(str(query.id), None if error is None else str(error))

    def _watch_epoch(self, batch_df: DataFrame, spark_query_id: str) -> None:
        """From inside ``foreachBatch``: find the session that started the query and watch it.

        ``batch_df.sparkSession`` is the stream's *clone* of that session, with a streaming
        query manager of its own that never hears of the query's end; the starting session
        is the one Spark's shared state records for the running query.
        """
        with self._watch_lock:
            if spark_query_id in self._watched or spark_query_id in self._ended:
                return
        jspark = batch_df.sparkSession._jsparkSession
        jvm = batch_df.sparkSession.sparkContext._jvm
        assert jvm is not None
        running = (
            jspark.sharedState()
            .activeStreamingQueries()
            .get(jvm.java.util.UUID.fromString(spark_query_id))
        )
        self._watch(running.sparkSession() if running is not None else jspark, spark_query_id)

    def _watch(self, jsession: Any, spark_query_id: str) -> None:
        """Listen for ``spark_query_id``'s end on the manager of ``jsession``.

        One listener per manager, removed when its last watched query ended.
        """
        from pyspark.sql.streaming.query import StreamingQueryManager

        with self._watch_lock:
            if spark_query_id in self._watched or spark_query_id in self._ended:
                return
            key = str(jsession.toString())
            self._watched[spark_query_id] = key
            if key not in self._listeners:
                manager = StreamingQueryManager(jsession.streams())
                listener = _termination_listener(self._on_terminated)
                manager.addListener(listener)
                self._listeners[key] = (manager, listener)

    def _on_terminated(self, spark_query_id: str, exception: str | None) -> None:
        """A watched query ended: fail the sinks if it failed; close them once none runs."""
        with self._watch_lock:
            key = self._watched.pop(spark_query_id, None)
            if key is None:
                return
            self._ended.add(spark_query_id)
            unused = None
            if key not in self._watched.values():
                unused = self._listeners.pop(key, None)
            last = not self._watched
        if unused is not None:
            # Not from inside the listener's own callback: Spark's listener bus thread.
            manager, listener = unused
            threading.Thread(target=manager.removeListener, args=(listener,), daemon=True).start()
        producers: list[TableSink | Topic] = [*self.sinks]
        if self._topic is not None:
            producers.append(self._topic)
        for producer in producers:
            if exception is not None:
                producer.fail(StreamingQueryFailedError(exception))
            elif last:
                producer.close()


def stamped_schema(schema: pa.Schema, epoch_column: str | None) -> pa.Schema:
    """An epoch's schema as live tables see it: with ``epoch_column`` (``int64``) appended.

    Nothing is appended when there is no ``epoch_column`` or the epoch has that column already.
    """
    if epoch_column is None or epoch_column in schema.names:
        return schema
    return schema.append(pa.field(epoch_column, pa.int64(), nullable=False))


def stamp_epoch(table: pa.Table, epoch_column: str | None, epoch_id: int) -> pa.Table:
    """``table`` with ``epoch_id`` in every row of ``epoch_column`` (see :func:`stamped_schema`)."""
    if epoch_column is None or epoch_column in table.schema.names:
        return table
    ids = pa.repeat(pa.scalar(epoch_id, pa.int64()), table.num_rows)
    return table.append_column(pa.field(epoch_column, pa.int64(), nullable=False), ids)


def _termination_listener(settle: Callable[[str, str | None], None]) -> Any:
    """A StreamingQueryListener that reports query terminations to ``settle``."""
    from pyspark.sql.streaming.listener import StreamingQueryListener

    class _Listener(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            pass

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            settle(str(event.id), event.exception)

    return _Listener()
