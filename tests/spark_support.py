"""Helpers for the Spark tests: generated sources, bounded query runs, dataset inspection."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import lance
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pushtable.lance_epochs import EPOCH_KEY, QUERY_KEY
from pushtable.spark import ForeachBatchBridge, local_spark

DDL = "id long, level string"
ARROW = pa.schema([("id", pa.int64()), ("level", pa.string())])
QUERY_WAIT = 120  # seconds; a streaming query still running then is a failure


def spark_session(app: str = "pushtable-tests") -> SparkSession:
    return local_spark(app)


def write_epochs(src: Path, epochs: int, rows: int = 5, start: int = 0) -> None:
    """One JSON file per epoch (the stream reads one file per trigger, oldest first)."""
    src.mkdir(parents=True, exist_ok=True)
    for e in range(start, start + epochs):
        path = src / f"part-{e:04d}.json"
        with open(path, "w") as f:
            for r in range(rows):
                f.write(json.dumps({"id": e * rows + r, "level": "ab"[r % 2]}) + "\n")
        age(path, e)


def age(path: Path, epoch: int) -> None:
    """Give epoch ``epoch``'s file a distinct modification time, so epochs follow file order."""
    stamp = 1_700_000_000 + epoch * 10
    os.utime(path, (stamp, stamp))


def stream(spark: SparkSession, src: Path, ddl: str = DDL) -> DataFrame:
    return spark.readStream.schema(ddl).option("maxFilesPerTrigger", 1).json(str(src))


def run(
    df: DataFrame, bridge: ForeachBatchBridge, chk: Path, output_mode: str = "append"
) -> StreamingQuery:
    """Run the stream over everything available, bounded by QUERY_WAIT."""
    q = (
        df.writeStream.foreachBatch(bridge)
        .outputMode(output_mode)
        .option("checkpointLocation", str(chk))
        .trigger(availableNow=True)
        .start()
    )
    bridge.watch(q)
    finished = q.awaitTermination(QUERY_WAIT)
    assert finished, "the streaming query did not finish in time"
    return q


def stamped(uri: Path) -> list[tuple[str, int]]:
    """(query id, epoch id) of every stamped commit, oldest first."""
    ds = lance.dataset(str(uri))
    out = []
    for v in range(1, ds.latest_version + 1):
        tx = ds.read_transaction(v)
        props = (tx.transaction_properties or {}) if tx else {}
        if QUERY_KEY in props:
            out.append((props[QUERY_KEY], int(props[EPOCH_KEY])))
    return out


def ids(uri: Path) -> list[int]:
    return sorted(lance.dataset(str(uri)).to_table(columns=["id"])["id"].to_pylist())


class Crash(RuntimeError):
    """Injected failure inside an epoch."""


def crash_at(step: str, epoch: int) -> Callable[[str, int], None]:
    """A bridge fault hook raising Crash at ``step`` of ``epoch``."""

    def fault(s: str, e: int) -> None:
        if s == step and e == epoch:
            raise Crash(f"injected crash at {step} of epoch {epoch}")

    return fault
