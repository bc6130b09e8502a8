"""RemoteBridge: Spark epochs to a ``pushtable serve`` table (from the executors or the driver),
Lance exactly once, the live table exactly once; Spark Connect with a task that fails once."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from pyspark.errors import PythonException
from pyspark.sql import DataFrame, SparkSession

from pushtable.flight import Client, Server, connect
from pushtable.lance_epochs import LanceEpochWriter
from pushtable.spark import RemoteBridge, query_id_from_checkpoint
from tests.conftest import WAIT, Background
from tests.spark_support import ARROW, ids, stamped, write_epochs
from tests.test_spark_types import TYPES, ZONE, lance_rows, rows_of, spark_rows

ROWS = 20


def epoch_df(spark: SparkSession, epoch: int) -> DataFrame:
    start = epoch * ROWS
    return spark.range(start, start + ROWS, numPartitions=2).selectExpr(
        "id", "cast(id % 2 AS string) AS level"
    )


def expected(epochs: range) -> list[int]:
    return [i for e in epochs for i in range(e * ROWS, e * ROWS + ROWS)]


def outcome(stdout: str, child: subprocess.Popen[str]) -> dict[str, object]:
    """A streaming query's outcome, as the Spark Connect child printed it (its last line)."""
    lines = stdout.strip().splitlines()
    assert lines, f"the child printed nothing (exit code {child.poll()})"
    result: dict[str, object] = json.loads(lines[-1])
    assert result["finished"], result
    assert result["error"] is None, result
    return result


def live_ids(client: Client, table: str) -> Background:
    result = client.sql(f"SELECT id FROM {table}")
    return Background(lambda: sorted(result.read_all()["id"].to_pylist()))


def live_events(client: Client) -> Background:
    """A table ``events`` (``id``, ``level``) on the server and a live reader of its ids."""
    client.create_table("events", ARROW)
    return live_ids(client, "events")


@pytest.mark.spark
@pytest.mark.parametrize("push", ["executors", "driver"])
def test_epochs_reach_the_server_and_lance_once_even_when_replayed(
    spark: SparkSession, tmp_path: Path, server: Server, client: Client, push: str
) -> None:
    reader = live_events(client)
    uri = tmp_path / "out.lance"
    bridge = RemoteBridge(server.location, "events", lance_uri=uri, query_id="q", push=push)  # type: ignore[arg-type]
    for e in (0, 1, 2, 2, 1, 3):  # Spark replays the newest epoch after a restart; 1 is older
        bridge(epoch_df(spark, e), e)
    bridge.close()
    assert reader.join() == expected(range(4))
    assert ids(uri) == expected(range(4))
    assert stamped(uri) == [("q", e) for e in range(4)]
    assert client.published("events", "q") == 3


@pytest.mark.spark
def test_an_epoch_committed_but_not_published_is_published_on_replay(
    spark: SparkSession, tmp_path: Path, server: Server, client: Client
) -> None:
    """A driver that died between the Lance commit and the publish: the replay publishes."""
    reader = live_events(client)
    uri = tmp_path / "out.lance"
    bridge = RemoteBridge(server.location, "events", lance_uri=uri, query_id="q")
    bridge(epoch_df(spark, 0), 0)
    LanceEpochWriter(uri, "q").commit(1, epoch_df(spark, 1).toArrow())  # ...then the crash
    bridge(epoch_df(spark, 1), 1)  # the restarted query replays epoch 1
    bridge.close()
    assert reader.join() == expected(range(2))
    assert ids(uri) == expected(range(2))
    assert stamped(uri) == [("q", 0), ("q", 1)]


@pytest.mark.spark
def test_the_bridge_creates_a_missing_table_and_refuses_a_wrong_schema(
    spark: SparkSession, server: Server, client: Client
) -> None:
    bridge = RemoteBridge(server.location, "fresh", query_id="q")
    bridge(epoch_df(spark, 0), 0)
    assert client.schema("fresh").names == ["id", "level"]
    client.create_table("other", ARROW.append(ARROW.field("id").with_name("extra")))
    with pytest.raises(ValueError, match="column 'extra'"):
        RemoteBridge(server.location, "other", query_id="q")(epoch_df(spark, 0), 0)


def test_settings_are_checked_and_the_bridge_pickles(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode='append'"):
        RemoteBridge("grpc://127.0.0.1:1", "t", mode="complete")
    with pytest.raises(ValueError, match="push must be"):
        RemoteBridge("grpc://127.0.0.1:1", "t", push="nowhere")  # type: ignore[arg-type]
    bridge = RemoteBridge("grpc://127.0.0.1:1", "t", checkpoint=tmp_path / "chk", token="x")
    copy = pickle.loads(pickle.dumps(bridge))
    assert (copy.uri, copy.table, copy.token, copy.checkpoint) == (
        bridge.uri,
        "t",
        "x",
        str(tmp_path / "chk"),
    )
    with pytest.raises(ValueError, match="checkpointLocation"):
        query_id_from_checkpoint(tmp_path / "chk")
    (tmp_path / "chk").mkdir()
    (tmp_path / "chk" / "metadata").write_text('{"id":"9f1c"}\n')
    assert query_id_from_checkpoint(f"file:{tmp_path / 'chk'}") == "9f1c"


_CONNECT_RUN = textwrap.dedent(
    """
    import json, sys
    from pyspark.sql import SparkSession
    from pushtable.spark import RemoteBridge, register

    uri, src, work = sys.argv[1:4]
    HOWS = ("format", "foreachBatch")
    # local[2,2]: two cores, and a failed task gets a second attempt (as on a cluster).
    spark = (SparkSession.builder.remote("local[2,2]")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())

    register(spark)

    def run(how, fail):
        table, chk, lance_uri = f"events_{how}", f"{work}/{how}/chk", f"{work}/{how}/out.lance"
        df = (spark.readStream.schema("id long, level string")
              .option("maxFilesPerTrigger", 1).json(src))
        if how == "format":  # writeStream.format("pushtable"), Spark's own sink protocol
            writer = (df.writeStream.format("pushtable").option("uri", uri)
                      .option("table", table).option("lance_uri", lance_uri))
            if fail:  # fails once, after sending
                writer = writer.option("pushtable.test.fail_first_attempt", "0:after_stage")
        else:
            bridge = RemoteBridge(uri, table, lance_uri=lance_uri, checkpoint=chk)
            if fail:
                bridge.fail_first_attempt = (0, "after_stage")  # fails once, after sending
            writer = df.writeStream.foreachBatch(bridge)
        q = (writer.option("checkpointLocation", chk).trigger(availableNow=True).start())
        finished = q.awaitTermination(180)
        print(json.dumps({"how": how, "finished": finished, "id": str(q.id),
                          "error": None if q.exception() is None else str(q.exception())}),
              flush=True)

    for how in HOWS:
        run(how, fail=True)
    sys.stdin.readline()  # the test wrote another epoch: restart on the same checkpoints
    for how in HOWS:
        run(how, fail=False)
    # Every Spark type through format("pushtable") under Spark Connect, in a zone not UTC.
    spark.conf.set("spark.sql.session.timeZone", sys.argv[5])
    q = (spark.readStream.schema("id long, level string").json(src)
         .selectExpr(*json.loads(sys.argv[4])).writeStream.format("pushtable")
         .option("uri", uri).option("table", "events_types")
         .option("lance_uri", f"{work}/types/out.lance")
         .option("checkpointLocation", f"{work}/types/chk").trigger(availableNow=True).start())
    finished = q.awaitTermination(180)
    print(json.dumps({"how": "types", "finished": finished, "id": str(q.id),
                      "error": None if q.exception() is None else str(q.exception())}),
          flush=True)
    spark.stop()
    """
)
HOWS = ("format", "foreachBatch")


@pytest.mark.spark
@pytest.mark.slow  # a Spark Connect server of its own (68 s); the demo test runs Connect by default
def test_spark_connect_with_a_task_that_fails_once(
    tmp_path: Path, server: Server, spark: SparkSession
) -> None:
    """Spark Connect, through ``format("pushtable")`` and through a server-side foreachBatch
    with executor push, a task attempt that staged its partition and then failed: the live
    table and Lance hold every row exactly once, under the query id Spark keeps in the
    checkpoint, across a restart of the query. Then every Spark type through
    ``format("pushtable")`` in a session zone that is not UTC: Spark's own values."""
    client = connect(server.location)
    readers = {}
    for how in HOWS:
        client.create_table(f"events_{how}", ARROW)
        readers[how] = live_ids(client, f"events_{how}")
    src = tmp_path / "src"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        # Spark's own switch for parallel test runs (SPARK-42272): the local Spark Connect
        # server takes an ephemeral port, not 15002, so a second run on the machine (another
        # checkout's suite, the demo) does not collide with it ("Failed to bind").
        "SPARK_TESTING": "1",
    }
    write_epochs(src, 2, rows=ROWS)
    # One Spark Connect server runs all four queries (its start-up is most of the test's
    # time). Its stderr goes to a file: a full pipe nobody reads would stall Spark.
    with (tmp_path / "child.err").open("w") as err:
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CONNECT_RUN,
                server.location,
                str(src),
                str(tmp_path),
                json.dumps(TYPES),
                ZONE,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        try:
            assert child.stdout is not None
            first = {}
            for _ in HOWS:
                line = Background(child.stdout.readline).join(timeout=110)
                result = outcome(line, child)
                first[str(result["how"])] = result
            write_epochs(src, 1, rows=ROWS, start=2)
            out, _ = child.communicate("restart\n", timeout=170)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(WAIT)
    assert child.returncode == 0, (tmp_path / "child.err").read_text()[-3000:]
    lines = out.strip().splitlines()
    second = {str(r["how"]): r for r in (outcome(line, child) for line in lines[-3:-1])}
    assert outcome(lines[-1], child)["how"] == "types"
    rows = expected(range(3))
    for how in HOWS:
        client.sink(f"events_{how}").close()
        chk, uri = tmp_path / how / "chk", tmp_path / how / "out.lance"
        assert readers[how].join(timeout=WAIT) == rows, how
        assert ids(uri) == rows, how
        # the restarted query: the same query id, the one Spark keeps in the checkpoint
        assert first[how]["id"] == second[how]["id"] == query_id_from_checkpoint(chk)
        assert stamped(uri) == [(first[how]["id"], e) for e in range(3)], how
        assert lance.dataset(str(uri)).count_rows() == len(rows), how
    assert server.dropped_shares >= 2  # each failed attempt staged its share: not published
    # The type matrix through format("pushtable") under Spark Connect: Spark's own values.
    want = spark_rows(spark, src)
    types = Background(lambda: rows_of(client.sql("SELECT * FROM events_types").read_all()))
    client.sink("events_types").close()
    assert types.join(timeout=WAIT) == want
    assert lance_rows(tmp_path / "types" / "out.lance") == want


@pytest.mark.spark
@pytest.mark.parametrize("push", ["executors", "driver"])
def test_a_not_null_violation_and_an_over_limit_epoch_are_refused_and_retryable(
    spark: SparkSession, tmp_path: Path, push: str
) -> None:
    """Through ``RemoteBridge``: an epoch with nulls where the table says NOT NULL fails
    naming the column, one over the server's staging limit names the limit; neither writes
    anything, and a good epoch then lands once."""
    from pushtable import ResourceLimitError, SchemaDriftError
    from pushtable.flight import Limits

    server = Server(limits=Limits(max_staged_bytes_per_query=4096))
    try:
        client = connect(server.location)
        strict = pa.schema([pa.field("id", pa.int64(), nullable=False), ("level", pa.string())])
        client.create_table("strict", strict)
        bridge = RemoteBridge(server.location, "strict", query_id="q", push=push)  # type: ignore[arg-type]
        nulls = epoch_df(spark, 0).selectExpr(
            "CASE WHEN id % 2 = 0 THEN NULL ELSE id END AS id", "level"
        )
        # On executors Spark hands the task's error back as its PythonException, with the
        # class and message the task raised.
        on_driver = push == "driver"
        with pytest.raises(
            SchemaDriftError if on_driver else PythonException,
            match=r"SchemaDriftError: column 'id' is NOT NULL|^column 'id' is NOT NULL",
        ):
            bridge(nulls, 0)
        big = spark.range(0, 5000, numPartitions=1).selectExpr("id", "repeat('x', 100) AS level")
        with pytest.raises(
            ResourceLimitError if on_driver else PythonException,
            match="max_staged_bytes_per_query",
        ):
            bridge(big, 0)
        assert client.stats("strict")["rows"] == 0
        reader = live_ids(client, "strict")
        bridge(epoch_df(spark, 0), 0)
        bridge.close()
        assert reader.join() == expected(range(1))
        client.close()
    finally:
        server.stop()
