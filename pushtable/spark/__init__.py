"""Spark: ``format("pushtable")`` (sink and source) and ``foreachBatch`` bridges.

The bridges go from a Structured Streaming query to live tables and Lance.

- :func:`register` (:mod:`pushtable.spark.datasource`): ``writeStream.format("pushtable")``
  into a server's live table (and Lance) exactly once, ``readStream.format("pushtable")``
  from a server's durable topic by offsets.

- :class:`ForeachBatchBridge` (:mod:`pushtable.spark.bridge`): sinks and topics in this
  process; Lance exactly once.
- :func:`local_spark` (:mod:`pushtable.spark.session`): a quiet local session whose JVM
  output goes to a log file.
- :func:`arrow_schema` (:mod:`pushtable.spark.arrow`): the Arrow schema of a DataFrame's
  micro-batches, as every path above gives them to live tables and Lance (to register a
  live table for a query).
- :class:`RemoteBridge` (:mod:`pushtable.spark.remote`): a table on a ``pushtable serve``
  server, fed from the executors or the driver; picklable, so it runs under Spark Connect.
"""

from __future__ import annotations

from pushtable.spark.arrow import UnsupportedSparkTypeError, arrow_schema
from pushtable.spark.bridge import (
    EpochReport,
    ForeachBatchBridge,
    IncompatibleSinkError,
    SlowReaderError,
    StreamingQueryFailedError,
)
from pushtable.spark.datasource import PushTableDataSource, register
from pushtable.spark.remote import RemoteBridge, query_id_from_checkpoint
from pushtable.spark.session import WorkerPythonError, local_spark, spark_log_path

__all__ = [
    "EpochReport",
    "ForeachBatchBridge",
    "IncompatibleSinkError",
    "PushTableDataSource",
    "RemoteBridge",
    "SlowReaderError",
    "StreamingQueryFailedError",
    "UnsupportedSparkTypeError",
    "WorkerPythonError",
    "arrow_schema",
    "local_spark",
    "query_id_from_checkpoint",
    "register",
    "spark_log_path",
]
