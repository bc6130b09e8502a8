"""An idempotent producer whose server stays away longer than ``retry``: a clear
``ServerUnavailableError`` that says what is kept, and nothing lost or doubled once the server
is back (a real ``pushtable serve --data-dir`` process, killed with SIGKILL)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest

from pushtable import ServerUnavailableError
from pushtable.flight import connect
from pushtable.flight.client.remote_sink import RemoteSink
from tests.conftest import WAIT, Background, serve_process

SCHEMA = pa.schema([("v", pa.int64())])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _server(data_dir: Path, port: int) -> Iterator[subprocess.Popen[str]]:
    with serve_process({}, data_dir.parent, "--data-dir", str(data_dir), port=port) as (proc, _):
        yield proc


def _stored_then_killed(data_dir: Path, port: int, values: list[int], retry: float) -> RemoteSink:
    """An idempotent producer of durable topic ``t`` whose batch ``values`` is stored, and
    then its server killed with SIGKILL."""
    with _server(data_dir, port) as proc:
        client = connect(f"grpc://127.0.0.1:{port}", timeout=WAIT)
        client.create_topic("t", SCHEMA, durable=True)
        sink = client.sink("t", producer_id="p", retry=retry)
        sink.write(pa.record_batch({"v": values}, schema=SCHEMA))
        sink.flush(timeout=WAIT)
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    return sink


def test_retry_exhaustion_raises_server_unavailable_and_keeps_the_batches(tmp_path: Path) -> None:
    port = _free_port()
    uri = f"grpc://127.0.0.1:{port}"
    sink = _stored_then_killed(tmp_path / "data", port, [1, 2], retry=1.0)
    with pytest.raises(ServerUnavailableError) as info:
        sink.write(pa.record_batch({"v": [3]}, schema=SCHEMA))
        sink.flush(timeout=WAIT)
    message = str(info.value)
    assert "stayed unreachable for 1.0s" in message
    assert "1 batch(es) not acknowledged" in message
    assert "kept and sent again" in message
    with _server(tmp_path / "data", port):  # back on its data dir: a flush resends
        # gRPC's channel tries the server again within its reconnect backoff (at most
        # RECONNECT_BACKOFF_MS): a flush inside it may give up after ``retry`` once more.
        deadline = time.monotonic() + WAIT
        while True:
            try:
                sink.flush(timeout=WAIT)
                break
            except ServerUnavailableError:
                assert time.monotonic() < deadline, "the server never became reachable again"
        client = connect(uri, timeout=WAIT)
        committed = client.offsets("t")["committed"]
        rows = client.read("t", 0, committed).read_all().column("v").to_pylist()
        assert rows == [1, 2, 3]  # the first batch once, the kept one once
        sink.close()
        client.close()


@pytest.mark.slow
def test_an_outage_shorter_than_retry_is_survived_however_long_it_was(tmp_path: Path) -> None:
    """An outage of 20 s, within a producer's ``retry`` of 25 s: the sink reaches the server
    once it is back and its batch is stored. gRPC's own reconnect backoff would have grown to
    about 10 s by then (its next attempt past ``retry``); the client caps it at
    ``RECONNECT_BACKOFF_MS``. Without the cap this fails in most runs."""
    port = _free_port()
    uri = f"grpc://127.0.0.1:{port}"
    sink = _stored_then_killed(tmp_path / "data", port, [1], retry=25.0)

    def write_through_the_outage() -> None:
        sink.write(pa.record_batch({"v": [2]}, schema=SCHEMA))
        sink.flush(timeout=60)

    outage = Background(write_through_the_outage)
    time.sleep(20.0)  # the outage itself (what is tested is what follows it)
    with _server(tmp_path / "data", port):
        outage.join(timeout=60)  # raises ServerUnavailableError if retry ran out
        client = connect(uri, timeout=WAIT)
        assert client.read("t", 0, 2).read_all().column("v").to_pylist() == [1, 2]
        sink.close()
        client.close()
