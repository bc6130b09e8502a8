"""What every producer shares, local or remote.

The ``with`` scope, the Arrow data a write takes, timeouts, and the counters' snapshots.

A leaf of the package (pyarrow and :mod:`pushtable.errors` only): the remote producers of
:mod:`pushtable.flight` use it without loading DataFusion or the native core.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from pushtable.errors import InvalidBatchError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "Late",
    "OnSlow",
    "ProducerScope",
    "SinkStats",
    "SubscriptionStats",
    "TopicStats",
    "arrow_batches",
    "batch_bytes",
    "check_timeout",
]

log = logging.getLogger(__name__)

#: What an ordered table does with a row behind its order: raise, or drop it and count it.
Late = Literal["reject", "drop"]
#: What a topic does about a subscriber that falls behind: wait for it, or cut it loose.
OnSlow = Literal["block", "detach"]


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as a wait limit: None for no limit (also for infinity)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a number >= 0 or None, got {timeout}")
    return None if math.isinf(timeout) else float(timeout)


def batch_bytes(batch: pa.RecordBatch) -> int:
    """The bytes ``batch`` references: what it costs to hold, send or store it.

    A slice counts its own rows, not its parent's buffers: the batches of
    ``table.to_batches(max_chunksize=...)`` share the table's buffers, and counting those
    whole (``get_total_buffer_size``) weighs each slice as the entire table, so a window or
    a bound in bytes holds one batch at a time. Arrow's own count of referenced ranges
    (``nbytes``: per column, not per row); a dictionary counts whole, as Arrow counts it.
    """
    try:
        return int(batch.nbytes)
    except (pa.ArrowException, NotImplementedError):  # a type Arrow cannot measure so
        return int(batch.get_total_buffer_size())


def arrow_batches(data: Any) -> Iterator[pa.RecordBatch]:
    """The record batches of ``data``: a batch, a table, or any Arrow PyCapsule object."""
    if isinstance(data, pa.RecordBatch):
        yield data
    elif isinstance(data, pa.Table):
        yield from data.to_batches()
    elif hasattr(data, "__arrow_c_array__"):
        yield pa.record_batch(data)
    elif hasattr(data, "__arrow_c_stream__"):
        yield from pa.RecordBatchReader.from_stream(data)
    else:
        raise InvalidBatchError(
            "expected Arrow data (a pyarrow RecordBatch or Table, or an object with "
            f"__arrow_c_array__ / __arrow_c_stream__), got {type(data).__name__}"
        )


@dataclass(frozen=True)
class SinkStats:
    """A snapshot of a sink's counters.

    ``rows``/``batches``/``bytes`` count what was accepted (``bytes`` counts each batch's
    own slice of its buffers); ``queued_*`` is what waits for the reader now;
    ``waiting_writers`` is how many writes are blocked for room right now, served in arrival
    order; ``late_rows`` counts rows an ordered table with ``late="drop"`` dropped for arriving
    behind the newest value (or the watermark); ``held_rows``/``held_bytes`` is what a
    ``max_delay`` table holds in its reorder buffer until the watermark passes it;
    ``blocked_seconds`` is the total time producers spent waiting; ``realigned_batches``/
    ``realigned_bytes`` count the batches (and their buffers' bytes) the import had to copy
    because a buffer did not start at an address aligned for its type: 0 for batches built in
    memory, and what it costs when data read from the wire or an IPC file lands anywhere (a
    ``pushtable serve`` table fed by pushtable's clients keeps it at 0 up to 2 MiB a message).
    """

    rows: int
    batches: int
    bytes: int
    queued_batches: int
    queued_bytes: int
    waiting_writers: int
    late_rows: int
    held_rows: int
    held_bytes: int
    blocked_seconds: float
    closed: bool
    failed: bool
    reader_gone: bool
    realigned_batches: int = 0
    realigned_bytes: int = 0

    @classmethod
    def known(cls, counters: dict[str, Any]) -> Self:
        """The snapshot of ``counters``, keeping only the fields this class has.

        A server newer than its client may report counters the client does not know.
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in counters.items() if k in names})


class ProducerScope:
    """``with`` / ``async with`` for a producer: end of stream on success, ``fail(exc)`` on error.

    Shared by local sinks, topics and remote sinks.
    """

    def close(self) -> None:
        """End of stream (each producer implements it)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Asyncio counterpart of :meth:`close` (each producer implements it)."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """Make the reading query raise ``exc`` (each producer implements it)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self._fail_keeping(exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.aclose()
        else:
            self._fail_keeping(exc)

    def _fail_keeping(self, exc: BaseException) -> None:
        """``fail(exc)`` on the way out of a ``with`` block on an error; ``exc`` always propagates.

        If that fails too (the server refused it, the connection is gone), the producer's own
        error still propagates: the failure to fail is logged and noted on it, never raised in
        its place.
        """
        try:
            self.fail(exc)
        except Exception as refused:  # noqa: BLE001 -- any, or it would replace ``exc``
            log.warning("fail() of %r on a producer's error did not succeed: %s", self, refused)
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(
                    f"pushtable: fail() of this producer's table did not succeed: {refused}"
                )


@dataclass(frozen=True)
class TopicStats(SinkStats):
    """A topic's counters: :class:`SinkStats` plus its subscribers.

    ``queued_batches``/``queued_bytes`` count what the topic holds (batches some subscriber
    has still to read, plus the retention window); ``subscribers`` are the live ones;
    ``detached`` counts subscribers cut loose for falling behind. A durable topic adds its
    offsets (``next_offset``; every offset below ``committed_offset`` is stored), what waits
    for a commit (``pending_batches``/``pending_bytes``), the committed batches kept in memory
    within ``retain``/``retain_bytes`` (``retained_batches``/``retained_bytes``), ``commits``,
    ``commit_failures``, ``consumers`` (each consumer's position, e.g. a Spark query's: see
    ``consumed``), ``earliest_offset`` (retention deleted what is below it) and
    ``expirations`` (its deletions).
    """

    subscribers: int = 0
    detached: int = 0
    durable: bool = False
    next_offset: int = 0
    committed_offset: int = 0
    pending_batches: int = 0
    pending_bytes: int = 0
    retained_batches: int = 0
    retained_bytes: int = 0
    commits: int = 0
    commit_failures: int = 0
    consumers: dict[str, int] = field(default_factory=dict)
    earliest_offset: int = 0
    expirations: int = 0


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
