"""Durable topics with the data users have: random schemas (timestamps with zones, decimals,
lists, structs, dictionaries, nulls) through a topic's Lance log and back, unchanged, before
and after a reopen. The schema strategy is the one that drives the in-process sink."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable import SessionContext, Topic
from tests.conftest import WAIT
from tests.test_hostile_input import schemas, values


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas(), sizes=st.lists(st.sampled_from([1, 7, 300]), min_size=1, max_size=3))
def test_random_schemas_round_trip_through_a_durable_topic(
    schema: pa.Schema, sizes: list[int]
) -> None:
    batches = [
        pa.RecordBatch.from_arrays(
            [values(f.type, n, nulls=f.nullable) for f in schema], schema=schema
        )
        for n in sizes
    ]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.lance"
        topic = Topic("t", schema, persist=path, upkeep_interval=None)
        ctx = SessionContext()
        topic.subscribe(ctx, "live")
        for b in batches:
            topic.write(b)
        topic.flush(timeout=WAIT)
        # Values, not buffers: Lance re-encodes a dictionary column (one dictionary).
        want = pa.Table.from_batches(batches, schema=schema).to_pylist()

        def stored(t: Topic) -> list[dict[str, object]]:
            table = t.read(0, len(batches)).read_all()
            assert table.schema.equals(schema)
            rows: list[dict[str, object]] = table.to_pylist()
            return rows

        assert stored(topic) == want
        topic.close()
        live = ctx.sql("SELECT * FROM live").to_arrow_table().to_pylist()
        assert sorted(map(repr, live)) == sorted(map(repr, want))  # a scan's order is free
        again = Topic.reopen(path, upkeep_interval=None)
        assert again.schema.equals(schema)
        assert again.offsets()["next"] == len(batches)
        assert stored(again) == want
        again.close()
