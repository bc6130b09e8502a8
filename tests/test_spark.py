"""The Spark bridge on a real local Spark (local[2]) and real Lance datasets in tmp dirs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from pushtable import SessionContext
from pushtable.lance_epochs import EpochCommitError, SchemaDriftError
from pushtable.spark import ForeachBatchBridge
from pushtable.spark.session import SPARK_LOG_KEPT, prune_spark_logs, spark_log_path
from tests.conftest import WAIT, query
from tests.ctrl_c import BLOCKED_WRITE_CHILD
from tests.spark_support import (
    ARROW,
    DDL,
    QUERY_WAIT,
    crash_at,
    ids,
    run,
    stamped,
    stream,
    write_epochs,
)

pytestmark = pytest.mark.spark


# --- the streaming paths ------------------------------------------------------------------


def test_append_commits_each_epoch_once_with_stamps(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 3)
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(lance_uri=uri)
    q = run(stream(spark, tmp_path / "src"), bridge, tmp_path / "chk")
    assert ids(uri) == list(range(15))
    assert stamped(uri) == [(str(q.id), 0), (str(q.id), 1), (str(q.id), 2)]
    schema = lance.dataset(str(uri)).schema
    assert schema.field("id").type == pa.int64()
    assert schema.field("level").type == pa.string()


def test_live_sql_sees_every_row_once_and_the_sink_closes(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_epochs(tmp_path / "src", 4)
    ctx = SessionContext()
    live = ctx.register_streaming_table("events", ARROW, capacity=2)
    reader = query(ctx, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM events")
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=tmp_path / "out.lance")
    run(stream(spark, tmp_path / "src"), bridge, tmp_path / "chk")
    assert reader.join(timeout=QUERY_WAIT) == {"n": [20], "d": [20]}
    assert ids(tmp_path / "out.lance") == list(range(20))


def test_fan_out_to_several_sinks_without_lance(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 2)
    ctx = SessionContext()
    a = ctx.register_streaming_table("a", ARROW)
    b = ctx.register_streaming_table("b", ARROW)
    ra = query(ctx, "SELECT sum(id) AS s FROM a")
    rb = query(ctx, "SELECT count(*) AS n FROM b WHERE level = 'a'")
    run(stream(spark, tmp_path / "src"), ForeachBatchBridge(sinks=[a, b]), tmp_path / "chk")
    assert ra.join(timeout=QUERY_WAIT) == {"s": [sum(range(10))]}
    assert rb.join(timeout=QUERY_WAIT) == {"n": [6]}


def test_a_failing_query_makes_the_live_reader_raise(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 3)
    ctx = SessionContext()
    live = ctx.register_streaming_table("events", ARROW)
    reader = query(ctx, "SELECT count(*) FROM events")
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=tmp_path / "out.lance")
    bridge.fault = crash_at("before_arrow", 1)
    q = stream(spark, tmp_path / "src").writeStream.foreachBatch(bridge)
    started = q.option("checkpointLocation", str(tmp_path / "chk")).trigger(availableNow=True)
    handle = started.start()
    bridge.watch(handle)
    with pytest.raises(StreamingQueryException, match="injected crash"):
        handle.awaitTermination(QUERY_WAIT)
    err = reader.join_error(timeout=QUERY_WAIT)
    assert "StreamingQueryFailedError" in str(err)
    assert "injected crash" in str(err)
    assert ids(tmp_path / "out.lance") == list(range(5))  # only whole epochs


@pytest.mark.parametrize("step", ["before_commit", "after_commit", "after_push"])
def test_crash_and_restart_keeps_every_row_exactly_once(
    spark: SparkSession, tmp_path: Path, step: str
) -> None:
    write_epochs(tmp_path / "src", 3)
    uri, chk = tmp_path / "out.lance", tmp_path / "chk"
    crashing = ForeachBatchBridge(lance_uri=uri)
    crashing.fault = crash_at(step, 1)
    with pytest.raises(StreamingQueryException, match="injected crash"):
        run(stream(spark, tmp_path / "src"), crashing, chk)
    restarted = ForeachBatchBridge(lance_uri=uri)
    q = run(stream(spark, tmp_path / "src"), restarted, chk)
    assert ids(uri) == list(range(15))  # no duplicates, no losses
    assert stamped(uri) == [(str(q.id), 0), (str(q.id), 1), (str(q.id), 2)]


def test_executor_writes_commit_one_transaction_per_epoch(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_epochs(tmp_path / "src", 2, rows=50)
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(lance_uri=uri, executor_writes=True)
    q = run(stream(spark, tmp_path / "src").repartition(2), bridge, tmp_path / "chk")
    assert ids(uri) == list(range(100))
    assert stamped(uri) == [(str(q.id), 0), (str(q.id), 1)]


def test_complete_mode_overwrites_with_the_full_result(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 3)
    uri = tmp_path / "counts.lance"
    counts = stream(spark, tmp_path / "src").groupBy("level").count()
    run(counts, ForeachBatchBridge(lance_uri=uri, mode="complete"), tmp_path / "chk", "complete")
    got = lance.dataset(str(uri)).to_table().sort_by("level").to_pydict()
    assert got == {"level": ["a", "b"], "count": [9, 6]}


def test_update_mode_appends_the_updated_rows(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 2)
    uri = tmp_path / "updates.lance"
    counts = stream(spark, tmp_path / "src").groupBy("level").count()
    run(counts, ForeachBatchBridge(lance_uri=uri, mode="update"), tmp_path / "chk", "update")
    got = (
        lance.dataset(str(uri)).to_table().sort_by([("level", "ascending"), ("count", "ascending")])
    )
    assert got.to_pydict() == {"level": ["a", "a", "b", "b"], "count": [3, 6, 2, 4]}


# --- direct calls (the bridge is a plain callable) ----------------------------------------


def frame(spark: SparkSession, rows: list[tuple[int, str]]) -> DataFrame:
    return spark.createDataFrame(rows, DDL)


def test_empty_append_epoch_is_a_no_op(spark: SparkSession, tmp_path: Path) -> None:
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(lance_uri=uri, query_id="q")
    bridge(frame(spark, [(1, "a")]), 0)
    version = lance.dataset(str(uri)).latest_version
    bridge(frame(spark, []), 1)
    assert lance.dataset(str(uri)).latest_version == version
    assert bridge.last_report is not None
    assert not bridge.last_report.committed


def test_empty_complete_epoch_commits_an_empty_typed_overwrite(
    spark: SparkSession, tmp_path: Path
) -> None:
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(lance_uri=uri, mode="complete", query_id="q")
    bridge(frame(spark, [(1, "a"), (2, "b")]), 0)
    bridge(frame(spark, []), 1)
    ds = lance.dataset(str(uri))
    assert ds.count_rows() == 0
    assert ds.schema == pa.schema([("id", pa.int64()), ("level", pa.string())])
    assert stamped(uri) == [("q", 0), ("q", 1)]


def test_dedupe_survives_150_foreign_commits_and_a_compaction(
    spark: SparkSession, tmp_path: Path
) -> None:
    uri = tmp_path / "out.lance"
    first = ForeachBatchBridge(lance_uri=uri, query_id="q")
    first(frame(spark, [(0, "a")]), 0)
    first(frame(spark, [(1, "a")]), 1)
    for i in range(150):  # another writer, beyond lance-spark's 100-version window
        lance.write_dataset(pa.table({"id": [1000 + i], "level": ["x"]}), str(uri), mode="append")
    lance.dataset(str(uri)).optimize.compact_files()
    replay = ForeachBatchBridge(lance_uri=uri, query_id="q")  # a fresh process's bridge
    replay(frame(spark, [(1, "a")]), 1)
    assert replay.last_report is not None
    assert not replay.last_report.committed
    replay(frame(spark, [(2, "a")]), 2)
    assert [i for i in ids(uri) if i < 1000] == [0, 1, 2]
    assert stamped(uri)[-1] == ("q", 2)


def test_two_queries_do_not_dedupe_each_other(spark: SparkSession, tmp_path: Path) -> None:
    uri = tmp_path / "out.lance"
    ForeachBatchBridge(lance_uri=uri, query_id="a")(frame(spark, [(1, "a")]), 0)
    ForeachBatchBridge(lance_uri=uri, query_id="b")(frame(spark, [(2, "b")]), 0)
    assert ids(uri) == [1, 2]


def test_cleanup_keeps_the_newest_stamped_commit(spark: SparkSession, tmp_path: Path) -> None:
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(
        lance_uri=uri, query_id="q", compact_every=2, cleanup_older_than=timedelta(0)
    )
    for e in range(4):
        bridge(frame(spark, [(e, "a")]), e)
    for i in range(5):  # newer foreign commits, then a cleanup by someone else too
        lance.write_dataset(pa.table({"id": [100 + i], "level": ["x"]}), str(uri), mode="append")
    lance.dataset(str(uri)).cleanup_old_versions(
        older_than=timedelta(0), error_if_tagged_old_versions=False
    )
    ds = lance.dataset(str(uri))
    assert len(ds.get_fragments()) < 9  # compaction merged the per-epoch fragments
    fresh = ForeachBatchBridge(lance_uri=uri, query_id="q")
    fresh(frame(spark, [(3, "a")]), 3)  # replay of the last epoch
    assert fresh.last_report is not None
    assert not fresh.last_report.committed
    assert [i for i in ids(uri) if i < 100] == [0, 1, 2, 3]


# --- bad input ----------------------------------------------------------------------------


def test_bridge_needs_a_destination_and_a_known_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs somewhere to send epochs"):
        ForeachBatchBridge()
    with pytest.raises(ValueError, match=r"unknown mode 'overwrite'"):
        ForeachBatchBridge(lance_uri=tmp_path / "x.lance", mode="overwrite")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TableSink"):
        ForeachBatchBridge(sinks=["not a sink"])  # type: ignore[list-item]


def test_an_append_query_cannot_turn_into_truncation(spark: SparkSession, tmp_path: Path) -> None:
    uri = tmp_path / "out.lance"
    ForeachBatchBridge(lance_uri=uri, query_id="q")(frame(spark, [(1, "a")]), 0)
    restarted = ForeachBatchBridge(lance_uri=uri, query_id="q", mode="complete")
    with pytest.raises(ValueError, match="refusing to continue in 'complete' mode"):
        restarted(frame(spark, [(2, "a")]), 1)
    assert ids(uri) == [1]


def test_direct_call_without_a_query_id_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    bridge = ForeachBatchBridge(lance_uri=tmp_path / "x.lance")
    with pytest.raises(ValueError, match="query_id"):
        bridge(frame(spark, [(1, "a")]), 0)


@pytest.mark.parametrize(
    ("ddl", "rows", "column"),
    [
        ("id long, level string, extra int", [(1, "a", 1)], "extra"),
        ("id long", [(1,)], "level"),
        ("id string, level string", [("1", "a")], "id"),
    ],
)
def test_schema_drift_names_the_column_and_commits_nothing(
    spark: SparkSession, tmp_path: Path, ddl: str, rows: list[tuple[Any, ...]], column: str
) -> None:
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(lance_uri=uri, query_id="q")
    bridge(frame(spark, [(1, "a")]), 0)
    version = lance.dataset(str(uri)).latest_version
    with pytest.raises(SchemaDriftError, match=f"'{column}'"):
        bridge(spark.createDataFrame(rows, ddl), 1)
    assert lance.dataset(str(uri)).latest_version == version


def test_commit_conflicts_are_retried_then_reported(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lance.commit import CommitConflictError

    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(lance_uri=uri, query_id="q")
    bridge(frame(spark, [(0, "a")]), 0)
    real_commit = lance.LanceDataset.commit
    failures = [CommitConflictError("preempted", retryable=True)] * 2

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", flaky)
    bridge(frame(spark, [(1, "a")]), 1)
    assert not failures
    assert ids(uri) == [0, 1]
    failures.append(CommitConflictError("incompatible", retryable=False))
    with pytest.raises(EpochCommitError, match="retrying cannot resolve"):
        bridge(frame(spark, [(2, "a")]), 2)
    assert ids(uri) == [0, 1]


# --- the interpreter Spark's Python workers run -------------------------------------------


@pytest.mark.parametrize("preset", [None, "/opt/elsewhere/bin/python3"])
def test_spark_workers_default_to_this_interpreter(preset: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_PYTHON"}
    if preset is not None:
        env["PYSPARK_PYTHON"] = preset
    code = "import os, pushtable.spark; print(os.environ['PYSPARK_PYTHON'])"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=WAIT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (preset or sys.executable)


CTRL_C_AFTER_STOP = (
    BLOCKED_WRITE_CHILD
    + """
from pushtable.spark import local_spark

def blocked_write_then_ctrl_c(state):
    ctx, sink = full_sink()
    ctrl_c_once_blocked(sink)
    try:
        sink.write(one, timeout=60)  # blocked on the main thread until Ctrl-C
        print(state, "not interrupted", flush=True)
    except BaseException as exc:
        print(state, type(exc).__name__, exc, flush=True)

spark = local_spark("ctrl-c")
blocked_write_then_ctrl_c("running")
spark.stop()  # pyspark's SIGINT handler outlives its context
blocked_write_then_ctrl_c("stopped")
"""
)


def test_ctrl_c_is_a_keyboard_interrupt_with_a_local_spark_running_and_stopped(
    tmp_path: Path,
) -> None:
    # The state a full test run is in after its first Spark test: pyspark's own SIGINT handler
    # (cancel the jobs over py4j, then KeyboardInterrupt) is installed, and stays installed
    # after the session stops. A blocked write on the main thread must still end in a
    # KeyboardInterrupt, in a fresh process where nothing else decides the handler.
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_AFTER_STOP],
        capture_output=True,
        text=True,
        timeout=3 * WAIT,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = [line.split()[:2] for line in done.stdout.strip().splitlines()]
    assert got[-2:] == [["running", "KeyboardInterrupt"], ["stopped", "KeyboardInterrupt"]], (
        done.stdout
    )


def test_jvm_logs_of_exited_processes_are_pruned_and_others_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(WAIT)  # its pid is free now
    old = time.time() - SPARK_LOG_KEPT - 60
    logs = {
        "exited, old": tmp_path / f"pushtable-spark-{gone.pid}.log",
        "exited, recent": tmp_path / f"pushtable-spark-{gone.pid + 1_000_000}.log",
        "running, old": tmp_path / f"pushtable-spark-{os.getpid()}.log",
        "not ours": tmp_path / "pushtable-spark-notapid.log",
    }
    for path in logs.values():
        path.write_text("jvm output\n")
    for name in ("exited, old", "running, old", "not ours"):
        os.utime(logs[name], (old, old))
    assert prune_spark_logs() == 1
    assert sorted(name for name, path in logs.items() if path.exists()) == [
        "exited, recent",
        "not ours",
        "running, old",
    ]
    assert spark_log_path() == logs["running, old"]


def test_a_python_worker_runs_the_interpreter_that_runs_pushtable(spark: SparkSession) -> None:
    workers = spark.sparkContext.parallelize([0, 1], 2).map(lambda _: sys.executable).collect()
    assert set(workers) == {sys.executable}


# --- live sinks and output modes ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["complete", "update"])
def test_live_sinks_are_refused_outside_append_mode(mode: str, tmp_path: Path) -> None:
    live = SessionContext().register_streaming_table("t", ARROW)
    with pytest.raises(ValueError, match=rf"live sinks need mode='append': in '{mode}' mode"):
        ForeachBatchBridge(sinks=[live], lance_uri=tmp_path / "x.lance", mode=mode)  # type: ignore[arg-type]
    # Persisting alone in that mode is fine, and so are sinks in append mode.
    ForeachBatchBridge(lance_uri=tmp_path / "x.lance", mode=mode)  # type: ignore[arg-type]
    ForeachBatchBridge(sinks=[live], lance_uri=tmp_path / "x.lance", mode="append")
