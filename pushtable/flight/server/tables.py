"""The tables and topics of ``pushtable serve``, by name.

They are declared by the operator, a config file or a
remote admin, and looked up by every other part of the server by name.

Durable topics live under the server's data dir (``DIR/<name>.lance``) and are reopened when the
server starts on it again, each held to the data dir's ``max_data_bytes``. The action handlers here
(``create_table``, ``subscribe``, ``close``, ``fail``, ``stats``, ``tables``, ``offsets``,
``producer``, ``consumed``) take a checked request (:mod:`pushtable.flight.server.actions`) and the
caller's grant, whose role the server has already required.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import pyarrow as pa

from pushtable import errors
from pushtable.context import SessionContext
from pushtable.durable.fence import Fence
from pushtable.errors import PermissionDeniedError, ResourceLimitError, UnknownTableError
from pushtable.flight import protocol
from pushtable.flight.server import actions
from pushtable.flight.server.auth import Grant
from pushtable.flight.server.data_dir import DataDir
from pushtable.flight.server.limits import DataBudget, Usage
from pushtable.sink import TableSink
from pushtable.topic import Subscription, Topic

#: a durable topic's name, which is also its dataset's file name under the data dir
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class Tables:
    """The server's catalog of live tables and topics, by name (a part of the server)."""

    def __init__(
        self,
        ctx: SessionContext,
        usage: Usage,
        data_dir: DataDir | None,
        fsync: bool,
        fence: Fence | None = None,
    ) -> None:
        self._ctx, self._usage = ctx, usage
        #: the data dir's owner epoch every durable topic's commits carry (see
        #: :mod:`pushtable.durable.fence`): opening a topic fences out an older owner's
        self._fence = fence
        self._data_dir, self._fsync = data_dir, fsync
        self._lock = threading.Lock()
        self._tables: dict[str, TableSink | Topic] = {}
        self._budget: DataBudget | None = None
        #: subscriptions registered in the session: name -> (topic, capacity)
        #: name -> (its topic, its capacity, the subscription)
        self._subscriptions: dict[str, tuple[str, int, Subscription]] = {}
        if data_dir is not None:  # every durable topic is back before calls arrive
            self._budget = DataBudget(
                data_dir.bytes,
                usage.limits.max_data_bytes,
                usage,
                "max_data_bytes",
                f"bytes in the data dir {data_dir}",
                self._pending_bytes,
            )
            for name in data_dir.names():
                self._tables[name] = self._budgeted(
                    Topic.reopen(
                        data_dir.topic_uri(name),
                        name,
                        fsync=fsync,
                        storage_options=data_dir.storage_options,
                        fence=fence,
                    )
                )

    # -- lookups ------------------------------------------------------------------------

    def get(self, name: str) -> TableSink | Topic:
        """The table or topic ``name``; :class:`UnknownTableError` when there is none."""
        producer = self.find(name)
        if producer is None:
            raise UnknownTableError(f"no table named {name!r} on this server")
        return producer

    def find(self, name: str) -> TableSink | Topic | None:
        """The table or topic ``name``, or None."""
        with self._lock:
            return self._tables.get(name)

    def durable(self, name: str) -> Topic:
        """The durable topic ``name``; ``ValueError`` when ``name`` is another kind of table."""
        topic = self.get(name)
        if not isinstance(topic, Topic) or topic.durable is None:
            raise ValueError(f"'{name}' is not a durable topic (create_topic(..., durable=True))")
        return topic

    def all(self) -> list[tuple[str, TableSink | Topic]]:
        """Every table and topic, by name (a snapshot)."""
        with self._lock:
            return list(self._tables.items())

    # -- declaring ----------------------------------------------------------------------

    def create(
        self,
        name: str,
        schema: pa.Schema,
        *,
        topic: bool = False,
        durable: bool = False,
        if_not_exists: bool = False,
        **options: Any,
    ) -> TableSink | Topic:
        """Declare a streaming table, a topic or a durable topic named ``name``.

        ``topic=True`` makes a topic; ``durable=True`` a durable topic, stored in
        ``data_dir/<name>.lance``.
        """
        with self._lock:
            existing = self._tables.get(name)
            if existing is not None:
                if if_not_exists and existing.schema.equals(schema):
                    return existing
                raise errors.TableExistsError(
                    f"a table named {name!r} already exists on this server"
                    + (" with another schema" if if_not_exists else "")
                    + "; create_table(..., if_not_exists=True) returns an existing one"
                )
            if durable:
                producer: TableSink | Topic = self._durable_topic(name, schema, options)
            elif topic:
                producer = Topic(name, schema, **options)
            else:
                producer = self._ctx.register_streaming_table(name, schema, **options)
            self._tables[name] = producer
            return producer

    def declare(self, config: dict[str, Any]) -> None:
        """Declare the ``tables`` and ``topics`` of a server config (see docs/network.md)."""
        for kind, is_topic in (("tables", False), ("topics", True)):
            for spec in config.get(kind, []):
                spec = dict(spec)
                if "schema" not in spec or "name" not in spec:
                    raise ValueError(f"each of {kind!r} needs a 'name' and a 'schema': {spec}")
                schema = pa.schema(
                    [(n, pa.type_for_alias(t)) for n, t in spec.pop("schema").items()]
                )
                if spec.get("durable"):  # a restart found it in the data dir already
                    spec.setdefault("if_not_exists", True)
                if (seconds := spec.pop("retention_seconds", None)) is not None:
                    spec["retention"] = timedelta(seconds=seconds)
                self.create(spec.pop("name"), schema, topic=is_topic, **spec)

    def _durable_topic(self, name: str, schema: pa.Schema, options: dict[str, Any]) -> Topic:
        if self._data_dir is None:
            raise ValueError(
                "durable topics need a data dir: start the server with --data-dir DIR "
                "(Server(..., data_dir=DIR))"
            )
        if not _FILE_NAME.fullmatch(name):
            raise ValueError(
                f"a durable topic's name is its dataset's file name: letters, digits, '_', "
                f"'-' and '.', not starting with '.' or '-'; got {name!r}"
            )
        if (us := options.pop("retention_us", None)) is not None:
            options["retention"] = timedelta(microseconds=int(us))
        uri = self._data_dir.topic_uri(name)
        return self._budgeted(
            Topic(
                name,
                schema,
                persist=uri,
                fsync=self._fsync,
                storage_options=self._data_dir.storage_options,
                fence=self._fence,
                **options,
            )
        )

    def _budgeted(self, topic: Topic) -> Topic:
        """``topic``'s writes and upkeep held to the data dir's ``max_data_bytes``."""
        assert topic.durable is not None
        assert self._budget is not None
        whole, log = self._budget, topic.durable
        own = DataBudget(
            topic.durable.store.disk_bytes,
            self._usage.limits.max_topic_bytes,
            self._usage,
            "max_topic_bytes",
            f"bytes of durable topic '{topic.name}'",
            lambda: log.pending_bytes,
        )

        def reserve(nbytes: int) -> None:
            own.reserve(nbytes)  # this topic's bound first: over it, only it is refused
            whole.reserve(nbytes)

        topic.durable.reserve = reserve
        topic.durable.room = lambda: min(own.room(), whole.room())
        topic.durable.store.hold = self._usage.limits.reader_hold  # readers pin for so long
        topic.durable.store.hold_bytes = self._usage.limits.reader_hold_bytes  # and so much
        return topic

    def _pending_bytes(self) -> int:
        """The bytes durable topics accepted and have not committed yet (the budget's part)."""
        return sum(
            t.durable.pending_bytes
            for t in list(self._tables.values())
            if isinstance(t, Topic) and t.durable is not None
        )

    def fail_all(self, exc: BaseException, timeout: float = 10.0) -> None:
        """Fail every table and topic with ``exc`` (the server is stopping), within ``timeout``.

        The durable topics store what is pending all at once, under one deadline: one after
        another, a store that did not answer cost each its own wait (42 s for 4 topics with
        a 10 s stop). A topic whose commit outlasts the deadline is abandoned (what it had
        pending is never acknowledged).
        """
        deadline = time.monotonic() + timeout
        closing: list[tuple[Topic, threading.Thread]] = []
        for _, producer in self.all():
            if isinstance(producer, Topic) and producer.durable is not None:
                thread = threading.Thread(
                    target=producer.fail,
                    args=(exc, timeout),
                    name=f"pushtable-fail-{producer.name}",
                    daemon=True,
                )
                thread.start()
                closing.append((producer, thread))
            else:
                producer.fail(exc)
        for topic, thread in closing:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():  # a store call still runs: nothing more is acknowledged
                assert topic.durable is not None  # (the thread fails its live side after)
                topic.durable.abandon()

    # -- action handlers ----------------------------------------------------------------

    def create_remote(self, req: actions.NewTable, grant: Grant) -> Any:
        """``create_table`` from a remote admin: within the server's limits, never a path."""
        body = dict(req.options)
        for key in ("persist", "upkeep_interval", "fsync"):
            if key in body:
                raise PermissionDeniedError(
                    f"a remote client cannot set {key!r}: the server places durable topics "
                    "under its data dir (create_topic(..., durable=True))"
                )
        schema = protocol.schema_from(req.schema)
        if (us := body.pop("max_delay_us", None)) is not None:
            body["max_delay"] = timedelta(microseconds=int(us))
        with self._lock:
            count = len(self._tables)
        try:
            options = self._usage.limits.check_table_options(count, body)
        except ResourceLimitError:
            self._usage.refused("table_options")
            raise
        self.create(req.name, schema, **options)
        return {}

    def subscribe(self, req: actions.Subscribe, grant: Grant) -> Any:
        """``subscribe``: a subscription of a topic, registered in the server's session."""
        topic = self.get(req.topic)
        if not isinstance(topic, Topic):
            raise ValueError(f"{topic.name!r} is a streaming table, not a topic")
        try:
            options = self._usage.limits.check_queue_options(dict(req.options))
        except ResourceLimitError:
            self._usage.refused("table_options")
            raise
        options["start"] = protocol.start_value(options.get("start", "now"))
        name = options.pop("name")
        subscription = topic.subscribe(self._ctx, name, **options)
        with self._lock:
            self._subscriptions[name] = (topic.name, options.get("capacity", 16), subscription)
        return {}

    def unsubscribe(self, req: actions.Named, grant: Grant) -> Any:
        """``unsubscribe``: drop a subscription (its name is free again; it holds no producer).

        Raises :class:`~pushtable.UnknownTableError` when ``req.name`` is no subscription.
        """
        if not self.drop_subscriptions([req.name]):
            raise UnknownTableError(f"no subscription named {req.name!r} on the server")
        return {}

    def drop_subscriptions(self, names: Iterable[str]) -> list[str]:
        """Drop those of ``names`` that are subscriptions; returns the ones dropped.

        A subscription is a single-scan table: once the query that read it ended (or was
        refused before it started) nothing can read it again, so the server lets it go then,
        and the topic's producers stop waiting for it.
        """
        dropped = []
        with self._lock:
            for name in names:
                if (entry := self._subscriptions.pop(name, None)) is not None:
                    with contextlib.suppress(Exception):  # deregistered already
                        entry[2].close()  # its cursor too, not only when collected
                    dropped.append(name)
        return dropped

    def offsets(self, req: actions.Named, grant: Grant) -> Any:
        """``offsets``: a durable topic's first, committed and next offsets."""
        return self.durable(req.name).offsets()

    def consumed(self, req: actions.Consumed, grant: Grant) -> Any:
        """``consumed``: a consumer read every offset below ``req.offset``."""
        self.durable(req.name).consumed(req.consumer, req.offset)
        return {}

    def producer(self, req: actions.Producer, grant: Grant) -> Any:
        """``producer``: an idempotent producer's last stored sequence."""
        log = self.durable(req.name).durable
        assert log is not None
        return {"sequence": log.last_sequence(req.producer_id)}

    def close(self, req: actions.Named, grant: Grant) -> Any:
        """``close``: end a table's stream."""
        self.get(req.name).close()
        return {}

    def fail(self, req: actions.Fail, grant: Grant) -> Any:
        """``fail``: a remote producer's error, raised by the table's reader."""
        self.get(req.name).fail(errors.RemoteError(req.message, remote_type=req.type))
        return {}

    def stats(self, req: actions.Named, grant: Grant) -> Any:
        """``stats``: a table's, topic's or subscription's counters.

        A subscription is listed by ``tables`` (``subscription_of`` its topic) until it is
        dropped, so its counters answer too: what it holds of its topic, and its state.
        """
        with self._lock:
            entry = self._subscriptions.get(req.name)
        if entry is not None:
            topic, capacity, subscription = entry
            return {**asdict(subscription.stats), "subscription_of": topic, "capacity": capacity}
        return asdict(self.get(req.name).stats)

    def listing(self, req: actions.Listing, grant: Grant) -> Any:
        """``tables``: the tables the caller's token covers, with their schemas and bounds."""
        out = []
        for name, producer in self.all():
            if grant.covers(name):
                report = producer.metrics_report()
                out.append(
                    {
                        "name": name,
                        "topic": isinstance(producer, Topic),
                        "durable": isinstance(producer, Topic) and producer.durable is not None,
                        "schema": protocol.schema_bytes(producer.schema),
                        "bound_batches": report.bound_batches,  # for a queue's fill
                        "bound_bytes": report.bound_bytes,
                    }
                )
        with self._lock:
            subscriptions = list(self._subscriptions.items())
        for name, (topic, capacity, _) in subscriptions:
            if grant.covers(name) and self._ctx.table_exist(name):
                schema = self._ctx.table(name).schema()
                out.append(
                    {
                        "name": name,
                        "topic": False,
                        "durable": False,
                        "subscription_of": topic,  # read with SQL, as a single-scan table
                        "schema": protocol.schema_bytes(schema),
                        "bound_batches": capacity,
                        "bound_bytes": None,
                    }
                )
        return out
