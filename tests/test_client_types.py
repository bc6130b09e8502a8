"""The Flight client's API with the data users have: random schemas (timestamps with zones,
decimals, lists, structs, dictionaries, nulls) through a real ``pushtable serve`` and back,
unchanged: a table written by a ``RemoteSink`` and read by remote SQL while it is written, and
a durable topic written by an idempotent producer and read back by offset range, before and
after the server restarts. The schema strategy is the one that drives the in-process sink."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable.flight import Server, connect
from tests.conftest import WAIT, Background
from tests.test_hostile_input import schemas, values

_names = itertools.count()


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def batches_of(schema: pa.Schema, sizes: list[int]) -> list[pa.RecordBatch]:
    return [
        pa.RecordBatch.from_arrays(
            [values(f.type, n, nulls=f.nullable) for f in schema], schema=schema
        )
        for n in sizes
    ]


def rows(table: pa.Table) -> list[str]:
    """A table's rows as a multiset (a scan's order is free; values, not buffers: Lance
    re-encodes a dictionary column)."""
    return sorted(map(repr, table.to_pylist()))


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas(), sizes=st.lists(st.sampled_from([1, 7, 300]), min_size=1, max_size=3))
def test_random_schemas_round_trip_through_the_client(
    data_dir: Path, schema: pa.Schema, sizes: list[int]
) -> None:
    batches = batches_of(schema, sizes)
    want = pa.Table.from_batches(batches, schema=schema)
    table, topic = f"t{next(_names)}", f"d{next(_names)}"
    server = Server(data_dir=data_dir)
    try:
        with connect(server.location) as client:
            client.create_table(table, schema)
            assert client.schema(table).equals(schema)
            reading = Background(lambda: client.sql(f'SELECT * FROM "{table}"').read_all())
            with client.sink(table) as sink:  # closing the sink ends the table's stream
                for b in batches:
                    sink.write(b)
            live = reading.join(timeout=WAIT)
            assert live.schema.equals(schema)
            assert rows(live) == rows(want)

            client.create_topic(topic, schema, durable=True)
            with client.sink(topic, producer_id="p") as durable:
                for b in batches:
                    durable.write(b)
                durable.flush()
            stored = client.read(topic, 0, len(batches)).read_all()
            assert stored.schema.equals(schema)
            assert stored.to_pylist() == want.to_pylist()  # a range keeps its order
    finally:
        server.stop()
    server = Server(data_dir=data_dir)  # restarted: the topic comes back from Lance
    try:
        with connect(server.location) as client:
            assert client.offsets(topic)["next"] == len(batches)
            again = client.read(topic, 0, len(batches)).read_all()
            assert again.schema.equals(schema)
            assert again.to_pylist() == want.to_pylist()
    finally:
        server.stop()


def test_dictionary_columns_reach_a_remote_reader(data_dir: Path) -> None:
    """A dictionary column, top-level or nested, through remote SQL: pyarrow's generator
    stream alone would send its batches without their dictionaries (apache/arrow#38480)."""
    words = pa.dictionary(pa.int32(), pa.string())
    schema = pa.schema(
        [
            ("word", words),
            ("tagged", pa.struct([("tag", words), ("n", pa.int64())])),
        ]
    )
    batches = [
        pa.RecordBatch.from_pylist(
            [{"word": w, "tagged": {"tag": w, "n": i}} for i, w in enumerate(ws)], schema=schema
        )
        for ws in (["a", "b", "a"], ["c", None])  # a second batch with its own dictionary
    ]
    server = Server()
    try:
        with connect(server.location) as client:
            client.create_table("t", schema)
            reading = Background(lambda: client.sql("SELECT * FROM t").read_all())
            with client.sink("t") as sink:
                for b in batches:
                    sink.write(b)
            got = reading.join(timeout=WAIT)
    finally:
        server.stop()
    assert got.schema.equals(schema)
    assert rows(got) == rows(pa.Table.from_batches(batches))
