"""A server stop is an outage to its producers: SIGTERM a real ``pushtable serve --data-dir``
while idempotent producers write, start it again on the same port and data dir, and they
ride it out (every batch stored once); a plain producer is told the server stopped."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable import ServerStoppedError, ServerUnavailableError
from pushtable.flight import connect
from tests.conftest import WAIT, serve_process, wait_until
from tests.test_producer_outage import _free_port, _server

SCHEMA = pa.schema([("v", pa.int64())])
ROWS = 100


class Producer:
    """Writes 100-row batches every 10 ms until stopped; batch i of producer p holds
    ``p * 10**6 + i * ROWS + r``. Keeps what was written and the error that ended it."""

    def __init__(self, uri: str, index: int, producer_id: str | None) -> None:
        self.index = index
        self.client = connect(uri, timeout=WAIT)
        if producer_id is None:
            self.sink: Any = self.client.sink("t")
        else:
            self.sink = self.client.sink("t", producer_id=producer_id, retry=30)
        self.written = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                base = self.index * 10**6 + self.written * ROWS
                self.sink.write(pa.record_batch({"v": range(base, base + ROWS)}, schema=SCHEMA))
                self.written += 1
                time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def values(self) -> list[int]:
        base = self.index * 10**6
        return list(range(base, base + self.written * ROWS))


def test_idempotent_producers_ride_out_a_sigterm_and_restart(tmp_path: Path) -> None:
    port = _free_port()
    uri = f"grpc://127.0.0.1:{port}"
    data = tmp_path / "data"
    with _server(data, port) as proc:
        admin = connect(uri, timeout=WAIT)
        admin.create_topic("t", SCHEMA, durable=True)
        producers = [Producer(uri, 1, "p1"), Producer(uri, 2, "p2")]
        plain = Producer(uri, 3, None)
        wait_until(lambda: all(p.written >= 5 for p in [*producers, plain]), "writes")
        proc.send_signal(signal.SIGTERM)
        proc.wait(WAIT)
        admin.close()
    plain.thread.join(WAIT)
    assert isinstance(plain.error, ServerStoppedError | ServerUnavailableError), plain.error
    time.sleep(2)  # the outage: the server is away for two seconds
    before = [p.written for p in producers]
    with _server(data, port):
        # each idempotent producer goes on where it stopped: three more batches each
        wait_until(
            lambda: all(
                p.written >= b + 3 or p.error for p, b in zip(producers, before, strict=True)
            ),
            "writes after the restart",
        )
        for p in producers:
            p.stop.set()
            p.thread.join(WAIT)
            assert p.error is None, p.error
            p.sink.flush(timeout=WAIT)
        reader = connect(uri, timeout=WAIT)
        committed = reader.offsets("t")["committed"]
        stored = reader.read("t", 0, committed).read_all().column("v").to_pylist()
        for p in producers:
            mine = sorted(v for v in stored if v // 10**6 == p.index)
            assert mine == p.values()  # every batch it wrote, once
        acknowledged = [v for v in stored if v // 10**6 == plain.index]
        assert len(set(acknowledged)) == len(acknowledged)  # never twice
        reader.close()
        for p in [*producers, plain]:
            p.client.close()


def test_closing_a_sink_after_the_server_stopped_says_it_stopped(tmp_path: Path) -> None:
    port = _free_port()
    uri = f"grpc://127.0.0.1:{port}"
    with _server(tmp_path / "data", port) as proc:
        client = connect(uri, timeout=WAIT)
        client.create_table("t", SCHEMA, 4)
        sink = client.sink("t")
        sink.write(pa.record_batch({"v": [1]}, schema=SCHEMA))
        sink.flush()  # acknowledged: the server's handler holds the stream when it stops
        proc.send_signal(signal.SIGTERM)
        proc.wait(WAIT)
    with pytest.raises(ServerStoppedError, match="stopped"):  # the stream heard the stop
        sink.write(pa.record_batch({"v": [2]}, schema=SCHEMA))
    with pytest.raises(ServerStoppedError, match="stopped"):  # not "unreachable"
        sink.close()
    client.close()


def test_a_client_that_stopped_reading_does_not_keep_a_stopped_server_alive(
    tmp_path: Path,
) -> None:
    """A remote query whose client opened its DoGet, read one message and went quiet (its
    connection open, gRPC's flow-control window full) cannot be told the server stopped:
    the stop abandons that call after its timeout, and the process exits. It used to wait
    for the call again at interpreter exit (pyarrow's own shutdown hook), forever."""
    with serve_process({}, tmp_path) as (proc, location), connect(location) as client:
        client.create_table("big", SCHEMA, capacity=64)
        with client.sink("big") as sink:
            for i in range(40):  # 80 MB of results: more than the flow-control window (which
                # gRPC grows on a fast link) and the query's hand-off hold; 20 MB was drained whole
                # in a full run (0 queued)
                rows = 262_144
                sink.write(pa.record_batch({"v": np.arange(i * rows, (i + 1) * rows)}))
        quiet = flight.FlightClient(location)
        try:
            reader = quiet.do_get(flight.Ticket(json.dumps({"sql": "SELECT v FROM big"}).encode()))
            assert reader.read_chunk().data.num_rows > 0
            # The query stops pulling once the window and its hand-off are full: the table
            # keeps batches queued, unchanged. Seen (for a second), then the signal.
            deadline = time.monotonic() + WAIT
            last, since = -1, time.monotonic()
            while True:
                queued = client.stats("big")["queued_batches"]
                if queued != last:
                    last, since = queued, time.monotonic()
                elif queued > 0 and time.monotonic() - since >= 1.0:
                    break
                assert time.monotonic() < deadline, f"the query never stalled ({queued} queued)"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(WAIT) == 0
            assert proc.stdout is not None
            said = proc.stdout.read()  # to EOF: the process has exited
            assert "pushtable serve: stopped (1 idle stream(s) abandoned)" in said, said
        finally:
            quiet.close()
