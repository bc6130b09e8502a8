"""What pushtable's DoPut messages look like on the server's side of the wire: a batch sent
with the client's ``LATER`` metadata arrives with its buffers as aligned as one sent with no
metadata at all (a misaligned body is copied whole by the server's import), and data whose
buffers are misaligned anyway (another client, an IPC file) is accepted by every write path."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable import SessionContext, Topic
from pushtable.flight import protocol
from tests.conftest import WAIT

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])


class _Recorder(flight.FlightServerBase):  # type: ignore[misc]
    """A bare Flight server noting where each received batch's buffers start (mod 64)."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.seen: list[tuple[int, bytes, list[int]]] = []
        self.done = threading.Event()

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                self.done.set()
                return
            if chunk.data is None:
                continue
            metadata = b"" if chunk.app_metadata is None else chunk.app_metadata.to_pybytes()
            offsets = [
                buf.address % 64 for col in chunk.data.columns for buf in col.buffers() if buf
            ]
            self.seen.append((chunk.data.num_rows, metadata, offsets))


@pytest.fixture(scope="module")
def served() -> Iterator[_Recorder]:
    """One bare server for the module: a second one started right after the first was shut
    down was, under load, sometimes never reachable (gRPC's listeners share ports)."""
    server = _Recorder()
    threading.Thread(target=server.serve, daemon=True).start()
    with flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as probe:
        probe.wait_for_available(int(WAIT))
    yield server
    server.shutdown()


@pytest.fixture
def recorder(served: _Recorder) -> _Recorder:
    """The module's server with nothing recorded yet."""
    served.seen.clear()
    served.done.clear()
    return served


@pytest.mark.parametrize("rows", [8_192, 65_536])
def test_a_batch_sent_with_later_arrives_as_aligned_as_one_sent_bare(
    recorder: _Recorder, rows: int
) -> None:
    k = pa.array(np.arange(rows, dtype=np.int64))
    batch = pa.record_batch([k, pa.array(np.random.default_rng(0).random(rows))], schema=SCHEMA)
    client = flight.FlightClient(f"grpc://127.0.0.1:{recorder.port}")
    writer, _ = client.do_put(flight.FlightDescriptor.for_path("t"), SCHEMA)
    for _ in range(3):
        writer.write_batch(batch)
        writer.write_with_metadata(batch, pa.py_buffer(protocol.LATER))
    writer.done_writing()
    writer.close()
    assert recorder.done.wait(WAIT)
    bare = [offsets for _, metadata, offsets in recorder.seen if not metadata]
    later = [offsets for _, metadata, offsets in recorder.seen if metadata == protocol.LATER]
    assert len(bare) == len(later) == 3
    for offsets in later:
        # every buffer 8-byte aligned (what arrow-rs needs for 64-bit values: no copy) ...
        assert all(o % 8 == 0 for o in offsets), offsets
        # ... and shifted by a multiple of 8 from where a bare batch's buffers land
        assert [o % 8 for o in offsets] == [o % 8 for o in bare[0]]


def _misaligned(values: list[int]) -> pa.Array:
    """An int64 array whose values buffer starts one byte past an aligned address."""
    raw = np.asarray(values, np.int64).tobytes()
    buf = pa.py_buffer(b"\0" + raw).slice(1)
    assert buf.address % 8 != 0
    return pa.Array.from_buffers(pa.int64(), len(values), [None, buf])


def test_misaligned_buffers_are_accepted_in_a_batch_a_table_and_a_stream() -> None:
    schema = pa.schema([("v", pa.int64())])
    batch = pa.record_batch([_misaligned([1, 2, 3])], schema=schema)
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=8)
    sink.write(batch)
    sink.write(pa.Table.from_batches([batch, batch]))  # a stream: imported batch by batch
    sink.write(pa.RecordBatchReader.from_batches(schema, [batch]))
    sink.close()
    assert ctx.sql("SELECT count(*) AS n, sum(v) AS s FROM t").to_pydict() == {
        "n": [12],
        "s": [24],
    }


def test_misaligned_buffers_are_accepted_as_a_topic_history() -> None:
    schema = pa.schema([("v", pa.int64())])
    batch = pa.record_batch([_misaligned([5, 6])], schema=schema)
    ctx = SessionContext()
    topic = Topic("events", schema)
    topic.subscribe(ctx, "s", history=pa.Table.from_batches([batch, batch]))
    topic.close()
    assert ctx.sql("SELECT count(*) AS n, sum(v) AS s FROM s").to_pydict() == {
        "n": [4],
        "s": [22],
    }
