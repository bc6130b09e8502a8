"""Flight SQL: a generic client (ADBC's Flight SQL driver, as JDBC/BI tools use) runs live SQL
on ``pushtable serve``."""

from __future__ import annotations

from collections.abc import Iterator

import adbc_driver_flightsql.dbapi as flightsql
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable.flight import Client, Server, connect, sql
from tests.conftest import SCHEMA, Background, batch, wait_until


@pytest.fixture
def secured() -> Iterator[Server]:
    s = Server(token="s3cret")
    yield s
    s.stop()


def adbc(server: Server, token: str | None = "s3cret") -> flightsql.Connection:
    options = {"adbc.flight.sql.authorization_header": f"Bearer {token}"} if token else {}
    return flightsql.connect(server.location, db_kwargs=options, autocommit=True)


def test_an_adbc_client_reads_a_live_table_while_it_is_written(secured: Server) -> None:
    client = connect(secured.location, token="s3cret")
    client.create_table("t", SCHEMA)
    with adbc(secured) as conn, conn.cursor() as cur:

        def run() -> pa.Table:
            cur.execute("SELECT k FROM t ORDER BY k")
            return cur.fetch_arrow_table()

        reading = Background(run)
        # The statement is planned and running before any data exists: it answers live.
        wait_until(lambda: secured._calls == 1, "the Flight SQL query under way")
        with client.sink("t") as sink:
            sink.write(batch(3))
            sink.write(batch(2, start=3))
        assert reading.join().column("k").to_pylist() == list(range(5))


def test_adbc_errors_and_refusals(secured: Server) -> None:
    with adbc(secured) as conn, conn.cursor() as cur:
        with pytest.raises(flightsql.Error, match=r"table 'datafusion\.public\.nope' not found"):
            cur.execute("SELECT * FROM nope")
        with pytest.raises(flightsql.Error, match="not implemented"):
            conn.adbc_get_objects().read_all()  # catalog commands are not served
    with (
        adbc(secured, token="wrong") as conn,
        conn.cursor() as cur,
        pytest.raises(flightsql.Error, match=r"(?i)unauthenticated|bearer"),
    ):
        cur.execute("SELECT 1")


def test_statement_queries_decode_and_other_descriptors_are_refused(
    server: Server, client: Client
) -> None:
    assert sql.statement_query(sql.encode_statement_query("SELECT 1 AS x")) == "SELECT 1 AS x"
    with pytest.raises(ValueError, match="not a Flight SQL command"):
        sql.statement_query(b"\x0a\x03abc")
    raw = flight.FlightClient(server.location)
    info = raw.get_flight_info(
        flight.FlightDescriptor.for_command(sql.encode_statement_query("SELECT 41 + 1 AS x"))
    )
    assert info.schema.names == ["x"]
    assert raw.do_get(info.endpoints[0].ticket).read_all().to_pydict() == {"x": [42]}
    with pytest.raises(flight.FlightServerError, match="statement queries only"):
        raw.get_flight_info(flight.FlightDescriptor.for_path("t"))
    raw.close()
