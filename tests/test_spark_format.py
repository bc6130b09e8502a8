"""``format("pushtable")`` on a real local Spark: the sink lands each micro-batch once in the
live table and Lance across a replayed batch; the source reads a durable topic exactly once
into a file sink across restarts (of the query and of the server) and a replayed range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.errors import AnalysisException, StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pushtable.flight import Client, Server, connect
from pushtable.spark import query_id_from_checkpoint, register
from tests.conftest import WAIT
from tests.spark_support import ARROW, QUERY_WAIT, ids, stamped, stream, write_epochs
from tests.test_spark_remote import ROWS, expected, live_events

TICKS = pa.schema([("k", pa.int64()), ("name", pa.string())])


@pytest.fixture
def pushtable_spark(spark: SparkSession) -> SparkSession:
    register(spark)
    return spark


def finish(query: StreamingQuery) -> None:
    assert query.awaitTermination(QUERY_WAIT), "the streaming query did not finish in time"
    assert query.exception() is None, query.exception()


def drain(reader: Any, checkpoint: Path, each: Any) -> StreamingQuery:
    """Run the stream of ``reader`` once over what is available (``availableNow``), handing
    each micro-batch to ``each``; the finished query."""
    query: StreamingQuery = (
        reader.load()
        .writeStream.foreachBatch(each)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    finish(query)
    return query


def forget_last_commit(checkpoint: Path) -> None:
    """Remove the checkpoint's newest commit file (and its checksum), as a crash before Spark
    recorded the batch done would: a restart replays that batch with the same offsets."""
    commits = sorted((checkpoint / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    commits[-1].unlink()
    (checkpoint / "commits" / f".{commits[-1].name}.crc").unlink(missing_ok=True)


def sink_query(spark: SparkSession, src: Path, location: str, chk: Path, uri: Path) -> list[int]:
    """Run the sink over what ``src`` holds; the batch ids it ran."""
    query = (
        stream(spark, src)
        .writeStream.format("pushtable")
        .option("uri", location)
        .option("table", "events")
        .option("lance_uri", str(uri))
        .option("checkpointLocation", str(chk))
        .trigger(availableNow=True)
        .start()
    )
    finish(query)
    return batch_ids(query)


def batch_ids(query: StreamingQuery) -> list[int]:
    return sorted({int(p["batchId"]) for p in query.recentProgress})


@pytest.mark.spark
def test_sink_lands_each_batch_once_across_a_replayed_batch(
    pushtable_spark: SparkSession, tmp_path: Path, server: Server, client: Client
) -> None:
    reader = live_events(client)
    src, chk, uri = tmp_path / "src", tmp_path / "chk", tmp_path / "out.lance"
    write_epochs(src, 3, rows=ROWS)
    assert sink_query(pushtable_spark, src, server.location, chk, uri) == [0, 1, 2]
    query_id = query_id_from_checkpoint(chk)
    assert client.published("events", query_id) == 2
    forget_last_commit(chk)  # batch 2 is replayed
    write_epochs(src, 2, rows=ROWS, start=3)
    assert sink_query(pushtable_spark, src, server.location, chk, uri) == [2, 3, 4]
    client.sink("events").close()
    rows = expected(range(5))
    assert reader.join(timeout=WAIT) == rows
    assert ids(uri) == rows
    assert stamped(uri) == [(query_id, e) for e in range(5)]
    assert client.published("events", query_id) == 4


@pytest.mark.spark
def test_sink_errors_name_what_is_wrong(
    pushtable_spark: SparkSession, tmp_path: Path, server: Server, client: Client
) -> None:
    src = tmp_path / "src"
    write_epochs(src, 1, rows=ROWS)
    client.create_table("events", pa.schema([("id", pa.string())]))

    def start(**options: str) -> None:
        writer = stream(pushtable_spark, src).writeStream.format("pushtable")
        for key, value in {"checkpointLocation": str(tmp_path / "chk"), **options}.items():
            writer = writer.option(key, value)
        finish(writer.trigger(availableNow=True).start())

    with pytest.raises(StreamingQueryException, match='needs option "table"'):
        start(uri=server.location)
    with pytest.raises(StreamingQueryException, match='needs option "uri"'):
        start(table="events")
    with pytest.raises(StreamingQueryException, match="cannot take this query's epochs"):
        start(uri=server.location, table="events")  # id is a string there, a long here
    with pytest.raises(StreamingQueryException, match='"publish_timeout" must be a number'):
        start(uri=server.location, table="t2", publish_timeout="soon")
    with pytest.raises(StreamingQueryException, match='"storage_options" must be a JSON object'):
        start(uri=server.location, table="t2", storage_options="region=eu")
    # docs/spark.md: complete mode restates the whole result each micro-batch: refused.
    counts = stream(pushtable_spark, src).groupBy("level").count()
    complete = (
        counts.writeStream.format("pushtable")
        .outputMode("complete")
        .option("uri", server.location)
        .option("table", "t3")
        .option("checkpointLocation", str(tmp_path / "chk-complete"))
        .trigger(availableNow=True)
    )
    with pytest.raises(
        (StreamingQueryException, AnalysisException),
        match=r'takes outputMode\("append"\): in "complete" mode',
    ):
        finish(complete.start())


def durable_server(data_dir: Path) -> Server:
    return Server(data_dir=data_dir)


def write_ticks(client: Client, first: int, count: int) -> None:
    sink = client.sink("ticks")
    for k in range(first, first + count):
        sink.write(pa.record_batch({"k": [k * 10 + i for i in range(10)], "name": ["x"] * 10}))
    sink.flush()


def source_query(spark: SparkSession, location: str, out: Path, chk: Path) -> StreamingQuery:
    df = (
        spark.readStream.format("pushtable")
        .option("uri", location)
        .option("topic", "ticks")
        .option("maxBatchesPerTrigger", "3")
        .load()
    )
    return (
        df.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(chk))
        .trigger(availableNow=True)
        .start()
    )


@pytest.mark.spark
def test_source_reads_a_durable_topic_exactly_once_across_restarts(
    pushtable_spark: SparkSession, tmp_path: Path
) -> None:
    data, out, chk = tmp_path / "data", tmp_path / "out", tmp_path / "chk"
    server = durable_server(data)
    try:
        with connect(server.location) as client:
            client.create_topic("ticks", TICKS, durable=True)
            write_ticks(client, 0, 7)
            q = source_query(pushtable_spark, server.location, out, chk)
            finish(q)
            assert batch_ids(q) == [0, 1, 2]  # 7 offsets at 3 a batch
            write_ticks(client, 7, 3)
    finally:
        server.stop()
    forget_last_commit(chk)  # Spark replays its last range: the same rows again
    server = durable_server(data)  # a restarted server: history comes from Lance
    try:
        with connect(server.location) as client:
            write_ticks(client, 10, 2)
            q = source_query(pushtable_spark, server.location, out, chk)
            finish(q)
            # Batch 2 again (offsets 6..7; the file sink had it: it skips it), then 7..10, 10..12
            assert batch_ids(q) == [2, 3, 4]
            consumers = client.stats("ticks")["consumers"]
    finally:
        server.stop()
    got = sorted(r.k for r in pushtable_spark.read.parquet(str(out)).select("k").collect())
    assert got == list(range(120))
    assert 0 < consumers["spark"] <= 12


def read_batches(
    spark: SparkSession,
    location: str,
    chk: Path,
    per_batch: int | None,
    dataset: Path | None = None,
) -> list[list[tuple[int, int, str]]]:
    """Each micro-batch of the source as Spark read it: its rows as ``(input partition, k,
    name)``, sorted (``partitions`` = 3); with ``dataset``, read from it directly."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    reader = (
        spark.readStream.format("pushtable")
        .option("uri", location)
        .option("topic", "ticks")
        .option("partitions", "3")
    )
    if per_batch is not None:
        reader = reader.option("maxBatchesPerTrigger", str(per_batch))
    if dataset is not None:
        reader = reader.option("dataset", str(dataset))
    batches: list[list[tuple[int, int, str]]] = []

    def seen(df: DataFrame, batch_id: int) -> None:
        rows = df.select(F.spark_partition_id(), "k", "name").collect()
        batches.append(sorted((int(r[0]), int(r[1]), str(r[2])) for r in rows))

    drain(reader, chk, seen)
    return batches


def pieces(batch: list[tuple[int, int, str]]) -> list[tuple[int, int, int, int]]:
    """A micro-batch's input partitions: ``(partition, first k, last k, rows)``."""
    out = []
    for p in sorted({p for p, _, _ in batch}):
        ks = [k for q, k, _ in batch if q == p]
        out.append((p, min(ks), max(ks), len(ks)))
    return out


@pytest.mark.spark
def test_spark_reads_a_range_in_contiguous_partitions_the_same_from_memory_and_from_lance(
    pushtable_spark: SparkSession, tmp_path: Path
) -> None:
    """Through Spark: a micro-batch's offsets split into at most ``partitions`` contiguous
    pieces whose sizes differ by at most one (fewer when there are fewer offsets), and a
    range reads the same rows whether the server holds it in memory or only in Lance."""
    data = tmp_path / "data"
    server = durable_server(data)
    try:
        with connect(server.location) as client:
            client.create_topic("ticks", TICKS, durable=True)
            write_ticks(client, 0, 11)  # offsets 0..10, ten rows each: k = 10 * offset + i
            in_memory = read_batches(pushtable_spark, server.location, tmp_path / "c1", None)
    finally:
        server.stop()
    # 11 offsets in 3 pieces: [0, 4), [4, 8), [8, 11), each row once
    assert [pieces(b) for b in in_memory] == [[(0, 0, 39, 40), (1, 40, 79, 40), (2, 80, 109, 30)]]
    assert sorted(k for _, k, _ in in_memory[0]) == list(range(110))
    server = durable_server(data)  # restarted: the topic's history comes from Lance only
    try:
        from_lance = read_batches(pushtable_spark, server.location, tmp_path / "c2", None)
        two_a_batch = read_batches(pushtable_spark, server.location, tmp_path / "c3", 2)
    finally:
        server.stop()
    assert from_lance == in_memory  # the same rows, in the same partitions
    # 2 offsets a batch, 3 partitions asked: one piece per offset; the last batch has one
    assert [pieces(b) for b in two_a_batch] == [
        [(0, 20 * b, 20 * b + 9, 10), (1, 20 * b + 10, 20 * b + 19, 10)] for b in range(5)
    ] + [[(0, 100, 109, 10)]]


@pytest.mark.spark
def test_a_server_process_and_its_dataset_give_each_partition_the_same_rows(
    pushtable_spark: SparkSession, tmp_path: Path
) -> None:
    """``pushtable serve`` in a process of its own, as deployed: the executors read their
    offset ranges through it, or (``dataset``) from the topic's Lance dataset directly; the
    same rows land in the same partitions either way, and a ``dataset`` that is not the
    topic's is refused naming it."""
    from tests.test_durable_crash import Serve, free_port

    data = tmp_path / "data"
    served = Serve(data, free_port())
    try:
        with connect(served.location) as client:
            client.create_topic("ticks", TICKS, durable=True)
            client.create_topic("other", pa.schema([("x", pa.float64())]), durable=True)
            write_ticks(client, 0, 11)
        through = read_batches(pushtable_spark, served.location, tmp_path / "c1", 4)
        direct = read_batches(
            pushtable_spark, served.location, tmp_path / "c2", 4, data / "ticks.lance"
        )
        reader = (
            pushtable_spark.readStream.format("pushtable")
            .option("uri", served.location)
            .option("topic", "ticks")
        )
        with pytest.raises(AnalysisException, match="holds a topic of schema"):
            reader.option("dataset", str(data / "other.lance")).load()
        with pytest.raises(AnalysisException, match="cannot be opened as a Lance dataset"):
            reader.option("dataset", str(tmp_path / "nowhere.lance")).load()
    finally:
        served.stop()
    # 4 offsets a batch in 3 pieces ([0, 2), [2, 3), [3, 4) ...): each row once, in order
    assert pieces(through[0]) == [(0, 0, 19, 20), (1, 20, 29, 10), (2, 30, 39, 10)]
    assert sorted(k for b in through for _, k, _ in b) == list(range(110))
    assert direct == through


def source_rows(
    spark: SparkSession, location: str, chk: Path, **options: str
) -> tuple[list[int], Any]:
    """The ``k`` the source reads in one ``availableNow`` run with ``options``, and the query."""
    from pyspark.sql import DataFrame

    reader = spark.readStream.format("pushtable").option("uri", location).option("topic", "ticks")
    for key, value in options.items():
        reader = reader.option(key, value)
    seen: list[int] = []

    def collect(df: DataFrame, _: int) -> None:
        seen.extend(int(r.k) for r in df.select("k").collect())

    query = drain(reader, chk, collect)
    return sorted(seen), query


@pytest.mark.spark
def test_source_starting_offsets_and_consumer_name(
    pushtable_spark: SparkSession, tmp_path: Path
) -> None:
    """docs/spark.md: ``startingOffsets`` (earliest, latest or an offset) places a new query;
    ``consumer`` names the position the server records; an offset outside the topic is
    refused naming the stored range."""
    server = durable_server(tmp_path / "data")
    try:
        with connect(server.location) as client:
            client.create_topic("ticks", TICKS, durable=True)
            write_ticks(client, 0, 5)  # offsets 0..4, k = 10 * offset + i
            from_three, _ = source_rows(
                pushtable_spark,
                server.location,
                tmp_path / "c1",
                startingOffsets="3",
                consumer="from-three",
                maxBatchesPerTrigger="1",  # two micro-batches: Spark commits the first
            )
            latest, _ = source_rows(
                pushtable_spark, server.location, tmp_path / "c2", startingOffsets="latest"
            )
            everything, _ = source_rows(pushtable_spark, server.location, tmp_path / "c3")
            consumers = client.stats("ticks")["consumers"]
            with pytest.raises(StreamingQueryException, match=r"outside topic 'ticks'.*0\.\.5"):
                source_rows(pushtable_spark, server.location, tmp_path / "c4", startingOffsets="99")
    finally:
        server.stop()
    assert from_three == list(range(30, 50))
    assert latest == []
    assert everything == list(range(50))  # earliest, the default
    # The last micro-batch's end too: Spark's commit of it never comes after an availableNow
    # run (the position stayed one batch behind, 4); the source reports it when Spark asks
    # for the next batch's end, once that batch has finished.
    assert consumers["from-three"] == 5


@pytest.mark.spark
def test_source_refuses_a_topic_that_is_not_durable_and_names_missing_options(
    pushtable_spark: SparkSession, server: Server, client: Client
) -> None:
    client.create_topic("ticks", TICKS)

    def load(**options: str) -> None:
        reader = pushtable_spark.readStream.format("pushtable")
        for key, value in options.items():
            reader = reader.option(key, value)
        reader.load()

    with pytest.raises(AnalysisException, match="reads durable topics only"):
        load(uri=server.location, topic="ticks")
    with pytest.raises(AnalysisException, match='needs option "topic"'):
        load(uri=server.location)
    with pytest.raises(AnalysisException, match='needs option "uri"'):
        load(topic="ticks")
    with pytest.raises(AnalysisException, match="no topic 'nope'"):
        load(uri=server.location, topic="nope")


@pytest.mark.spark
def test_a_failed_batch_is_aborted_its_shares_dropped_and_a_restart_lands_it_once(
    pushtable_spark: SparkSession, tmp_path: Path, server: Server, client: Client
) -> None:
    """local[2] gives a failed task no second attempt: the batch fails, Spark aborts it (the
    server drops the shares its tasks staged), and the restarted query lands it once."""
    reader = live_events(client)
    src, chk, uri = tmp_path / "src", tmp_path / "chk", tmp_path / "out.lance"
    write_epochs(src, 2, rows=ROWS)
    failing = (
        stream(pushtable_spark, src)
        .writeStream.format("pushtable")
        .option("uri", server.location)
        .option("table", "events")
        .option("lance_uri", str(uri))
        .option("checkpointLocation", str(chk))
        .option("pushtable.test.fail_first_attempt", "0:after_stage")
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(StreamingQueryException, match="injected failure"):
        failing.awaitTermination(QUERY_WAIT)  # raises the query's error once it has failed
    assert server.dropped_shares >= 1  # aborted: nothing held
    assert server._staging.staged_epochs == 0
    assert client.stats("events")["rows"] == 0
    assert sink_query(pushtable_spark, src, server.location, chk, uri) == [0, 1]
    client.sink("events").close()
    assert reader.join(timeout=WAIT) == expected(range(2))
    assert ids(uri) == expected(range(2))


@pytest.mark.spark
def test_sink_refuses_nulls_for_a_not_null_column_and_a_batch_over_the_staging_limit(
    pushtable_spark: SparkSession, tmp_path: Path
) -> None:
    """A micro-batch with nulls where the live table says NOT NULL, and one bigger than the
    server lets a query stage: the query fails naming the column or the limit, and the
    table takes nothing of it."""
    from pushtable.flight import Limits

    src = tmp_path / "src"
    write_epochs(src, 1, rows=ROWS)
    server = Server(limits=Limits(max_staged_bytes_per_query=256))
    try:
        client = connect(server.location)
        strict = pa.schema([pa.field("id", pa.int64(), nullable=False), ("level", pa.string())])
        client.create_table("strict", strict)
        client.create_table("events", ARROW)

        def start(table: str, chk: str, nulls: bool) -> None:
            df = stream(pushtable_spark, src)
            if nulls:
                df = df.selectExpr("CASE WHEN id % 2 = 0 THEN NULL ELSE id END AS id", "level")
            writer = (
                df.writeStream.format("pushtable")
                .option("uri", server.location)
                .option("table", table)
                .option("checkpointLocation", str(tmp_path / chk))
            )
            finish(writer.trigger(availableNow=True).start())

        with pytest.raises(StreamingQueryException, match="column 'id' is NOT NULL in the target"):
            start("strict", "chk-strict", nulls=True)
        with pytest.raises(StreamingQueryException, match="max_staged_bytes_per_query"):
            start("events", "chk-events", nulls=False)
        for name in ("strict", "events"):
            assert client.stats(name)["rows"] == 0, name
        client.close()
    finally:
        server.stop()
