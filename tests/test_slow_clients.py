"""Clients that stop reading: a producer that never reads its acknowledgements stalls nothing
but itself, is cut off after ``ack_timeout``, and never keeps a server from stopping.

The server is a real ``pushtable serve --data-dir`` process; the client that does not read is
a raw Flight client whose receive window stays at gRPC's initial 64 KiB (BDP probing off), so
a few thousand unread acknowledgements fill it: past that, any write of one blocks until the
client reads."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable.flight import Client, connect, protocol
from tests.conftest import WAIT, wait_until

ORDERED = pa.schema([pa.field("t", pa.int64(), nullable=False)])
#: Watermark messages the client that does not read sends: each is acknowledged at once
#: (nothing to commit). Past the client's 64 KiB window, the server's side of the call takes
#: a few MB more of acknowledgements (~24 bytes each): with one written per message, writes
#: block after about 130,000 messages (measured: a flood then stops for good, as the server
#: stops reading), so a stream that carries twice that was read on while its acks could not
#: be sent.
FLOOD = 260_000
STOP_S = 10.0  # the server's stop timeout (Server.stop's default, what the command uses)


@contextlib.contextmanager
def durable_server(
    tmp_path: Path, limits: dict[str, Any], *extra: str
) -> Iterator[tuple[Any, Client, str]]:
    """``pushtable serve --data-dir`` (and ``extra`` arguments) with one durable topic
    ``events``: (process, client, location)."""
    args = [sys.executable, "-m", "pushtable", "serve", "--port", "0"]
    args += ["--data-dir", str(tmp_path / "data"), *extra]
    if limits:
        config = tmp_path / "serve.json"
        config.write_text(json.dumps({"limits": limits}))
        args += ["--config", str(config)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        location = proc.stdout.readline().split("listening on ")[1].split()[0]
        with connect(location, timeout=WAIT) as client:
            client.create_topic("events", ORDERED, durable=True, order_by="t")
            yield proc, client, location
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


class Unread:
    """A DoPut stream into ``events`` that sends watermark messages from a thread and never
    reads what the server sends back."""

    def __init__(self, location: str) -> None:
        self._client = flight.FlightClient(location, generic_options=[("grpc.http2.bdp_probe", 0)])
        descriptor = flight.FlightDescriptor.for_path("events")
        self._writer, self._unread = self._client.do_put(descriptor, ORDERED)
        self.sent = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flood, daemon=True)
        self._thread.start()

    def _flood(self) -> None:
        empty = pa.RecordBatch.from_pylist([], schema=ORDERED)
        try:
            while not self._stop.is_set() and self.sent < FLOOD:
                metadata = pa.py_buffer(protocol.advance_metadata(self.sent))
                self._writer.write_with_metadata(empty, metadata)
                self.sent += 1
            self._stop.wait()
            self._writer.done_writing()
            self._unread.read()  # the call's end: its status, or an acknowledgement
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            self.error = exc

    def stop(self) -> None:
        self._stop.set()


@pytest.mark.slow  # 260,000 messages (about 50 s on 2 cores): CI's slow run has it
def test_a_producer_that_never_reads_its_acks_stalls_only_itself(tmp_path: Path) -> None:
    """While one client floods a durable topic and reads none of its acknowledgements,
    another producer of the same topic is acknowledged all along (acknowledgements leave
    from each stream's own sender, never the committer's thread), and SIGTERM then ends the
    server within its stop timeout."""
    with durable_server(tmp_path, {}) as (proc, client, location):
        unread = Unread(location)
        good = client.sink("events")
        flushes = 0
        while unread.sent < FLOOD or flushes < 10:
            assert unread.error is None, unread.error
            good.write(pa.record_batch({"t": [1_000_000_000 + flushes]}, schema=ORDERED))
            good.flush(timeout=WAIT)  # acknowledged: committed while the other does not read
            flushes += 1
        # The flood went on while its acknowledgements stayed unread: the server kept
        # reading that stream too, with what it had to say to it pending.
        assert unread.sent == FLOOD
        assert client.offsets("events")["committed"] == flushes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_S + WAIT) == 0  # whatever the unread client does
        unread.stop()


def test_a_producer_that_does_not_read_for_ack_timeout_is_cut_off(tmp_path: Path) -> None:
    """Past ``ack_timeout`` with an acknowledgement unread, the server ends that stream (a
    ResourceLimitError naming the limit, counted as an ``ack_timeout`` refusal) and stops
    reading it; what was acknowledged stays stored and the topic takes writes."""
    extra = ("--metrics-port", "0")
    with durable_server(tmp_path, {"ack_timeout": 1}, *extra) as (proc, client, location):
        lines = [proc.stdout.readline() for _ in range(2)]  # the data dir, then the metrics
        metrics_url = lines[-1].split("metrics on ")[1].strip()
        sink = client.sink("events")
        sink.write(pa.record_batch({"t": [7]}, schema=ORDERED))
        sink.flush(timeout=WAIT)
        Unread(location)
        wait_until(lambda: refusals(metrics_url, "ack_timeout") == 1, "the unread stream cut off")
        later = 10 * FLOOD  # past every watermark the cut-off stream declared
        sink.write(pa.record_batch({"t": [later]}, schema=ORDERED))
        sink.flush(timeout=WAIT)
        assert client.read("events", 0, 2).read_all().to_pydict() == {"t": [7, later]}
        assert proc.poll() is None


def refusals(metrics_url: str, reason: str) -> float:
    """The server's count of refusals for ``reason``, read from its Prometheus metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=WAIT) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("pushtable_server_refusals") and (
                sample.labels.get("reason") == reason
            ):
                return sample.value
    return 0.0
