"""Concurrency stress: many producers, racing close/fail, readers abandoned at random points.

Every wait is bounded; a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import random
import threading

import pyarrow as pa
import pytest

from pushtable import (
    ReaderGoneError,
    SchemaMismatchError,
    SessionContext,
    SinkClosedError,
    TableSink,
)
from tests.conftest import SCHEMA, WAIT, Background, batch, query, wait_until


def test_16_threads_and_asyncio_producers_deliver_every_row_once(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=4)
    reader = query(ctx, "SELECT count(*) AS n, count(DISTINCT k) AS d, sum(k) AS s FROM t")
    per = 25

    def threaded(i: int) -> None:
        for j in range(per):
            sink.write(batch(4, (i * per + j) * 4), timeout=WAIT)

    async def tasks() -> None:
        async def one(i: int) -> None:
            for j in range(per):
                await sink.awrite(batch(4, (i * per + j) * 4), timeout=WAIT)

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16, 24))), WAIT)

    threads = [Background(functools.partial(threaded, i)) for i in range(16)]
    asyncio.run(tasks())
    for t in threads:
        t.join()
    sink.close()
    total = 24 * per * 4
    assert reader.join() == {"n": [total], "d": [total], "s": [sum(range(total))]}


def _writer(sink: TableSink, start: int, count: int, written: list[int]) -> None:
    """Write ``count`` one-row batches; record the keys that were accepted."""
    try:
        for k in range(start, start + count):
            sink.write(batch(1, k), timeout=WAIT)
            written.append(k)
    except (SinkClosedError, ReaderGoneError):
        pass


@pytest.mark.parametrize("seed", range(15))
def test_close_racing_blocked_writers_loses_nothing_accepted(seed: int) -> None:
    rng = random.Random(seed)
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=rng.choice([1, 2, 8]))
    written: list[int] = []
    writers = [
        Background(functools.partial(_writer, sink, i * 1000, 50, written)) for i in range(6)
    ]
    # No reader yet: the table fills and writers block (the event the race needs).
    wait_until(lambda: sink.stats.waiting_writers >= 1, "a writer to block")
    reader = query(ctx, "SELECT k FROM t")
    threading.Event().wait(rng.uniform(0, 0.02))
    sink.close()
    for w in writers:
        w.join()
    got = sorted(reader.join()["k"])
    assert got == sorted(written)  # every accepted row delivered once, nothing else


@pytest.mark.parametrize("seed", range(15))
def test_fail_racing_blocked_writers_never_hangs(seed: int) -> None:
    rng = random.Random(seed)
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=rng.choice([1, 4]))
    written: list[int] = []
    writers = [
        Background(functools.partial(_writer, sink, i * 1000, 50, written)) for i in range(6)
    ]
    # No reader yet: the table fills and writers block (the event the race needs).
    wait_until(lambda: sink.stats.waiting_writers >= 1, "a writer to block")
    reader = query(ctx, "SELECT count(*) FROM t")
    threading.Event().wait(rng.uniform(0, 0.02))
    sink.fail(RuntimeError(f"race {seed}"))
    for w in writers:
        w.join()
    assert f"race {seed}" in str(reader.join_error())


@pytest.mark.parametrize("seed", range(15))
def test_reader_cancelled_at_random_points_releases_writers(seed: int) -> None:
    rng = random.Random(seed)
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    written: list[int] = []
    writers = [
        Background(functools.partial(_writer, sink, i * 1000, 200, written)) for i in range(4)
    ]
    stream = ctx.sql("SELECT k FROM t").execute_stream()
    # At least one read: DataFusion starts a multi-partition scan on its runtime just after
    # execute_stream returns, so a stream dropped before any read may never have claimed the
    # table (it then stays unclaimed for a later query, and its writers keep waiting; seen
    # once under load, seed 14 with no read).
    for _ in range(rng.randint(1, 5)):
        next(iter(stream))
    del stream
    gc.collect()
    for w in writers:
        w.join()
    assert len(written) < 800
    with pytest.raises(ReaderGoneError):
        sink.write(batch(1), timeout=WAIT)


def test_abandoned_scans_do_not_starve_other_queries() -> None:
    ctx = SessionContext()
    sinks = [ctx.register_streaming_table(f"t{i}", SCHEMA, capacity=1) for i in range(20)]
    streams = []
    for i, sink in enumerate(sinks):
        sink.write(batch(1, i))
        stream = ctx.sql(f"SELECT * FROM t{i}").execute_stream()
        if i % 2:
            next(iter(stream))  # half read one batch, all are then abandoned mid-stream
        streams.append(stream)
    # With 20 scans parked and their producers idle, the context still answers other queries.
    live = ctx.register_streaming_table("other", SCHEMA)
    live.write(batch(3))
    live.close()
    assert ctx.sql("SELECT count(*) AS n FROM other").to_pydict() == {"n": [3]}
    assert ctx.sql("SELECT 1 + 1 AS two").to_pydict() == {"two": [2]}
    del streams, stream
    gc.collect()
    for sink in sinks:  # every abandoned scan released its producer
        with pytest.raises(ReaderGoneError):
            sink.write(batch(1), timeout=WAIT)


def test_many_tables_each_read_once_concurrently() -> None:
    ctx = SessionContext()
    n_tables = 12
    sinks = [ctx.register_streaming_table(f"t{i}", SCHEMA, capacity=2) for i in range(n_tables)]
    readers = [query(ctx, f"SELECT count(*) AS n FROM t{i}") for i in range(n_tables)]

    def produce(sink: TableSink) -> None:
        with sink:
            for j in range(20):
                sink.write(batch(5, j * 5), timeout=WAIT)

    producers = [Background(functools.partial(produce, s)) for s in sinks]
    for p in producers:
        p.join()
    assert [r.join() for r in readers] == [{"n": [100]}] * n_tables


def test_write_and_table_schema_mismatch_under_contention(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    reader = query(ctx, "SELECT count(*) AS n FROM t")
    bad = pa.record_batch([pa.array([1], pa.int64())], names=["k"])
    errors: list[BaseException] = []

    def mixed(i: int) -> None:
        for j in range(30):
            try:
                sink.write(bad if j % 3 == 0 else batch(1, i * 100 + j), timeout=WAIT)
            except SchemaMismatchError as exc:  # the bad batch's error, and only that one
                errors.append(exc)

    workers = [Background(functools.partial(mixed, i)) for i in range(8)]
    for w in workers:
        w.join()
    sink.close()
    assert reader.join() == {"n": [8 * 20]}
    assert len(errors) == 8 * 10
    assert all("'t'" in str(e) for e in errors)
