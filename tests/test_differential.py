"""A live answer is the answer: random tables, queries and batch splits against plain DataFusion.

Each case draws rows (nulls everywhere, zoned timestamps, decimals, strings, dictionaries,
lists and structs, NaN and ±0.0), a query from the grammar in ``tests/differential.py``
(projections, filters with NULL logic, ``CASE``, aggregates with ``DISTINCT``/``FILTER``,
``ROLLUP``/``CUBE``/``GROUPING SETS``, window functions, joins of every kind with ``=`` and
``IS NOT DISTINCT FROM``, semi and anti joins, set operations, subqueries, ``ANY``, CTEs used
twice, self-joins, duplicate column names, ``ORDER BY``/``LIMIT``, three tables), whether the
right-hand table is live or in memory, where the batches are cut and how many batches a
table may queue; the live answer must equal plain DataFusion's over the same rows.

The default run draws a bounded number of cases; ``-m slow`` sweeps many more. A failure
hypothesis shrinks becomes a regular test in ``tests/test_faithful_joins.py``.

Streaming shapes are checked against their batch meaning: an updating aggregate's final
state is the batch ``GROUP BY``; windows over a closed ordered table are the batch answer.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable import SessionContext
from tests.conftest import WAIT
from tests.differential import (
    T0,
    Case,
    l_rows,
    live,
    oracle,
    queries,
    r_rows,
    rows,
    same,
)


@st.composite
def cases(draw: Any) -> Case:
    return Case(
        query=draw(queries()),
        l_rows=draw(l_rows()),
        r_rows=draw(r_rows()),
        l_cuts=draw(st.lists(st.integers(0, 20), max_size=4)),
        r_cuts=draw(st.lists(st.integers(0, 20), max_size=3)),
        r_live=draw(st.booleans()),
        capacity=draw(st.sampled_from([1, 2, 16])),
        m_rows=draw(r_rows(max_size=4)),
    )


def check(case: Case) -> None:
    want = oracle(case)
    same(case, live(case), want)


HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]


@settings(max_examples=300, deadline=None, suppress_health_check=HEALTH)
@given(cases())
def test_live_answers_equal_datafusions(case: Case) -> None:
    check(case)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=HEALTH)
@given(cases())
def test_live_answers_equal_datafusions_sweep(case: Case) -> None:
    check(case)


# --- streaming shapes against their batch meaning ---------------------------------------------

EV = pa.schema([("ts", pa.timestamp("us", tz="UTC")), ("k", pa.int64()), ("v", pa.float64())])


@st.composite
def events(draw: Any) -> list[dict[str, Any]]:
    """Rows in time order (gaps of 0 to 1.5 s), keys and values with nulls."""
    t, out = T0, []
    for _ in range(draw(st.integers(1, 30))):
        t += timedelta(milliseconds=draw(st.integers(0, 1500)))
        out.append(
            {
                "ts": t,
                "k": draw(st.one_of(st.none(), st.integers(0, 3))),
                "v": draw(st.one_of(st.none(), st.sampled_from([0.5, -1.0, 2.0]))),
            }
        )
    return out


def _batch_answer(data: list[dict[str, Any]], sql: str) -> pa.Table:
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("ev", [[pa.RecordBatch.from_pylist(data, schema=EV)]])
    return ctx.sql(sql).to_arrow_table()


def _write(sink: Any, data: list[dict[str, Any]], cuts: list[int]) -> threading.Thread:
    from tests.differential import split

    def produce() -> None:
        with sink:
            for b in split(data, EV, cuts):
                sink.write(b, timeout=WAIT)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    return thread


@settings(max_examples=25, deadline=None, suppress_health_check=HEALTH)
@given(
    events(),
    st.lists(st.integers(0, 30), max_size=5),
    st.sampled_from(["k", "k, v > 0", ""]),
)
def test_an_updating_aggregates_final_state_is_the_batch_group_by(
    data: list[dict[str, Any]], cuts: list[int], key: str
) -> None:
    """On an unbounded table, the changelog applied as upserts ends at the batch answer."""
    select = f"{key}, " if key else ""
    group = f" GROUP BY {key}" if key else ""
    aggs = "count(*) AS n, sum(v) AS sv, count(DISTINCT k) AS dk, max(ts) AS mt"
    sql = f"SELECT {select}{aggs} FROM ev{group}"
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", EV, 2, unbounded=True)
    frame = ctx.sql(sql)
    keys = frame.upsert_key
    assert keys is not None
    producer = _write(sink, data, cuts)
    state: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for b in frame.execute_stream():
        table = pa.Table.from_batches([b.to_pyarrow()])
        for row, values in zip(table.select(keys).to_pylist(), rows(table), strict=True):
            state[tuple(row.values())] = values
    producer.join(WAIT)
    want = sorted(rows(_batch_answer(data, sql)), key=repr)
    assert sorted(state.values(), key=repr) == want


@settings(max_examples=25, deadline=None, suppress_health_check=HEALTH)
@given(
    events(),
    st.lists(st.integers(0, 30), max_size=5),
    st.sampled_from(
        [
            "SELECT date_bin(INTERVAL '2 seconds', ts) AS w, k, count(*) AS n, sum(v) AS sv "
            "FROM ev GROUP BY 1, 2",
            "SELECT window(ts, '2 seconds')['start'] AS w, count(*) AS n, max(v) AS mv "
            "FROM ev GROUP BY window(ts, '2 seconds')",
        ]
    ),
)
def test_windows_over_a_closed_ordered_table_are_the_batch_answer(
    data: list[dict[str, Any]], cuts: list[int], sql: str
) -> None:
    """Each window as it closes; all of them, once the table closes, are the batch answer
    (Spark's ``window`` by its start is ``date_bin`` of the same width)."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", EV, 2, order_by="ts")
    frame = ctx.sql(sql)
    producer = _write(sink, data, cuts)
    got = frame.to_arrow_table()
    producer.join(WAIT)
    batch_sql = sql.replace(
        "window(ts, '2 seconds')['start']", "date_bin(INTERVAL '2 seconds', ts)"
    )
    batch_sql = batch_sql.replace(
        "GROUP BY window(ts, '2 seconds')", "GROUP BY date_bin(INTERVAL '2 seconds', ts)"
    )
    want = _batch_answer(data, batch_sql)
    assert sorted(rows(got), key=repr) == sorted(rows(want), key=repr)
