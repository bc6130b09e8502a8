"""Prometheus metrics of pushtable: per table and topic, per subscription, per server.

:data:`REGISTRY` is a ``prometheus_client`` registry that every process using pushtable has.
Table, topic and server figures are read from their ``stats`` when it is scraped (nothing is
counted twice on the write path); server calls and the two latency histograms are counted as
they happen. ``pushtable serve --metrics-port`` serves it; an application embedding
:class:`pushtable.SessionContext` serves it with ``prometheus_client.start_http_server(port,
registry=pushtable.metrics.REGISTRY)``. Names follow Prometheus conventions: base units,
``_total`` counters, ``_seconds`` and ``_bytes``.

Example:
    >>> import pyarrow as pa
    >>> from prometheus_client import generate_latest
    >>> from pushtable import SessionContext, metrics
    >>> ctx = SessionContext()
    >>> sink = ctx.register_streaming_table("events", pa.schema([("v", pa.int64())]))
    >>> line = f'pushtable_rows_written_total{{session="{ctx.session_id()}",table="events"}} 0.0'
    >>> line in generate_latest(metrics.REGISTRY).decode()
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "CALLS",
    "FIRST_RESULT",
    "REGISTRY",
    "WRITE_ACK",
    "QueueReport",
    "ServerReport",
    "SubscriptionReport",
    "track",
]

REGISTRY = CollectorRegistry()

CALLS = Counter(
    "pushtable_server_calls",
    "Calls to pushtable serve by action (do_put, do_get, an action's name) and outcome "
    "(ok, or the error class: PermissionDeniedError, ResourceLimitError, ...).",
    ["action", "outcome"],
    registry=REGISTRY,
)
WRITE_ACK = Histogram(
    "pushtable_write_ack_seconds",
    "DoPut: from the arrival of a batch that asks for an acknowledgement (one per half "
    "window) to the acknowledgement (queued; includes waiting for room).",
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
    registry=REGISTRY,
)
FIRST_RESULT = Histogram(
    "pushtable_query_first_result_seconds",
    "Remote SQL: from the DoGet to the query's first result batch.",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300),
    registry=REGISTRY,
)

#: what is reported, and the session it belongs to (its ``session`` label)
_tracked: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class QueueStats(Protocol):
    """The counters a table or topic reports (``SinkStats`` and ``TopicStats`` have them)."""

    @property
    def rows(self) -> int: ...
    @property
    def batches(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def queued_batches(self) -> int: ...
    @property
    def queued_bytes(self) -> int: ...
    @property
    def waiting_writers(self) -> int: ...
    @property
    def blocked_seconds(self) -> float: ...
    @property
    def late_rows(self) -> int: ...
    @property
    def held_rows(self) -> int: ...
    @property
    def realigned_bytes(self) -> int: ...


@dataclass(frozen=True)
class QueueReport:
    """What a table or topic reports: its counters, its queue's bound and a topic's subscribers.

    The bound is (batches, bytes): ``capacity`` / ``max_bytes``, a topic's ``retain`` /
    ``retain_bytes`` (None: no bound of that kind).
    """

    name: str
    stats: QueueStats
    bound_batches: int | None
    bound_bytes: int | None
    subscribers: int | None = None
    detached: int | None = None


@dataclass(frozen=True)
class SubscriptionReport:
    """What a topic's subscription reports."""

    topic: str
    name: str
    read_batches: int
    queued_batches: int


@dataclass(frozen=True)
class ServerReport:
    """What a server reports: its location, what is open now, and its refusals by reason."""

    location: str
    queries: int
    streams: int
    staged_bytes: int
    refusals: dict[str, int] = field(default_factory=dict)


class Reporting(Protocol):
    """What :func:`track` takes: an object that says what it reports when scraped."""

    def metrics_report(self) -> QueueReport | SubscriptionReport | ServerReport: ...


def track(obj: Reporting, session: str = "") -> None:
    """Report ``obj`` (a ``TableSink``, ``Topic``, ``Subscription`` or a server) while it lives.

    The context, topics and servers call this for what they create. ``session`` (a
    ``SessionContext``'s ``session_id()``) tells apart tables of the same name in two
    sessions of one process.
    """
    _tracked[obj] = session


def _family(kind: type, name: str, doc: str, labels: list[str]) -> Any:
    return kind(name, doc, labels=labels)


class _Tracked(Collector):
    """Reads the tracked objects' ``stats`` at scrape time."""

    def collect(self) -> Iterator[Any]:
        g, c = GaugeMetricFamily, CounterMetricFamily
        t = ["session", "table"]
        fams = {
            "rows": _family(c, "pushtable_rows_written", "Rows written to a table or topic.", t),
            "batches": _family(c, "pushtable_batches_written", "Batches written.", t),
            "bytes": _family(c, "pushtable_bytes_written", "Bytes written (buffers).", t),
            "queued_batches": _family(g, "pushtable_queued_batches", "Batches queued now.", t),
            "queued_bytes": _family(g, "pushtable_queued_bytes", "Bytes queued now.", t),
            "bound_batches": _family(
                g, "pushtable_queue_bound_batches", "The queue's bound (capacity, retain).", t
            ),
            "bound_bytes": _family(
                g, "pushtable_queue_bound_bytes", "The queue's byte bound (max_bytes).", t
            ),
            "waiting": _family(
                g, "pushtable_producers_blocked", "Producers blocked waiting for room.", t
            ),
            "blocked": _family(c, "pushtable_blocked_seconds", "Time producers spent blocked.", t),
            "late": _family(c, "pushtable_late_rows", "Rows late for the order (dropped).", t),
            "held": _family(g, "pushtable_held_rows", "Rows held in the reorder buffer.", t),
            "realigned": _family(
                c, "pushtable_realigned_bytes", "Bytes copied on import to align buffers.", t
            ),
            "subscribers": _family(g, "pushtable_topic_subscribers", "Live subscriptions.", t),
            "detached": _family(
                c, "pushtable_topic_detached", "Subscriptions cut loose for falling behind.", t
            ),
        }
        subs = {
            "read": _family(
                c,
                "pushtable_subscription_batches_read",
                "Batches a subscription's query has read.",
                ["session", "topic", "subscription"],
            ),
            "queued": _family(
                g,
                "pushtable_subscription_queued_batches",
                "Batches waiting for a subscription's query.",
                ["session", "topic", "subscription"],
            ),
        }
        server = {
            "queries": _family(g, "pushtable_server_active_queries", "Remote queries.", ["server"]),
            "streams": _family(g, "pushtable_server_active_streams", "Open streams.", ["server"]),
            "staged": _family(g, "pushtable_server_staged_bytes", "Shares staged.", ["server"]),
            "refusals": _family(
                c, "pushtable_server_refusals", "Refusals by limit.", ["server", "reason"]
            ),
        }
        for obj, session in list(_tracked.items()):
            report = obj.metrics_report()
            if isinstance(report, QueueReport):
                s = report.stats
                name = [session, report.name]
                fams["rows"].add_metric(name, s.rows)
                fams["batches"].add_metric(name, s.batches)
                fams["bytes"].add_metric(name, s.bytes)
                fams["queued_batches"].add_metric(name, s.queued_batches)
                fams["queued_bytes"].add_metric(name, s.queued_bytes)
                if report.bound_batches is not None:
                    fams["bound_batches"].add_metric(name, report.bound_batches)
                if report.bound_bytes is not None:
                    fams["bound_bytes"].add_metric(name, report.bound_bytes)
                fams["waiting"].add_metric(name, s.waiting_writers)
                fams["blocked"].add_metric(name, s.blocked_seconds)
                fams["late"].add_metric(name, s.late_rows)
                fams["held"].add_metric(name, s.held_rows)
                fams["realigned"].add_metric(name, s.realigned_bytes)
                if report.subscribers is not None:
                    fams["subscribers"].add_metric(name, report.subscribers)
                if report.detached is not None:
                    fams["detached"].add_metric(name, report.detached)
            elif isinstance(report, SubscriptionReport):
                labels = [session, report.topic, report.name]
                subs["read"].add_metric(labels, report.read_batches)
                subs["queued"].add_metric(labels, report.queued_batches)
            else:
                where = [report.location]
                server["queries"].add_metric(where, report.queries)
                server["streams"].add_metric(where, report.streams)
                server["staged"].add_metric(where, report.staged_bytes)
                for reason, n in sorted(report.refusals.items()):
                    server["refusals"].add_metric([*where, reason], n)
        yield from fams.values()
        yield from subs.values()
        yield from server.values()
        yield from _live_state()


def _live_state() -> Iterator[Any]:
    """The live engine's stateful operators (updating aggregates, session windows), per kind.

    Each kind is summed over the process's running queries.
    """
    from pushtable import _native

    op = ["operator"]
    g = GaugeMetricFamily
    streams = g("pushtable_live_state_streams", "Running stateful live operators.", labels=op)
    groups = g("pushtable_live_state_groups", "Groups or sessions they hold.", labels=op)
    nbytes = g("pushtable_live_state_bytes", "Bytes of state they hold.", labels=op)
    for operator, n_streams, n_groups, n_bytes in _native.live_state():
        streams.add_metric([operator], n_streams)
        groups.add_metric([operator], n_groups)
        nbytes.add_metric([operator], n_bytes)
    yield from (streams, groups, nbytes)


REGISTRY.register(_Tracked())
