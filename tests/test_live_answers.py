"""Answers while data arrives: filters run in the scan (no operator waits for `batch_size`
rows), the scan reads with several partitions, and ordered tables enforce their order."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushtable import (
    OrderViolationError,
    ReaderGoneError,
    SessionContext,
    StreamConsumedError,
)
from tests.conftest import SCHEMA, WAIT, Background, batch, query


def physical_plan(ctx: SessionContext, sql: str) -> str:
    return str(ctx.sql(sql).execution_plan().display_indent())


class Results:
    """A query's result batches as they come, read in a background thread."""

    def __init__(self, ctx: SessionContext, sql: str) -> None:
        self.batches: queue.Queue[Any] = queue.Queue()

        def read() -> None:
            try:
                for b in ctx.sql(sql).execute_stream():
                    self.batches.put(b.to_pyarrow())
            except Exception as exc:  # noqa: BLE001 - handed to the test
                self.batches.put(exc)
            self.batches.put(None)

        threading.Thread(target=read, daemon=True).start()

    def rows(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` result rows; fails the test if they do not come within WAIT."""
        out: list[dict[str, Any]] = []
        while len(out) < n:
            try:
                item = self.batches.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"only {len(out)} of {n} rows arrived without more data")
            assert item is not None, f"stream ended after {len(out)} of {n} rows"
            if isinstance(item, BaseException):
                raise item
            out.extend(item.to_pylist())
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The rows that come until the stream ends (its error raised); fails the test if it
        does not end within WAIT. ``finish() == []``: no further row, no error."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                item = self.batches.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"the stream did not end within {WAIT}s ({len(out)} more rows)")
            if item is None:
                return out
            if isinstance(item, BaseException):
                raise item
            out.extend(item.to_pylist())


# --- filters and projections answer per batch -------------------------------------------------


@pytest.mark.parametrize("rows", [1, 100, 8192])
@pytest.mark.parametrize(
    "sql",
    [
        "SELECT k FROM t WHERE k % 2 = 0",
        "SELECT k, v * 2 AS w FROM t",
        "SELECT k FROM t WHERE v >= 0 AND k < 1000000",
    ],
)
@pytest.mark.parametrize("order_by", [None, "k"])
def test_each_batch_is_answered_before_the_next_write(
    rows: int, sql: str, order_by: str | None
) -> None:
    # An ordered table too: a round-robin repartition above its scan would hold small
    # batches until batch_size rows (DataFusion 54), so the scan gives DataFusion no reason
    # to add one.
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=4, order_by=order_by)
    results = Results(ctx, sql)
    for i in (0, 2, 4):  # nothing else is written until this batch's rows came out
        sink.write(batch(rows, i * rows))
        ks = range(i * rows, (i + 1) * rows)
        expected = [k for k in ks if k % 2 == 0] if "% 2" in sql else list(ks)
        keys = [r["k"] for r in results.rows(len(expected))]
        assert (keys if order_by else sorted(keys)) == expected  # an ordered table, in order
    sink.close()


def test_a_filter_is_evaluated_in_the_scan_not_by_a_filter_operator(ctx: SessionContext) -> None:
    ctx.register_streaming_table("t", SCHEMA)
    plan = physical_plan(ctx, "SELECT k, v * 2 FROM t WHERE k > 3 AND v < 1")
    assert "LiveScanExec" in plan
    assert "FilterExec" not in plan
    # No repartition between the scan and the projection: one holds rows for batch_size.
    assert "RepartitionExec" not in plan
    assert "CoalesceBatchesExec" not in plan


def test_the_scan_reads_with_target_partitions_partitions() -> None:
    ctx = SessionContext(datafusion.SessionConfig().with_target_partitions(3))
    ctx.register_streaming_table("t", SCHEMA)
    ctx.register_streaming_table("o", SCHEMA, order_by="k")
    assert ctx.sql("SELECT k FROM t").execution_plan().partition_count == 3
    # An ordered table's scan has as many, but only the first reads (in order); the others
    # are empty. With one, DataFusion would add a round-robin repartition above it.
    plan = ctx.sql("SELECT k, k + 1 AS j FROM o").execution_plan()
    assert plan.partition_count == 3
    assert "RepartitionExec" not in str(plan.display_indent())


def test_filtered_results_are_exact(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    reader = query(
        ctx, "SELECT count(*) AS n, sum(k) AS s FROM t WHERE k % 3 = 0 AND v BETWEEN 1 AND 50"
    )
    for i in range(50):
        sink.write(batch(10, i * 10), timeout=WAIT)
    sink.close()
    ks = [k for k in range(500) if k % 3 == 0 and 1 <= k / 10 <= 50]
    assert reader.join() == {"n": [len(ks)], "s": [sum(ks)]}


def test_a_filter_with_a_limit_stops_after_enough_matches(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    reader = query(ctx, "SELECT k FROM t WHERE k >= 5 LIMIT 3")

    def write_all() -> None:
        for i in range(100):
            sink.write(batch(1, i), timeout=WAIT)

    writer = Background(write_all)
    got = reader.join()["k"]
    # Any three matches (no ORDER BY; the scan's partitions race for batches), each once.
    assert len(got) == 3
    assert len(set(got)) == 3
    assert all(k >= 5 for k in got)
    assert isinstance(writer.join_error(), ReaderGoneError)  # the reader went away


def test_a_volatile_filter_stays_above_the_scan(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    sink.write(batch(5))
    sink.close()
    plan = physical_plan(ctx, "SELECT k FROM t WHERE random() < 2")
    assert "FilterExec" in plan
    assert ctx.sql("SELECT k FROM t WHERE random() < 2").to_pydict() == {"k": [0, 1, 2, 3, 4]}


@pytest.mark.parametrize(
    "where",
    [
        "info['note'] = 'n0'",  # get_field: its field name must reach it as a scalar
        "info['at'] IS NOT NULL",
        "upper(info['note']) LIKE 'N%'",
        "positive(id - 1)",  # the session's own UDF, run where it lives
    ],
)
def test_a_filter_on_a_struct_field_or_a_function_runs_in_the_scan(where: str) -> None:
    """A filter pushed into the scan is evaluated with pushtable's own built-in functions; a
    function from datafusion-python (a foreign UDF) hands its arguments over as arrays, which
    ``get_field`` refuses for a field name. A UDF of the session's own stays the session's.
    The answer is DataFusion's over the same rows."""
    import pyarrow.compute as pc

    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("info", pa.struct([("note", pa.string()), ("at", pa.timestamp("us", tz="UTC"))])),
        ]
    )
    rows = [
        {"id": 0, "info": {"note": "n0", "at": 1}},
        {"id": 1, "info": {"note": None, "at": None}},
        {"id": 2, "info": {"note": "n2", "at": 2}},
        {"id": 3, "info": None},
    ]
    positive = datafusion.udf(
        lambda v: pc.greater(v, 0), [pa.int64()], pa.bool_(), "immutable", name="positive"
    )
    written = pa.RecordBatch.from_pylist(rows, schema=schema)
    sql = f"SELECT id FROM t WHERE {where}"
    reference = datafusion.SessionContext()
    reference.register_udf(positive)
    reference.register_record_batches("t", [[written]])
    expected = sorted(reference.sql(sql).to_pydict()["id"])
    assert expected  # each filter keeps some rows
    ctx = SessionContext()
    ctx.register_udf(positive)
    sink = ctx.register_streaming_table("t", schema)
    assert "FilterExec" not in physical_plan(ctx, sql)  # in the scan
    reader = query(ctx, sql)
    sink.write(written)
    sink.close()
    assert sorted(reader.join()["id"]) == expected


def test_a_live_table_joins_a_lance_dataset_with_its_filter_in_the_scan(tmp_path: Path) -> None:
    names = pa.table({"k": pa.array(range(10), pa.int32()), "name": [f"n{i}" for i in range(10)]})
    dataset = lance.write_dataset(names, str(tmp_path / "names.lance"))
    ctx = SessionContext()
    ctx.register_table("names", lance.FFILanceTableProvider(dataset))
    sink = ctx.register_streaming_table("t", SCHEMA)
    sql = "SELECT t.k, n.name FROM t JOIN names n ON t.k = n.k WHERE t.v >= 0.5 ORDER BY t.k"
    assert "FilterExec" not in physical_plan(ctx, sql)
    reader = query(ctx, sql)
    sink.write(batch(10))
    sink.close()
    assert reader.join() == {"k": [5, 6, 7, 8, 9], "name": ["n5", "n6", "n7", "n8", "n9"]}


def test_several_partitions_still_scan_once(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    sink.write(batch(4))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t WHERE k > 0").to_pydict() == {"n": [3]}
    with pytest.raises(StreamConsumedError):
        ctx.sql("SELECT k FROM t WHERE k > 0").collect()


# --- ordered streams --------------------------------------------------------------------------

TS = pa.schema([("ts", pa.int64()), ("v", pa.float64())])


def ts_batch(*ts: int | None) -> pa.RecordBatch:
    return pa.record_batch([pa.array(ts, pa.int64()), pa.array([1.0] * len(ts))], schema=TS)


def test_an_out_of_order_batch_is_rejected_whole_and_named(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", TS, order_by="ts")
    sink.write(ts_batch(1, 2, 5))
    with pytest.raises(OrderViolationError) as info:
        sink.write(ts_batch(4, 6))  # starts behind the newest value written
    message = str(info.value)
    assert "'ts'" in message
    assert "ts=4" in message
    assert "previous maximum ts=5" in message
    assert sink.stats.batches == 1  # nothing of it was queued
    sink.write(ts_batch(5, 7))  # equal to the maximum is in order; the sink stays usable
    sink.close()
    assert ctx.sql("SELECT ts FROM t").to_pydict() == {"ts": [1, 2, 5, 5, 7]}


def test_disorder_within_a_batch_is_rejected(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", TS, order_by=["ts"])
    with pytest.raises(OrderViolationError, match=r"row 2 has ts=3 after row 1 with ts=8"):
        sink.write(ts_batch(1, 8, 3))
    assert sink.stats.batches == 0
    assert isinstance(OrderViolationError("x"), ValueError)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=3000),
    at=st.floats(min_value=0, max_value=1, exclude_max=True),
    step=st.integers(min_value=1, max_value=2**40),
)
def test_the_first_descent_is_found_wherever_it_is(n: int, at: float, step: int) -> None:
    """The order check is vectorised over chunks of the column: a descent at any row (chunk
    edges included) is found and named, and a sorted batch of any length passes."""
    descent = 1 + int(at * (n - 1))
    ts = [i * step for i in range(n)]
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", TS, order_by="ts")
    sink.write(ts_batch(*ts))
    ts[descent] = ts[descent - 1] - 1
    with pytest.raises(OrderViolationError, match=rf"row {descent} has ts="):
        sink.write(ts_batch(*[t + n * step for t in ts]))  # after the first batch
    assert sink.stats.batches == 1


def test_nulls_in_an_order_column_are_rejected(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", TS, order_by="ts", late="drop")
    with pytest.raises(OrderViolationError, match="'ts' holds 1 null"):
        sink.write(ts_batch(1, None, 3))
    assert sink.stats.batches == 0


def test_late_rows_are_dropped_and_counted(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", TS, order_by="ts", late="drop")
    sink.write(ts_batch(1, 5, 3, 6))  # 3 is behind 5 within the batch
    sink.write(ts_batch(2, 4, 6, 9))  # 2 and 4 are behind the newest value, 6
    sink.write(ts_batch(1, 2))  # wholly late: nothing is queued
    assert sink.stats.late_rows == 5
    assert sink.stats.batches == 2
    sink.close()
    assert ctx.sql("SELECT ts FROM t").to_pydict() == {"ts": [1, 5, 6, 6, 9]}


def test_a_multi_column_order_is_lexicographic(ctx: SessionContext) -> None:
    schema = pa.schema([("day", pa.int32()), ("seq", pa.int32())])
    sink = ctx.register_streaming_table("t", schema, order_by=["day", "seq"])

    def rows(*pairs: tuple[int, int]) -> pa.RecordBatch:
        days, seqs = zip(*pairs, strict=True)
        columns = [pa.array(days, pa.int32()), pa.array(seqs, pa.int32())]
        return pa.record_batch(columns, schema=schema)

    sink.write(rows((1, 5), (1, 9), (2, 0)))
    with pytest.raises(OrderViolationError, match=r"day=1, seq=3.*day=2, seq=0"):
        sink.write(rows((1, 3)))
    sink.write(rows((2, 1), (3, 0)))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [5]}


def test_concurrent_producers_cannot_interleave_out_of_order() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", TS, capacity=4, order_by="ts", late="drop")
    reader = query(ctx, "SELECT ts FROM t")
    counter = iter(range(1_000_000))
    lock = threading.Lock()

    def produce() -> None:
        for _ in range(200):
            with lock:  # stamps come from one clock, but writes race each other
                first = next(counter)
                second = next(counter)
            sink.write(ts_batch(first, second), timeout=WAIT)

    producers = [Background(produce) for _ in range(4)]
    for p in producers:
        p.join()
    sink.close()
    seen = reader.join()["ts"]
    assert seen == sorted(seen)  # whatever arrived late was dropped, never misplaced
    assert len(seen) + sink.stats.late_rows == 1600


def test_order_by_names_a_column_of_the_schema(ctx: SessionContext) -> None:
    with pytest.raises(ValueError, match="order_by column 'nope' is not in the schema"):
        ctx.register_streaming_table("t", TS, order_by="nope")
    with pytest.raises(ValueError, match="late must be"):
        ctx.register_streaming_table("u", TS, order_by="ts", late="ignore")  # type: ignore[arg-type]


# --- know before you run ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "mode", "says"),
    [
        ("SELECT k FROM t WHERE k > 1", "incremental", None),
        ("SELECT k, v FROM t LIMIT 5", "incremental", None),
        # The limit gathers one partition; DataFusion then spreads the projection round-robin.
        ("SELECT k, v * 2 AS w FROM t LIMIT 5", "batched", "repartition"),
        # The live engine joins each batch as it arrives (DataFusion's own join would batch).
        ("SELECT t.k, d.name FROM t JOIN dim d ON t.k = d.k", "incremental", "joined rows"),
        ("SELECT k FROM t WHERE random() < 0.5", "batched", "volatile"),
        ("SELECT k, count(*) FROM t GROUP BY k", "at_end", "whole stream"),
        ("SELECT k FROM t ORDER BY v", "at_end", "ORDER BY"),
        ("SELECT k, count(*) FROM u GROUP BY k", "incremental", "upsert changelog"),
        ("SELECT k, count(*) FROM u GROUP BY k HAVING count(*) > 1", "rejected", "HAVING"),
        ("SELECT k FROM u ORDER BY v", "rejected", "SortExec"),
        ("SELECT k FROM u WHERE k > 0", "incremental", None),
    ],
)
def test_explain_live_says_how_a_query_will_answer(sql: str, mode: str, says: str | None) -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA)
    ctx.register_streaming_table("u", SCHEMA, unbounded=True)
    ctx.register_record_batches(
        "dim", [[pa.record_batch({"k": pa.array([1], pa.int32()), "name": ["one"]})]]
    )
    explained = ctx.explain_live(sql)
    assert explained.mode == mode, str(explained)
    if explained.engine == "pushtable":  # t has no order: nothing may claim one
        assert "order" not in str(explained).split("\n", 1)[1], str(explained)
    if says is None:
        assert explained.reasons == []
    else:
        assert any(says in r for r in explained.reasons), explained.reasons
        assert explained.hint or explained.engine == "pushtable"
    # Explaining planned the query but did not consume the table.
    sink.write(batch(2))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [2]}


@pytest.mark.parametrize("kind", ["JOIN", "LEFT JOIN"])
def test_a_lookup_join_with_a_condition_beyond_the_keys_answers_per_batch(kind: str) -> None:
    """``t LEFT JOIN dim ON t.k = d.k AND t.v >= d.floor``: each batch's rows come out as it
    arrives (live rows without a match kept by the left join), the rows of the same query
    over the whole input."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, unbounded=True)
    dim = pa.record_batch(
        {
            "k": pa.array([1, 1, 2, 3], pa.int32()),
            "floor": [0.0, 0.5, 0.25, None],
            "name": ["low", "high", "two", "three"],
        }
    )
    ctx.register_record_batches("dim", [[dim]])
    query = f"SELECT t.k, t.v, d.name FROM t {kind} dim d ON t.k = d.k AND t.v >= d.floor"
    explained = ctx.explain_live(query)
    assert (explained.mode, explained.engine) == ("incremental", "pushtable"), explained
    results = Results(ctx, query)
    first = pa.record_batch(
        [pa.array([1, 2, 3, 4], pa.int32()), pa.array([0.7, 0.1, 0.9, 1.0])], schema=SCHEMA
    )
    sink.write(first)
    # (1, low) and (1, high); the left join adds 2 (below its floor), 3 (a null floor), 4
    got = results.rows(2 if kind == "JOIN" else 5)
    second = pa.record_batch([pa.array([1, 2], pa.int32()), pa.array([0.2, 0.3])], schema=SCHEMA)
    sink.write(second)
    got += results.rows(2)  # (1, low) and (2, two)
    sink.close()
    whole = datafusion.SessionContext()
    whole.register_record_batches("t", [[first, second]])
    whole.register_record_batches("dim", [[dim]])
    expected = whole.sql(query).to_arrow_table().to_pylist()
    key = lambda r: (r["k"], r["v"], str(r["name"]))  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)
