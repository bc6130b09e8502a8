"""Per-epoch cost of the Spark bridge, split by step, against Spark's own ``toArrow`` alone.

One run prints, for epochs of ``--rows`` rows on a local[2] Spark:

- ``toArrow`` alone (the floor: what any Arrow consumer of a micro-batch pays),
- the bridge's driver path split into Spark->Arrow, Lance commit and live push,
- the executor path (executors write fragments, the driver commits),
- the dedupe walk and commit with 100 versions of foreign history since the query's last commit.

"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from pushtable import SessionContext
from pushtable.lance_epochs import LanceEpochWriter
from pushtable.spark import ForeachBatchBridge, local_spark


def spark_session() -> SparkSession:
    """The bench's local Spark session (Arrow batches of up to 100,000 records)."""
    return local_spark(
        "pushtable-bench", **{"spark.sql.execution.arrow.maxRecordsPerBatch": "100000"}
    )


def epoch_frame(spark: SparkSession, rows: int) -> DataFrame:
    """A cached epoch of ``rows`` rows in two partitions: ``id``, ``level`` and ``value``."""
    df = spark.range(rows).selectExpr(
        "id", "CAST(id % 7 AS STRING) AS level", "CAST(id AS DOUBLE) / 3 AS value"
    )
    df = df.repartition(2).cache()
    df.count()
    return df


def median_ms(samples: list[float]) -> dict[str, float]:
    """Median, min and max of ``samples`` (seconds), in milliseconds."""
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "min_ms": min(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
    }


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    """The seconds each of ``reps`` calls of ``fn`` took."""
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def measure(rows: int, reps: int) -> dict[str, Any]:
    """Every figure of the run, for epochs of ``rows`` rows; each a median of ``reps``."""
    spark = spark_session()
    df = epoch_frame(spark, rows)
    work = Path(tempfile.mkdtemp(prefix="pushtable-bench-"))
    results: dict[str, Any] = {"rows_per_epoch": rows, "reps": reps}
    try:
        timed(df.toArrow, 2)  # warm-up: JIT and Arrow buffers

        # Driver path: toArrow + Lance commit + live push into a table a query drains.
        ctx = SessionContext()
        schema = df.limit(0).toArrow().schema
        sink = ctx.register_streaming_table("events", schema, capacity=4)
        drained: dict[str, Any] = {}
        reader = threading.Thread(
            target=lambda: drained.update(ctx.sql("SELECT count(*) AS n FROM events").to_pydict())
        )
        reader.start()
        bridge = ForeachBatchBridge(sinks=[sink], lance_uri=work / "driver.lance", query_id="b")
        steps: dict[str, list[float]] = {"to_arrow": [], "commit": [], "push": [], "total": []}
        alone: list[float] = []
        bridge(df, 0)  # warm-up epoch (creates the dataset)
        for epoch in range(1, reps + 1):
            alone.extend(timed(df.toArrow, 1))  # interleaved, so drift hits both alike
            start = time.perf_counter()
            bridge(df, epoch)
            steps["total"].append(time.perf_counter() - start)
            report = bridge.last_report
            assert report is not None
            assert report.committed
            assert report.pushed
            steps["to_arrow"].append(report.to_arrow_s)
            steps["commit"].append(report.commit_s)
            steps["push"].append(report.push_s)
        sink.close()
        reader.join(60)
        assert drained == {"n": [rows * (reps + 1)]}, drained
        results["to_arrow_alone"] = median_ms(alone)
        results["driver_path"] = {k: median_ms(v) for k, v in steps.items()}

        # Executor path: fragments written by executors, one commit by the driver.
        executor = ForeachBatchBridge(
            lance_uri=work / "executor.lance", query_id="e", executor_writes=True
        )
        results["executor_path"] = median_ms(_epochs(executor, df, reps))
        # Lance only, driver path, for a like-for-like comparison with the executor path.
        driver_only = ForeachBatchBridge(lance_uri=work / "driver-only.lance", query_id="d")
        results["driver_path_lance_only"] = median_ms(list(_epochs(driver_only, df, reps)))

        results["dedupe"] = dedupe_walk(work / "history.lance", reps)
        floor = results["to_arrow_alone"]["median_ms"]
        total = results["driver_path"]["total"]["median_ms"]
        results["bridge_overhead_pct"] = 100 * (total - floor) / floor
        results["rows_per_s"] = {
            "to_arrow_alone": rows / (floor / 1e3),
            "bridge_driver_path": rows / (total / 1e3),
            "bridge_executor_path": rows / (results["executor_path"]["median_ms"] / 1e3),
            "bridge_driver_path_lance_only": rows
            / (results["driver_path_lance_only"]["median_ms"] / 1e3),
        }
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    return results


def _epochs(bridge: ForeachBatchBridge, df: DataFrame, reps: int) -> list[float]:
    out = []
    for epoch in range(reps):
        start = time.perf_counter()
        bridge(df, epoch)
        out.append(time.perf_counter() - start)
        assert bridge.last_report is not None
        assert bridge.last_report.committed
    return out


def dedupe_walk(uri: Path, reps: int) -> dict[str, Any]:
    """Walk + commit with 100 foreign versions since this query's last commit."""
    small = pa.table({"id": [1], "level": ["x"], "value": [0.5]})
    walks, commits = [], []
    for rep in range(reps):
        path = uri.with_name(f"{uri.stem}-{rep}.lance")
        LanceEpochWriter(path, "q").commit(0, small)
        for _ in range(100):
            lance.write_dataset(small, str(path), mode="append")
        fresh = LanceEpochWriter(path, "q")  # a restarted process: nothing cached
        start = time.perf_counter()
        last = fresh.last_committed_epoch()
        walks.append(time.perf_counter() - start)
        assert last == 0
        start = time.perf_counter()
        assert fresh.commit(1, small).committed
        commits.append(time.perf_counter() - start)
    steady = LanceEpochWriter(uri.with_name("steady.lance"), "q")
    for epoch in range(101):  # the query's own commits are the newest: one read per walk
        steady.commit(epoch, small)
    steady_commits = []
    for epoch in range(101, 101 + reps):
        start = time.perf_counter()
        steady.commit(epoch, small)
        steady_commits.append(time.perf_counter() - start)
    return {
        "walk_100_foreign_versions": median_ms(walks),
        "commit_after_walk": median_ms(commits),
        "walk_plus_commit": median_ms([w + c for w, c in zip(walks, commits, strict=True)]),
        "steady_state_commit_with_100_versions": median_ms(steady_commits),
    }


def report(r: dict[str, Any]) -> str:
    """The run's figures as text."""
    d = r["driver_path"]
    lines = [
        f"epoch of {r['rows_per_epoch']:,} rows, median of {r['reps']} (ms)",
        f"  toArrow alone                    {r['to_arrow_alone']['median_ms']:8.1f}",
        f"  bridge, driver path total        {d['total']['median_ms']:8.1f}"
        f"   (+{r['bridge_overhead_pct']:.1f}% over toArrow)",
        f"    Spark->Arrow                   {d['to_arrow']['median_ms']:8.1f}",
        f"    Lance commit (+dedupe)         {d['commit']['median_ms']:8.1f}",
        f"    live push                      {d['push']['median_ms']:8.1f}",
        f"  Lance only: driver path          {r['driver_path_lance_only']['median_ms']:8.1f}",
        f"  Lance only: executor path        {r['executor_path']['median_ms']:8.1f}",
        f"  dedupe walk, 100 foreign versions "
        f"{r['dedupe']['walk_100_foreign_versions']['median_ms']:7.1f}",
        f"  walk + commit, 100 versions      {r['dedupe']['walk_plus_commit']['median_ms']:8.1f}",
        f"  commit, steady state             "
        f"{r['dedupe']['steady_state_commit_with_100_versions']['median_ms']:8.1f}",
        "rows/s: " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in r["rows_per_s"].items()),
    ]
    return "\n".join(lines)


def run(quick: bool, reps: int = 5) -> dict[str, Any]:
    """The ``spark`` suite as a JSON-ready dict."""
    return measure(100_000 if quick else 1_000_000, reps)
