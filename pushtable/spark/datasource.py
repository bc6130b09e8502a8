"""``format("pushtable")``: Spark's own idiom for writing to and reading from a server.

:func:`register` registers :class:`PushTableDataSource` under the name ``"pushtable"``, in a
classic session or under Spark Connect. Then::

    df.writeStream.format("pushtable").option("uri", "grpc://host:8815")
        .option("table", "events").option("checkpointLocation", "/ck").start()

feeds a live table on a ``pushtable serve`` server, exactly once per micro-batch
(:mod:`pushtable.spark.stream_sink`), and::

    spark.readStream.format("pushtable").option("uri", "grpc://host:8815")
        .option("topic", "ticks").load()

reads a durable topic by offsets (:mod:`pushtable.spark.stream_source`). Options are
strings, as Spark passes them; a missing or malformed one is refused by name before the
query runs anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSource

from pushtable.spark.options import Options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSourceStreamReader, DataSourceStreamWriter
    from pyspark.sql.types import StructType

__all__ = ["PushTableDataSource", "register"]

#: what ``format(...)`` takes
NAME = "pushtable"


def register(spark: SparkSession) -> None:
    """Register ``format("pushtable")`` with ``spark`` (a classic session or Spark Connect).

    It first makes sure Spark's Python workers can import pushtable: a classic session
    created before ``import pushtable.spark`` gets this interpreter for its workers; a worker
    interpreter the user chose that lacks pushtable, or a Spark Connect server's that does,
    raises :class:`~pushtable.spark.session.WorkerPythonError` saying what to set.

    Example:
        >>> from pushtable.spark import local_spark, register
        >>> spark = local_spark("docs")                              # doctest: +SKIP
        >>> register(spark)                                          # doctest: +SKIP
        >>> (spark.readStream.format("pushtable")                    # doctest: +SKIP
        ...     .option("uri", "grpc://127.0.0.1:8815").option("topic", "ticks").load())
    """
    from pushtable.spark.session import check_connect_workers, ensure_worker_python

    if type(spark).__module__.startswith("pyspark.sql.connect"):
        check_connect_workers(spark)  # its workers run on the server: ask them
    else:
        ensure_worker_python(spark)  # before the source is wrapped with the workers' Python
    spark.dataSource.register(PushTableDataSource)


class PushTableDataSource(DataSource):
    """The ``"pushtable"`` data source: a streaming sink and a streaming source.

    The sink writes into a server's live table, the source reads a server's durable topic
    (see the module's docs for options).
    """

    @classmethod
    def name(cls) -> str:
        """The format's name, ``"pushtable"``."""
        return NAME

    def schema(self) -> StructType:
        """A source's schema: the durable topic's, as the server has it."""
        from pyspark.sql.pandas.types import from_arrow_schema

        from pushtable.spark.stream_source import topic_schema

        return from_arrow_schema(topic_schema(Options(self.options, "source")))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """The streaming sink, from the sink's options."""
        from pushtable.spark.stream_sink import PushTableStreamWriter

        return PushTableStreamWriter(Options(self.options, "sink"), schema, overwrite)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """The streaming source, from the source's options."""
        from pushtable.spark.stream_source import PushTableStreamReader

        return PushTableStreamReader(Options(self.options, "source"), schema)
