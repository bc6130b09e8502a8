"""The core's edges: fair waiting, byte accounting, timeouts, partial streams, type names,
Ctrl-C while woken, interpreter exit with blocked producers, errors raised inside queries."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import textwrap
import threading
import time
from typing import Literal

import datafusion
import pyarrow as pa
import pytest

from pushtable import (
    SchemaMismatchError,
    SessionContext,
    SinkClosedError,
    StreamFailedError,
    TableSink,
    WriteTimeoutError,
    _native,
)
from tests.conftest import SCHEMA, WAIT, Background, batch, full_table, query, wait_until
from tests.ctrl_c import BLOCKED_WRITE_CHILD, CtrlC


def _waiting(sink: TableSink, n: int) -> bool:
    return sink.stats.waiting_writers == n


# --- fairness -----------------------------------------------------------------------------


@pytest.mark.parametrize("run", range(5))
def test_blocked_writers_are_served_in_arrival_order(run: int) -> None:
    # One scan partition, so the query's output order is the queue's order.
    ctx = SessionContext(datafusion.SessionConfig().with_target_partitions(1))
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    sink.write(batch(1, 0))
    writers = []
    for i in range(1, 7):  # each one arrives after the previous is waiting in line
        writers.append(Background(functools.partial(sink.write, batch(1, i), timeout=WAIT)))
        wait_until(functools.partial(_waiting, sink, i), f"writer {i} to block")
    reader = query(ctx, "SELECT k FROM t")
    for w in writers:
        w.join()
    sink.close()
    assert reader.join() == {"k": [0, 1, 2, 3, 4, 5, 6]}


def test_an_earlier_writer_never_times_out_while_a_later_one_gets_in() -> None:
    ctx = SessionContext(datafusion.SessionConfig().with_target_partitions(1))  # output in order
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    sink.write(batch(1, 0))
    first = Background(lambda: sink.write(batch(1, 1), timeout=WAIT))
    wait_until(lambda: sink.stats.waiting_writers == 1, "the first writer to block")
    # A later arrival with no timeout to spare fails at once: it may not overtake the line.
    with pytest.raises(WriteTimeoutError):
        sink.write(batch(1, 2), timeout=0)
    reader = query(ctx, "SELECT k FROM t")
    first.join()
    sink.close()
    assert reader.join() == {"k": [0, 1]}


# --- byte accounting ----------------------------------------------------------------------


def test_a_slice_is_charged_for_its_rows_not_its_parent_buffer(ctx: SessionContext) -> None:
    big = pa.table(
        {"k": pa.array(range(1_000_000), pa.int32()), "v": pa.array([0.5] * 1_000_000)},
        schema=SCHEMA,
    )
    slices = big.to_batches(max_chunksize=1_000)
    one = slices[0]
    assert one.get_total_buffer_size() > 1_000_000  # shares the parent's buffers
    assert _native.batch_bytes(one) == 1_000 * (4 + 8)
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=100, max_bytes=50_000)
    for s in slices[:4]:  # 4 x 12,000 bytes fit the 50,000-byte budget without a reader
        sink.write(s, timeout=0)
    assert sink.stats.queued_bytes == 48_000
    assert sink.stats.bytes == 48_000
    with pytest.raises(WriteTimeoutError):
        sink.write(slices[4], timeout=0)


# --- timeouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e20, math.inf, sys.float_info.max])
def test_huge_and_infinite_timeouts_mean_no_limit(ctx: SessionContext, timeout: float) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    sink.write(batch(1), timeout=timeout)
    blocked = Background(lambda: sink.write(batch(1), timeout=timeout))
    wait_until(lambda: sink.stats.waiting_writers == 1, "the writer to block")
    sink.close()
    assert isinstance(blocked.join_error(), SinkClosedError)


@pytest.mark.parametrize("timeout", [-1.0, math.nan])
def test_negative_or_nan_timeout_is_refused(ctx: SessionContext, timeout: float) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    with pytest.raises(ValueError, match="timeout"):
        sink.write(batch(1), timeout=timeout)
    assert sink.stats.batches == 0


# --- streams written batch by batch ---------------------------------------------------------


NOT_NULL = pa.schema([pa.field("k", pa.int32(), nullable=False), ("v", pa.float64())])


def test_a_stream_failing_midway_reports_what_it_queued(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", NOT_NULL, capacity=8)
    good = pa.record_batch([pa.array([1, 2], pa.int32()), pa.array([0.1, 0.2])], schema=SCHEMA)
    bad = pa.record_batch([pa.array([3, None], pa.int32()), pa.array([0.3, 0.4])], schema=SCHEMA)
    with pytest.raises(SchemaMismatchError, match="NOT NULL") as info:
        sink.write(pa.Table.from_batches([good, bad, good]))
    assert info.value.batches_written == 1
    assert sink.stats.batches == 1
    sink.write(good)  # the sink stays usable
    sink.close()
    assert ctx.sql("SELECT k FROM t").to_pydict() == {"k": [1, 2, 1, 2]}


def test_a_stream_timing_out_midway_reports_what_it_queued(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    with pytest.raises(WriteTimeoutError) as info:
        sink.write(pa.Table.from_batches([batch(1, i) for i in range(4)]), timeout=0.05)
    assert info.value.batches_written == 2
    assert sink.stats.queued_batches == 2


def test_a_single_batch_error_wrote_nothing(ctx: SessionContext) -> None:
    sink = full_table(ctx)
    with pytest.raises(WriteTimeoutError) as info:
        sink.write(batch(1), timeout=0)
    assert info.value.batches_written == 0


# --- messages speak pyarrow -----------------------------------------------------------------


def test_type_names_in_errors_are_pyarrow_names(ctx: SessionContext) -> None:
    schema = pa.schema([("k", pa.int32()), ("ts", pa.timestamp("us", tz="UTC"))])
    sink = ctx.register_streaming_table("t", schema)
    wrong = pa.record_batch(
        [pa.array([1], pa.int64()), pa.array([0], pa.timestamp("us", tz="UTC"))],
        names=["k", "ts"],
    )
    with pytest.raises(SchemaMismatchError) as info:
        sink.write(wrong)
    assert "field 'k' has type int64 in the batch, expected int32" in str(info.value)
    missing = pa.record_batch([pa.array([1], pa.int32())], names=["k"])
    with pytest.raises(SchemaMismatchError, match=r"expected timestamp\[us, tz=UTC\]"):
        sink.write(missing)


# --- Ctrl-C -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["signal", "interrupt_main"])
def test_ctrl_c_reaches_a_main_thread_writer_that_keeps_being_woken(
    ctx: SessionContext, how: Literal["signal", "interrupt_main"]
) -> None:
    sink = full_table(ctx)
    stop = threading.Event()

    def wake_the_line() -> None:  # every cancellation wakes every waiting writer
        while not stop.is_set():
            sink._native.token().cancel()
            time.sleep(0.002)

    waker = threading.Thread(target=wake_the_line, daemon=True)
    waker.start()
    try:
        # Ctrl-C 0.2 s into the wait, while the writer keeps being woken.
        with CtrlC(ready=lambda: _waiting(sink, 1), after=0.2, how=how):
            sink.write(batch(1), timeout=WAIT)  # on the main thread
    finally:
        stop.set()
        waker.join(WAIT)
    assert sink.stats.batches == 1
    assert sink.stats.waiting_writers == 0


ASYNCIO_CTRL_C = BLOCKED_WRITE_CHILD + textwrap.dedent(
    """
    import asyncio

    ctx, sink = full_sink()

    async def blocked_write():
        sink.write(one, timeout=60)  # a blocking write inside a coroutine: it holds the loop

    async def main():
        if sys.argv[1] == "main task":
            await blocked_write()
        else:
            await asyncio.gather(asyncio.sleep(60), blocked_write())

    ctrl_c_once_blocked(sink)
    try:
        asyncio.run(main())
        print("returned")
    except BaseException as exc:
        print(type(exc).__name__, sink.stats.waiting_writers, sink.stats.batches)
    """
)


@pytest.mark.parametrize("where", ["main task", "child task"])
def test_ctrl_c_ends_a_blocking_write_inside_asyncio_run(where: str) -> None:
    # asyncio.run's SIGINT handler only cancels the main task and returns; the task cannot
    # see that while a blocking write holds its loop, so the write itself must end (as an
    # await would, with CancelledError, which asyncio.run turns into KeyboardInterrupt).
    # A fresh process: asyncio installs its handler only over Python's default one.
    done = subprocess.run(
        [sys.executable, "-c", ASYNCIO_CTRL_C, where],
        capture_output=True,
        text=True,
        timeout=3 * WAIT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["KeyboardInterrupt", "0", "1"], done.stdout + done.stderr


# --- interpreter exit -----------------------------------------------------------------------


EXIT_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import pyarrow as pa
    from pushtable import SessionContext

    schema = pa.schema([("k", pa.int32())])
    one = pa.record_batch([pa.array([1], pa.int32())], schema=schema)
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=1)
    sink.write(one)
    for _ in range(3):  # daemon producers blocked when the interpreter exits
        threading.Thread(target=sink.write, args=(one,), daemon=True).start()
    deadline = time.monotonic() + 30
    while sink.stats.waiting_writers < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    print("blocked", sink.stats.waiting_writers, flush=True)
    # Exiting drops the session during finalization: the reader goes, the writers wake.
    """
)


def test_interpreter_exits_cleanly_with_blocked_daemon_producers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=WAIT
    )
    assert done.stdout.strip() == "blocked 3", done.stderr
    assert done.returncode == 0, done.stderr
    assert "Fatal" not in done.stderr, done.stderr
    assert "panic" not in done.stderr, done.stderr


MID_POLL_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import pyarrow as pa
    from pushtable import SessionContext

    schema = pa.schema([("x", pa.int64())])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=2)
    df = ctx.sql(sys.argv[1])
    flowing = threading.Event()

    def consume():
        for _ in df.execute_stream():
            flowing.set()

    def produce():
        i = 0
        while True:
            sink.write(pa.record_batch([pa.array([i, i + 1])], schema=schema))
            i += 2

    threading.Thread(target=consume, daemon=True).start()
    threading.Thread(target=produce, daemon=True).start()
    print("flowing", flowing.wait(30), flush=True)
    # The interpreter exits with the query mid-poll and the producer mid-write.
    """
)


@pytest.mark.parametrize(
    "sql",
    ["SELECT x FROM t", "SELECT x % 3 AS k, count(*) AS n FROM t GROUP BY x % 3 EMIT CHANGES"],
    ids=["scan", "updating"],
)
def test_interpreter_exits_cleanly_with_a_query_mid_poll_and_a_producer_mid_write(
    sql: str,
) -> None:
    # Python < 3.14 ends a thread that takes the GIL while the interpreter finalizes with
    # pthread_exit; inside native code that aborted the process ("FATAL: exception not
    # rethrown", every run of three before the fix). Three runs, each must exit with 0.
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", MID_POLL_SCRIPT, sql],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert done.stdout.strip() == "flowing True", done.stdout + done.stderr
        assert done.returncode == 0, done.stderr[-2000:]
        assert "FATAL" not in done.stderr, done.stderr[-2000:]


# --- errors raised inside queries ---------------------------------------------------------


def test_a_failed_producer_raises_stream_failed_error_with_its_exception(
    ctx: SessionContext,
) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA)
    cause = LookupError("shard 7 vanished")
    reader = query(ctx, "SELECT k FROM t")
    sink.write(batch(1))
    sink.fail(cause)
    error = reader.join_error()
    assert isinstance(error, StreamFailedError)
    assert error.error is cause
    assert error.__cause__ is cause
    assert "'t'" in str(error)
    assert "LookupError: shard 7 vanished" in str(error)


def test_stream_failed_error_from_a_stream_and_async_iteration(ctx: SessionContext) -> None:
    import asyncio

    sink = ctx.register_streaming_table("a", SCHEMA)
    sink.fail(RuntimeError("x"))
    with pytest.raises(StreamFailedError):
        for _ in ctx.sql("SELECT k FROM a").execute_stream():
            pass
    sink = ctx.register_streaming_table("b", SCHEMA)
    sink.fail(RuntimeError("y"))

    async def drain() -> None:
        async for _ in ctx.sql("SELECT k FROM b"):
            pass

    with pytest.raises(StreamFailedError, match="RuntimeError: y"):
        asyncio.run(asyncio.wait_for(drain(), WAIT))
