"""One read, every promise: a table a query reads through more than one scan keeps every
promise of a single scan.

A table named twice in one query is read once and shared by its scans; the joins of live
tables read their sides ahead. Each test here is a promise a single scan keeps — its own
rows (two subscriptions of one topic are two tables), its own watermark, each row read once
(nested read-aheads), backpressure (a paused consumer holds the producer), a dropped
consumer seen at once, and an exit hook's write that ends — checked through the public API
and diffed against plain DataFusion where there are rows to compare.
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import textwrap
from decimal import Decimal
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pushtable import (
    ReaderGoneError,
    SessionContext,
    Topic,
    WriteTimeoutError,
)
from tests.conftest import WAIT, Background, wait_until
from tests.differential import L_PREDS, L, l_rows
from tests.test_faithful_joins import multiset, oracle

V = pa.schema([("v", pa.int64())])


EARLY_LATE = {
    "early": pa.table({"v": pa.array([1, 2, 3], pa.int64())}),
    "late": pa.table({"v": pa.array([3], pa.int64())}),
}


def early_and_late() -> SessionContext:
    """Subscriptions ``early`` (from the earliest batch: 1, 2, 3) and ``late`` (taken after
    1 and 2 were written: 3) of one closed topic."""
    topic = Topic("ev", V, retain=10)
    topic.write(pa.record_batch({"v": [1, 2]}, schema=V))
    ctx = SessionContext()
    topic.subscribe(ctx, "early", start="earliest")
    topic.subscribe(ctx, "late")
    topic.write(pa.record_batch({"v": [3]}, schema=V))
    topic.close()
    return ctx


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        (
            "SELECT 'e' AS s, v FROM early UNION ALL SELECT 'l' AS s, v FROM late",
            [("e", 1), ("e", 2), ("e", 3), ("l", 3)],
        ),
        (  # early is shared by its two scans, and only with itself
            "SELECT 'a' AS s, v FROM early UNION ALL SELECT 'b' AS s, v FROM early "
            "UNION ALL SELECT 'l' AS s, v FROM late",
            [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("b", 3), ("l", 3)],
        ),
    ],
)
def test_two_subscriptions_of_one_topic_in_one_query_read_their_own_rows(
    sql: str, expected: list[tuple[str, int]]
) -> None:
    ctx = early_and_late()  # kept: its frames run in it
    got = ctx.sql(sql).to_arrow_table()
    assert multiset(got) == multiset(oracle(sql, EARLY_LATE)) == expected


def test_windows_over_a_table_named_twice_close_once_per_arm_with_whole_counts() -> None:
    schema = pa.schema([("ts", pa.int64()), ("d", pa.decimal128(10, 2))])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=4, order_by="ts")
    sql = (
        "SELECT 'a' AS arm, ts / 10 AS w, count(*) AS n, sum(d) AS s FROM t GROUP BY ts / 10 "
        "UNION ALL SELECT 'b', ts / 10, count(*), sum(d) FROM t GROUP BY ts / 10"
    )
    result = Background(ctx.sql(sql).to_arrow_table)
    rows = [
        (w * 10 + i, None if (w + i) % 7 == 0 else Decimal(w) + Decimal(i) / 4)
        for w in range(400)
        for i in range(3)
    ]
    batches = [
        pa.record_batch({"ts": [ts], "d": pa.array([d], pa.decimal128(10, 2))}, schema=schema)
        for ts, d in rows
    ]
    for b in batches:
        sink.write(b, timeout=WAIT)
    sink.advance(4000)
    sink.close()
    got = result.join()
    want = oracle(sql, {"t": pa.Table.from_batches(batches)})
    assert got.num_rows == 800
    assert multiset(got) == multiset(want)


@pytest.mark.parametrize("run", range(4))
def test_a_lookup_join_nested_in_another_reads_each_probe_row_once(run: int) -> None:
    k = pa.schema([("k", pa.int64()), ("a", pa.string())])
    k2 = pa.schema([("k", pa.int64()), ("b", pa.timestamp("us", tz="Europe/Paris"))])
    u = pa.schema([("k", pa.int64()), ("x", pa.int64())])
    ctx = SessionContext()
    d1 = ctx.register_streaming_table("d1", k, capacity=4)
    d2 = ctx.register_streaming_table("d2", k2, capacity=4)
    live = ctx.register_streaming_table("u", u, capacity=4, unbounded=True)
    dim1 = pa.record_batch({"k": list(range(10)), "a": [f"a{i}" for i in range(10)]}, schema=k)
    dim2 = pa.record_batch(
        {"k": list(range(10)), "b": pa.array(range(10), pa.int64()).cast(k2.field("b").type)},
        schema=k2,
    )
    d1.write(dim1)
    d1.close()
    d2.write(dim2)
    d2.close()
    sql = "SELECT u.x, d1.a, d2.b FROM u JOIN d2 ON u.k = d2.k JOIN d1 ON u.k = d1.k"
    result = Background(ctx.sql(sql).to_arrow_table)
    probes = [pa.record_batch({"k": [i % 10], "x": [i]}, schema=u) for i in range(300)]
    for b in probes:
        live.write(b, timeout=WAIT)
    live.close()
    got = result.join()
    want = oracle(
        sql,
        {
            "u": pa.Table.from_batches(probes),
            "d1": pa.Table.from_batches([dim1]),
            "d2": pa.Table.from_batches([dim2]),
        },
    )
    assert got.num_rows == 300
    assert multiset(got) == multiset(want)


MB = pa.record_batch({"v": pa.array(range(131_072), pa.int64())}, schema=V)  # 1 MiB


def test_a_paused_consumer_of_a_table_named_twice_holds_the_producer() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", V, capacity=2)
    stream = ctx.sql("SELECT v FROM t UNION ALL SELECT v FROM t").execute_stream()
    sink.write(MB, timeout=WAIT)
    first = Background(functools.partial(next, iter(stream)))
    assert first.join().to_pyarrow().num_rows > 0  # the consumer read one batch, and now pauses
    accepted = 0
    with pytest.raises(WriteTimeoutError):
        # A single scan holds the producer after capacity plus what its operators buffer
        # (6 here); the shared read, unpaced, took all 150.
        for _ in range(150):
            sink.write(MB, timeout=0.5)
            accepted += 1
    assert accepted < 40, accepted
    assert sink.stats.queued_batches == 2  # held by the table's own bound, not failed


def test_a_dropped_consumer_of_a_table_named_twice_is_seen_at_once() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", V, capacity=4)
    stream = ctx.sql("SELECT v FROM t UNION ALL SELECT v FROM t WHERE v > 0").execute_stream()
    sink.write(pa.record_batch({"v": [1, 2]}, schema=V), timeout=WAIT)
    first = Background(functools.partial(next, iter(stream)))
    assert first.join().to_pyarrow().num_rows > 0
    del stream, first  # dropped mid-stream; the producer is idle
    gc.collect()
    wait_until(lambda: sink.stats.reader_gone, "the producer to learn the reader is gone")
    with pytest.raises(ReaderGoneError):
        sink.write(pa.record_batch({"v": [3]}, schema=V), timeout=WAIT)


def test_a_dropped_consumer_of_a_join_of_live_tables_is_seen_at_once() -> None:
    ctx = SessionContext()
    a = ctx.register_streaming_table("a", V, capacity=4)
    b = ctx.register_streaming_table("b", V, capacity=4)
    stream = ctx.sql("SELECT a.v FROM a JOIN b ON a.v = b.v").execute_stream()
    a.write(pa.record_batch({"v": [1]}, schema=V), timeout=WAIT)
    # Nothing reads between polls (a read-ahead reads only while its join waits): a's batch
    # is still queued, and dropping the query frees it and tells both producers.
    assert a.stats.queued_batches == 1
    del stream
    gc.collect()
    wait_until(lambda: a.stats.reader_gone, "a's producer to learn the reader is gone")
    wait_until(lambda: b.stats.reader_gone, "b's producer to learn the reader is gone")
    with pytest.raises(ReaderGoneError):
        a.write(pa.record_batch({"v": [2]}, schema=V), timeout=WAIT)


EXIT_HOOK = """
import atexit, threading

def hook():
    try:
        for _ in range({writes}):
            sink.write(pa.record_batch({{"v": [1]}}, schema=V))
        print("wrote", flush=True)
    except Exception as exc:
        print("raised", type(exc).__name__, exc, flush=True)

atexit.register(hook)  # before pushtable's own: it runs after it

import pyarrow as pa
import pushtable

V = pa.schema([("v", pa.int64())])
ctx = pushtable.SessionContext()
sink = ctx.register_streaming_table("t", V, capacity=2)
if {query}:
    started = threading.Event()
    def read():
        started.set()
        ctx.sql("SELECT v FROM t UNION ALL SELECT v FROM t").to_arrow_table()
    threading.Thread(target=read, daemon=True).start()
    started.wait()
print("exiting", flush=True)
"""


@pytest.mark.parametrize(
    ("writes", "query", "outcome"),
    [
        (1, False, "wrote"),
        (5, False, "raised ReaderGoneError"),
        (5, True, "raised ReaderGoneError"),
    ],
)
def test_an_exit_hook_that_writes_after_pushtables_own_ends(
    writes: int, query: bool, outcome: str
) -> None:
    code = textwrap.dedent(EXIT_HOOK.format(writes=writes, query=query))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "exiting"
    assert lines[1].startswith(outcome), lines
    if outcome.startswith("raised"):
        assert "exiting" in lines[1], lines[1]
        assert "full" in lines[1], lines[1]


# --- the same promises, drawn -----------------------------------------------------------------

PAUSED_SHAPES = [
    "SELECT k, s FROM t UNION ALL SELECT k, s FROM t WHERE {pred}",
    "WITH c AS (SELECT k, d, ts FROM t WHERE {pred} OR k IS NULL) "
    "SELECT * FROM c UNION ALL SELECT * FROM c",
    "SELECT st, lst FROM t UNION ALL SELECT st, lst FROM t WHERE {pred} "
    "UNION ALL SELECT st, lst FROM t",
]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    st.sampled_from(PAUSED_SHAPES),
    st.sampled_from(L_PREDS),
    st.integers(1, 4),
    l_rows(),
)
def test_a_paused_then_dropped_consumer_of_any_shared_shape_holds_then_frees_the_producer(
    shape: str, pred: str, capacity: int, rows: list[dict[str, Any]]
) -> None:
    """Any query over a table named several times: a consumer that reads one batch and
    pauses holds the producer within the table's bound (plus what the operators buffer, as a
    single scan's would); once dropped, the producer's next write raises at once.

    Each scan gets rows of each batch (the filter passes one): a scan whose filter drops
    every row keeps asking, as a single scan with that filter would, and the read goes at
    its fastest scan's pace (the others' rows wait in the memory pool)."""
    sql = shape.format(pred=pred)
    data = pa.RecordBatch.from_pylist(rows, schema=L)
    check = datafusion.SessionContext()
    check.register_record_batches("t", [[data]])
    assume(check.sql(f"SELECT count(*) AS n FROM t WHERE {pred}").to_pydict()["n"][0] > 0)
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", L, capacity=capacity)
    stream = ctx.sql(sql).execute_stream()
    sink.write(data, timeout=WAIT)
    first = Background(functools.partial(next, iter(stream)))
    assert first.join().to_pyarrow().num_rows > 0
    accepted = 0
    with pytest.raises(WriteTimeoutError):
        for _ in range(200):
            sink.write(data, timeout=0.3)
            accepted += 1
    assert accepted <= capacity + 24, (sql, accepted)
    del stream, first
    gc.collect()
    wait_until(lambda: sink.stats.reader_gone, "the producer to learn the reader is gone")
    with pytest.raises(ReaderGoneError):
        sink.write(data, timeout=WAIT)
