"""The semantics of a streaming table (docs/semantics.md), one section per numbered point."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import textwrap
import threading
import time
from typing import Literal

import datafusion
import polars as pl
import pyarrow as pa
import pytest

import pushtable
from pushtable import (
    InvalidBatchError,
    PushTableError,
    ReaderGoneError,
    SchemaMismatchError,
    SessionContext,
    SinkClosedError,
    StreamConsumedError,
    StreamFailedError,
    WriteTimeoutError,
    register_streaming_table,
)
from tests.conftest import SCHEMA, WAIT, Background, batch, full_table, query, write_many
from tests.ctrl_c import CtrlC

# --- 1. backpressure ----------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_capacity_must_be_a_positive_integer(ctx: SessionContext, capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        ctx.register_streaming_table("t", SCHEMA, capacity=capacity)  # type: ignore[arg-type]
    assert not ctx.table_exist("t")


def test_max_bytes_must_be_positive(ctx: SessionContext) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        ctx.register_streaming_table("t", SCHEMA, max_bytes=0)


def test_full_queue_blocks_until_timeout_then_accepts_once_read(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    sink.write(batch(3))
    sink.write(batch(3, 3))
    with pytest.raises(WriteTimeoutError, match="timed out") as info:
        sink.write(batch(3, 6), timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    stats = sink.stats
    assert (stats.batches, stats.queued_batches) == (2, 2)
    assert stats.blocked_seconds >= 0.15
    reader = query(ctx, "SELECT count(*) AS n, sum(k) AS s FROM t")
    sink.write(batch(3, 6), timeout=WAIT)  # room appears once the query reads
    sink.close()
    assert reader.join() == {"n": [9], "s": [sum(range(9))]}


def test_max_bytes_bounds_the_queued_bytes(ctx: SessionContext) -> None:
    one = batch(1000)
    size = one.get_total_buffer_size()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=100, max_bytes=int(size * 1.5))
    sink.write(one)
    with pytest.raises(WriteTimeoutError):
        sink.write(batch(1000), timeout=0.1)
    assert sink.stats.queued_batches == 1
    assert sink.stats.queued_bytes <= int(size * 1.5)


def test_a_batch_larger_than_max_bytes_is_admitted_into_an_empty_queue(
    ctx: SessionContext,
) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=4, max_bytes=16)
    sink.write(batch(1000), timeout=WAIT)
    with pytest.raises(WriteTimeoutError):
        sink.write(batch(1), timeout=0.05)
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [1000]}


def test_negative_timeout_is_rejected(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(ValueError, match="timeout"):
        sink.write(batch(1), timeout=-1)
    assert sink.stats.batches == 0


# --- 2. concurrency -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "rows"),
    [
        # DataFusion coalesces filtered / repartitioned batches up to batch_size rows ...
        (datafusion.SessionConfig(), 8192),
        # ... so small batches stream out one by one with a small batch_size.
        (datafusion.SessionConfig().with_batch_size(5), 5),
    ],
)
def test_results_stream_out_before_close(config: datafusion.SessionConfig, rows: int) -> None:
    ctx = SessionContext(config)
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    first_seen = threading.Event()
    closed = threading.Event()
    seen_before_close: list[bool] = []

    def consume() -> int:
        n = 0
        for b in ctx.sql("SELECT k, v * 2 AS w FROM t WHERE v >= 0").execute_stream():
            n += b.to_pyarrow().num_rows
            if not first_seen.is_set():
                seen_before_close.append(not closed.is_set())
                first_seen.set()
        return n

    reader = Background(consume)
    sink.write(batch(rows))
    assert first_seen.wait(WAIT), "the query produced nothing while the producer was writing"
    sink.write(batch(rows, rows))
    closed.set()
    sink.close()
    assert reader.join() == 2 * rows
    assert seen_before_close == [True]


def test_many_producer_threads_every_row_exactly_once(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=3)
    reader = query(ctx, "SELECT count(*) AS n, count(DISTINCT k) AS d, sum(k) AS s FROM t")
    per, n_threads = 40, 6

    def produce(i: int) -> None:
        for j in range(per):
            sink.write(batch(10, (i * per + j) * 10), timeout=WAIT)

    producers = [Background(functools.partial(produce, i)) for i in range(n_threads)]
    for p in producers:
        p.join()
    sink.close()
    total = n_threads * per * 10
    assert reader.join() == {"n": [total], "d": [total], "s": [sum(range(total))]}


GIL_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import pyarrow as pa
    from pushtable import SessionContext

    schema = pa.schema([("k", pa.int64())])
    ctx = SessionContext()  # kept: a table whose session is dropped has no reader to come
    sink = ctx.register_streaming_table("t", schema, capacity=1)
    one = pa.record_batch([pa.array([1])], schema=schema)
    sink.write(one)  # the table is full: the next write blocks in the native core
    threading.Thread(target=sink.write, args=(one,), daemon=True).start()
    deadline = time.monotonic() + 30
    while sink.stats.waiting_writers == 0:
        assert time.monotonic() < deadline, "the writer never blocked"
        time.sleep(0.001)
    n = sum(1 for _ in range(2_000_000))  # Python work while the writer is blocked
    print("ran", n, sink.stats.waiting_writers, flush=True)
    """
)


def test_gil_is_released_while_a_write_is_blocked() -> None:
    """Python runs while a write is blocked: in a child process, so that a blocked writer
    holding the GIL (which would stop every other thread, the test's too) is a timeout the
    test reports, not a hang of the suite. The writer is still blocked after the work."""
    done = subprocess.run(
        [sys.executable, "-c", GIL_SCRIPT], capture_output=True, text=True, timeout=WAIT
    )
    assert done.stdout.split() == ["ran", "2000000", "1"], done.stdout + done.stderr


@pytest.mark.parametrize("how", ["signal", "interrupt_main"])
def test_ctrl_c_interrupts_a_blocked_write(
    ctx: SessionContext, how: Literal["signal", "interrupt_main"]
) -> None:
    sink = full_table(ctx)
    # Sent once the main thread is blocked in the write (not after a delay).
    with CtrlC(ready=lambda: sink.stats.waiting_writers == 1, how=how):
        sink.write(batch(1), timeout=WAIT)  # runs on the main thread
    assert sink.stats.batches == 1
    assert sink.stats.waiting_writers == 0


# --- 3. end of stream ---------------------------------------------------------------------


def test_close_is_idempotent_and_queued_batches_are_still_delivered(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=8)
    for i in range(4):
        sink.write(batch(2, i * 2))
    sink.close()
    sink.close()
    assert sink.closed
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [8]}


def test_write_after_close_raises(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    sink.close()
    with pytest.raises(SinkClosedError, match="'t' is closed"):
        sink.write(batch(1))


def test_close_unblocks_a_blocked_writer(ctx: SessionContext) -> None:
    sink = full_table(ctx)
    blocked = Background(lambda: sink.write(batch(1, 1), timeout=WAIT))
    deadline = time.monotonic() + WAIT
    while sink.stats.waiting_writers == 0:  # the close below must find it blocked
        assert time.monotonic() < deadline, "the writer never blocked"
        time.sleep(0.001)
    assert not blocked.done.is_set()
    sink.close()
    assert isinstance(blocked.join_error(), SinkClosedError)
    assert ctx.sql("SELECT k FROM t").to_pydict() == {"k": [0]}


# --- 4. failure ---------------------------------------------------------------------------


def test_fail_never_blocks_and_the_query_raises_the_original_error(ctx: SessionContext) -> None:
    sink = full_table(ctx)  # the queue is full and nobody reads
    boom = ValueError("disk on fire")
    Background(lambda: sink.fail(boom)).join(timeout=5)
    assert sink.error is boom
    with pytest.raises(StreamFailedError, match=r"ValueError: disk on fire"):
        ctx.sql("SELECT count(*) FROM t").collect()
    with pytest.raises(SinkClosedError, match="failed"):
        sink.write(batch(1))


def test_fail_reaches_a_query_that_is_already_running(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    reader = query(ctx, "SELECT count(*) FROM t")
    sink.write(batch(3))
    sink.fail(RuntimeError("upstream lost"))
    err = reader.join_error()
    assert isinstance(err, StreamFailedError), err
    assert "RuntimeError: upstream lost" in str(err)
    assert "'t'" in str(err)


def test_with_block_closes_or_fails(ctx: SessionContext) -> None:
    ok = ctx.register_streaming_table("ok", SCHEMA)
    with ok:
        ok.write(batch(2))
    assert ok.closed
    assert ok.error is None
    bad = ctx.register_streaming_table("bad", SCHEMA)
    with pytest.raises(KeyError), bad:
        bad.write(batch(2))
        raise KeyError("missing shard")
    assert isinstance(bad.error, KeyError)
    with pytest.raises(StreamFailedError, match="KeyError: 'missing shard'"):
        ctx.sql("SELECT * FROM bad").collect()
    assert ctx.sql("SELECT count(*) AS n FROM ok").to_pydict() == {"n": [2]}


def test_fail_requires_an_exception(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(TypeError, match="exception"):
        sink.fail("not an exception")  # type: ignore[arg-type]


# --- 5. single scan -----------------------------------------------------------------------


def test_second_query_is_refused(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("shards", SCHEMA)
    sink.write(batch(2))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM shards").to_pydict() == {"n": [2]}
    with pytest.raises(StreamConsumedError, match=r"'shards'.*single-scan"):
        ctx.sql("SELECT count(*) FROM shards").collect()
    # Every way of running a query raises the same class: streams and iteration included.
    with pytest.raises(StreamConsumedError):
        next(iter(ctx.sql("SELECT k FROM shards").execute_stream()))
    with pytest.raises(StreamConsumedError):
        list(ctx.table("shards"))
    with pytest.raises(StreamConsumedError):
        ctx.sql("SELECT k FROM shards").filter(datafusion.col("k") > 0).to_pydict()


def test_a_self_join_reads_the_table_once_and_a_second_query_is_refused(
    ctx: SessionContext,
) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    sink.write(batch(2))
    sink.close()
    joined = ctx.sql("SELECT a.k, b.v FROM t a JOIN t b ON a.k = b.k").to_pydict()
    assert sorted(zip(joined["k"], joined["v"], strict=True)) == [(0, 0.0), (1, 0.1)]
    with pytest.raises(StreamConsumedError, match="single-scan"):
        ctx.sql("SELECT * FROM t a JOIN t b ON a.k = b.k").collect()


def test_planning_does_not_consume_but_explain_analyze_does(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    plan = ctx.sql("EXPLAIN SELECT k FROM t WHERE v > 0").to_pydict()
    assert any("LiveScanExec" in line for line in plan["plan"])
    df = ctx.sql("SELECT sum(k) AS s FROM t")
    df.schema()
    sink.write(batch(4))
    sink.close()
    assert df.to_pydict() == {"s": [6]}
    with pytest.raises(StreamConsumedError, match="single-scan"):
        ctx.sql("EXPLAIN ANALYZE SELECT * FROM t").collect()


def test_stream_consumed_error_is_part_of_the_hierarchy() -> None:
    assert issubclass(StreamConsumedError, PushTableError)


# --- 6. reader gone -----------------------------------------------------------------------


def _blocked_writer(sink: pushtable.TableSink) -> Background:
    """A writer that writes until the queue is full, returned once it is blocked on it.

    (A running scan's partitions may take batches ahead of the query, so the writer keeps
    writing until one write has to wait; every wait is bounded by WAIT.)
    """

    def write_until_it_fails() -> None:
        while True:
            sink.write(batch(1), timeout=WAIT)

    writer = Background(write_until_it_fails)
    deadline = time.monotonic() + WAIT
    while sink.stats.waiting_writers == 0 and not writer.done.is_set():
        assert time.monotonic() < deadline, "the writer never blocked"
        time.sleep(0.001)
    return writer


def test_limit_releases_blocked_writers(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    reader = query(ctx, "SELECT k FROM t LIMIT 3")
    for i in range(3):
        sink.write(batch(1, i), timeout=WAIT)
    assert len(reader.join()["k"]) == 3
    writer = Background(lambda: write_many(sink, batch(1), 5))
    assert isinstance(writer.join_error(), ReaderGoneError)
    with pytest.raises(ReaderGoneError, match="stopped before the end"):
        sink.write(batch(1))


def test_dropping_the_result_stream_releases_blocked_writers(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    stream = ctx.sql("SELECT * FROM t").execute_stream()
    sink.write(batch(1))
    next(iter(stream))
    writer = _blocked_writer(sink)
    del stream
    gc.collect()
    assert isinstance(writer.join_error(), ReaderGoneError)


def test_a_failing_query_releases_blocked_writers() -> None:
    ctx = SessionContext(datafusion.SessionConfig().with_batch_size(1))
    schema = pa.schema([("s", pa.string())])
    sink = ctx.register_streaming_table("t", schema, capacity=1)
    reader = query(ctx, "SELECT CAST(s AS INT) AS i FROM t")
    sink.write(pa.record_batch([pa.array(["1"])], schema=schema), timeout=WAIT)
    sink.write(pa.record_batch([pa.array(["not a number"])], schema=schema), timeout=WAIT)
    assert "not a number" in str(reader.join_error())
    two = pa.record_batch([pa.array(["2"])], schema=schema)
    writer = Background(lambda: write_many(sink, two, 5))
    assert isinstance(writer.join_error(), ReaderGoneError)


def test_dropping_the_table_unscanned_releases_blocked_writers(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    writer = _blocked_writer(sink)
    ctx.deregister_table("t")
    err = writer.join_error()
    assert isinstance(err, ReaderGoneError)
    assert "dropped before any query" in str(err)


# --- 7. schema ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            pa.record_batch(
                [pa.array([1], pa.int32()), pa.array([1], pa.int64())], names=["k", "v"]
            ),
            r"field 'v' has type int64 in the batch, expected double",
        ),
        (pa.record_batch([pa.array([1], pa.int32())], names=["k"]), r"missing field 'v'"),
        (
            pa.record_batch(
                [pa.array([1], pa.int32()), pa.array([1.0]), pa.array(["x"])], names=["k", "v", "w"]
            ),
            r"unexpected field 'w'",
        ),
        (
            pa.record_batch([pa.array([1], pa.int32()), pa.array([1.0])], names=["k", "value"]),
            r"field 1 is named 'value' in the batch, expected 'v'",
        ),
    ],
)
def test_schema_mismatch_names_the_field_and_leaves_the_sink_usable(
    ctx: SessionContext, bad: pa.RecordBatch, message: str
) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(SchemaMismatchError, match=message) as info:
        sink.write(bad)
    assert isinstance(info.value, ValueError)
    assert sink.stats.batches == 0
    sink.write(batch(2))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [2]}


def test_not_null_fields_reject_nulls_but_accept_nullable_batches_without_any(
    ctx: SessionContext,
) -> None:
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    sink = ctx.register_streaming_table("t", schema)
    with pytest.raises(SchemaMismatchError, match=r"'id' is declared NOT NULL .* 1 null"):
        sink.write(pa.record_batch([pa.array([1, None])], names=["id"]))
    sink.write(pa.record_batch([pa.array([1, 2])], names=["id"]))  # nullable field, no nulls
    sink.close()
    assert ctx.sql("SELECT sum(id) AS s FROM t").to_pydict() == {"s": [3]}


def test_types_are_compared_node_by_node_nested_names_aside(ctx: SessionContext) -> None:
    """A batch is imported with the table's own types when its C schema says the same
    types: nested field names do not matter; a time zone or a dictionary's value type does."""
    schema = pa.schema(
        [
            ("tags", pa.list_(pa.field("item", pa.string()))),
            ("at", pa.timestamp("us", tz="UTC")),
            ("service", pa.dictionary(pa.int32(), pa.string())),
        ]
    )
    sink = ctx.register_streaming_table("t", schema)
    tags = pa.array([["a", "b"]], pa.list_(pa.field("element", pa.string())))
    at = pa.array([0], pa.timestamp("us", tz="UTC"))
    service = pa.array(["api"]).dictionary_encode().cast(pa.dictionary(pa.int32(), pa.string()))
    sink.write(pa.record_batch([tags, at, service], names=schema.names))
    with pytest.raises(
        SchemaMismatchError, match=r"field 'at' has type timestamp\[us, tz=Europe/Paris\]"
    ):
        sink.write(
            pa.record_batch(
                [tags, at.cast(pa.timestamp("us", tz="Europe/Paris")), service], names=schema.names
            )
        )
    with pytest.raises(
        SchemaMismatchError, match=r"field 'service' has type dictionary<values=large_string"
    ):
        large = service.cast(pa.dictionary(pa.int32(), pa.large_string()))
        sink.write(pa.record_batch([tags, at, large], names=schema.names))
    assert sink.stats.batches == 1
    sink.close()
    got = ctx.sql("SELECT tags, service FROM t").to_pydict()
    assert got == {"tags": [["a", "b"]], "service": ["api"]}


def test_metadata_is_ignored(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA.with_metadata({b"origin": b"a"}))
    sink.write(batch(1).replace_schema_metadata({b"other": b"b"}))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [1]}


def test_an_empty_batch_is_data_not_end_of_stream(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    reader = query(ctx, "SELECT count(*) AS n FROM t")
    sink.write(batch(0))
    sink.write(batch(3))
    sink.close()
    assert reader.join() == {"n": [3]}
    assert sink.stats.batches == 2


# --- 8. inputs ----------------------------------------------------------------------------


class OnlyArray:
    """Exports a batch through ``__arrow_c_array__`` alone (like arro3 or nanoarrow)."""

    def __init__(self, b: pa.RecordBatch) -> None:
        self._b = b

    def __arrow_c_array__(self, requested_schema: object = None) -> object:
        return self._b.__arrow_c_array__(requested_schema)


class OnlyStream:
    """Exports a stream through ``__arrow_c_stream__`` alone."""

    def __init__(self, t: pa.Table) -> None:
        self._t = t

    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        return self._t.__arrow_c_stream__(requested_schema)


def test_accepts_batches_tables_and_capsule_objects(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=64)
    table = pa.Table.from_batches([batch(2), batch(3, 2)])
    sink.write(batch(1, 100))
    sink.write(table)
    sink.write(OnlyArray(batch(1, 200)))
    sink.write(OnlyStream(table))
    frame = pl.DataFrame(
        {"k": pl.Series([300, 301], dtype=pl.Int32), "v": pl.Series([1.0, 2.0], dtype=pl.Float64)}
    )
    sink.write(frame)
    sink.close()
    assert sink.stats.batches == 1 + 2 + 1 + 2 + 1
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [1 + 5 + 1 + 5 + 2]}


@pytest.mark.parametrize("junk", [None, 42, "text", [1, 2], {"k": [1]}])
def test_objects_that_are_not_arrow_are_rejected(ctx: SessionContext, junk: object) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(InvalidBatchError, match="expected Arrow data") as info:
        sink.write(junk)
    assert isinstance(info.value, TypeError)
    sink.write(batch(1))
    assert sink.stats.batches == 1


def test_a_stream_with_the_wrong_schema_enqueues_nothing(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(SchemaMismatchError, match="'k'"):
        sink.write(pa.table({"k": [1, 2], "v": [1.0, 2.0]}))  # k is int64 here
    assert sink.stats.batches == 0


# --- 9. stats -----------------------------------------------------------------------------


def test_stats_count_what_was_written(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    b = batch(7)
    sink.write(b)
    sink.write(b)
    with pytest.raises(WriteTimeoutError):
        sink.write(b, timeout=0.05)
    s = sink.stats
    assert (s.rows, s.batches, s.queued_batches) == (14, 2, 2)
    assert s.bytes >= 2 * b.nbytes
    assert s.queued_bytes == s.bytes
    assert s.blocked_seconds > 0
    assert not (s.closed)
    assert not (s.failed)
    assert not (s.reader_gone)
    sink.close()
    ctx.sql("SELECT * FROM t").collect()
    s = sink.stats
    assert (s.queued_batches, s.queued_bytes, s.closed) == (0, 0, True)
    assert "rows=14" in repr(sink)


# --- 10. unbounded mode -------------------------------------------------------------------


def test_unbounded_tables_reject_plans_that_need_the_end_of_stream(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, unbounded=True)
    with pytest.raises(pushtable.UnboundedQueryError, match="SortExec needs all of its input"):
        ctx.sql("SELECT * FROM t ORDER BY v").collect()
    # A window function over an unordered table: the message names the operator and what
    # answers instead.
    with pytest.raises(pushtable.UnboundedQueryError) as window:
        ctx.sql("SELECT k, sum(v) OVER () AS s FROM t").to_arrow_table()
    assert "WindowAggExec" in str(window.value)
    assert "order_by" in str(window.value)
    assert "explain_live" in str(window.value)
    stream = ctx.sql("SELECT k FROM t WHERE v >= 0").execute_stream()  # streaming plans run
    sink.write(batch(3))
    sink.close()
    assert sum(b.to_pyarrow().num_rows for b in stream) == 3


def test_bounded_tables_allow_sorting(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    sink.write(batch(3))
    sink.close()
    assert ctx.sql("SELECT k FROM t ORDER BY v DESC").to_pydict() == {"k": [2, 1, 0]}


# --- 11. errors, registration -------------------------------------------------------------


def test_error_hierarchy_is_exported() -> None:
    for cls in (
        pushtable.UnboundedQueryError,
        pushtable.InvalidQueryError,
        pushtable.SinkClosedError,
        pushtable.ReaderGoneError,
        pushtable.StreamConsumedError,
        pushtable.StreamFailedError,
        pushtable.SchemaMismatchError,
        pushtable.InvalidBatchError,
        pushtable.WriteTimeoutError,
    ):
        assert issubclass(cls, PushTableError)
        assert cls.__name__ in pushtable.__all__


def test_register_on_a_plain_datafusion_context() -> None:
    ctx = datafusion.SessionContext()
    sink = register_streaming_table(ctx, "t", SCHEMA, 2)
    sink.write(batch(2))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [2]}


def test_duplicate_name_and_bad_name_are_refused(ctx: SessionContext) -> None:
    ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(ValueError, match="already registered"):
        ctx.register_streaming_table("t", SCHEMA)
    with pytest.raises(ValueError, match="name"):
        ctx.register_streaming_table("", SCHEMA)
