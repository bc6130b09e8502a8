"""Fan-out: one stream, any number of live queries over it (:class:`Topic`).

A streaming table has one reader. A topic has *subscriptions*: each one is a single-scan
table in any session, taken at any time, that sees every batch written after it (or from
the oldest batch still retained) exactly once, in order. Batches are stored once and shared
by every subscription; memory grows with queued and retained batches, not with subscribers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import datafusion
import pyarrow as pa

from pushtable import _native, metrics
from pushtable.context import (
    Validate,
    check_new_table,
    check_validate,
    delay_units,
    order_columns,
)
from pushtable.sink import SinkStats, _Producer

__all__ = ["Subscription", "SubscriptionStats", "Topic", "TopicStats"]


@dataclass(frozen=True)
class TopicStats(SinkStats):
    """A topic's counters: :class:`SinkStats` plus its subscribers.

    ``queued_batches``/``queued_bytes`` count what the topic holds (batches some subscriber
    has still to read, plus the retention window); ``subscribers`` are the live ones;
    ``detached`` counts subscribers cut loose for falling behind.
    """

    subscribers: int = 0
    detached: int = 0


@dataclass(frozen=True)
class SubscriptionStats:
    """One subscription's counters: its backlog, what it read, and its state.

    ``state`` is ``"waiting for a query"``, ``"reading"``, ``"detached"`` (see
    ``detached_because``) or ``"finished"`` (its query ended or its table was dropped).
    """

    queued_batches: int
    queued_bytes: int
    read_batches: int
    state: str
    detached_because: str | None


class Subscription:
    """A topic's reader registered as a table: what :meth:`Topic.subscribe` returns."""

    def __init__(self, native: _native.Subscription, name: str, topic: Topic) -> None:
        self._native = native
        self.name = name
        self.topic = topic

    def __repr__(self) -> str:
        s = self.stats
        return f"Subscription(name={self.name!r}, topic={self.topic.name!r}, {s.state})"

    @property
    def stats(self) -> SubscriptionStats:
        """Current counters (see :class:`SubscriptionStats`)."""
        return SubscriptionStats(**self._native.stats())


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
        late: Literal["reject", "drop"] = "reject",
        arrival_column: str | None = None,
        max_delay: timedelta | int | None = None,
        validate: Validate = "basic",
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
        native = _native.topic(
            name,
            schema,
            retain,
            retain_bytes,
            order,
            late,
            arrival_column,
            delay,
            check_validate(validate),
        )
        super().__init__(native, name, schema)
        self.retain = retain
        self.retain_bytes = retain_bytes
        metrics.track(self)

    def __repr__(self) -> str:
        s = self.stats
        state = "failed" if s.failed else "closed" if s.closed else "open"
        return f"Topic(name={self.name!r}, {state}, rows={s.rows}, subscribers={s.subscribers})"

    @property
    def stats(self) -> TopicStats:
        """Current counters (see :class:`TopicStats`)."""
        return TopicStats(**self._native.stats())

    def subscribe(
        self,
        ctx: datafusion.SessionContext,
        name: str,
        capacity: int = 16,
        *,
        max_bytes: int | None = None,
        start: Literal["now", "earliest"] = "now",
        on_slow: Literal["block", "detach"] = "block",
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
        if start not in ("now", "earliest"):
            raise ValueError(f"start must be 'now' or 'earliest', got {start!r}")
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
        native, provider = self._native.subscribe(
            capacity, max_bytes, start, timeout, history, unbounded
        )
        ctx.register_table(name, provider)
        subscription = Subscription(native, name, self)
        metrics.track(subscription, session=ctx.session_id())
        return subscription
