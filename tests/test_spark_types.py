"""Every Spark type an event stream carries, through every Spark path, on a real local Spark:
``ForeachBatchBridge`` (driver and executor writes), ``RemoteBridge`` (executor and driver
push) and ``writeStream.format("pushtable")``. The live table and the Lance dataset hold
Spark's own values (``DataFrame.toArrow`` of the same rows): zoned timestamps in a session
zone that is not UTC, ``timestamp_ntz``, dates, decimals (whose buffers Spark hands over
unaligned for Rust), binary, arrays, maps, structs with a nested timestamp, durations, nulls.
A type with no Arrow form is refused on the driver, before any task, naming the column.
Hypothesis draws random choices of these columns through the bridge too."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from pushtable import SessionContext
from pushtable.flight import Client, Server
from pushtable.spark import (
    ForeachBatchBridge,
    RemoteBridge,
    UnsupportedSparkTypeError,
    arrow_schema,
    register,
)
from tests.conftest import WAIT, Background
from tests.spark_support import DDL, QUERY_WAIT, run, stream, write_epochs

#: one column per type; null in some rows of each nullable one
TYPES = (
    "id",
    "IF(id % 4 = 3, NULL, CAST(id * 1.25 AS DECIMAL(18, 2))) AS price",
    "CAST(id AS DECIMAL(38, 10)) / 7 AS share",
    # 01:30 New York time on the day its clocks go forward, then one hour per row
    "TIMESTAMP '2026-03-08 01:30:00' + make_interval(0, 0, 0, 0, CAST(id AS INT), 0, 0) AS ts",
    "TIMESTAMP_NTZ '2026-03-08 01:30:00' + make_interval(0, 0, 0, 0, CAST(id AS INT), 0, 0)"
    " AS local_ts",
    "date_add(DATE '2026-02-27', CAST(id AS INT)) AS day",
    "IF(id % 3 = 0, NULL, CAST(concat('b', id) AS BINARY)) AS raw",
    "array(CAST(id AS DECIMAL(10, 1)), NULL) AS amounts",
    "map('n', id, 'twice', id * 2) AS counts",
    "named_struct('at', TIMESTAMP '2026-01-01 00:00:00' + make_interval(0, 0, 0, 0, 0, 0, id),"
    " 'n', id, 'tag', IF(id % 2 = 0, NULL, 'odd')) AS detail",
    "IF(id % 3 = 1, NULL, level) AS level",
    "CAST(id AS FLOAT) / 2 AS ratio",
    "CAST(id % 100 AS TINYINT) AS small",
    "id % 2 = 0 AS even",
    "make_dt_interval(0, 0, 0, id) AS waited",
)
ZONE = "America/New_York"
ROWS = 6


@contextlib.contextmanager
def in_zone(spark: SparkSession) -> Iterator[SparkSession]:
    """``spark`` in a zone that is not UTC (Spark labels executors' batches with it)."""
    before = str(spark.conf.get("spark.sql.session.timeZone"))
    spark.conf.set("spark.sql.session.timeZone", ZONE)
    try:
        yield spark
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)


@pytest.fixture
def zoned(spark: SparkSession) -> Iterator[SparkSession]:
    with in_zone(spark) as session:
        yield session


def typed(df: DataFrame) -> DataFrame:
    return df.selectExpr(*TYPES)


def spark_rows(spark: SparkSession, src: Path) -> list[dict[str, Any]]:
    """What Spark itself hands out for the same rows (``toArrow``) in :data:`ZONE`, by id."""
    with in_zone(spark):
        return rows_of(typed(spark.read.schema(DDL).json(str(src))).toArrow())


def rows_of(table: pa.Table) -> list[dict[str, Any]]:
    return sorted(table.to_pylist(), key=lambda r: r["id"])


def lance_rows(uri: Path) -> list[dict[str, Any]]:
    return rows_of(lance.dataset(str(uri)).to_table())


def live_reader(ctx: SessionContext, table: str) -> Background:
    return Background(lambda: rows_of(ctx.sql(f"SELECT * FROM {table}").to_arrow_table()))


def remote_reader(client: Client, table: str) -> Background:
    return Background(lambda: rows_of(client.sql(f"SELECT * FROM {table}").read_all()))


def check_schema(expected: pa.Schema, got: pa.Schema) -> None:
    """Same columns, with Spark's types (an instant labelled UTC, as ``toArrow`` does)."""
    assert got.names == expected.names
    for want, have in zip(expected, got, strict=True):
        assert have.type == want.type or str(have.type).replace("view", "") == str(
            want.type
        ).replace("view", ""), (want, have)


@pytest.mark.spark
def test_every_type_through_the_foreach_batch_bridge(zoned: SparkSession, tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_epochs(src, 2, rows=ROWS)
    want = spark_rows(zoned, src)
    df = typed(stream(zoned, src))
    schema = arrow_schema(df.schema)
    assert schema.field("ts").type == pa.timestamp("us", tz="UTC")
    assert schema.field("local_ts").type == pa.timestamp("us")
    for executor_writes in (False, True):
        ctx = SessionContext()
        sink = ctx.register_streaming_table("events", schema, capacity=4)
        reader = live_reader(ctx, "events")
        uri = tmp_path / f"out-{executor_writes}.lance"
        bridge = ForeachBatchBridge(sinks=[sink], lance_uri=uri, executor_writes=executor_writes)
        run(df, bridge, tmp_path / f"chk-{executor_writes}")
        assert reader.join(timeout=WAIT) == want, executor_writes
        assert lance_rows(uri) == want, executor_writes
        check_schema(schema, lance.dataset(str(uri)).schema)


@pytest.mark.spark
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    columns=st.lists(st.sampled_from(TYPES[1:]), min_size=1, max_size=5, unique=True),
    rows=st.sampled_from([1, 6, 40]),
    executor_writes=st.booleans(),
)
def test_random_columns_through_the_foreach_batch_bridge(
    zoned: SparkSession, columns: list[str], rows: int, executor_writes: bool
) -> None:
    """Any choice of the columns above, in any order, through the bridge: the live table and
    Lance hold what Spark hands out for the same rows."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "src"
        write_epochs(src, 2, rows=rows)
        chosen = ["id", *columns]
        want = rows_of(zoned.read.schema(DDL).json(str(src)).selectExpr(*chosen).toArrow())
        df = stream(zoned, src).selectExpr(*chosen)
        schema = arrow_schema(df.schema)
        ctx = SessionContext()
        sink = ctx.register_streaming_table("events", schema, capacity=4)
        reader = live_reader(ctx, "events")
        uri = tmp / "out.lance"
        bridge = ForeachBatchBridge(sinks=[sink], lance_uri=uri, executor_writes=executor_writes)
        run(df, bridge, tmp / "chk")
        assert reader.join(timeout=WAIT) == want
        assert lance_rows(uri) == want
        check_schema(schema, lance.dataset(str(uri)).schema)


@pytest.mark.spark
def test_every_type_through_the_remote_bridge_and_the_format_sink(
    zoned: SparkSession, tmp_path: Path, server: Server, client: Client
) -> None:
    src = tmp_path / "src"
    write_epochs(src, 2, rows=ROWS)
    want = spark_rows(zoned, src)
    df = typed(stream(zoned, src))
    register(zoned)
    for how in ("executors", "driver", "format"):
        table, uri, chk = f"events_{how}", tmp_path / f"{how}.lance", tmp_path / f"chk-{how}"
        client.create_table(table, arrow_schema(df.schema))
        reader = remote_reader(client, table)
        if how == "format":
            writer = (
                df.writeStream.format("pushtable")
                .option("uri", server.location)
                .option("table", table)
                .option("lance_uri", str(uri))
            )
        else:
            bridge = RemoteBridge(server.location, table, lance_uri=uri, push=how)  # type: ignore[arg-type]
            writer = df.writeStream.foreachBatch(bridge)
        query = writer.option("checkpointLocation", str(chk)).trigger(availableNow=True).start()
        assert query.awaitTermination(QUERY_WAIT), how
        assert query.exception() is None, query.exception()
        client.sink(table).close()
        assert reader.join(timeout=WAIT) == want, how
        assert lance_rows(uri) == want, how


@pytest.mark.spark
def test_a_type_with_no_arrow_form_is_refused_before_any_task(
    spark: SparkSession, tmp_path: Path, server: Server
) -> None:
    src = tmp_path / "src"
    write_epochs(src, 1, rows=ROWS)
    df = stream(spark, src).selectExpr(
        "id", "named_struct('age', make_ym_interval(1, CAST(id AS INT))) AS person"
    )
    with pytest.raises(UnsupportedSparkTypeError, match=r"'person.age'.*interval year to month"):
        arrow_schema(df.schema)
    variant = stream(spark, src).selectExpr("id", "parse_json('{\"a\": 1}') AS payload")
    with pytest.raises(UnsupportedSparkTypeError, match=r"'payload'.*variant.*to_json\(payload\)"):
        arrow_schema(variant.schema)
    # Through a bridge: the query fails on the driver with that error; nothing was written.
    uri = tmp_path / "out.lance"
    bridge = RemoteBridge(server.location, "events", lance_uri=uri)
    query = (
        df.writeStream.foreachBatch(bridge)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(
        StreamingQueryException, match=r"UnsupportedSparkTypeError: column 'person.age'"
    ):
        query.awaitTermination(QUERY_WAIT)
    assert not uri.exists()
