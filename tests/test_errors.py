"""The error hierarchy: one home, every class exported and documented, classified by type."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import pushtable
import pushtable.errors as errors
from pushtable.flight import connect, protocol
from tests.conftest import WAIT

SEMANTICS = (Path(__file__).resolve().parents[1] / "docs" / "semantics.md").read_text()


def _all_error_classes() -> set[type]:
    """Every PushTableError subclass the package defines (its modules imported; the
    benchmarks' peers need a venv of their own and the CLI's entry point runs on import)."""
    for info in pkgutil.walk_packages(pushtable.__path__, "pushtable."):
        if info.name.startswith("pushtable.bench") or info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
    found: set[type] = set()
    todo = [errors.PushTableError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    return {c for c in found if c.__module__.startswith("pushtable")}


def test_every_error_is_defined_in_errors_exported_and_documented() -> None:
    classes = _all_error_classes()
    assert len(classes) >= 30
    for cls in classes:
        assert cls.__module__ == "pushtable.errors", f"{cls.__qualname__} in {cls.__module__}"
        assert getattr(pushtable, cls.__name__) is cls, cls.__name__
        assert cls.__name__ in pushtable.__all__
        assert f"`{cls.__name__}`" in SEMANTICS, f"docs/semantics.md does not name {cls.__name__}"


def test_the_bridge_s_slow_reader_is_the_subscriber_error() -> None:
    from pushtable.spark import SlowReaderError

    assert SlowReaderError is pushtable.SlowSubscriberError


def test_a_producer_resends_after_a_lost_server_by_class_never_by_message() -> None:
    assert protocol.retriable(pushtable.ServerUnavailableError("refused"))
    assert protocol.retriable(pushtable.ServerStoppedError("stopped"))
    assert protocol.retriable(pushtable.StreamEndedError("ended"))
    # Words that once made a message look like a broken connection decide nothing.
    assert not protocol.retriable(pushtable.SinkClosedError("connection closed by close()"))
    assert not protocol.retriable(pushtable.RemoteError("OSError: connection reset"))
    assert not protocol.retriable(pushtable.CommitFailedError("socket closed"))
    assert not protocol.retriable(ConnectionResetError("connection reset"))


def test_pyarrows_closed_destination_is_the_stream_ending() -> None:
    """The words pyarrow gives a write on a DoPut stream whose far end is gone (no class of
    its own): the stream ended, retriable. The durable crash sweep's run 17 died of it."""
    import pyarrow as pa

    error = protocol.client_error(pa.ArrowInvalid("Destination already closed"))
    assert isinstance(error, pushtable.StreamEndedError)
    assert protocol.retriable(error)
    other = pa.ArrowInvalid("Invalid: column 'k' has the wrong type")
    assert protocol.client_error(other) is other  # any other ArrowInvalid stays what it is


def test_a_write_on_a_stream_whose_server_died_is_a_retriable_error(tmp_path: Path) -> None:
    """A real server killed under a producer: whatever the write meets, it is an error an
    idempotent producer resends after (never a bare pyarrow error)."""
    import signal

    import pyarrow as pa

    from tests.conftest import serve_process

    with serve_process({}, tmp_path) as (proc, location):
        client = connect(location)
        client.create_table("t", pa.schema([("k", pa.int64())]))
        sink = client.sink("t")
        one = pa.record_batch({"k": list(range(1000))})
        sink.write(one)  # the stream is open
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
        with pytest.raises(pushtable.PushTableError) as ended:
            for _ in range(10_000):  # gRPC may take a few before it notices
                sink.write(one, timeout=WAIT)
        assert protocol.retriable(ended.value), repr(ended.value)


def test_a_request_missing_a_field_is_refused_naming_it() -> None:
    """Through a real server: the action's request is checked before anything runs."""
    import pyarrow as pa
    import pytest

    from pushtable.flight import Server, connect

    server = Server()
    try:
        client = connect(server.location)
        client.create_topic("events", pa.schema([("v", pa.int64())]), durable=False)
        with pytest.raises(
            pushtable.InvalidRequestError, match="'consumed' needs the field 'offset'"
        ):
            client._action("consumed", {"name": "events", "consumer": "job"})
        with pytest.raises(pushtable.InvalidRequestError, match="'offset' must be an integer"):
            client._action("consumed", {"name": "events", "consumer": "job", "offset": "3"})
        with pytest.raises(pushtable.InvalidRequestError, match="unknown action 'drop'"):
            client._action("drop", {"name": "events"})
        assert [t["name"] for t in client.tables()] == ["events"]  # nothing else happened
        client.close()
    finally:
        server.stop()


def test_creating_a_table_that_exists_is_table_exists_error() -> None:
    """Through a real server: a typed error, and ``if_not_exists`` answers with the table."""
    import pyarrow as pa
    import pytest

    from pushtable.flight import Server, connect

    schema = pa.schema([("v", pa.int64())])
    server = Server()
    try:
        client = connect(server.location)
        client.create_table("t", schema)
        with pytest.raises(pushtable.TableExistsError, match="'t' already exists"):
            client.create_table("t", schema)
        with pytest.raises(pushtable.TableExistsError, match="'t' already exists"):
            client.create_topic("t", schema)
        client.create_table("t", schema, if_not_exists=True)  # the same schema: the table
        with pytest.raises(pushtable.TableExistsError, match="another schema"):
            client.create_table("t", pa.schema([("w", pa.int64())]), if_not_exists=True)
        assert issubclass(pushtable.TableExistsError, ValueError)
        client.close()
    finally:
        server.stop()


def test_a_request_the_server_cannot_honour_is_invalid_request_error() -> None:
    """A server-side ValueError (a durable topic where no data dir is) crosses as
    InvalidRequestError (a ValueError) naming the cause, not a bare RemoteError."""
    import pyarrow as pa
    import pytest

    from pushtable.flight import Server, connect

    server = Server()
    try:
        client = connect(server.location)
        with pytest.raises(pushtable.InvalidRequestError, match="--data-dir"):
            client.create_topic("t", pa.schema([("v", pa.int64())]), durable=True)
        client.close()
    finally:
        server.stop()


def test_sql_over_a_topic_says_it_is_read_through_a_subscription() -> None:
    import pyarrow as pa
    import pytest

    from pushtable.flight import Server, connect

    server = Server()
    try:
        client = connect(server.location)
        client.create_topic("ticks", pa.schema([("v", pa.int64())]))
        with pytest.raises(pushtable.UnknownTableError, match=r"'ticks' is a topic.*subscribe"):
            client.sql("SELECT * FROM ticks").read_all()
        client.close()
    finally:
        server.stop()


def test_a_table_outside_the_tokens_scope_is_permission_denied_everywhere() -> None:
    """SQL, schema(), stats() and a sink name the same refusal; a listing leaves it out; a
    name in scope that does not exist is UnknownTableError."""
    import pyarrow as pa
    import pytest

    from pushtable.flight import Grant, Server, connect

    tokens = {
        "admin-t": Grant("admin", roles={"admin"}),
        "reader-t": Grant("reader", roles={"read", "write"}, tables=("ev*",)),
    }
    server = Server(tokens=tokens)
    try:
        connect(server.location, token="admin-t").create_table(
            "secret", pa.schema([("v", pa.int64())])
        )
        client = connect(server.location, token="reader-t")
        calls: dict[str, Any] = {
            "sql": lambda: client.sql("SELECT * FROM secret").read_all(),
            "schema": lambda: client.schema("secret"),
            "stats": lambda: client.stats("secret"),
            "sink": lambda: client.sink("secret").write(pa.record_batch({"v": [1]})),
        }
        for call in calls.values():
            with pytest.raises(pushtable.PermissionDeniedError, match="outside its scope"):
                call()
        assert [t["name"] for t in client.tables()] == []
        with pytest.raises(pushtable.UnknownTableError, match="'events'"):
            client.schema("events")
        client.close()
    finally:
        server.stop()
