"""Real Spark into a durable topic on a ``pushtable serve --data-dir`` process killed with
SIGKILL between stage and publish, and between publish and Spark's own commit, through
``format("pushtable")`` and ``foreachBatch(RemoteBridge)``: every epoch lands exactly once.

- Killed between stage and publish: the staged shares die with the server; the publish after
  the restart raises ``SharesLostError`` (never "published" with nothing in it), the query
  fails, and its restart runs the epoch again: stored once.
- Killed after publish answered but before Spark recorded the batch (its commit file
  removed, as a driver crash then would): the restarted server knows the epoch is published
  (stored in the same commit as the rows); the replay writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pushtable.flight import Client, connect
from pushtable.spark import RemoteBridge, query_id_from_checkpoint, register
from tests.conftest import WAIT
from tests.spark_support import ARROW, QUERY_WAIT, stream, write_epochs
from tests.test_durable_crash import Serve, free_port
from tests.test_spark_format import forget_last_commit
from tests.test_spark_remote import ROWS, expected

Start = Callable[[Path | None], None]


def stored_ids(client: Client) -> list[int]:
    end = client.offsets("events")["committed"]
    return sorted(client.read("events", 0, end).read_all().column("id").to_pylist())


def wait_for(path: Path, query: StreamingQuery) -> None:
    """Wait (bounded) until the driver reaches ``path``; a query that ended first fails."""
    deadline = time.monotonic() + 2 * WAIT
    while not path.exists():
        if not query.isActive:
            query.awaitTermination(0)  # raises what ended it
            pytest.fail(f"the query ended before the driver reached {path.name}")
        assert time.monotonic() < deadline, f"the driver never reached {path.name}"
        time.sleep(0.05)


@pytest.mark.spark
@pytest.mark.parametrize("path", ["format", "foreachBatch"])
def test_spark_publishes_into_a_durable_topic_exactly_once_across_server_kills(
    spark: SparkSession, tmp_path: Path, path: str
) -> None:
    register(spark)
    data, port = tmp_path / "data", free_port()
    server = Serve(data, port)
    location = server.location
    connect(location).create_topic("events", ARROW, durable=True)
    src, chk = tmp_path / "src", tmp_path / "chk"
    write_epochs(src, 3, rows=ROWS)

    def start(pause: Path | None) -> StreamingQuery:
        """Start the query over what ``src`` holds."""
        df = stream(spark, src)
        if path == "format":
            writer = (
                df.writeStream.format("pushtable").option("uri", location).option("table", "events")
            )
            if pause is not None:
                writer = writer.option("pushtable.test.pause_before_publish", str(pause))
        else:
            bridge = RemoteBridge(location, "events", push="executors")
            bridge.pause_before_publish = None if pause is None else str(pause)
            writer = df.writeStream.foreachBatch(bridge)
        return writer.option("checkpointLocation", str(chk)).trigger(availableNow=True).start()

    def run() -> None:
        """Run the query to its end (raises what the query raised)."""
        query = start(None)
        assert query.awaitTermination(QUERY_WAIT), "the streaming query did not finish in time"

    try:
        # 1. Epoch 0 publishes; epoch 1 is staged, then the server dies before its publish.
        pause = tmp_path / "pause"
        (tmp_path / "pause.0.go").touch()
        failing = start(pause)
        wait_for(tmp_path / "pause.1.reached", failing)
        server.kill()
        server = Serve(data, port)
        (tmp_path / "pause.1.go").touch()
        with pytest.raises(StreamingQueryException, match="SharesLostError"):
            failing.awaitTermination(QUERY_WAIT)
        client = connect(location)
        query_id = query_id_from_checkpoint(chk)
        assert client.published("events", query_id) == 0
        assert stored_ids(client) == expected(range(1))

        # 2. The restarted query runs epoch 1 again, then 2.
        run()
        assert client.published("events", query_id) == 2
        assert stored_ids(client) == expected(range(3))

        # 3. Killed after the publish answered, before Spark recorded batch 2: a replay.
        server.kill()
        forget_last_commit(chk)
        server = Serve(data, port)
        client = connect(location)
        assert client.published("events", query_id) == 2  # stored with the rows
        run()
        assert stored_ids(client) == expected(range(3))  # each row once
        assert client.offsets("events")["committed"] == client.offsets("events")["next"]
    finally:
        server.stop()
