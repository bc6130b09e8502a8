"""What remote clients of ``pushtable serve`` may consume, and the accounting that enforces it.

The limits bind remote calls only: the operator's own Python API (``Server.ctx``,
``Server.create_table``) keeps full power. Every refusal is a :class:`ResourceLimitError`
naming the limit, its value and the option that sets it (a batch over ``max_batch_bytes`` or
``max_value_bytes``: an :class:`InvalidBatchError`, which costs only that batch); the server
goes on serving.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pushtable.errors import InvalidBatchError, ResourceLimitError
from pushtable.flight import protocol

__all__ = ["Limits"]

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Caps on what remote clients may use. Defaults suit a 2-core / 24 GiB machine.

    Example:
        >>> from pushtable.flight import Limits
        >>> Limits(max_queries=2).max_queries
        2
    """

    #: DataFusion memory pool of remote queries (bytes, fair shares, no spilling to disk):
    #: a query over its share fails with a resource error, the others go on.
    query_memory: int = 4 * GiB
    #: remote queries (DoGet / Flight SQL) running at once.
    max_queries: int = 8
    #: ... and of one token (all its connections), so one tenant's live queries cannot
    #: refuse every other tenant's (two of them did, with ``max_queries`` 2).
    max_queries_per_token: int = 4
    #: open DoPut + DoGet streams per client (one connection: token name and peer address).
    max_streams_per_client: int = 16
    #: ... and of one token over all its connections, so that no token fills ``max_streams``
    #: by opening more connections (set ``max_streams`` above what the tokens may hold
    #: together, each this plus ``max_streams_per_client`` still opening).
    max_streams_per_token: int = 128
    #: open DoPut + DoGet streams on the whole server (every client together).
    max_streams: int = 256
    #: Spark shares staged and not yet published, whole server (bytes).
    max_staged_bytes: int = 2 * GiB
    #: ... and per streaming query (bytes).
    max_staged_bytes_per_query: int = 512 * MiB
    #: tables and topics a server holds (remote ``create_table`` beyond it is refused).
    max_tables: int = 256
    #: largest ``capacity`` (batches) a remote ``create_table`` may ask for.
    max_capacity: int = 1024
    #: largest ``max_bytes`` a remote ``create_table`` may ask for; also what it gets if it
    #: names none (a remote table is never unbounded in bytes).
    max_table_bytes: int = 1 * GiB
    #: seconds a remote query may wait on a client that reads nothing before it is dropped.
    idle_timeout: float = 300.0
    #: bytes the durable topics of ``--data-dir`` may take on disk (a write past it is
    #: refused; what is stored stays readable).
    max_data_bytes: int = 64 * GiB
    #: ... and each durable topic's own dataset, so one topic that fills up stops only its
    #: own producers (set the topics' bounds to add up to at most ``max_data_bytes``).
    max_topic_bytes: int = 16 * GiB
    #: seconds a durable topic's producer may leave its acknowledgements unread (while the
    #: server waits to send one) before its stream is cut off; it never stalls others.
    ack_timeout: float = 30.0
    #: seconds a reader of a durable topic's stored history (a range read, a subscription's
    #: catch-up, a Spark batch read through the server) may hold the version it opened
    #: against retention and upkeep; past it the version's files may go, and the reader gets
    #: ``OffsetOutOfRangeError`` naming the earliest offset (as Kafka's consumer that fell
    #: behind retention does). Bounds the disk a stalled reader can pin.
    reader_hold: float = 60.0
    #: bytes of history (beyond what retention keeps) a reader of a durable topic may keep
    #: on disk by holding its version: past them the version's files may go, as past
    #: ``reader_hold`` (a reader stalled 90 s while producers wrote 1 MB/s held a 16 MB
    #: retention at 70-81 MB; at 100 MB/s the same age is 6 GB)
    reader_hold_bytes: int = 256 * MiB
    #: largest batch (bytes of its buffers) a DoPut or a staged Spark share may carry; a
    #: bigger one is refused by name, and the stream goes on.
    max_batch_bytes: int = 256 * MiB
    #: largest single string or binary value in a batch from the network (inside lists,
    #: structs, maps and dictionaries too), refused as above.
    max_value_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"Limits.{f.name} must be a positive number, got {value!r}")

    @classmethod
    def from_config(cls, spec: dict[str, Any]) -> Limits:
        """Limits from a config file's ``"limits"`` object (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown limits {unknown}; known: {', '.join(sorted(known))}")
        return cls(**spec)

    def check_table_options(self, count: int, options: dict[str, Any]) -> dict[str, Any]:
        """The options of a remote ``create_table`` (a topic's with ``topic=True``), checked.

        The byte bound defaults to ``max_table_bytes``: a remote table is never unbounded.
        """
        if count >= self.max_tables:
            raise _refused("tables on the server", count + 1, self.max_tables, "max_tables")
        batches, nbytes = (
            ("retain", "retain_bytes")
            if options.get("topic")
            else (
                "capacity",
                "max_bytes",
            )
        )
        return self.check_queue_options(options, batches, nbytes)

    def check_queue_options(
        self, options: dict[str, Any], batches: str = "capacity", nbytes: str = "max_bytes"
    ) -> dict[str, Any]:
        """A queue's bounds asked for remotely, checked against the server's limits.

        The queue is a table's, a topic's retention or a subscription's; the limits are
        ``max_capacity`` and ``max_table_bytes``.
        """
        count = options.get(batches)
        if isinstance(count, int) and count > self.max_capacity:
            raise _refused(f"{batches} asked for", count, self.max_capacity, "max_capacity")
        size = options.get(nbytes)
        if size is None:  # a topic retaining nothing stays so
            keeps = batches != "retain" or options.get(batches) is not None
            return {**options, nbytes: self.max_table_bytes} if keeps else options
        if isinstance(size, int) and size > self.max_table_bytes:
            raise _refused(f"{nbytes} asked for", size, self.max_table_bytes, "max_table_bytes")
        return options

    def check_batch(self, table: str, number: int, batch: pa.RecordBatch) -> None:
        """Refuse a batch from the network too big, or holding a value too long.

        Over ``max_batch_bytes``, or with a string or binary value over ``max_value_bytes``:
        :class:`~pushtable.InvalidBatchError`, naming which. O(buffers), plus one length
        pass over each variable-width column (without the GIL). A stream's batches share
        one schema: :meth:`batch_check` finds its variable-width columns once.
        """
        self.batch_check(batch.schema)(table, number, batch)

    def batch_check(self, schema: pa.Schema) -> Callable[[str, int, pa.RecordBatch], None]:
        """:meth:`check_batch` for the batches of one stream of ``schema``.

        The columns that can hold a string or binary value (nested ones included) are found
        once; a batch of a schema with none costs one buffer-size sum.
        """
        sized = [(i, field.name) for i, field in enumerate(schema) if _holds_values(field.type)]
        max_batch, max_value = self.max_batch_bytes, self.max_value_bytes

        def check(table: str, number: int, batch: pa.RecordBatch) -> None:
            size = batch.get_total_buffer_size()
            if size > max_batch:
                raise InvalidBatchError(
                    f"batch {number} for table {table!r} is {size:,} bytes, over the server's "
                    f"limit of {max_batch:,} (max_batch_bytes); it was refused"
                )
            for i, name in sized:
                longest = _longest_value(batch.column(i))
                if longest > max_value:
                    raise InvalidBatchError(
                        f"batch {number} for table {table!r} holds a value of {longest:,} bytes "
                        f"in column {name!r}, over the server's limit of {max_value:,} "
                        "(max_value_bytes); it was refused"
                    )

        return check


def _holds_values(kind: pa.DataType) -> bool:
    """Whether a column of type ``kind`` can hold a string or binary value, at any depth."""
    if pa.types.is_dictionary(kind):
        return _holds_values(kind.value_type)
    if _is_binary_like(kind):
        return True
    return any(_holds_values(kind.field(i).type) for i in range(kind.num_fields))


def _is_binary_like(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_string_view(kind)
        or pa.types.is_binary_view(kind)
    )


def _longest_value(array: pa.Array) -> int:
    """The longest string or binary value in ``array`` (nested ones included); 0 if none."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        return _longest_value(array.dictionary)
    if pa.types.is_struct(kind):
        return max((_longest_value(array.field(i)) for i in range(kind.num_fields)), default=0)
    if pa.types.is_map(kind):
        return max(_longest_value(array.keys), _longest_value(array.items))
    if (
        pa.types.is_list(kind)
        or pa.types.is_large_list(kind)
        or pa.types.is_fixed_size_list(kind)
        or pa.types.is_list_view(kind)
        or pa.types.is_large_list_view(kind)
    ):
        return _longest_value(array.flatten())
    if _is_binary_like(kind):
        longest = pc.max(pc.binary_length(array)).as_py()
        return int(longest or 0)
    return 0


def _refused(what: str, value: int, limit: int, option: str) -> ResourceLimitError:
    return ResourceLimitError(
        f"refused: {what} would be {value:,}, over the server's limit of {limit:,} ({option})"
    )


class Usage:
    """Live counts of what remote clients hold, checked against :class:`Limits`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.queries = 0
        #: token name -> its queries running
        self.token_queries: dict[str, int] = {}
        self.streams: dict[str, int] = {}
        #: the same streams by token, over all its connections
        self.token_streams: dict[str, int] = {}
        self.staged_bytes = 0
        self.staged_by_query: dict[tuple[str, str], int] = {}
        self.refusals: dict[str, int] = {}
        #: streaming calls opened and not yet in their handler (no first message yet), by token
        self.opening: dict[str, int] = {}

    def open_call(self, token: str) -> None:
        """Count a streaming call from its first byte, before its first message, or refuse it.

        gRPC holds a server thread for a call from the moment it opens, and pyarrow's Flight
        server calls the handler (where :meth:`stream` takes the call's slot) only once the
        first message came: until then it counts here, against ``max_streams`` with every
        stream held, and against ``max_streams_per_client`` for its token. :meth:`opened`
        gives the count back.
        """
        with self._lock:
            total = sum(self.streams.values()) + sum(self.opening.values())
            what = "open streams on the server (those waiting for their first message included)"
            self._within(what, total, "max_streams")
            mine = self.opening.get(token, 0)
            try:
                what = f"streams of token {token!r} waiting for their first message"
                self._within(what, mine, "max_streams_per_client")
            except ResourceLimitError as exc:
                # The token's own calls reach their handlers within moments unless it stalls
                # them itself: its client opens another a moment later (protocol.reopening).
                raise protocol.reopening(exc) from None
            self.opening[token] = mine + 1

    def opened(self, token: str) -> None:
        """A call counted by :meth:`open_call` reached its handler, or ended before."""
        with self._lock:
            left = self.opening.get(token, 0) - 1
            if left > 0:
                self.opening[token] = left
            else:
                self.opening.pop(token, None)

    def _refuse(self, error: ResourceLimitError, reason: str) -> ResourceLimitError:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        return error

    def _within(self, what: str, count: int, option: str) -> None:
        """Refuse one more of ``count`` ``what`` if that passes the limit ``option`` names."""
        limit = getattr(self.limits, option)
        if count >= limit:
            raise self._refuse(_refused(what, count + 1, limit, option), option)

    @contextlib.contextmanager
    def stream(self, client: str, token: str) -> Iterator[None]:
        """Hold one of ``client``'s stream slots (one of its token ``token``'s) for the block."""
        with self._lock:
            held = self.streams.get(client, 0)
            of_token = self.token_streams.get(token, 0)
            self._within("open streams on the server", sum(self.streams.values()), "max_streams")
            self._within(f"open streams of {client}", held, "max_streams_per_client")
            what = f"open streams of token {token!r} (all its connections)"
            self._within(what, of_token, "max_streams_per_token")
            self.streams[client] = held + 1
            self.token_streams[token] = of_token + 1
        try:
            yield
        finally:
            with self._lock:
                for counts, key in ((self.streams, client), (self.token_streams, token)):
                    left = counts[key] - 1
                    if left:
                        counts[key] = left
                    else:
                        del counts[key]

    def query(self, token: str | None) -> Slot:
        """Take one of the server's query slots for ``token``; :meth:`Slot.release` gives it back.

        It is released once, from whichever side lets go of the query first. A token holds
        at most ``max_queries_per_token`` of them (None: a server without tokens, one tenant).
        """
        with self._lock:
            mine = 0 if token is None else self.token_queries.get(token, 0)
            what = f"remote queries of token {token!r} running"
            if token is not None:
                self._within(what, mine, "max_queries_per_token")
            if self.queries >= self.limits.max_queries:
                raise self._refuse(
                    _refused(
                        "remote queries running",
                        self.queries + 1,
                        self.limits.max_queries,
                        "max_queries",
                    ),
                    "max_queries",
                )
            self.queries += 1
            if token is not None:
                self.token_queries[token] = mine + 1
        return Slot(self, token)

    def _release_query(self, token: str | None) -> None:
        with self._lock:
            self.queries -= 1
            if token is None:
                return
            left = self.token_queries.get(token, 0) - 1
            if left > 0:
                self.token_queries[token] = left
            else:
                self.token_queries.pop(token, None)

    def stage(self, key: tuple[str, str], nbytes: int) -> None:
        """Count ``nbytes`` more staged for the query ``key``, or refuse them."""
        with self._lock:
            held = self.staged_by_query.get(key, 0)
            if self.staged_bytes + nbytes > self.limits.max_staged_bytes:
                raise self._refuse(
                    _refused(
                        "bytes staged on the server",
                        self.staged_bytes + nbytes,
                        self.limits.max_staged_bytes,
                        "max_staged_bytes",
                    ),
                    "max_staged_bytes",
                )
            if held + nbytes > self.limits.max_staged_bytes_per_query:
                raise self._refuse(
                    _refused(
                        f"bytes staged for query {key[1]!r} of table {key[0]!r}",
                        held + nbytes,
                        self.limits.max_staged_bytes_per_query,
                        "max_staged_bytes_per_query",
                    ),
                    "max_staged_bytes_per_query",
                )
            self.staged_bytes += nbytes
            self.staged_by_query[key] = held + nbytes

    def unstage(self, key: tuple[str, str], nbytes: int) -> None:
        """Release ``nbytes`` staged for ``key`` (published, dropped or refused)."""
        with self._lock:
            self.staged_bytes -= nbytes
            left = self.staged_by_query.get(key, 0) - nbytes
            if left > 0:
                self.staged_by_query[key] = left
            else:
                self.staged_by_query.pop(key, None)

    def snapshot(self) -> tuple[int, int, int, dict[str, int]]:
        """(queries, open streams, staged bytes, refusals by reason), read together."""
        with self._lock:
            return self.queries, sum(self.streams.values()), self.staged_bytes, dict(self.refusals)

    def refused(self, reason: str) -> None:
        """Count a refusal decided elsewhere (a table option, a statement kind, a role)."""
        with self._lock:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1


class DataBudget:
    """The data dir's disk use against ``max_data_bytes``: each durable write reserves its bytes.

    It reserves the Arrow size, a bound on what Lance stores for it. Near the limit the
    directory is measured again, since upkeep removes old versions; what is accepted and not
    yet committed (``pending``) counts on top of what is measured until it is committed or
    dropped (measured alone, the pending batches' reservations were forgotten: 24 batches
    accepted under a 4 MiB limit, 11.8 MiB on disk once committed).
    """

    def __init__(
        self,
        measure: Callable[[], int],
        limit: int,
        usage: Usage,
        option: str,
        what: str,
        pending: Callable[[], int] = lambda: 0,
    ) -> None:
        self._measure = measure  # the bytes stored now
        self._pending = pending  # the bytes accepted, not yet stored
        self.limit = limit
        self._usage = usage
        self._option = option
        self._what = what
        self._lock = threading.Lock()
        self.used = measure() + pending()

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            if self.used + nbytes > self.limit:
                self.used = self._measure() + self._pending()
            if self.used + nbytes > self.limit:
                raise self._usage._refuse(
                    _refused(self._what, self.used + nbytes, self.limit, self._option),
                    self._option,
                )
            self.used += nbytes

    def room(self) -> int:
        """Bytes the data dir may still grow by, measured now.

        Upkeep asks before it compacts: compaction writes new files before cleanup removes the
        old.
        """
        with self._lock:
            self.used = self._measure() + self._pending()
            return max(0, self.limit - self.used)


class Slot:
    """A held query slot. ``release()`` is idempotent and thread-safe."""

    def __init__(self, usage: Usage, token: str | None) -> None:
        self._usage = usage
        self._token = token
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._usage._release_query(self._token)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
