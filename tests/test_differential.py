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
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pushtable import SessionContext
from tests.conftest import WAIT
from tests.differential import (
    DATAFUSION_DIVERGES,
    NULL_LOGIC,
    SHAPES,
    T0,
    Case,
    l_rows,
    live,
    oracle,
    queries,
    r_rows,
    rows,
    same,
    second_oracle,
    witnessed,
)


@st.composite
def cases(draw: Any, shape: str | None = None) -> Case:
    left = draw(l_rows())
    return Case(
        query=draw(queries(shape)),
        l_rows=left,
        r_rows=draw(r_rows(like=left)),
        l_cuts=draw(st.lists(st.integers(0, 20), max_size=4)),
        r_cuts=draw(st.lists(st.integers(0, 20), max_size=3)),
        r_live=draw(st.booleans()),
        capacity=draw(st.sampled_from([1, 2, 16])),
        m_rows=draw(r_rows(max_size=8, like=left)),
        before=draw(st.integers(0, 4)),
    )


@dataclass
class Tally:
    """Per shape: cases checked, those whose answer had a row, and those that exercised what
    the shape is for (``Query.witness``: a row, and rows a filter kept and dropped, join rows
    that matched, groups ``HAVING`` kept and dropped). A shape whose cases never did was not
    tested: an answer with a row alone is met by a keyless aggregate's one row or an outer
    join's unmatched rows."""

    cases: Counter[str] = field(default_factory=Counter)
    answered: Counter[str] = field(default_factory=Counter)
    proved: Counter[str] = field(default_factory=Counter)
    #: per shape, how many cases had each witness above zero
    witnessed: dict[str, Counter[str]] = field(default_factory=dict)

    #: NULL-logic cases DuckDB also answered (and agreed on)
    second: int = 0
    #: cases of a query DataFusion 54 answers wrongly (``DATAFUSION_DIVERGES``): compared,
    #: left out of the floor
    diverged: int = 0

    def check(self, case: Case) -> None:
        want = oracle(case)
        got = live(case)
        same(case, got, want)
        duck = second_oracle(case)
        if duck is not None:
            assert sorted(rows(duck), key=repr) == sorted(rows(want), key=repr), (
                f"DataFusion and DuckDB disagree: {case.query.sql}\n"
                f" datafusion: {rows(want)}\n duckdb: {rows(duck)}"
            )
            self.second += 1
        shape = case.query.shape
        if any(named in case.query.sql for named in DATAFUSION_DIVERGES):
            # compared (pushtable answers as DataFusion does), but DataFusion 54's answer is
            # always empty there: it cannot count toward the shape's non-empty floor
            self.diverged += 1
            event(f"shape {shape}: a named DataFusion divergence")
            return
        self.cases[shape] += 1
        event(f"shape {shape}")
        assert case.query.witness, f"{shape}: a query without witnesses proves nothing"
        counts = witnessed(case)
        seen = self.witnessed.setdefault(shape, Counter())
        seen.update(name for name, n in counts.items() if n > 0)
        if want.num_rows:
            self.answered[shape] += 1
            event(f"shape {shape}: rows")
            if all(n > 0 for n in counts.values()):
                self.proved[shape] += 1

    def report(self) -> str:
        shapes = ", ".join(
            f"{s} {self.proved[s]}/{self.answered[s]}/{n} {dict(self.witnessed.get(s, {}))}"
            for s, n in sorted(self.cases.items())
        )
        return (
            f"(exercised/answered/cases) {shapes}; {self.second} also by DuckDB; "
            f"{self.diverged} named divergences"
        )

    def assert_floor(self, shape: str, share: float) -> None:
        """``shape`` exercised what it is for (a row and every witness) in at least ``share``
        of its cases, and at least once (and a NULL-logic shape was checked by the second
        oracle too)."""
        cases, proved = self.cases[shape], self.proved[shape]
        assert cases, f"{shape} never drawn ({self.report()})"
        assert proved, f"{shape} never exercised its witnesses in {cases} cases ({self.report()})"
        assert proved >= share * cases, (
            f"{shape} exercised its witnesses in {proved} of {cases} cases, under {share:.0%}: "
            f"its checks compared answers that test little ({self.report()})"
        )
        if shape in NULL_LOGIC:
            assert self.second, f"the second oracle never ran ({self.report()})"


HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]


def sweep(shape: str, examples: int, derandomize: bool) -> Tally:
    """``examples`` cases of ``shape`` diffed against plain DataFusion; what they exercised.

    One sweep per shape: hypothesis draws in bursts around an example, so in one mixed
    sweep a shape's count (and how many of its cases had rows) swung from run to run.
    """
    tally = Tally()

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=HEALTH,
        derandomize=derandomize,
        database=None if derandomize else settings().database,
    )
    @given(cases(shape))
    def diff(case: Case) -> None:
        tally.check(case)

    diff()
    print(f"differential tally: {tally.report()}")
    return tally


@pytest.mark.parametrize("shape", SHAPES)
def test_live_answers_equal_datafusions(shape: str) -> None:
    """30 cases a shape, the same every run, a tenth of them exercising what the shape is for
    (``Query.witness``; the slow sweep draws anew each time, held to half that share:
    hypothesis's first examples of a run are its simplest, often empty tables). The default
    run's shares on 2026-12-02: any_all 3 of 24, three_tables 5 of 30, the rest 9 to 23 of 30."""
    sweep(shape, 30, derandomize=True).assert_floor(shape, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_live_answers_equal_datafusions_sweep(shape: str) -> None:
    sweep(shape, 5000 // len(SHAPES), derandomize=False).assert_floor(shape, 0.05)


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


def _ordered_answer(data: list[dict[str, Any]], cuts: list[int], sql: str) -> pa.Table:
    """``sql`` over ``ev`` ordered by ``ts``, while ``data`` is written cut at ``cuts``."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", EV, 2, order_by="ts")
    frame = ctx.sql(sql)
    producer = _write(sink, data, cuts)
    got = frame.to_arrow_table()
    producer.join(WAIT)
    return got


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
    state = _final_state(frame, keys)
    producer.join(WAIT)
    want = sorted(rows(_batch_answer(data, sql)), key=repr)
    assert state == want


def _final_state(frame: Any, keys: list[str]) -> list[tuple[Any, ...]]:
    """An updating query's changelog applied as upserts on ``keys``: its rows at the end."""
    state: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for b in frame.execute_stream():
        table = pa.Table.from_batches([b.to_pyarrow()])
        for row, values in zip(table.select(keys).to_pylist(), rows(table), strict=True):
            state[tuple(row.values())] = values
    return sorted(state.values(), key=repr)


@settings(max_examples=40, deadline=None, suppress_health_check=HEALTH)
@given(
    events(),
    st.lists(st.integers(0, 30), max_size=5),
    st.sampled_from(
        [
            "SELECT date_bin(INTERVAL '2 seconds', ts) AS w, k, count(*) AS n, sum(v) AS sv "
            "FROM ev GROUP BY 1, 2",
            "SELECT window(ts, '2 seconds')['start'] AS w, count(*) AS n, max(v) AS mv "
            "FROM ev GROUP BY window(ts, '2 seconds')",
            # the window alone: batches of 16+ rows are cut into their windows' runs; windows
            # of nulls only (an average is NULL there, never NaN)
            "SELECT date_bin(INTERVAL '2 seconds', ts) AS w, count(*) AS n, avg(v) AS av, "
            "min(v) AS mn, count(v) AS cv, sum(v) FILTER (WHERE k > 1) AS sf "
            "FROM ev GROUP BY 1",
        ]
    ),
)
def test_windows_over_a_closed_ordered_table_are_the_batch_answer(
    data: list[dict[str, Any]], cuts: list[int], sql: str
) -> None:
    """Each window as it closes; all of them, once the table closes, are the batch answer
    (Spark's ``window`` by its start is ``date_bin`` of the same width)."""
    got = _ordered_answer(data, cuts, sql)
    batch_sql = sql.replace(
        "window(ts, '2 seconds')['start']", "date_bin(INTERVAL '2 seconds', ts)"
    )
    batch_sql = batch_sql.replace(
        "GROUP BY window(ts, '2 seconds')", "GROUP BY date_bin(INTERVAL '2 seconds', ts)"
    )
    want = _batch_answer(data, batch_sql)
    assert sorted(rows(got), key=repr) == sorted(rows(want), key=repr)


# --- streaming shapes over a table named twice ------------------------------------------------

TWICE_WINDOWS = [
    "SELECT 'a' AS arm, date_bin(INTERVAL '2 seconds', ts) AS w, count(*) AS n, sum(v) AS sv "
    "FROM ev GROUP BY 2 UNION ALL SELECT 'b', date_bin(INTERVAL '2 seconds', ts), count(*), "
    "max(v) FROM ev WHERE k IS NOT NULL GROUP BY 2",
    "SELECT a.k, a.ts, b.v FROM ev a JOIN ev b ON a.k = b.k "
    "AND b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 second'",
]
TWICE_UPDATING = (
    "SELECT k, count(*) AS n, sum(v) AS sv FROM "
    "(SELECT k, v FROM ev UNION ALL SELECT k, v FROM ev WHERE v > 0) GROUP BY k"
)


@settings(max_examples=30, deadline=None, suppress_health_check=HEALTH)
@given(events(), st.lists(st.integers(0, 30), max_size=5), st.sampled_from(TWICE_WINDOWS))
def test_windows_and_stream_joins_over_a_table_named_twice_are_the_batch_answer(
    data: list[dict[str, Any]], cuts: list[int], sql: str
) -> None:
    """Each scan's windows close on its own consumer's watermark: whole counts, once each."""
    got = _ordered_answer(data, cuts, sql)
    want = _batch_answer(data, sql)
    assert sorted(rows(got), key=repr) == sorted(rows(want), key=repr)
    if "date_bin" in sql:
        assert want.num_rows  # events() draws at least one row: there is always a window


@settings(max_examples=20, deadline=None, suppress_health_check=HEALTH)
@given(events(), st.lists(st.integers(0, 30), max_size=5))
def test_an_updating_aggregate_over_a_table_named_twice_ends_at_the_batch_group_by(
    data: list[dict[str, Any]], cuts: list[int]
) -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", EV, 2, unbounded=True)
    frame = ctx.sql(TWICE_UPDATING)
    keys = frame.upsert_key
    assert keys == ["k"]
    producer = _write(sink, data, cuts)
    state = _final_state(frame, keys)
    producer.join(WAIT)
    want = sorted(rows(_batch_answer(data, TWICE_UPDATING)), key=repr)
    assert want  # events() draws at least one row: there is always a group
    assert state == want
