"""``pushtable serve`` over real sockets: remote producers, remote SQL, security, failures."""

from __future__ import annotations

import asyncio
import datetime
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from datafusion import SessionConfig

from pushtable import (
    ReaderGoneError,
    SchemaMismatchError,
    SessionContext,
    SinkClosedError,
    StreamFailedError,
    WriteTimeoutError,
    metrics,
)
from pushtable.errors import (
    RemoteError,
    ServerStoppedError,
    ServerUnavailableError,
    UnauthenticatedError,
    UnboundedQueryError,
    UnknownTableError,
)
from pushtable.flight import Client, Server, connect, serve
from tests.conftest import SCHEMA, WAIT, Background, batch, wait_until

NOT_NULL = pa.schema([pa.field("k", pa.int32(), nullable=False), ("v", pa.float64())])


def remote_ks(client: Client, sql: str) -> Background:
    return Background(lambda: sorted(client.sql(sql).read_all().to_pydict()["k"]))


# --- remote producers --------------------------------------------------------------------


def test_two_remote_producers_and_a_remote_query(server: Server, client: Client) -> None:
    client.create_table("events", SCHEMA, capacity=4)
    reader = remote_ks(client, "SELECT k FROM events")
    sinks = [client.sink("events"), client.sink("events")]

    def produce(i: int) -> None:
        for j in range(50):
            sinks[i].write(batch(2, start=1000 * i + 2 * j), timeout=WAIT)
        sinks[i].flush(timeout=WAIT)

    producers = [Background(functools.partial(produce, i)) for i in range(2)]
    for p in producers:
        p.join()
    sinks[0].close()
    assert reader.join() == sorted([*range(100), *range(1000, 1100)])
    assert sinks[1].stats.acknowledged_batches == 50


def _batch_acks_sent() -> float:
    return metrics.REGISTRY.get_sample_value("pushtable_write_ack_seconds_count") or 0.0


def test_acknowledgements_come_once_per_half_window_and_flush_asks_for_the_rest(
    server: Server, client: Client
) -> None:
    client.create_table("t", SCHEMA, capacity=64)
    sink = client.sink("t", window=8)
    before = _batch_acks_sent()
    for i in range(11):
        sink.write(batch(1, start=i), timeout=WAIT)
    sink.flush(timeout=WAIT)  # 3 batches were sent asking for nothing: flush asks
    stats = sink.stats
    assert (stats.sent_batches, stats.acknowledged_batches) == (11, 11)
    assert stats.table.queued_batches == 11
    # Batches 4 and 8 asked for an acknowledgement (half of the window each); flush's request
    # is not a batch's.
    assert _batch_acks_sent() - before == 2
    one = client.sink("t", window=1)  # a window of one: every batch asks
    one.write(batch(1, start=100), timeout=WAIT)
    one.write(batch(1, start=101), timeout=WAIT)
    one.flush(timeout=WAIT)
    assert _batch_acks_sent() - before == 4
    assert one.stats.acknowledged_batches == 2
    sink.write(batch(1, start=200), timeout=WAIT)  # sent asking for nothing
    reader = remote_ks(client, "SELECT k FROM t")
    sink.close()  # the stream's end acknowledges everything it carried
    assert reader.join() == [*range(11), 100, 101, 200]
    assert sink.stats.acknowledged_batches == 12


def test_backpressure_reaches_the_client(server: Server, client: Client) -> None:
    client.create_table("t", SCHEMA, capacity=2)
    sink = client.sink("t", window=1)
    table = server.table("t")
    for i in range(2):  # the table's capacity
        sink.write(batch(1, start=i), timeout=WAIT)
    wait_until(lambda: table.stats.queued_batches == 2, "the table to fill")
    sent = 2
    # The table is full (seen above): the next write is held by the server, the one after
    # waits for its acknowledgement and times out.
    with pytest.raises(WriteTimeoutError, match="unacknowledged"):
        for i in range(2, 20):
            sink.write(batch(1, start=i), timeout=0.5)
            sent += 1
    # What is in flight is bounded: the table's capacity, the one batch the server is
    # writing, and the client's window.
    assert sent == 2 + 1
    assert table.stats.queued_batches == 2
    reader = remote_ks(client, "SELECT k FROM t")
    for i in range(sent, 20):
        sink.write(batch(1, start=i), timeout=WAIT)  # the reader makes room
    sink.close()
    assert reader.join() == list(range(20))


def test_errors_keep_their_class_and_a_rejected_batch_leaves_the_sink_usable(
    server: Server, client: Client
) -> None:
    client.create_table("t", NOT_NULL, capacity=8)
    sink = client.sink("t")
    with pytest.raises(SchemaMismatchError, match="field 'k' has type int64 in the batch"):
        sink.write(pa.table({"k": pa.array([1], pa.int64()), "v": [0.5]}))
    bad = pa.record_batch([pa.array([None], pa.int32()), pa.array([0.5])], schema=SCHEMA)
    sink.write(batch(1, start=10))
    sink.write(bad)  # in flight: the server's verdict comes on a later call
    refusals: list[SchemaMismatchError] = []
    for step in ("write", "flush"):
        try:  # batch 2 is sent after the bad one, never taken: sent again, not lost
            if step == "write":
                sink.write(batch(2, start=20))
            else:
                sink.flush(timeout=WAIT)
        except SchemaMismatchError as exc:
            refusals.append(exc)
    # Raised once, by whichever call heard it first (the write still sent its batch).
    assert len(refusals) == 1, refusals
    assert re.search(r"'k'.*null", str(refusals[0]))
    sink.write(batch(3), timeout=WAIT)  # a new stream: usable after the rejection
    sink.close()
    got = client.sql("SELECT k FROM t ORDER BY k").read_all().to_pydict()["k"]
    assert got == [0, 1, 2, 10, 20, 21]  # everything but the refused batch, once
    with pytest.raises(SinkClosedError):
        sink.write(batch(1))
    with pytest.raises(UnknownTableError, match="no table named 'nope'"):
        client.sink("nope")


def test_fail_reaches_the_remote_reader(server: Server, client: Client) -> None:
    client.create_table("t", SCHEMA)
    result = client.sql("SELECT k FROM t")
    failing = Background(result.read_all)
    with client.sink("t") as sink:
        sink.write(batch(1))
        sink.fail(RuntimeError("upstream broke"))
    error = failing.join_error()
    assert isinstance(error, StreamFailedError)
    # As a local reader would see it: the remote exception's own class name, nothing added.
    assert str(error) == "the producer of streaming table 't' failed: RuntimeError: upstream broke"


def test_a_topic_over_the_wire(server: Server, client: Client) -> None:
    client.create_topic("ticks", SCHEMA, retain=10)
    with client.sink("ticks") as sink:
        sink.write(batch(2, start=0))
        sink.flush()
        client.subscribe("ticks", "all_ticks", start="earliest")
        reader = remote_ks(client, "SELECT k FROM all_ticks")
        sink.write(batch(2, start=2))
    assert reader.join() == [0, 1, 2, 3]


# --- remote SQL --------------------------------------------------------------------------


def test_remote_results_stream_while_data_arrives(server: Server, client: Client) -> None:
    client.create_table("t", SCHEMA)
    result = client.sql("SELECT k FROM t WHERE k >= 0")
    sink = client.sink("t")
    sink.write(batch(1, start=7))
    sink.flush()
    first = Background(lambda: next(iter(result)))
    assert first.join().to_pydict()["k"] == [7]  # before close: live, not collected
    sink.close()
    assert list(result) == []


def test_result_batches_that_queued_up_go_out_together_and_an_error_after_them_comes_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DoGet side of remote SQL, through a real server and client: batches the query
    produced while a message was going out leave in one message (up to GROUP_ROWS rows), and
    an error raised after them is raised only once they are out. The first message is too big
    for gRPC's flow-control window, so its write waits until the client reads it; the client
    reads only once the query's worker has queued everything behind it."""
    import json

    from pushtable.errors import RemoteError
    from pushtable.flight import protocol
    from pushtable.flight.server.query import GROUP_ROWS, HANDOFF

    workers: list[threading.Thread] = []

    class Recorded(threading.Thread):
        def start(self) -> None:
            super().start()
            if self.name == "pushtable-sql":
                workers.append(self)

    monkeypatch.setattr(threading, "Thread", Recorded)  # the module query.py starts it from
    server = Server(ctx=SessionContext(SessionConfig().with_target_partitions(1)))
    try:
        schema = pa.schema([("k", pa.int64())])
        sink = server.create_table("t", schema, capacity=8)
        first = 16 << 20  # 128 MiB: more than any window gRPC grows to before it is read
        big = GROUP_ROWS * 5 // 8  # two of them pass the cap, one does not
        for ks in (pa.repeat(1, first), [1] * big, [1] * big, [1] * big, [0]):  # 10 / 0 fails
            sink.write(pa.record_batch([pa.array(ks, pa.int64())], schema=schema))
        sink.close()
        assert HANDOFF >= 4  # the worker queues all of it while the first message waits
        raw = flight.FlightClient(server.location)
        ticket = flight.Ticket(json.dumps({"sql": "SELECT k, 10 / k AS q FROM t"}).encode())
        reader = raw.do_get(ticket)
        # The worker is seen to start, then to end (it has queued everything): events, not
        # the absence of a thread that may not have started yet.
        wait_until(lambda: bool(workers), "the query's worker to start")
        workers[0].join(WAIT)
        assert not workers[0].is_alive(), "the query's worker did not queue everything"
        assert reader.read_chunk().data.num_rows == first
        assert reader.read_chunk().data.num_rows == 2 * big  # two queued batches: at the cap
        assert reader.read_chunk().data.num_rows == big  # the last one before the error
        with pytest.raises(flight.FlightError) as failed:
            reader.read_chunk()
        error = protocol.client_error(failed.value)  # what pushtable's client raises
        assert isinstance(error, RemoteError), error
        assert "divide by zero" in str(error).lower()
        raw.close()
    finally:
        server.stop()


def test_cancelling_a_remote_query_stops_it_and_producers_learn(
    server: Server, client: Client
) -> None:
    client.create_table("t", SCHEMA, capacity=1)
    result = client.sql("SELECT k FROM t")
    sink = client.sink("t", window=1)
    sink.write(batch(1), timeout=WAIT)
    sink.flush(timeout=WAIT)
    assert next(iter(result)).num_rows == 1
    result.cancel()

    def write_until_refused() -> None:
        for i in range(10_000):
            sink.write(batch(1, start=i), timeout=WAIT)
            sink.flush(timeout=WAIT)

    assert isinstance(Background(write_until_refused).join_error(), ReaderGoneError)


def test_a_bad_query_gets_the_servers_message(server: Server, client: Client) -> None:
    from pushtable.errors import RemoteError

    with pytest.raises(RemoteError, match="nosuchtable"):
        client.sql("SELECT * FROM nosuchtable").read_all()


# --- security ----------------------------------------------------------------------------


def test_every_call_without_the_token_is_refused() -> None:
    server = Server(token="s3cret")
    try:
        for token in (None, "wrong"):
            c = connect(server.location, token=token)
            with pytest.raises(UnauthenticatedError):
                c.tables()
            with pytest.raises(UnauthenticatedError):
                c.create_table("t", SCHEMA)
            with pytest.raises(UnauthenticatedError):
                c.sql("SELECT 1").read_all()
            raw = flight.FlightClient(server.location)
            # The refusal surfaces when the call opens or on its first write, as gRPC likes.
            with pytest.raises(flight.FlightUnauthenticatedError):
                writer, _ = raw.do_put(flight.FlightDescriptor.for_path("t"), SCHEMA)
                writer.write_batch(batch(1))
                writer.close()
        good = connect(server.location, token="s3cret")
        good.create_table("t", SCHEMA)
        with good.sink("t") as sink:
            sink.write(batch(2))
        assert good.sql("SELECT count(*) AS n FROM t").read_all().to_pydict() == {"n": [2]}
    finally:
        server.stop()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server = Server("grpc://localhost:0", tls=(cert, key), token="t")
    try:
        assert server.location.startswith("grpc+tls://localhost:")
        c = connect(server.location, token="t", tls_root_certs=cert)
        c.create_table("t", SCHEMA)
        with c.sink("t") as sink:
            sink.write(batch(4))
        assert c.sql("SELECT count(*) AS n FROM t").read_all().to_pydict() == {"n": [4]}
        untrusted = connect(server.location, token="t", timeout=5)
        with pytest.raises(ServerUnavailableError):
            untrusted.tables()
        plain = connect(server.location.replace("grpc+tls://", "grpc://"), token="t", timeout=5)
        with pytest.raises(ServerUnavailableError, match="connect with grpc\\+tls://"):
            plain.tables()  # a plain client of a TLS server: named as such
    finally:
        server.stop()
    server = Server("grpc://localhost:0", token="t")
    try:  # and a TLS client of a plain server
        tls = connect(
            server.location.replace("grpc://", "grpc+tls://"),
            token="t",
            tls_root_certs=cert,
            timeout=5,
        )
        with pytest.raises(ServerUnavailableError, match="connect with grpc://"):
            tls.tables()
    finally:
        server.stop()


def test_serve_binds_to_localhost_by_default() -> None:
    said: list[str] = []
    server = serve(port=0, block=False, say=said.append)
    try:
        assert server.location.startswith("grpc://127.0.0.1:")
        assert said == [f"pushtable serve: listening on {server.location} (no auth)"]
    finally:
        server.stop()


# --- reliability -------------------------------------------------------------------------


def test_stopping_the_server_releases_blocked_producers_and_readers(server: Server) -> None:
    client = connect(server.location)
    client.create_table("full", SCHEMA, capacity=1)
    client.create_table("read", SCHEMA)
    sink = client.sink("full", window=1)
    sink.write(batch(1))

    def write_three() -> None:
        for _ in range(3):
            sink.write(batch(1))
        sink.flush()

    blocked = Background(write_three)
    wait_until(lambda: server.table("full").stats.blocked_seconds > 0, "a blocked producer")
    reading = Background(lambda: client.sql("SELECT k FROM read").read_all())
    wait_until(lambda: server._calls.count == 2, "the reading query under way")
    server.stop()
    # The handler's write fails (SinkClosedError) or the stop notice arrives first.
    assert isinstance(blocked.join_error(), (SinkClosedError, ServerStoppedError))
    error = reading.join_error()
    assert isinstance(error, StreamFailedError)
    assert "ServerStoppedError: the pushtable server stopped" in str(error)


def test_stopping_the_server_ends_an_idle_producers_stream(server: Server) -> None:
    """A connected producer that is not writing must not hold the stop (nor the process)."""
    client = connect(server.location)
    client.create_table("t", SCHEMA)
    sink = client.sink("t")
    sink.write(batch(1))
    sink.flush(timeout=WAIT)  # acknowledged; the stream stays open, idle
    assert server.stop(timeout=WAIT) == 0
    with pytest.raises(ServerStoppedError):
        sink.write(batch(1), timeout=WAIT)


_KILLED_PRODUCER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    from pushtable.flight import connect
    sink = connect(sys.argv[1]).sink("t", window=4)
    schema = sink.schema
    def rows(start):
        return pa.record_batch([pa.array(range(start, start + 100), pa.int32()),
                                pa.array([0.0] * 100)], schema=schema)
    for i in range(10):
        sink.write(rows(100_000 + 100 * i))
    sink.flush(timeout=30)
    print("acknowledged 10", flush=True)
    i = 10
    while True:  # until killed mid-stream
        sink.write(rows(100_000 + 100 * i))
        i += 1
    """
)


def test_a_producer_killed_mid_put_keeps_what_was_acknowledged(
    server: Server, client: Client
) -> None:
    client.create_table("t", SCHEMA, capacity=4)
    reader = Background(lambda: client.sql("SELECT k FROM t").read_all().to_pydict()["k"])
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PRODUCER, server.location],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "acknowledged 10"
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT)
    finally:
        child.kill()
    with client.sink("t") as other:  # the table's other producers go on
        other.write(batch(5), timeout=WAIT)
    ks = reader.join()
    killed = sorted(k for k in ks if k >= 100_000)
    assert sorted(k for k in ks if k < 100_000) == list(range(5))
    # Every acknowledged batch is there; nothing after them is half-applied: whole batches only.
    assert killed[: 10 * 100] == list(range(100_000, 101_000))
    assert len(killed) % 100 == 0
    assert killed == list(range(100_000, 100_000 + len(killed)))


def test_garbage_and_a_wrong_schema_on_the_port(server: Server, client: Client) -> None:
    port = int(server.location.rsplit(":", 1)[1])
    for payload in (os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 100):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
    client.create_table("t", SCHEMA)
    raw = flight.FlightClient(server.location)
    wrong = pa.schema([("x", pa.string())])
    writer, _ = raw.do_put(flight.FlightDescriptor.for_path("t"), wrong)
    with pytest.raises(flight.FlightServerError, match="SchemaMismatchError"):
        writer.write_batch(pa.record_batch({"x": ["a"]}))
        writer.close()
    with client.sink("t") as sink:  # the server is fine
        sink.write(batch(3))
    assert client.sql("SELECT count(*) AS n FROM t").read_all().to_pydict() == {"n": [3]}


def test_a_hundred_connections_each_writing_a_little(server: Server, client: Client) -> None:
    client.create_table("t", SCHEMA, capacity=8)
    reader = remote_ks(client, "SELECT k FROM t")

    def one(i: int) -> None:
        with connect(server.location) as c:
            sink = c.sink("t")
            sink.write(batch(3, start=3 * i), timeout=WAIT)
            sink.flush(timeout=WAIT)

    workers = [Background(functools.partial(one, i)) for i in range(100)]
    for w in workers:
        w.join(timeout=120)
    client.sink("t").close()
    assert reader.join(timeout=120) == list(range(300))


def test_the_serve_command_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "tables.json"
    config.write_text('{"tables": [{"name": "events", "schema": {"k": "int32"}, "capacity": 4}]}')
    proc = subprocess.Popen(
        [sys.executable, "-m", "pushtable", "serve", "--port", "0", "--config", str(config)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pushtable serve: listening on grpc://127.0.0.1:")
        location = line.split("listening on ")[1].split()[0]
        c = connect(location)
        assert [t["name"] for t in c.tables()] == ["events"]
        result = c.sql("SELECT k FROM events")
        reading = Background(result.read_all)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
        assert isinstance(reading.join_error(), (StreamFailedError, ServerUnavailableError))
    finally:
        proc.kill()


@pytest.mark.asyncio
async def test_asyncio_producers_write_remotely_without_blocking_the_loop(
    server: Server, client: Client
) -> None:
    """awrite on a full remote table waits off the loop: a ticker task keeps running."""
    client.create_table("t", SCHEMA, capacity=1)
    sink = client.sink("t", window=1)
    await sink.awrite(batch(1), timeout=WAIT)
    await sink.awrite(batch(1), timeout=WAIT)  # queued, then one in the handler: now full
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    ticking = asyncio.create_task(ticker())
    blocked = asyncio.create_task(sink.awrite(batch(1), timeout=WAIT))
    await asyncio.to_thread(wait_until, lambda: ticks >= 20, "the loop to keep running")
    assert not blocked.done()  # still waiting for room, and the loop ran meanwhile
    reader = Background(lambda: client.sql("SELECT count(*) AS n FROM t").read_all())
    await asyncio.wait_for(blocked, WAIT)
    async with sink:  # aclose on exit: end of stream
        await sink.awrite(batch(2), timeout=WAIT)
    stop.set()
    await ticking
    assert reader.join().to_pydict() == {"n": [5]}


def test_a_remote_query_that_would_wait_forever_is_refused_by_name() -> None:
    server = Server()
    try:
        server.create_table("events", SCHEMA, unbounded=True)
        client = connect(server.location, timeout=WAIT)
        with pytest.raises(UnboundedQueryError, match="SortExec needs all of its input"):
            client.sql("SELECT * FROM events ORDER BY 1").read_all()
        client.close()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("query", "error"),
    [
        (
            "SELECT k, count(*) AS n FROM top GROUP BY k ORDER BY n DESC LIMIT 5",
            UnboundedQueryError,
        ),
        ("SELECT no_such_column FROM top", RemoteError),
    ],
)
def test_a_query_refused_at_planning_lets_its_subscription_go(
    server: Server, client: Client, query: str, error: type[Exception]
) -> None:
    """A subscription whose query is refused before it read anything (a shape that cannot
    answer while data arrives, a column that does not exist) is dropped at once: the topic's
    producer is not held by it (capacity 2, 10 writes) and ``tables()`` no longer lists it.
    (It stayed, its backlog filled and the topic's producer waited: a Spark micro-batch took
    40 s until ``unsubscribe``.)"""
    client.create_topic("ev", SCHEMA)
    client.subscribe("ev", "top", capacity=2)
    with pytest.raises(error):
        client.sql(query).read_all()
    sink = client.sink("ev")
    for i in range(10):
        sink.write(batch(1, i), timeout=WAIT)  # held after 2 if "top" still read the topic
    assert "top" not in {t["name"] for t in client.tables()}
    sink.close()
