"""What pushtable's DoPut messages cost ``pushtable serve`` to import, measured on the
server's own counters (``stats.realigned_bytes``: the bytes its import copied because a buffer
did not start at an address aligned for its type).

A batch sent by pushtable's client (most with the ``LATER`` metadata) arrives as aligned as one
a bare pyarrow client sends with no metadata: up to 2 MiB a message, every buffer aligned and
nothing copied. The first, 15-byte ``LATER`` put every buffer one byte off and the import
copied each batch whole. Over 2 MiB, pyarrow 26's Flight server hands over every message at
an unaligned address whoever sent it (measured; the copy is then the transport's, not the
protocol's). Data whose buffers are misaligned anyway (another client, an IPC file) is
accepted by every write path."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable import SessionContext, Topic
from pushtable.flight import Client, connect, protocol
from tests.conftest import WAIT, serve_process

SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("v", pa.float64()),
        ("ts", pa.timestamp("us", tz="Europe/Paris")),
        ("price", pa.decimal128(12, 3)),
        ("name", pa.string()),
        ("tags", pa.list_(pa.struct([("id", pa.int32()), ("at", pa.timestamp("ms"))]))),
    ]
)
#: The largest message pyarrow's Flight server was measured to hand over where it landed.
ALIGNED_UP_TO = 2 * 1024 * 1024


def _batch(rows: int) -> pa.RecordBatch:
    """``rows`` rows of every column type (nested too), nulls in each column but ``k``."""
    k = np.arange(rows, dtype=np.int64)
    start = dt.datetime(2026, 3, 29, tzinfo=dt.timezone.utc)
    return pa.record_batch(
        [
            pa.array(k),
            pa.array(np.random.default_rng(0).random(rows), mask=k % 97 == 0),
            pa.array([start + dt.timedelta(seconds=int(i)) for i in k], SCHEMA.field("ts").type),
            pa.array(
                [None if i % 89 == 0 else Decimal(int(i)) / 1000 for i in k], pa.decimal128(12, 3)
            ),
            pa.array([None if i % 83 == 0 else f"n{i}" for i in k]),
            pa.array(
                [
                    None if i % 79 == 0 else [{"id": int(i) % 7, "at": None if i % 3 else start}]
                    for i in k
                ],
                SCHEMA.field("tags").type,
            ),
        ],
        schema=SCHEMA,
    )


def _put_by_hand(location: str, table: str, batch: pa.RecordBatch, metadata: bytes | None) -> None:
    """Four DoPut messages of ``batch`` from a bare pyarrow client, with ``metadata`` or none."""
    raw = flight.FlightClient(location)
    wire = protocol.wire_schema(SCHEMA)
    writer, _ = raw.do_put(flight.FlightDescriptor.for_path(table), wire)
    message = protocol.to_wire(table, SCHEMA, wire, batch)
    for _ in range(4):
        if metadata is None:
            writer.write_batch(message)
        else:
            writer.write_with_metadata(message, pa.py_buffer(metadata))
    writer.done_writing()
    writer.close()  # returns once the server's DoPut has returned: every batch is written
    raw.close()


def _realigned(client: Client, table: str) -> tuple[int, int]:
    stats = client.stats(table)
    assert stats["batches"] == 4
    return stats["realigned_batches"], stats["realigned_bytes"]


@pytest.mark.parametrize("rows", [8_192, 24_576, 65_536])
def test_pushtable_serve_copies_no_more_of_pushtables_messages_than_of_bare_ones(
    tmp_path: Path, rows: int
) -> None:
    batch = _batch(rows)
    with serve_process({}, tmp_path) as (_, location), connect(location) as client:
        for table in ("ours", "bare", "first"):
            client.create_table(table, SCHEMA, capacity=16)
        # pushtable's client, window 4: the 2nd and 4th ask for an acknowledgement, the
        # 1st and 3rd carry LATER.
        with client.sink("ours", window=4) as sink:
            for _ in range(4):
                sink.write(batch)
            sink.flush()
            assert sink.stats.acknowledged_batches == 4
        _put_by_hand(location, "bare", batch, None)
        _put_by_hand(location, "first", batch, protocol.LATER_V1)

        ours, bare, first = (_realigned(client, t) for t in ("ours", "bare", "first"))
        assert ours == bare
        # every fixed-width buffer (validity bitmaps need no alignment) one byte off: copied
        fixed = sum(b.size for c in batch.columns[:4] for b in c.buffers()[1:] if b is not None)
        assert first[0] == 4
        assert first[1] >= 4 * fixed
        if batch.nbytes < ALIGNED_UP_TO:
            assert ours == (0, 0)


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


class _StreamIntoSink(flight.FlightServerBase):  # type: ignore[misc]
    """A DoPut that hands pyarrow's reader of the call, as a C stream, to a sink's write."""

    def __init__(self, sink: Any) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self._sink = sink

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        self._sink.write(reader.to_reader())
        self._sink.close()


def stream_from_the_network_scenario() -> None:
    """The client sends its second batch only once a query in this process read the first.

    Run in a child process by the test below: a sink that held the GIL while it waited for
    the next batch of the stream stalled every other thread of the process for good (the
    client could not send, the query could not read, nor could a timeout fire).
    """
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=4)
    seen: list[pa.RecordBatch] = []
    arrived = threading.Event()

    def read() -> None:
        for b in ctx.sql("SELECT * FROM t").execute_stream():
            seen.append(b.to_pyarrow())
            arrived.set()

    server = _StreamIntoSink(sink)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    raw = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    try:
        writer, _ = raw.do_put(flight.FlightDescriptor.for_path("t"), SCHEMA)
        first, second = _batch(1_000), _batch(500)
        writer.write_batch(first)
        assert arrived.wait(WAIT), "the query never read the first batch"
        writer.write_batch(second)
        writer.done_writing()
        writer.close()
        reader.join(WAIT)
        assert not reader.is_alive()
        got = pa.Table.from_batches(seen).cast(SCHEMA)
        assert got.equals(pa.Table.from_batches([first, second]))
    finally:
        raw.close()
        server.shutdown()
    print("read", got.num_rows, "rows")


def test_a_stream_from_the_network_is_read_without_the_gil() -> None:
    """A C stream whose next batch is still on the wire is waited for without the GIL."""
    code = "from tests.test_flight_wire import stream_from_the_network_scenario as s; s()"
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=WAIT
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process stalled while the sink waited for the stream's next batch")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "read 1500 rows"
