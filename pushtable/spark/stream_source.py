"""The ``format("pushtable")`` streaming source: a durable topic read by offsets.

A durable topic gives every batch an offset and keeps what it acknowledged in Lance
(:mod:`pushtable.durable`), so a range of offsets reads the same rows every time: that is
what Spark's exactly-once recovery needs from a source. Spark keeps ``{"offset": n}`` in its
checkpoint; a restarted query asks for the same ``[start, end)`` again and gets the same rows.

What runs where:

- **driver** (``initialOffset``, ``latestOffset``, ``partitions``, ``commit``): asks the
  server for the topic's committed offsets, caps a micro-batch at ``maxBatchesPerTrigger``,
  splits its range into contiguous pieces, and tells the server what the query has consumed.
- **executors** (``read``, one task per piece): read offsets ``[start, end)`` from the server
  (its memory tail or the Lance dataset, whichever holds them), in offset order; or, with
  the ``dataset`` option, from the topic's Lance dataset directly.

Options: ``uri``, ``topic`` (required); ``token``, ``tls_root_certs``; ``startingOffsets``
(``earliest`` (default), ``latest`` or an offset: where a new query starts; a restarted one
starts from its checkpoint); ``maxBatchesPerTrigger`` (offsets per micro-batch); ``partitions``
(read tasks per micro-batch, default 2); ``consumer`` (the name the server reports the
query's position under, default ``spark``); ``dataset`` (the topic's Lance dataset as the
executors can open it, e.g. ``<data-dir>/<topic>.lance`` or ``s3://bucket/prefix/<topic>.lance``:
they read their ranges there, the driver still asks the server for offsets) with
``storage_options`` (a JSON object of Lance's storage options, as the sink takes them; without
it, Lance's environment variables on each executor).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from pushtable.flight.client.client import Client, connect
from pushtable.spark.options import Options

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["OffsetRange", "PushTableStreamReader", "topic_schema"]


def topic_schema(options: Options) -> pa.Schema:
    """The durable topic's schema, as the server has it.

    A topic that is not durable, or absent, is refused with the reason, and so is a
    ``dataset`` option that does not hold it.
    """
    topic = options.required("topic", "ticks")
    with connect(**options.connection()) as client:
        _check_durable(client, topic)
        schema = client.schema(topic)
    dataset = options.text("dataset")
    if dataset:
        _check_dataset(dataset, schema, topic, options.mapping("storage_options"))
    return schema


def _check_durable(client: Client, topic: str) -> None:
    found = {t["name"]: t for t in client.tables()}
    if topic not in found:
        raise ValueError(
            f'format("pushtable") source: the server has no topic {topic!r} this token can read '
            f"(it has: {', '.join(sorted(found)) or 'none'})"
        )
    if not found[topic]["durable"]:
        what = "topic" if found[topic]["topic"] else "streaming table"
        raise ValueError(
            f'format("pushtable") source reads durable topics only: {topic!r} is a {what} '
            "held in memory, whose batches have no stored offsets, so Spark could not read "
            "the same range again after a restart. Create it with "
            "client.create_topic(name, schema, durable=True) on a server with --data-dir"
        )


def _check_dataset(
    uri: str, schema: pa.Schema, topic: str, storage_options: dict[str, str] | None
) -> None:
    """Refuse a ``dataset`` option that is not this topic's dataset (as far as the driver sees)."""
    from pushtable.durable.store import describe  # Lance: only when the option is given

    try:
        have = describe(uri, storage_options)[0]
    except Exception as exc:  # any failure to open it: say which and why
        raise ValueError(
            f'format("pushtable") source: option "dataset" {uri!r} cannot be opened as a '
            f"Lance dataset ({type(exc).__name__}: {exc}); give the path of topic {topic!r}'s "
            "dataset as the executors see it (<data-dir>/<topic>.lance), or leave the option "
            "out to read through the server"
        ) from exc
    if not have.equals(schema):
        raise ValueError(
            f'format("pushtable") source: option "dataset" {uri!r} holds a topic of schema '
            f"{have}, not topic {topic!r}'s: {schema}"
        )


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One read task's offsets ``[start, end)``."""

    start: int
    end: int


class PushTableStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads a durable topic by offsets; every offset of the range exactly once."""

    def __init__(self, options: Options, schema: StructType | None) -> None:
        self.settings = options.connection()
        self.topic = options.required("topic", "ticks")
        self.starting = (options.text("startingOffsets") or "earliest").strip().lower()
        if self.starting not in ("earliest", "latest") and not self.starting.isdigit():
            raise ValueError(
                'format("pushtable") source: option "startingOffsets" must be "earliest", '
                f'"latest" or an offset, got {self.starting!r}'
            )
        self.max_batches: int | None = options.number("maxBatchesPerTrigger")
        if self.max_batches == 0:
            raise ValueError('option "maxBatchesPerTrigger" must be >= 1')
        self.partition_count: int = options.number("partitions") or 2
        self.consumer = options.text("consumer") or "spark"
        #: the topic's Lance dataset, when the executors can open it: read there directly
        self.dataset = options.text("dataset") or None
        #: what Lance takes to reach ``dataset`` on an object store (None: its environment)
        self.storage_options = options.mapping("storage_options")
        self._client: Client | None = None
        self._until: int | None = None  # Trigger.AvailableNow: the end fixed at the start
        self._reported: int | None = None  # the position the server was last told
        _check_durable(self.client(), self.topic)
        if self.dataset is not None:
            schema = self.client().schema(self.topic)
            _check_dataset(self.dataset, schema, self.topic, self.storage_options)

    def client(self) -> Client:
        """This process's connection to the server, opened on first use."""
        if self._client is None:
            self._client = connect(**self.settings)
        return self._client

    def _offsets(self) -> dict[str, int]:
        return self.client().offsets(self.topic)

    # -- driver -----------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        """Where a new query starts: ``startingOffsets`` (earliest, latest or an offset)."""
        offsets = self._offsets()
        if self.starting == "earliest":
            return {"offset": offsets["earliest"]}
        if self.starting == "latest":
            return {"offset": offsets["committed"]}
        start = int(self.starting)
        if not offsets["earliest"] <= start <= offsets["committed"]:
            raise ValueError(
                f'option "startingOffsets" {start} is outside topic {self.topic!r}: its stored '
                f"offsets are {offsets['earliest']}..{offsets['committed']}"
            )
        return {"offset": start}

    def getDefaultReadLimit(self) -> ReadLimit:
        """``maxBatchesPerTrigger`` as Spark's limit per micro-batch, else all available."""
        # Spark has no batch-count limit: like Kafka's maxOffsetsPerTrigger, offsets travel as
        # its max-rows limit (here an offset is one batch).
        return ReadAllAvailable() if self.max_batches is None else ReadMaxRows(self.max_batches)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of a ``Trigger.AvailableNow`` run: the offset committed now."""
        self._until = self._offsets()["committed"]

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The next micro-batch's end: the committed offset (or the fixed end), within ``limit``.

        Spark asks once the micro-batch before has finished, from that batch's end: the
        query has consumed everything below ``start``, which the server is told now. (Spark's
        ``commit`` of a batch comes only when the next one starts: after the last batch of a
        ``Trigger.AvailableNow`` run it never came, and the position stayed a batch behind.)
        """
        first = int(start["offset"])
        self._consumed(first)
        end = self._offsets()["committed"] if self._until is None else self._until
        if isinstance(limit, ReadMaxRows):
            end = min(end, first + int(limit.max_rows))
        return {"offset": max(first, end)}

    def reportLatestOffset(self) -> dict[str, Any]:
        """The topic's committed offset, for Spark's progress report."""
        return {"offset": self._offsets()["committed"]}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[OffsetRange]:
        """Split ``[start, end)`` into at most ``partitions`` ranges, their sizes within one."""
        first, last = int(start["offset"]), int(end["offset"])
        count = min(self.partition_count, last - first)
        if count <= 0:
            return []
        step, extra = divmod(last - first, count)
        pieces, at = [], first
        for i in range(count):
            size = step + (1 if i < extra else 0)
            pieces.append(OffsetRange(at, at + size))
            at += size
        return pieces

    def commit(self, end: dict[str, Any]) -> None:
        """Tell the server the consumer has read every offset below ``end``."""
        self._consumed(int(end["offset"]))

    def _consumed(self, offset: int) -> None:
        if self._reported is None or offset > self._reported:
            self.client().consumed(self.topic, self.consumer, offset)
            self._reported = offset

    def stop(self) -> None:
        """Close this process's connection to the server, if open."""
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- executors --------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The committed batches of one offset range, on an executor.

        From the topic's dataset when the ``dataset`` option names it (no server in the way),
        else through the server on a connection of its own.
        """
        assert isinstance(partition, OffsetRange)
        if self.dataset is not None:
            from pushtable.durable.store import read_offsets  # Lance: only where it is read

            yield from read_offsets(
                self.dataset, partition.start, partition.end, self.storage_options
            )
            return
        with connect(**self.settings) as client:
            yield from client.read(self.topic, partition.start, partition.end)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}  # a connection stays in its process
