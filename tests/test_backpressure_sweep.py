"""A paused consumer holds every producer: the backpressure sweep, shape by shape.

For every shape the differential sweeps draw (``tests/differential.py``'s grammar, and the
windows under read-aheads of ``tests/test_watermarks_in_band.py``), each case runs the query
over live tables and checks, as the one producer thread writes the case's batches:

- **before the first poll** nothing is read: each live table accepts exactly its
  ``capacity`` batches (a topic: at most its subscriptions' ``capacity``), and the next write
  waits;
- **the consumer reads one batch and pauses**: from then on each table accepts at most its
  ``capacity`` batches more (what its queue had room for when the consumer paused) plus
  ``HELD_BY_OPERATORS``, and then the producer is held. A query whose first batch comes only
  once its tables close (``explain_live``: ``at_end``) has nothing to hold after it: its
  producer is held before the first poll, and its bounded tables are read whole meanwhile,
  their rows counted in the session's pool (``memory_limit``);
- then the consumer resumes, the producer writes the rest and closes, and the answer is
  plain DataFusion's over every row the tables accepted (filler rows included): a pause
  loses or repeats nothing.

The per-shape tallies (``pytest -s``) are the issue's figures; a shape whose cases never held
a producer, or (streaming shapes) never held one after a first batch, fails its sweep.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushtable import ReaderGoneError, ResourceLimitError, SessionContext, Topic, WriteTimeoutError
from tests.conftest import WAIT, Background, fixed_draws
from tests.differential import SHAPES, Case, L, R, feed, rows, split
from tests.test_differential import cases
from tests.test_watermarks_in_band import SWEPT, T, U, feeds

#: How long a write waits before the sweep counts its producer as held (s): the consumer is
#: paused, so a write that would be accepted is accepted at once.
PAUSE = 0.2


def held_by_operators(ctx: SessionContext, scans: int) -> int:
    """What a query over ``scans`` live tables may take from one of them, beyond the room its
    queue had, while its consumer is paused or before its first poll: what DataFusion's merge
    of the scans' partitions holds. A live scan has ``target_partitions`` partitions, and
    ``CoalescePartitionsExec`` runs a task per partition into one channel as deep as all the
    merged partitions, each task holding one batch more: ``target_partitions * (scans + 1)``
    at most (4 on 2 cores for one table, 6 for a union of two). A read-ahead adds nothing: it
    reads only while its consumer polls."""
    setting = "datafusion.execution.target_partitions"
    sql = f"SELECT value FROM information_schema.df_settings WHERE name = '{setting}'"
    return int(ctx.sql(sql).to_pylist()[0]["value"]) * (scans + 1)


#: The session's pool: a plan that must read a table whole holds it here, or fails naming it.
MEMORY_LIMIT = 256 << 20


@dataclass
class Live:
    """One case's live tables: their producers, the batches each has still to write (in the
    one producer thread's order) and those each accepted."""

    sinks: dict[str, Any]
    order: list[str]
    pending: dict[str, deque[pa.RecordBatch]]
    #: a batch of the table whose rows reach the answer (None: no row of it does): what
    #: fills a queue until the producer is held (rows a filter drops or an aggregate folds
    #: are read on, as in DataFusion, and hold nothing)
    filler: Callable[[str], pa.RecordBatch | None]
    capacity: int
    #: what the plan's operators may hold beyond the queues (``held_by_operators``)
    slack: int
    written: dict[str, list[pa.RecordBatch]] = field(default_factory=dict)
    #: tables whose query no longer reads them (it had its answer: a LIMIT, an empty side)
    gone: set[str] = field(default_factory=set)
    #: called after each accepted batch (a window shape's ``advance()``)
    after_write: Callable[[str, int], None] = lambda name, i: None
    #: bounded tables closed after their last batch (a lookup join's bounded sides: the
    #: join streams once they have closed)
    close_early: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)
    #: ordered tables: the case's batches come first (a filler row is past them)
    ordered: bool = False

    def next_batch(self, name: str) -> pa.RecordBatch | None:
        return self.pending[name].popleft() if self.pending[name] else self.filler(name)

    def write(self, name: str, batch: pa.RecordBatch, timeout: float) -> bool:
        """Whether ``batch`` was accepted within ``timeout`` (False: held, batch not taken)."""
        try:
            self.sinks[name].write(batch, timeout=timeout)
        except WriteTimeoutError:
            return False
        except ReaderGoneError:
            # The query had its whole answer (a LIMIT, an empty side of a semi join): the
            # batch goes to the oracle all the same, so a query that let go of a table it
            # still needed answers short of plain DataFusion's over what was written.
            self.gone.add(name)
            self.written.setdefault(name, []).append(batch)
            return True
        self.written.setdefault(name, []).append(batch)
        self.after_write(name, len(self.written[name]))
        return True

    def done_with(self, name: str) -> bool:
        """Whether ``name`` takes no more writes (closing it when it should close early)."""
        if name in self.close_early and not self.pending[name] and name not in self.closed:
            self.sinks[name].close()
            self.closed.add(name)
        return name in self.gone or name in self.closed

    def close(self) -> None:
        for name, sink in self.sinks.items():
            if name not in self.closed:
                sink.close()


@dataclass
class Tally:
    """Per shape: what its cases exercised."""

    counts: Counter[str] = field(default_factory=Counter)

    def check(self, shape: str, streaming: set[str]) -> None:
        """Fails unless the shape's cases answered, and held a producer (a shape whose plans
        all answer at the end read their bounded tables whole, as DataFusion does: their
        rows are folded or held in the pool, which ``memory_limit`` bounds)."""
        print(shape, dict(self.counts))  # the note's per-shape tallies (pytest -s)
        c = self.counts
        assert c["cases"], (shape, c)
        assert c["non-empty answers"], (shape, c)
        if shape in streaming:
            assert c["held after a first batch"], (shape, c)
            assert c["held before a poll"], (shape, c)


TALLIES: dict[str, Tally] = {}


def paused(stream: Any, first: threading.Event, resume: threading.Event) -> list[Any]:
    """The consumer: reads one batch, pauses until ``resume``, then reads to the end."""
    got = []
    for batch in stream:
        got.append(batch)
        if len(got) == 1:
            first.set()
            if not resume.wait(WAIT):
                raise AssertionError("the consumer was never resumed")
    first.set()  # an empty answer: nothing to pause on
    return got


def run(
    live: Live, stream: Any, explained: Any, tally: Tally, sql: str, topic: bool = False
) -> list[Any] | None:
    """The three steps of the module's docstring over ``live``; the answer's batches (None:
    the query failed naming its memory limit)."""
    c = tally.counts
    # A table read once for its several scans goes on at the pace of the scan that asks:
    # one whose filter drops every row asks on, and the others' rows wait in the pool
    # (documented; only where a scan filters: a shared read without one is held).
    mode = explained.mode
    shared = " several times" in str(explained) and " WHERE " in sql
    # 1. Before the first poll: rows that reach the answer are not read past what the plan's
    # buffers hold. (A plan that folds them, or waits on a bounded side, reads on.)
    bounded_open = any(n not in live.closed for n in live.close_early)
    for name in dict.fromkeys(live.order):
        if name in live.close_early:
            continue  # a bounded side: written in step 2, then closed
        accepted, held = 0, False
        for _ in range(live.capacity + live.slack + 1):
            batch = live.next_batch(name) if live.ordered else live.filler(name)
            if batch is None or live.done_with(name):
                break
            if not live.write(name, batch, PAUSE):
                if live.ordered:
                    live.pending[name].appendleft(batch)
                held = True
                break
            accepted += 1
        if held:
            assert topic or accepted >= live.capacity, accepted  # its queue had room
            c["held before a poll"] += 1
        elif (
            mode == "incremental"
            and not bounded_open
            and not live.ordered
            and not shared
            and live.filler(name) is not None
        ):
            raise AssertionError(
                f"{name}: more than capacity {live.capacity} + {live.slack} batches accepted "
                f"before the first poll, its rows reaching the answer (explain_live {mode}): {sql}"
            )
        else:
            c["read on before a poll (folded, or a bounded side open)"] += 1
    # 2. The consumer reads one batch and pauses; the producer writes the rest of the case.
    first, resume = threading.Event(), threading.Event()
    reader = Background(lambda: paused(stream, first, resume))
    after: Counter[str] = Counter()
    held_at: str | None = None
    deadline = time.monotonic() + WAIT
    queue = live.order
    i = 0
    while i < len(queue) and held_at is None:
        name = queue[i]
        if live.done_with(name) or not live.pending[name]:
            i += 1
            continue
        batch = live.pending[name][0]
        pause_seen = first.is_set() and not reader.done.is_set()
        if live.write(name, batch, PAUSE):
            live.pending[name].popleft()
            after[name] += pause_seen
            i += 1
        elif pause_seen:
            held_at = name
        elif reader.done.is_set():
            break  # the query ended (its error is the reader's)
        else:
            assert time.monotonic() < deadline, f"{name}: held while the consumer waited"
    if mode == "incremental" and held_at is None and not first.is_set():
        # The case's rows were all written before a first batch came: rows that reach the
        # answer, one at a time, until one does (the plan streams).
        for name in dict.fromkeys(live.order):
            for _ in range(live.capacity + live.slack + 2):
                batch = live.filler(name)
                if first.is_set() or batch is None or live.done_with(name):
                    break
                pause_seen = first.is_set()
                if not live.write(name, batch, PAUSE):
                    held_at = name if pause_seen or first.is_set() else None
                    break
                after[name] += pause_seen
    streamed = first.is_set() and not reader.done.is_set()
    if streamed and held_at is None:  # the case's batches fit: fill until held
        for name in dict.fromkeys(live.order):
            for _ in range(live.capacity + live.slack + 1):
                batch = live.next_batch(name)
                if batch is None or live.done_with(name):
                    break
                pause_seen = not reader.done.is_set()
                if not live.write(name, batch, PAUSE):
                    live.pending[name].appendleft(batch)
                    held_at = name
                    break
                after[name] += pause_seen
    if streamed:
        for name, n in after.items():
            if shared and n > live.capacity + live.slack:
                # documented: the scan that asks sets the pace; the rows of the paused one
                # wait in the pool (``memory_limit`` bounds them: tests/test_shared_read.py)
                c["read on after a pause (a shared read's other scan asks)"] += 1
                held_at = held_at or name
                continue
            assert n <= live.capacity + live.slack, (
                f"{name}: {n} batches accepted after the consumer paused (capacity "
                f"{live.capacity} + {live.slack}, explain_live {mode}): {sql}"
            )
        fillable = [n for n in live.sinks if n not in live.closed and live.filler(n) is not None]
        assert held_at is not None or live.gone or not fillable, "the producer was never held"
        c["held after a first batch"] += held_at is not None and not (
            shared and max(after.values(), default=0) > live.capacity + live.slack
        )
    else:
        c["answered at the end"] += 1
    # 3. The consumer resumes; the rest is written; nothing was lost or repeated.
    resume.set()
    for name in live.order:
        while live.pending[name] and not live.done_with(name):
            assert live.write(name, live.pending[name].popleft(), WAIT), f"{name}: held"
    live.close()
    if not reader.done.wait(WAIT):
        raise AssertionError(f"the query did not end: {sql}")
    if isinstance(reader.error, ResourceLimitError):  # the pool's bound: it names it
        if "memory_limit" not in str(reader.error):
            raise AssertionError(f"a limit not named: {reader.error}")
        c["failed naming memory_limit"] += 1
        return None
    got: list[Any] = reader.join()
    return got


# --- the differential grammar's shapes --------------------------------------------------------


def _grammar_live(case: Case, ctx: SessionContext) -> Live:
    names: dict[int, str] = {}

    def live_table(name: str, schema: pa.Schema, capacity: int, unbounded: bool) -> Any:
        sink = ctx.register_streaming_table(name, schema, capacity, unbounded=unbounded)
        names[id(sink)] = name
        return sink

    writes, sinks = feed(case, live_table, lambda n, b: ctx.register_record_batches(n, [[b]]))
    by_name = {names[id(s)]: s for s in sinks}
    cycle: dict[str, list[pa.RecordBatch]] = {n: [] for n in by_name}
    for sink, b in writes:
        cycle[names[id(sink)]].append(b)
    reaching: dict[str, pa.RecordBatch | None] = {}

    def filler(name: str) -> pa.RecordBatch | None:
        """The first of the table's batches whose rows alone reach the answer (with every row
        of the other tables): plain DataFusion says which."""
        if name not in reaching:
            reaching[name] = next((b for b in cycle[name] if _answers(case, {name: [b]})), None)
        return reaching[name]

    return Live(
        sinks=by_name,
        order=[names[id(s)] for s, _ in writes] or list(by_name),
        pending={n: deque(cycle[n]) for n in by_name},
        filler=filler,
        capacity=case.capacity,
        slack=held_by_operators(ctx, len(by_name)),
        close_early=set(by_name) - set(case.query.unbounded) if case.query.unbounded else set(),
    )


def _plain(case: Case, tables: dict[str, list[pa.RecordBatch]]) -> pa.Table:
    """The case's query by plain DataFusion, ``tables`` in place of the case's rows."""
    ctx = datafusion.SessionContext()
    own = {"l": (L, case.l_rows), "r": (R, case.r_rows), "m": (R, case.m_rows)}
    for name, (schema, rows_) in own.items():
        batches = tables.get(name)
        if batches is None:
            batches = [pa.RecordBatch.from_pylist(rows_, schema=schema)]
        ctx.register_record_batches(name, [batches or [pa.RecordBatch.from_pylist([], schema)]])
    return ctx.sql(case.query.sql).to_arrow_table()


def _answers(case: Case, tables: dict[str, list[pa.RecordBatch]]) -> bool:
    return bool(_plain(case, tables).num_rows > 0)


def _grammar_oracle(case: Case, live: Live) -> list[tuple[Any, ...]]:
    written = {n: live.written.get(n, []) for n in live.sinks}
    return sorted(rows(_plain(case, written)), key=repr)


def _topic_case(case: Case, tally: Tally) -> None:
    """``two_subscriptions``: one topic, ``l`` from the earliest batch retained, ``l2`` from
    the batches written after it subscribed."""
    batches = split(case.l_rows, L, case.l_cuts) or [pa.RecordBatch.from_pylist([{}], schema=L)]
    topic = Topic("t", L, retain=10_000)
    before = batches[: case.before]
    for b in before:
        topic.write(b, timeout=WAIT)
    ctx = SessionContext(memory_limit=MEMORY_LIMIT)
    topic.subscribe(ctx, "l", case.capacity, start="earliest")
    topic.subscribe(ctx, "l2", case.capacity)
    explained = ctx.explain_live(case.query.sql)
    stream = ctx.sql(case.query.sql).execute_stream()
    reaching = [b for b in batches if _topic_plain(case.query.sql, [b], [b]).num_rows][:1]

    def filler(name: str) -> pa.RecordBatch | None:
        """A batch whose rows, in both subscriptions, reach the answer."""
        return reaching[0] if reaching else None

    live = Live(
        sinks={"t": topic},
        order=["t"] * len(batches[case.before :]) or ["t"],
        pending={"t": deque(batches[case.before :])},
        filler=filler,
        capacity=case.capacity,
        slack=held_by_operators(ctx, 2),
    )
    got = run(live, stream, explained, tally, case.query.sql, topic=True)
    if got is None:
        return
    later = live.written.get("t", [])
    want = sorted(rows(_topic_plain(case.query.sql, before + later, later)), key=repr)
    assert _rows_of(got) == want, case.query.sql
    tally.counts["non-empty answers"] += bool(want)


def _topic_plain(sql: str, l_batches: list[Any], l2_batches: list[Any]) -> pa.Table:
    ctx = datafusion.SessionContext()
    empty = [pa.RecordBatch.from_pylist([], schema=L)]
    ctx.register_record_batches("l", [l_batches or empty])
    ctx.register_record_batches("l2", [l2_batches or empty])
    return ctx.sql(sql).to_arrow_table()


def _rows_of(got: list[Any]) -> list[tuple[Any, ...]]:
    if not got:
        return []
    return sorted(rows(pa.Table.from_batches([b.to_pyarrow() for b in got])), key=repr)


#: Shapes whose plans stream while their tables are open (``explain_live`` says
#: ``incremental`` for some of their cases): each must hold a producer after a first batch.
STREAMING: set[str] = set()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_paused_consumer_holds_every_producer(shape: str) -> None:
    tally = TALLIES.setdefault(shape, Tally())

    @fixed_draws(12)
    @given(cases(shape))
    def case(case: Case) -> None:
        tally.counts["cases"] += 1
        if case.query.subscriptions:
            _topic_case(case, tally)
            return
        ctx = SessionContext(memory_limit=MEMORY_LIMIT)
        live = _grammar_live(case, ctx)
        explained = ctx.explain_live(case.query.sql)
        if explained.mode == "incremental":
            STREAMING.add(shape)
        stream = ctx.sql(case.query.sql).execute_stream()
        got = run(live, stream, explained, tally, case.query.sql)
        if got is None:
            return
        want = _grammar_oracle(case, live)
        assert _rows_of(got) == want, case.query.sql
        tally.counts["non-empty answers"] += bool(want)

    case()
    tally.check(shape, STREAMING)


# --- windows under read-aheads ----------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SWEPT))
def test_a_paused_consumer_of_a_window_under_a_read_ahead_holds_its_producers(shape: str) -> None:
    sql = SWEPT[shape]
    tally = TALLIES.setdefault(shape, Tally())

    @fixed_draws(12)
    @given(feeds(), st.sampled_from([1, 2, 4]))
    def case(drawn: tuple[list[dict[str, Any]], list[int], dict[int, int]], cap: int) -> None:
        data, cuts, advances = drawn
        tally.counts["cases"] += 1
        ctx = SessionContext(memory_limit=MEMORY_LIMIT)
        names = ["t", "t2"] if "t2" in sql else ["t"]
        sinks = {n: ctx.register_streaming_table(n, T, cap, order_by="ts") for n in names}
        if "t2" not in sql:
            ctx.register_streaming_table("t2", T, cap, order_by="ts")
        u = ctx.register_streaming_table("u", U, capacity=4)
        u.write(pa.record_batch({"x": [1, 2]}, schema=U), timeout=WAIT)
        u.close()
        parts = [
            pa.RecordBatch.from_pylist(data[a:b], schema=T)
            for a, b in zip([0, *cuts], cuts, strict=False)
        ]
        marks: dict[str, int] = dict.fromkeys(names, 0)

        def after_write(name: str, n: int) -> None:
            last = live.written[name][-1]
            marks[name] = max(marks[name], max(last.column("ts").to_pylist()))
            if n - 1 in advances and n <= len(parts):
                sinks[name].advance(advances[n - 1])
                marks[name] = max(marks[name], advances[n - 1])

        def filler(name: str) -> pa.RecordBatch | None:
            """A row a window past the table's high-water mark (in order, never late): it
            closes the window before it, whose row reaches the answer."""
            return pa.RecordBatch.from_pylist([{"ts": marks[name] + 10, "v": 1}], schema=T)

        live = Live(
            sinks=sinks,
            order=[n for _ in parts for n in names],
            pending={n: deque(parts) for n in names},
            filler=filler,
            capacity=cap,
            slack=held_by_operators(ctx, len(names) + 1),
            after_write=after_write,
            ordered=True,
        )
        explained = ctx.explain_live(sql)
        if explained.mode == "incremental":
            STREAMING.add(shape)
        got = run(live, ctx.sql(sql).execute_stream(), explained, tally, sql)
        if got is None:
            return
        plain_ctx = datafusion.SessionContext()
        t_rows = [r for b in live.written["t"] for r in b.to_pylist()]
        for n in ("t", "t2"):
            mine = (
                [r for b in live.written.get(n, []) for r in b.to_pylist()]
                if n in sinks
                else t_rows
            )
            plain_ctx.register_record_batches(n, [[pa.RecordBatch.from_pylist(mine, schema=T)]])
        plain_ctx.register_record_batches("u", [[pa.record_batch({"x": [1, 2]}, schema=U)]])
        want = sorted(rows(plain_ctx.sql(sql).to_arrow_table()), key=repr)
        assert _rows_of(got) == want, (shape, data, cuts, advances)
        tally.counts["non-empty answers"] += bool(want)
        tally.counts["closed windows"] += len(want)

    case()
    tally.check(shape, STREAMING)
    assert tally.counts["closed windows"], (shape, tally.counts)
