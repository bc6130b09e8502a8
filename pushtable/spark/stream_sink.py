"""The ``format("pushtable")`` streaming sink, driven by Spark's own writer protocol.

It is :class:`~pushtable.spark.RemoteBridge`'s exactly-once path.

What runs where:

- **driver** (``streamWriter``, once per query run): the options become a
  :class:`RemoteBridge`; the server's table is created from the query's schema if absent, or
  checked against it (a clear error before any task runs).
- **executors** (``write``, one task per partition): the task learns its micro-batch
  (``batchId``) and query id from Spark's task properties, stages its partition on the
  server under ``(query, batchId, partition, attempt)`` and writes its Lance fragments, in one
  pass. A batch the server has published before is not sent again.
- **driver** (``commit(messages, batchId)``): commits the fragments to Lance once per
  ``batchId`` and publishes exactly the attempts Spark kept to the live table, once: a batch
  Spark replays after a crash changes nothing. ``abort`` drops the batch's staged shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from pushtable.flight.client.client import connect
from pushtable.lance_epochs import dataset_schema
from pushtable.spark.arrow import arrow_schema
from pushtable.spark.options import Options
from pushtable.spark.remote import (
    EpochPlan,
    PartitionTask,
    RemoteBridge,
    Share,
    query_id_from_checkpoint,
)

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["PushTableStreamWriter", "StagedShare"]

#: Spark's task properties naming the streaming query and its micro-batch
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


@dataclass(frozen=True)
class StagedShare(WriterCommitMessage):
    """One task attempt's commit message: what it staged for which query and batch."""

    query_id: str
    batch_id: int
    share: Share


class PushTableStreamWriter(DataSourceStreamArrowWriter):
    """Writes each micro-batch to a server's live table (and Lance) exactly once."""

    def __init__(self, options: Options, schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise ValueError(
                'format("pushtable") sink takes outputMode("append"): in "complete" mode '
                "every micro-batch restates the whole result and the live table would show it "
                "again and again (see docs/spark.md)"
            )
        timeout = options.number("publish_timeout", float)
        lance_uri = options.text("lance_uri")
        storage = options.mapping("storage_options")
        fault = options.text("pushtable.test.fail_first_attempt")  # a test hook: "partition:step"
        self.bridge = RemoteBridge(
            **options.connection(),
            table=options.required("table", "events"),
            lance_uri=lance_uri,
            mode=options.text("mode", "append"),  # type: ignore[arg-type]
            query_id=options.text("query_id"),
            publish_timeout=timeout,
            epoch_column=options.text("epoch_column"),
            storage_options=storage,
        )
        if fault is not None:
            partition, step = fault.split(":")
            self.bridge.fail_first_attempt = (int(partition), step)
        self.bridge.pause_before_publish = options.text("pushtable.test.pause_before_publish")
        if self.bridge.query_id is None and (checkpoint := options.text("checkpointLocation")):
            with contextlib.suppress(ValueError):  # not on a local file system: tasks tell
                self.bridge.query_id = query_id_from_checkpoint(checkpoint)
        arrow = arrow_schema(schema)
        with connect(**self.bridge.settings()) as client:
            self.live_schema = self.bridge.live_schema(client, arrow)
        self.lance_schema = None if lance_uri is None else dataset_schema(lance_uri, arrow, storage)

    # -- executors ------------------------------------------------------------------------

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedShare:
        """One task: stage its partition on the server and write its Lance fragments."""
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None, "write runs in a Spark task"
        batch_id = int(context.getLocalProperty(BATCH_ID_PROPERTY) or -1)
        query_id = self.bridge.query_id or context.getLocalProperty(QUERY_ID_PROPERTY)
        if batch_id < 0 or not query_id:
            raise RuntimeError(
                "this task carries no streaming batch id or query id: format('pushtable') "
                "is a streaming sink (writeStream), not a batch one"
            )
        with connect(**self.bridge.settings()) as client:
            done = batch_id <= client.published(self.bridge.table, query_id)
            task = PartitionTask(
                settings=self.bridge.settings(),
                table=self.bridge.table,
                query_id=query_id,
                epoch=batch_id,
                live_schema=None if done else self.live_schema,
                lance_schema=None if done else self.lance_schema,
                lance_uri=self.bridge.lance_uri,
                storage_options=self.bridge.storage_options,
                fail_first_attempt=self.bridge.fail_first_attempt,
                epoch_column=self.bridge.epoch_column,
            )
            return StagedShare(query_id, batch_id, task.run(iterator, client))

    # -- driver ---------------------------------------------------------------------------

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Commit the batch's fragments to Lance and publish the attempts Spark kept, once."""
        shares = [m for m in messages if isinstance(m, StagedShare)]
        query_id = self._query_id(shares, batchId)
        if query_id is None:
            return  # no task ran and no id is known: nothing was staged
        writer = self.bridge.epoch_writer(query_id)
        client = self.bridge.client()
        plan = EpochPlan(
            query_id,
            batchId,
            writer,
            writer is None or writer.replayed(batchId) is not None,
            batchId <= client.published(self.bridge.table, query_id),
            self.live_schema,
        )
        self.bridge.commit_shares(plan, [s.share for s in shares], self.lance_schema)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Drop the batch's staged shares on the server."""
        shares = [m for m in messages if isinstance(m, StagedShare)]
        query_id = self._query_id(shares, batchId)
        if query_id is not None:
            self.bridge.client().discard(self.bridge.table, query_id, batchId)

    def _query_id(self, shares: list[StagedShare], batch_id: int) -> str | None:
        ids = {s.query_id for s in shares} | ({self.bridge.query_id} - {None})
        if len(ids) > 1:
            raise RuntimeError(f"batch {batch_id}: tasks report different query ids {ids}")
        if any(s.batch_id != batch_id for s in shares):
            raise RuntimeError(f"batch {batch_id}: a task wrote another batch's data")
        return next(iter(ids), None)
