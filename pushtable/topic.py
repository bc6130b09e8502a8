"""Fan-out: one stream, any number of live queries over it (:class:`Topic`).

A streaming table has one reader. A topic has *subscriptions*: each one is a single-scan
table in any session, taken at any time, that sees every batch written after it (or from
the oldest batch still retained) exactly once, in order. Batches are stored once and shared
by every subscription; memory grows with queued and retained batches, not with subscribers.

A topic made with ``persist=`` is *durable* (:mod:`pushtable.durable`): every batch gets an
offset and is stored in a Lance dataset by group commits; ``flush()``/``close()`` return once
what was written is committed, and subscriptions start at any offset or time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import pyarrow as pa

from pushtable import _native, metrics
from pushtable.context import (
    SessionContext,
    Validate,
    check_new_table,
    check_validate,
    delay_units,
    order_columns,
)
from pushtable.durable import DurableLog, Start
from pushtable.durable.fence import Fence
from pushtable.durable.store import describe
from pushtable.engine import table_key
from pushtable.errors import PushTableError
from pushtable.producer import (
    Late,
    OnSlow,
    SubscriptionStats,
    TopicStats,
    arrow_batches,
    check_timeout,
)
from pushtable.sink import _Producer

__all__ = ["Subscription", "SubscriptionStats", "Topic", "TopicStats"]


class Subscription:
    """A topic's reader registered as a table: what :meth:`Topic.subscribe` returns.

    Close it (:meth:`close`, or use it as a context manager) when no query will read it: a
    subscription that nobody reads holds the topic's producers once ``capacity`` batches
    wait for it (``on_slow="block"``).

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext, Topic
        >>> topic = Topic("t", pa.schema([("v", pa.int64())]))
        >>> ctx = SessionContext()
        >>> with topic.subscribe(ctx, "panel", capacity=2) as panel:
        ...     panel.stats.state
        'waiting for a query'
        >>> topic.stats.subscribers, ctx.table_exist("panel")
        (0, False)
    """

    def __init__(
        self,
        native: _native.Subscription,
        name: str,
        topic: Topic,
        ctx: datafusion.SessionContext | None = None,
    ) -> None:
        self._native = native
        self.name = name
        self.topic = topic
        self._ctx = ctx

    def close(self) -> None:
        """Let the subscription go: its table leaves the session.

        Unless a query is reading it (that query's end lets it go), the topic's producers
        stop waiting for it at once. A query planned on it before and run after raises,
        naming the close.
        """
        self._native.close()
        ctx, self._ctx = self._ctx, None
        if ctx is not None and ctx.table_exist(self.name):
            ctx.deregister_table(self.name)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats
        return f"Subscription(name={self.name!r}, topic={self.topic.name!r}, {s.state})"

    @property
    def stats(self) -> SubscriptionStats:
        """Current counters (see :class:`SubscriptionStats`)."""
        return SubscriptionStats(**self._native.stats())

    def metrics_report(self) -> metrics.SubscriptionReport:
        """What the Prometheus metrics read of this subscription when scraped."""
        s = self.stats
        return metrics.SubscriptionReport(
            self.topic.name, self.name, s.read_batches, s.queued_batches
        )


class Topic(_Producer):
    """A broadcast stream: producers write once, every subscription reads every batch.

    Producers use it exactly like a :class:`TableSink` (``write``/``awrite``, ``close``/``fail``,
    timeouts, PyCapsule inputs, schema and ``order_by`` checks). A write blocks while a
    subscription with ``on_slow="block"`` has ``capacity`` batches queued (the slowest such
    subscriber paces the producers); with no subscribers it never blocks.

    ``retain`` (batches) and/or ``retain_bytes`` keep the newest batches for subscriptions that
    start at ``"earliest"`` (with both, both limits apply). A subscription taken after
    :meth:`close` reads what is retained, then ends; after :meth:`fail`, its query raises the
    failure. ``validate`` is as for a table (:func:`~pushtable.register_streaming_table`):
    ``"full"`` checks every value of every batch written.

    ``persist="path/to/x.lance"`` makes it durable: each batch written gets an offset and
    goes to subscribers at once, and a committer stores everything written within
    ``commit_interval`` seconds in one Lance transaction. ``write`` returns once the batch is
    accepted; :meth:`flush` and :meth:`close` return once everything written is stored (or
    raise :class:`~pushtable.CommitFailedError`). A topic made again on the same path
    continues its offsets. ``retain``/``retain_bytes`` then bound the committed batches also
    kept in memory (history is read from Lance); ``upkeep_interval`` seconds apart, small
    fragments are compacted and versions older than ``keep_versions`` (ten minutes) removed,
    while writes go on: readers of an older version have that long, and what retention
    deleted leaves the disk that much later. ``retention`` (a ``timedelta``) and
    ``retention_bytes`` bound the stored history, as Kafka's ``retention.ms`` /
    ``retention.bytes``: whole old fragments are deleted, the ``earliest`` offset advances,
    and a read below it raises
    :class:`~pushtable.OffsetOutOfRangeError`. ``fsync`` (default on) syncs each commit's
    files before it counts as stored, so an acknowledged batch survives a power loss; off,
    it survives a killed process but an OS crash may lose the last seconds. ``persist`` may
    be an object store's URI (``s3://bucket/prefix/x.lance``, ``gs://``, ``az://``):
    ``storage_options`` are what Lance takes to reach it (``aws_endpoint``,
    ``aws_access_key_id``, …; without them, Lance's environment variables, ``AWS_*`` and the
    like), never stored with the topic. An acknowledgement then means the commit's puts
    returned. ``fence`` (a :class:`~pushtable.durable.fence.Fence`: what a server's data dir
    lease passes) makes its commits land only while its epoch is the newest: opening the
    topic fences out every commit an older owner prepared.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext, Topic
        >>> topic = Topic("events", pa.schema([("v", pa.int64())]), retain=10)
        >>> topic.write(pa.record_batch({"v": [1, 2]}))
        >>> ctx = SessionContext()
        >>> _ = topic.subscribe(ctx, "live", start="earliest")
        >>> _ = topic.subscribe(ctx, "live_sum")
        >>> topic.write(pa.record_batch({"v": [3]}))
        >>> topic.close()
        >>> ctx.sql("SELECT sum(v) AS s FROM live").to_pydict()
        {'s': [6]}
        >>> ctx.sql("SELECT sum(v) AS s FROM live_sum").to_pydict()
        {'s': [3]}
    """

    def __init__(
        self,
        name: str,
        schema: pa.Schema,
        *,
        retain: int | None = None,
        retain_bytes: int | None = None,
        order_by: str | Sequence[str] | None = None,
        late: Late = "reject",
        arrival_column: str | None = None,
        max_delay: timedelta | int | None = None,
        validate: Validate = "basic",
        persist: str | Path | None = None,
        commit_interval: float = 0.1,
        upkeep_interval: float | None = 60.0,
        retention: timedelta | None = None,
        retention_bytes: int | None = None,
        fsync: bool = True,
        keep_versions: timedelta = timedelta(minutes=10),
        storage_options: dict[str, str] | None = None,
        fence: Fence | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        for what, value in (("retain", retain), ("retain_bytes", retain_bytes)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{what} must be an integer >= 0 or None, got {value!r}")
        if not isinstance(schema, pa.Schema):
            schema = pa.schema(schema)
        order = order_columns(order_by, late)
        delay = delay_units(schema, order, max_delay)
        durable = persist is not None
        if not durable and (
            retention,
            retention_bytes,
            fsync,
            keep_versions,
            storage_options,
            fence,
        ) != (None, None, True, timedelta(minutes=10), None, None):
            raise ValueError(
                "retention, retention_bytes, fsync, keep_versions, storage_options and fence "
                "are options of a durable "
                "topic's stored history (Topic(..., persist=...)); retain/retain_bytes bound "
                "one in memory"
            )
        native = _native.topic(
            name,
            schema,
            0 if durable else retain,  # a durable topic's history is read from Lance
            None if durable else retain_bytes,
            order,
            late,
            arrival_column,
            delay,
            check_validate(validate),
        )
        super().__init__(native, name, schema)
        self.retain = retain
        self.retain_bytes = retain_bytes
        #: the log of a durable topic (None for a topic in memory only)
        self.durable: DurableLog | None = None
        if persist is not None:
            config = {
                "retain": retain,
                "retain_bytes": retain_bytes,
                "order_by": order or None,
                "late": late,
                "arrival_column": arrival_column,
                "validate": validate,
                "commit_interval": commit_interval,
                "retention_bytes": retention_bytes,
                "fsync": fsync,
                **_delay_config(max_delay),
                **_retention_config(retention),
            }
            self.durable = DurableLog(
                name,
                schema,
                persist,
                self._live_write,
                config=config,
                commit_interval=commit_interval,
                retain=retain,
                retain_bytes=retain_bytes,
                upkeep_interval=upkeep_interval,
                retention=retention,
                retention_bytes=retention_bytes,
                fsync=fsync,
                keep_versions=keep_versions,
                storage_options=storage_options,
                fence=fence,
            )
        metrics.track(self)

    @classmethod
    def reopen(cls, persist: str | Path, name: str | None = None, **options: Any) -> Topic:
        """The durable topic stored at ``persist``, with the schema and options it was made with.

        ``options`` override them. Its offsets continue where the last commit left.

        Example:
            >>> import tempfile, pyarrow as pa
            >>> path = tempfile.mkdtemp() + "/events.lance"
            >>> topic = Topic("events", pa.schema([("v", pa.int64())]), persist=path)
            >>> topic.write(pa.record_batch({"v": [1, 2]}))
            >>> topic.close()
            >>> again = Topic.reopen(path)
            >>> again.offsets()
            {'earliest': 0, 'committed': 1, 'next': 1}
            >>> again.close()
        """
        schema, config = describe(persist, options.get("storage_options"))
        if "max_delay_us" in config:
            config["max_delay"] = timedelta(microseconds=config.pop("max_delay_us"))
        if "retention_us" in config:
            config["retention"] = timedelta(microseconds=config.pop("retention_us"))
        config.update(options)
        topic_name = name if name is not None else Path(persist).name.removesuffix(".lance")
        return cls(topic_name, schema, persist=persist, **config)

    def _live_write(self, batch: pa.RecordBatch, timeout: float | None) -> None:
        _Producer.write(self, batch, timeout)

    def write(self, data: Any, timeout: float | None = None) -> None:
        """As :meth:`TableSink.write`; on a durable topic each batch also gets the next offset.

        There each batch is stored by a commit within ``commit_interval`` (:meth:`flush` waits
        for it). A durable topic whose last commit failed refuses writes with
        :class:`~pushtable.CommitFailedError` until a commit succeeds.
        """
        if self.durable is None:
            return super().write(data, timeout)
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        written = 0
        try:
            for batch in arrow_batches(data):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self.durable.append(batch, left)
                written += 1
        except PushTableError as exc:
            exc.batches_written = written
            raise
        return None

    async def awrite(self, data: Any, timeout: float | None = None) -> None:
        """Asyncio counterpart of :meth:`write` (a durable topic's runs in a worker thread)."""
        if self.durable is None:
            return await super().awrite(data, timeout)
        await asyncio.to_thread(self.write, data, timeout)
        return None

    def flush(self, timeout: float | None = None) -> None:
        """Return once every batch written so far is stored (a durable topic).

        Raises :class:`~pushtable.CommitFailedError` if a commit holding one failed. A topic in
        memory has nothing to wait for.
        """
        if self.durable is not None:
            self.durable.flush(check_timeout(timeout))

    def close(self) -> None:
        """End of stream; a durable topic first stores what is pending.

        Raises :class:`~pushtable.CommitFailedError` if it cannot store it: the stream still
        ends.
        """
        try:
            if self.durable is not None:
                self.durable.close()
        finally:
            super().close()

    async def aclose(self) -> None:
        """Asyncio counterpart of :meth:`close`, run in a worker thread (it may wait to store)."""
        await asyncio.to_thread(self.close)

    def fail(self, exc: BaseException, timeout: float = 10.0) -> None:
        """As :meth:`TableSink.fail`; a durable topic stores what was written before it.

        It waits at most ``timeout`` seconds for that commit (the store may be away); then
        what is pending is abandoned (never acknowledged).
        """
        if self.durable is not None:
            try:
                self.durable.close(timeout=timeout)
            except PushTableError:
                self.durable.abandon()
        super().fail(exc)

    def offsets(self) -> dict[str, int]:
        """A durable topic's ``earliest`` offset, ``committed`` and ``next``.

        Every offset below ``committed`` is stored; ``next`` is the next batch's offset.
        """
        return self._log("offsets").offsets()

    def read(self, start: int, end: int) -> pa.RecordBatchReader:
        """The stored batches of offsets ``[start, end)`` of a durable topic.

        They are the same rows every time (``end`` at most ``offsets()["committed"]``).
        """
        return self._log("read").read(start, end)

    def consumed(self, consumer: str, offset: int) -> None:
        """Record that ``consumer`` (e.g. a Spark query) has read every offset below ``offset``.

        For a durable topic: :attr:`stats` reports it, a restart recovers it.
        """
        self._log("consumed").consumed(consumer, offset)

    def _log(self, what: str) -> DurableLog:
        if self.durable is None:
            raise ValueError(f"{what}() needs a durable topic (Topic(..., persist=...))")
        return self.durable

    def __repr__(self) -> str:
        s = self.stats
        state = "failed" if s.failed else "closed" if s.closed else "open"
        return f"Topic(name={self.name!r}, {state}, rows={s.rows}, subscribers={s.subscribers})"

    @property
    def stats(self) -> TopicStats:
        """Current counters (see :class:`TopicStats`)."""
        extra = self.durable.stats if self.durable is not None else {}
        return TopicStats(**self._native.stats(), **extra)

    def metrics_report(self) -> metrics.QueueReport:
        """What the Prometheus metrics read of this topic when scraped."""
        s = self.stats
        return metrics.QueueReport(
            self.name, s, self.retain, self.retain_bytes, s.subscribers, s.detached
        )

    def subscribe(
        self,
        ctx: datafusion.SessionContext,
        name: str,
        capacity: int = 16,
        *,
        max_bytes: int | None = None,
        start: Start = "now",
        on_slow: OnSlow = "block",
        slow_timeout: float = 5.0,
        unbounded: bool = False,
        history: Any = None,
    ) -> Subscription:
        """Register a single-scan table ``name`` in ``ctx`` that reads this topic.

        Its query sees, in order and exactly once, every batch written after this call
        (``start="now"``) or from the oldest batch still retained (``start="earliest"``).
        ``capacity``/``max_bytes`` bound what may wait for it. When it is full,
        ``on_slow="block"`` (the default: nothing is ever dropped) makes producers wait;
        ``on_slow="detach"`` lets a write wait ``slow_timeout`` seconds for it, then cuts it
        loose: its query raises :class:`~pushtable.SlowSubscriberError` and the producers go
        on. A query that ends early (LIMIT, cancel, error) detaches only its subscription.
        ``history`` (an Arrow stream, e.g. a ``pa.RecordBatchReader``) is read first.

        On a durable topic ``start`` may also be ``"latest"`` (as ``"now"``), an offset, or a
        ``datetime`` (the first batch that arrived then or later): the query reads the stored
        history from there (Lance), then the live batches, with no gap and no duplicate.

        Example:
            >>> import pyarrow as pa
            >>> from pushtable import SessionContext, Topic
            >>> topic = Topic("t", pa.schema([("v", pa.int64())]))
            >>> ctx = SessionContext()
            >>> sub = topic.subscribe(ctx, "t_live", capacity=4, on_slow="detach")
            >>> sub.stats.state
            'waiting for a query'
        """
        check_new_table(ctx, name, capacity, max_bytes)
        if self.durable is None and start not in ("now", "latest", "earliest"):
            raise ValueError(
                f"start must be 'now', 'latest' or 'earliest', got {start!r} (an offset or a "
                "time needs a durable topic: Topic(..., persist=...))"
            )
        if on_slow not in ("block", "detach"):
            raise ValueError(f"on_slow must be 'block' or 'detach', got {on_slow!r}")
        if (
            isinstance(slow_timeout, bool)
            or not isinstance(slow_timeout, (int, float))
            or math.isnan(slow_timeout)
            or slow_timeout < 0
        ):
            raise ValueError(f"slow_timeout must be a number of seconds >= 0, got {slow_timeout!r}")
        if history is not None and not hasattr(history, "__arrow_c_stream__"):
            got = type(history).__name__
            raise TypeError(f"history must be an Arrow stream (__arrow_c_stream__), got {got}")
        timeout = float(slow_timeout) if on_slow == "detach" else None
        if self.durable is not None:
            if history is not None:
                raise ValueError("a durable topic reads its own history: pass start=, not history=")
            native, provider = self.durable.subscribe(
                start,
                lambda prelude: self._native.subscribe(
                    capacity, max_bytes, "now", timeout, prelude, unbounded
                ),
            )
        else:
            native, provider = self._native.subscribe(
                capacity,
                max_bytes,
                "now" if start == "latest" else str(start),
                timeout,
                history,
                unbounded,
            )
        ctx.register_table(name, provider)
        subscription = Subscription(native, name, self, ctx)
        if isinstance(ctx, SessionContext):  # let go with its table, or a refused query
            ctx._sources.closers[table_key(name)] = subscription.close
        metrics.track(subscription, session=ctx.session_id())
        return subscription


def _retention_config(retention: timedelta | None) -> dict[str, Any]:
    """``retention`` as a durable topic's stored option (JSON has no timedelta)."""
    return {} if retention is None else {"retention_us": retention // timedelta(microseconds=1)}


def _delay_config(max_delay: timedelta | int | None) -> dict[str, Any]:
    """``max_delay`` as a durable topic's stored option (JSON has no timedelta)."""
    if isinstance(max_delay, timedelta):
        return {"max_delay_us": round(max_delay / timedelta(microseconds=1))}
    return {} if max_delay is None else {"max_delay": max_delay}
