"""Hostile input to a live ``pushtable serve`` process: random descriptors, tickets, action
bodies and Flight SQL commands, and raw IPC streams that change schema mid-stream or lie about
their lengths. Every call ends (bounded) with a result or a clear error; the server never
crashes or hangs, and serves a normal query afterwards."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pushtable.flight import connect
from pushtable.flight.server import actions, catalog, sql
from tests.conftest import WAIT, Background, serve_process
from tests.flight_raw import do_put, flight_data, ipc_messages, lie_about_length, path_descriptor

TOKEN = "hostile-test-token"
SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string())])
CALL_S = 10.0  # every hostile call must end within this (a hang fails the test)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``pushtable serve`` in a child process, with one table; yields (process, location)."""
    config = {
        "tokens": [{"name": "fuzz", "secret": TOKEN, "role": "admin"}],
        "limits": {"max_staged_bytes": 64 << 20, "max_table_bytes": 64 << 20},
        "tables": [{"name": "t", "schema": {"k": "int64", "s": "string"}}],
    }
    with serve_process(config, tmp_path_factory.mktemp("serve")) as (proc, location):
        with connect(location, token=TOKEN, timeout=WAIT) as client:
            # A query drains "t" all along, so honest writes never wait for room.
            result = client.sql("SELECT count(*) AS n, sum(length(s)) AS chars FROM t")
            reading = Background(result.read_all)
            yield proc, location
            client._action("close", {"name": "t"})
            got = reading.join().to_pydict()
        # Every honest batch arrived whole: no lying length got into the table.
        assert got["n"][0] is not None
        assert got["n"][0] > 0
        still_serving(proc, location)


def options(timeout: float = CALL_S) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(
        timeout=timeout, headers=[(b"authorization", f"Bearer {TOKEN}".encode())]
    )


def still_serving(proc: subprocess.Popen[str], location: str) -> None:
    assert proc.poll() is None, f"the server process died (exit status {proc.returncode})"
    with connect(location, token=TOKEN, timeout=CALL_S) as client:
        assert client.sql("SELECT 41 + 1 AS x").read_all().to_pydict() == {"x": [42]}


def expect_clear_error(exc: BaseException) -> None:
    """A refusal names its problem; it never carries a server-side Python traceback."""
    text = str(exc)
    assert text.strip(), f"an error without a message: {exc!r}"
    assert "Traceback (most recent call last)" not in text, text


texts = st.text(max_size=40)
blobs = st.binary(max_size=200)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
bodies = st.one_of(
    blobs,
    st.dictionaries(
        st.sampled_from(
            [
                "name",
                "table",
                "topic",
                "query",
                "epoch",
                "parts",
                "schema",
                "type",
                "message",
                "capacity",
                "max_bytes",
                "retain",
                "start",
                "x",
            ]
        )
        | texts,
        json_values,
        max_size=6,
    ).map(lambda d: json.dumps(d).encode()),
)
action_types = st.sampled_from([*actions.ACTIONS, *sql.ACTIONS]) | texts


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=action_types, body=bodies)
def test_random_actions_end_with_a_result_or_a_clear_error(
    served: tuple[subprocess.Popen[str], str], kind: str, body: bytes
) -> None:
    assume(b'"t"' not in body)  # the table the other examples write to stays open
    proc, location = served
    client = flight.FlightClient(location)
    try:
        list(client.do_action(flight.Action(kind, body), options()))
    except flight.FlightTimedOutError:
        pytest.fail(f"action {kind!r} hung")
    except (flight.FlightError, pa.ArrowException) as exc:
        expect_clear_error(exc)
    finally:
        client.close()
    assert proc.poll() is None


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    ticket=st.one_of(
        blobs,
        json_values.map(lambda v: json.dumps(v).encode()),
        texts.map(lambda q: json.dumps({"sql": q}).encode()),
        blobs.map(lambda b: json.dumps({"flight_sql": base64.b64encode(b).decode()}).encode()),
        blobs.map(lambda b: json.dumps({"prepared": base64.b64encode(b).decode()}).encode()),
    ),
    command=blobs
    | texts.map(sql.encode_statement_query)
    | st.tuples(
        st.sampled_from([*catalog.COMMANDS, sql.PREPARED_QUERY, "CommandStatementUpdate"]), blobs
    ).map(lambda kind_and_body: sql.encode_command(*kind_and_body)),
    path=st.lists(texts, max_size=7),
)
def test_random_tickets_commands_and_descriptors(
    served: tuple[subprocess.Popen[str], str], ticket: bytes, command: bytes, path: list[str]
) -> None:
    proc, location = served
    client = flight.FlightClient(location)
    calls: list[Any] = [
        lambda: client.do_get(flight.Ticket(ticket), options()).read_all(),
        lambda: client.get_flight_info(flight.FlightDescriptor.for_command(command), options()),
        lambda: client.get_flight_info(flight.FlightDescriptor.for_path(*path), options()),
    ]
    try:
        for call in calls:
            try:
                call()
            except flight.FlightTimedOutError:
                pytest.fail("a call hung")
            except (flight.FlightError, pa.ArrowException) as exc:
                expect_clear_error(exc)
        # A DoPut to a random path (refused, or written if it names the table), and one with
        # the random command (Flight SQL binds parameters this way).
        for descriptor in (
            flight.FlightDescriptor.for_path(*path),
            flight.FlightDescriptor.for_command(command),
        ):
            writer, reader = client.do_put(descriptor, SCHEMA, options())
            try:
                writer.write_batch(pa.record_batch([[1], ["a"]], schema=SCHEMA))
                writer.done_writing()
                reader.read()
                writer.close()
            except flight.FlightTimedOutError:
                pytest.fail("a DoPut hung")
            except (flight.FlightError, pa.ArrowException) as exc:
                expect_clear_error(exc)
    finally:
        client.close()
    assert proc.poll() is None


def _stream(rows: int) -> list[tuple[bytes, bytes]]:
    batch = pa.record_batch(
        [pa.array(range(rows), pa.int64()), pa.array([f"v{i}" for i in range(rows)])],
        schema=SCHEMA,
    )
    return ipc_messages(SCHEMA, [batch])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    rows=st.integers(1, 3000),
    mutation=st.sampled_from(
        [
            "honest",
            "lie",
            "bad_utf8",
            "schema_change",
            "garbage_header",
            "short_body",
            "no_schema",
            "junk",
        ]
    ),
    junk=blobs,
    stage=st.booleans(),
)
def test_raw_ipc_streams_that_lie_are_refused(
    served: tuple[subprocess.Popen[str], str],
    rows: int,
    mutation: str,
    junk: bytes,
    stage: bool,
) -> None:
    proc, location = served
    (schema_header, _), (header, body) = _stream(rows)
    path = [b"t", b"stage", b"q", b"0", b"0", b"0"] if stage else [b"t"]
    first = flight_data(schema_header, descriptor=path_descriptor(path))
    other = pa.schema([("k", pa.string())])
    (other_schema, _), (other_header, other_body) = ipc_messages(
        other, [pa.record_batch([pa.array(["x"])], schema=other)]
    )
    at = body.find(b"v0")  # the first string's bytes: made invalid UTF-8, lengths intact
    bad_utf8 = body[:at] + b"\xff" + body[at + 1 :]
    messages = {
        "honest": [first, flight_data(header, body)],
        "bad_utf8": [first, flight_data(header, bad_utf8)],
        "lie": [first, flight_data(lie_about_length(header, rows, rows * 1000 + 7), body)],
        "schema_change": [
            first,
            flight_data(header, body),
            flight_data(other_schema),
            flight_data(other_header, other_body),
        ],
        "garbage_header": [first, flight_data(b"\x00" + junk, body)],
        "short_body": [first, flight_data(header, body[: len(body) // 3])],
        "no_schema": [flight_data(header, body, descriptor=path_descriptor(path))],
        "junk": [first, junk],
    }[mutation]
    auth = [("authorization", f"Bearer {TOKEN}")]
    code, details = do_put(location.removeprefix("grpc://"), iter(messages), CALL_S, auth)
    assert code != "DEADLINE_EXCEEDED", f"{mutation}: the server hung"
    if mutation == "honest":
        assert code == "OK", details
    elif mutation != "junk":  # junk bytes may happen to be an empty, valid message
        assert code != "OK", f"{mutation} was accepted"
    if code != "OK":
        assert details.strip()
        assert "Traceback (most recent call last)" not in details, details
    if mutation == "lie":  # the row count's 8 bytes may also match a buffer's offset or
        # length (rows=5 did), which leaves no valid flatbuffer: refused by name either way
        assert "is not valid Arrow data" in details or "malformed Arrow IPC" in details, details
    if mutation == "bad_utf8":
        assert "is not valid Arrow data" in details, details
    if mutation == "bad_utf8":
        assert "UTF8" in details or "UTF-8" in details, details
    still_serving(proc, location)


def test_one_batch_far_over_the_table_s_byte_bound_goes_through_alone(tmp_path: Path) -> None:
    """A 96 MiB batch into a remote table bounded at 1 MiB: written alone (as the docs
    promise for a batch larger than ``max_bytes``), validated in full, read whole; the table
    takes a small batch after it."""
    with (
        serve_process({}, tmp_path) as (_proc, location),
        connect(location, timeout=WAIT) as client,
    ):
        client.create_table("huge", SCHEMA, capacity=2, max_bytes=1 << 20)
        result = client.sql("SELECT count(*) AS n, sum(k) AS total FROM huge")
        reading = Background(result.read_all)
        rows = 12 << 20  # 96 MiB of int64 keys, one string
        huge = pa.record_batch(
            [pa.array(np.arange(rows, dtype=np.int64)), pa.array(["x"] * rows)],
            schema=SCHEMA,
        )
        with client.sink("huge") as sink:
            sink.write(huge, timeout=WAIT)
            sink.write(pa.record_batch([pa.array([1]), pa.array(["y"])], schema=SCHEMA))
        got = reading.join().to_pydict()
    assert got == {"n": [rows + 1], "total": [rows * (rows - 1) // 2 + 1]}


def test_a_batch_or_a_value_over_its_bound_is_refused_by_name(tmp_path: Path) -> None:
    """``max_batch_bytes`` and ``max_value_bytes`` bound what one message carries: a 100 MB
    string cell used to be taken. Each refusal names its limit, costs only its batch (the
    stream goes on), and holds for a value nested in a list of structs and in a durable
    topic's stream."""
    from pushtable.errors import InvalidBatchError

    nested = pa.schema([("k", pa.int64()), ("tags", pa.list_(pa.struct([("s", pa.string())])))])
    config = {"limits": {"max_batch_bytes": 4 << 20, "max_value_bytes": 1 << 20}}
    data = str(tmp_path / "data")
    with (
        serve_process(config, tmp_path, "--data-dir", data) as (_proc, location),
        connect(location, timeout=WAIT) as client,
    ):
        client.create_table("t", nested, capacity=8)
        client.create_topic("d", nested, durable=True)
        long_value = pa.record_batch(
            [pa.array([1, 2]), pa.array([[{"s": "x"}], [{"s": "y" * (2 << 20)}]], nested[1].type)],
            schema=nested,
        )
        wide = pa.record_batch(
            [
                pa.array(np.arange(1 << 20, dtype=np.int64)),
                pa.array([[]] * (1 << 20), nested[1].type),
            ],
            schema=nested,
        )  # 8 MiB of keys, each value short
        small = pa.record_batch(
            [pa.array([7]), pa.array([[{"s": "ok"}]], nested[1].type)], schema=nested
        )
        for name, sink in (("t", client.sink("t")), ("d", client.sink("d", producer_id="p"))):
            with pytest.raises(InvalidBatchError, match=r"column 'tags'.*max_value_bytes"):
                sink.write(long_value, timeout=WAIT)
                sink.flush(timeout=WAIT)
            with pytest.raises(
                InvalidBatchError, match=r"over the server's limit of 4,194,304 \(max_batch_bytes\)"
            ):
                sink.write(wide, timeout=WAIT)
                sink.flush(timeout=WAIT)
            sink.write(small, timeout=WAIT)
            sink.flush(timeout=WAIT)
            if name == "t":
                reading = Background(client.sql("SELECT k FROM t").read_all)
                sink.close()
                assert reading.join()["k"].to_pylist() == [7]
            else:
                assert client.read("d", 0, 1).read_all()["k"].to_pylist() == [7]
                assert client.offsets("d")["next"] == 1  # nothing refused was stored


@pytest.mark.parametrize(
    "metadata",
    [
        b'{"advance": "x"}',
        b'{"advance": {"iso": 5}}',
        b'{"advance": {"iso": "yesterday"}}',
        b'{"advance": {"int": "5"}}',
        b'{"advance": {"int": 1e400}}',
        b'{"advance": {"int": 99999999999999999999999}}',
        b'{"advance": {"int": 1, "iso": "2026-01-01T00:00:00"}}',
        b'["advance"]',
        b"\xff\xfe",
    ],
)
def test_bad_advance_metadata_is_refused_by_name(
    served: tuple[subprocess.Popen[str], str], metadata: bytes
) -> None:
    """A watermark message the server cannot read says what it expects; it used to answer
    with Python's own words ("string indices must be integers")."""
    proc, location = served
    client = flight.connect(location)
    writer, _ = client.do_put(flight.FlightDescriptor.for_path("t"), SCHEMA, options())
    with pytest.raises(flight.FlightError) as caught:
        writer.write_with_metadata(pa.record_batch([[], []], schema=SCHEMA), pa.py_buffer(metadata))
        writer.close()
    text = str(caught.value)
    expect_clear_error(caught.value)
    assert "advance" in text or "app_metadata" in text, text
    for python_words in ("indices", "KeyError", "TypeError", "OverflowError"):
        assert python_words not in text, text
    client.close()
    still_serving(proc, location)


def test_a_producer_id_past_its_bound_is_refused_by_name(
    served: tuple[subprocess.Popen[str], str],
) -> None:
    """A producer id is stored in every commit of its topic: one of 1 MB was taken."""
    proc, location = served
    client = flight.connect(location)
    path = ["t", "producer", "p" * 1_000_000, "0"]
    writer, _ = client.do_put(flight.FlightDescriptor.for_path(*path), SCHEMA, options())
    with pytest.raises(flight.FlightError, match=r"producer id takes at most 256 bytes"):
        writer.write_batch(pa.record_batch([[1], ["x"]], schema=SCHEMA))
        writer.close()
    client.close()
    with (
        connect(location, token=TOKEN, timeout=CALL_S) as ours,
        pytest.raises(ValueError, match=r"producer id takes at most 256 bytes"),
    ):
        ours.sink("t", producer_id="p" * 300)  # refused before any call
    still_serving(proc, location)
