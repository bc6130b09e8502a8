"""A corpus of ordinary SQL (``tests/corpus.py``) answered alike by every face of pushtable.

- Over stored tables on a server: each query that answers in process answers through
  pushtable's Flight client and through ADBC's Flight SQL driver with the same rows and types.
- Over live tables (written, then closed, while the query runs): each query answers as plain
  DataFusion does over the same rows, or is refused at ``ctx.sql`` naming why.

Every failure is collected and reported together (a query, a face, what differed).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import adbc_driver_flightsql.dbapi as flightsql
import datafusion
import pyarrow as pa
import pytest

from pushtable import PushTableError, SessionContext
from pushtable.flight import Server, connect
from tests.conftest import WAIT, Background
from tests.corpus import QUERIES, TABLES, ordered
from tests.differential import plain, rows


def _compare(sql: str, got: pa.Table, want: pa.Table) -> str | None:
    """What differs between two answers (None: the same names, types and rows)."""
    if got.column_names != want.column_names:
        return f"names {got.column_names} != {want.column_names}"
    got_types = [plain(t) for t in got.schema.types]
    want_types = [plain(t) for t in want.schema.types]
    if got_types != want_types:
        return f"types {got_types} != {want_types}"
    g, w = rows(got), rows(want)
    if not ordered(sql):
        g, w = sorted(g, key=repr), sorted(w, key=repr)
    if g != w:
        return f"rows {g} != {w}"
    return None


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(token="s3cret")
    for name, table in TABLES.items():
        s.ctx.register_record_batches(name, [table.to_batches()])
    yield s
    s.stop()


def test_the_corpus_answers_remotely_as_in_process(server: Server) -> None:
    failures, answered = [], 0
    options = {"adbc.flight.sql.authorization_header": "Bearer s3cret"}
    with (
        connect(server.location, token="s3cret") as client,
        flightsql.connect(server.location, db_kwargs=options, autocommit=True) as conn,
        conn.cursor() as cur,
    ):
        for sql in QUERIES:
            try:
                want = server.ctx.sql(sql).to_arrow_table()
            except Exception as exc:  # noqa: BLE001 (refused in process: nothing to compare)
                failures.append(f"in process: {sql}: {exc}")
                continue
            answered += 1
            for way in ("flight", "adbc"):
                try:
                    if way == "flight":
                        got = client.sql(sql).read_all()
                    else:
                        cur.execute(sql)
                        got = cur.fetch_arrow_table()
                except Exception as exc:  # noqa: BLE001 (collected)
                    failures.append(f"{way} failed where in process answered: {sql}: {exc}")
                    continue
                if (diff := _compare(sql, got, want)) is not None:
                    failures.append(f"{way} answered otherwise: {sql}: {diff}")
    assert not failures, f"{len(failures)} of {len(QUERIES)} queries:\n" + "\n".join(failures)
    assert answered == len(QUERIES)


class Refused(Exception):
    """``ctx.sql`` refused the query (naming why): the one place a refusal may happen."""


def _live_answer(sql: str) -> pa.Table:
    """``sql`` over live tables holding the corpus's rows, written while it runs, then closed.

    Raises ``Refused`` when ``ctx.sql`` refuses it; any error after (while the query runs)
    is a failure, not a refusal: every shape answers or is refused up front."""
    ctx = SessionContext()
    named = {n: t for n, t in TABLES.items() if re.search(rf"\b(FROM|JOIN)\s+{n}\b", sql)}
    sinks = {name: ctx.register_streaming_table(name, t.schema, 2) for name, t in named.items()}
    try:
        frame = ctx.sql(sql)
    except PushTableError as exc:
        raise Refused(f"{type(exc).__name__}: {exc}") from exc
    result = Background(frame.to_arrow_table)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for name, table in named.items():
                for batch in table.to_batches(max_chunksize=3):
                    sinks[name].write(batch, timeout=WAIT)
                sinks[name].close()
        except PushTableError as exc:  # a query that needed one table only may end first
            if type(exc).__name__ != "ReaderGoneError":
                errors.append(exc)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    table = result.join()
    producer.join(WAIT)
    assert not producer.is_alive(), f"the producer did not finish: {sql}"
    if errors:
        raise errors[0]
    return table


def test_the_corpus_over_live_tables_answers_as_datafusion() -> None:
    plain_ctx = datafusion.SessionContext()
    for name, table in TABLES.items():
        plain_ctx.register_record_batches(name, [table.to_batches()])
    failures: list[str] = []
    refused: list[str] = []
    for sql in QUERIES:
        want = plain_ctx.sql(sql).to_arrow_table()
        try:
            got = _live_answer(sql)
        except Refused as exc:
            refused.append(f"{sql}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 (collected: a failure that is not a refusal)
            failures.append(f"failed: {sql}: {type(exc).__name__}: {exc}")
            continue
        if (diff := _compare(sql, got, want)) is not None:
            failures.append(f"answered otherwise: {sql}: {diff}")
    assert not failures, f"{len(failures)} of {len(QUERIES)} queries:\n" + "\n".join(failures)
    # Refusals (at ctx.sql, naming why); the corpus is ordinary SQL over tables that close,
    # so few are.
    print(f"corpus over live tables: {len(QUERIES) - len(refused)} answered, refused: {refused}")
    assert len(refused) <= len(QUERIES) // 10, "\n".join(refused)
