"""Talking to ``pushtable serve``: connecting, declaring tables, remote SQL, staged epochs.

:func:`connect` opens the client; the staged epochs are the Spark bridge's. Producers are in
:mod:`pushtable.flight.client.remote_sink`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa

from pushtable.errors import (
    UnknownTableError,
)
from pushtable.flight import protocol
from pushtable.flight.client.idempotent import DURABLE_WINDOW, DURABLE_WINDOW_BYTES, IdempotentSink
from pushtable.flight.client.put_stream import LEAVE_AGAIN_FOR_S
from pushtable.flight.client.remote_sink import END_WAIT_S, WINDOW_BYTES, RemoteSink
from pushtable.flight.client.stager import Stager
from pushtable.flight.client.transport import Transport
from pushtable.producer import Late, OnSlow

__all__ = ["Client", "RemoteResult", "connect"]


def connect(
    uri: str,
    *,
    token: str | None = None,
    tls_root_certs: str | Path | bytes | None = None,
    timeout: float | None = 30.0,
) -> Client:
    """Connect to a ``pushtable serve`` server at ``uri`` (``grpc://host:port`` or ``grpc+tls://``).

    ``token`` is sent as a bearer token on every call; ``tls_root_certs`` (a PEM path or bytes)
    verifies a server with a self-signed certificate. ``timeout`` bounds each control call
    (table declarations, stats), not streams.

    Example:
        >>> from pushtable.flight import Server, connect
        >>> server = Server()
        >>> connect(server.location).tables()
        []
        >>> server.stop()  # the number of calls left open
        0
    """
    return Client(Transport(uri, token=token, tls_root_certs=tls_root_certs, timeout=timeout))


class Client:
    """A connection to a ``pushtable serve`` server (see :func:`connect`). Thread-safe.

    It owns ``transport`` (one Flight connection with its token and timeouts): its producers
    and results use it, and :meth:`close` closes it.
    """

    def __init__(self, transport: Transport) -> None:
        self.uri = transport.uri
        self._transport = transport
        self._sinks: weakref.WeakSet[RemoteSink] = weakref.WeakSet()
        self._results: weakref.WeakSet[RemoteResult] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"Client({self.uri!r})"

    def _action(self, name: str, body: dict[str, Any] | None = None, options: Any = None) -> Any:
        return self._transport.action(name, body, options)

    # -- declaring tables ---------------------------------------------------------------

    def create_table(
        self,
        name: str,
        schema: pa.Schema,
        capacity: int = 16,
        *,
        max_bytes: int | None = None,
        unbounded: bool = False,
        order_by: str | list[str] | None = None,
        late: Late = "reject",
        arrival_column: str | None = None,
        max_delay: timedelta | int | None = None,
        if_not_exists: bool = False,
    ) -> None:
        """Declare a single-scan streaming table on the server (as ``register_streaming_table``).

        ``max_delay`` as a ``timedelta`` crosses in microseconds.
        """
        self._action(
            "create_table",
            {
                "name": name,
                "schema": protocol.schema_bytes(schema),
                "capacity": capacity,
                "max_bytes": max_bytes,
                "unbounded": unbounded,
                "order_by": order_by,
                "late": late,
                "arrival_column": arrival_column,
                **protocol.delay_option(max_delay),
                "if_not_exists": if_not_exists,
            },
        )

    def create_topic(
        self,
        name: str,
        schema: pa.Schema,
        *,
        retain: int | None = None,
        retain_bytes: int | None = None,
        order_by: str | list[str] | None = None,
        if_not_exists: bool = False,
        durable: bool = False,
        commit_interval: float | None = None,
        retention: timedelta | None = None,
        retention_bytes: int | None = None,
    ) -> None:
        """Declare a topic on the server (see :class:`pushtable.Topic`).

        ``durable=True`` (an ``admin`` call) stores it in the server's data dir as
        ``<name>.lance``: each acknowledgement then means committed, it survives a restart,
        and subscriptions and :meth:`read` start at any offset. ``commit_interval``
        (seconds, default 0.1) is how long its group commits gather batches;
        ``retention`` / ``retention_bytes`` bound its stored history (whole old fragments
        are deleted; a read below ``earliest`` raises :class:`~pushtable.OffsetOutOfRangeError`).
        """
        body: dict[str, Any] = {
            "name": name,
            "schema": protocol.schema_bytes(schema),
            "topic": True,
            "retain": retain,
            "retain_bytes": retain_bytes,
            "order_by": order_by,
            "if_not_exists": if_not_exists,
        }
        if durable:
            body["durable"] = True
        if commit_interval is not None:
            body["commit_interval"] = commit_interval
        if retention is not None:
            body["retention_us"] = retention // timedelta(microseconds=1)
        if retention_bytes is not None:
            body["retention_bytes"] = retention_bytes
        self._action("create_table", body)

    def subscribe(
        self,
        topic: str,
        name: str,
        capacity: int = 16,
        *,
        start: str | int | datetime = "now",
        on_slow: OnSlow = "block",
        slow_timeout: float = 5.0,
    ) -> None:
        """Register a subscription of ``topic`` as table ``name`` on the server.

        On a durable topic ``start`` may be ``"earliest"``, ``"latest"``, an offset or a
        ``datetime`` (history from the dataset, then the live batches).
        """
        self._action(
            "subscribe",
            {
                "topic": topic,
                "name": name,
                "capacity": capacity,
                "start": protocol.start_option(start),
                "on_slow": on_slow,
                "slow_timeout": slow_timeout,
            },
        )

    def unsubscribe(self, name: str) -> None:
        """Drop subscription ``name`` on the server: its name is free, it holds no producer.

        The server drops a subscription by itself once the query reading it ends (or is
        refused): a subscription is a single-scan table. Raises
        :class:`~pushtable.UnknownTableError` when there is no subscription ``name``.
        """
        self._action("unsubscribe", {"name": name})

    def tables(self) -> list[dict[str, Any]]:
        """The server's tables and topics: ``name``, ``topic``, ``schema`` and bound of each.

        The bound is the queue's: ``bound_batches`` and ``bound_bytes`` (capacity and
        max_bytes, a topic's retain). A topic's subscriptions (what SQL reads) are listed
        too, each with ``subscription_of`` naming its topic.
        """
        out = self._action("tables")
        for t in out:
            t["schema"] = protocol.schema_from(t["schema"])
        return list(out)

    def stats(self, name: str) -> dict[str, Any]:
        """The live counters of table or topic ``name`` (its ``stats``, as a dict)."""
        return dict(self._action("stats", {"name": name}))

    def offsets(self, topic: str) -> dict[str, int]:
        """A durable topic's ``earliest`` offset, ``committed`` and ``next``.

        Every offset below ``committed`` is stored.
        """
        return {k: int(v) for k, v in self._action("offsets", {"name": topic}).items()}

    def consumed(self, topic: str, consumer: str, offset: int) -> None:
        """Tell the server ``consumer`` read every offset below ``offset`` of a durable topic.

        The topic's stats report it; a restart keeps it.
        """
        self._action("consumed", {"name": topic, "consumer": consumer, "offset": int(offset)})

    def read(self, topic: str, start: int, end: int) -> RemoteResult:
        """The committed batches of offsets ``[start, end)`` of a durable topic, from its dataset.

        They are the same rows each time (``end`` at most ``offsets(topic)["committed"]``).
        """
        ticket = {"topic": topic, "start": int(start), "end": int(end)}
        return RemoteResult(self._transport.do_get(ticket))

    def schema(self, name: str) -> pa.Schema:
        """The schema of table or topic ``name`` on the server.

        Raises :class:`~pushtable.UnknownTableError` if there is none, and
        :class:`~pushtable.PermissionDeniedError` if ``name`` is outside the token's scope (as
        SQL and every other call naming a table do; listings leave such tables out).
        """
        for t in self.tables():
            if t["name"] == name:
                return t["schema"]
        self._action("stats", {"name": name})  # the server's verdict: out of scope, or none
        raise UnknownTableError(f"no table named {name!r} on the server at {self.uri}")

    # -- producing and querying ---------------------------------------------------------

    def sink(
        self,
        name: str,
        *,
        window: int | None = None,
        producer_id: str | None = None,
        retry: float = 60.0,
        window_bytes: int | None = None,
    ) -> RemoteSink:
        """A producer for table (or topic) ``name``; ``window`` bounds unacknowledged batches.

        ``window`` defaults to 8 and ``window_bytes`` (the bytes those batches reference) to
        64 MiB, whichever bound comes first; a table acknowledges a batch once queued.

        With ``producer_id`` (a durable topic), an :class:`IdempotentSink`: its batches are
        numbered, kept until stored, and sent again after an outage of up to ``retry``
        seconds without being stored twice. Its window defaults to 256 batches and 64 MiB
        (``window_bytes``): a durable topic acknowledges a batch once a group commit stores it.
        """
        sink: RemoteSink
        if producer_id is not None:
            protocol.producer_path([name, protocol.PRODUCER, producer_id, "0"])  # refused early
            sink = IdempotentSink(
                self._transport,
                name,
                self.schema(name),
                producer_id,
                window=DURABLE_WINDOW if window is None else window,
                window_bytes=DURABLE_WINDOW_BYTES if window_bytes is None else window_bytes,
                retry=retry,
            )
        else:
            sink = RemoteSink(
                self._transport,
                name,
                self.schema(name),
                window=8 if window is None else window,
                window_bytes=WINDOW_BYTES if window_bytes is None else window_bytes,
            )
        self._sinks.add(sink)
        return sink

    def sql(self, query: str) -> RemoteResult:
        """Run ``query`` on the server; its batches stream back as the query produces them."""
        result = RemoteResult(self._transport.do_get({"sql": query}))
        self._results.add(result)
        return result

    # -- staged epochs (the Spark bridge's exactly-once path) ----------------------------

    def stager(
        self, table: str, query: str, epoch: int, partition: int, attempt: int, schema: pa.Schema
    ) -> Stager:
        """A stream for one Spark task attempt's share of an epoch.

        The server holds the share until :meth:`publish` names the attempt (see
        :mod:`pushtable.spark.remote`).
        """
        path = [table, protocol.STAGE, query, str(epoch), str(partition), str(attempt)]
        return Stager(self._transport, path, schema)

    def stage(
        self,
        table: str,
        query: str,
        epoch: int,
        partition: int,
        attempt: int,
        batches: Iterable[pa.RecordBatch],
        schema: pa.Schema,
    ) -> None:
        """Stage ``batches`` as one attempt's share of an epoch (see :meth:`stager`)."""
        stager = self.stager(table, query, epoch, partition, attempt, schema)
        for batch in batches:
            stager.write(batch)
        stager.finish()

    def publish(
        self,
        table: str,
        query: str,
        epoch: int,
        parts: Sequence[tuple[int, int] | tuple[int, int, int]],
        *,
        timeout: float | None = None,
        advance: int | None = None,
    ) -> bool:
        """Write the staged ``(partition, attempt)`` shares of ``epoch`` into ``table``, once.

        Returns False if the server published this epoch (or a later one) of ``query`` before.
        A part may carry its row count, ``(partition, attempt, rows)``: a part with rows the
        server does not hold (it restarted since it was staged) raises
        :class:`~pushtable.SharesLostError` and nothing of the epoch is written. Into a
        durable topic the answer comes once a commit holds the epoch.
        ``timeout`` bounds the wait for the table's reader to make room (None: no bound).
        ``advance``: then move an ordered table's watermark there (an unordered table has
        none: nothing to move).
        """
        options = self._transport.options(timeout)
        body: dict[str, Any] = {
            "table": table,
            "query": query,
            "epoch": epoch,
            "parts": [list(p) for p in parts],
        }
        if advance is not None:
            body["advance"] = int(advance)
        result = self._action("publish", body, options)
        return bool(result["published"])

    def discard(self, table: str, query: str, epoch: int) -> int:
        """Drop every share staged for ``epoch`` of ``query``; returns how many there were.

        Used when Spark aborts the epoch.
        """
        body = {"table": table, "query": query, "epoch": int(epoch)}
        return int(self._action("discard", body)["discarded"])

    def published(self, table: str, query: str) -> int:
        """The newest epoch of ``query`` published into ``table`` (-1: none)."""
        return int(self._action("published", {"table": table, "query": query})["epoch"])

    def close(self) -> None:
        """Disconnect: end this client's producer streams and cancel its queries.

        Batches already acknowledged stay in their tables; the tables stay open (a client
        leaving is not end of stream: call ``sink.close()`` for that).
        """
        leaving = [
            threading.Thread(target=sink._end_stream, name="pushtable-leave", daemon=True)
            for sink in list(self._sinks)
        ]
        for thread in leaving:  # all at once: one bound for every sink, not one each
            thread.start()
        deadline = time.monotonic() + END_WAIT_S
        for thread in leaving:
            thread.join(max(0.0, deadline - time.monotonic()))
        for result in list(self._results):
            result.cancel()
        # a stream left on a server that did not answer ends once a leave reaches it: the
        # connection stays open (in the background, new calls refused) until then
        held = list(self._transport.unended)
        if held:
            self._transport.close_after([put.wait_finished for put in held], LEAVE_AGAIN_FOR_S)
        else:
            self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteResult:
    """A remote query's result stream: iterate it, ``read_all()``, or ``cancel()``.

    Cancelling (or closing the client) stops the query on the server; the producers of the
    tables it read then get ``ReaderGoneError``.
    """

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    @property
    def schema(self) -> pa.Schema:
        """The result's Arrow schema."""
        return self._reader.schema

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return protocol.batches(lambda: protocol.call(self._reader.read_chunk))

    def read_all(self) -> pa.Table:
        """The rest of the result as one table: waits until the query ends."""
        return pa.Table.from_batches(list(self), schema=self.schema)

    def cancel(self) -> None:
        """Stop the query on the server (its tables' producers then get ``ReaderGoneError``)."""
        self._reader.cancel()

    def __enter__(self) -> RemoteResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
