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

from typing import TYPE_CHECKING

# Eager and light: importing pushtable.spark points Spark's Python workers at this
# interpreter (PYSPARK_PYTHON) unless the user set them, before any session exists.
import pushtable.spark.session  # noqa: F401
from pushtable.lazy import lazy_names

if TYPE_CHECKING:
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

#: Names loaded on first use: a Spark Python worker that runs the data source (its schema, a
#: stream reader, a read task) imports ``pushtable.spark.datasource`` without the bridges
#: and Lance (0.43 -> 0.2 s of start-up per worker).
_LAZY = {
    "UnsupportedSparkTypeError": "pushtable.spark.arrow",
    "arrow_schema": "pushtable.spark.arrow",
    "EpochReport": "pushtable.spark.bridge",
    "ForeachBatchBridge": "pushtable.spark.bridge",
    "IncompatibleSinkError": "pushtable.spark.bridge",
    "SlowReaderError": "pushtable.spark.bridge",
    "StreamingQueryFailedError": "pushtable.spark.bridge",
    "PushTableDataSource": "pushtable.spark.datasource",
    "register": "pushtable.spark.datasource",
    "RemoteBridge": "pushtable.spark.remote",
    "query_id_from_checkpoint": "pushtable.spark.remote",
    "WorkerPythonError": "pushtable.spark.session",
    "local_spark": "pushtable.spark.session",
    "spark_log_path": "pushtable.spark.session",
}

__getattr__, __dir__ = lazy_names("pushtable.spark", _LAZY, globals())

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
