"""Hostile input to a sink: every call succeeds or raises a PushTableError, and the table stays
usable afterwards. Never a panic, a crash, a hang or a corrupted later query."""

from __future__ import annotations

import datetime as dt
import decimal
import os
import struct
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable import (
    InvalidBatchError,
    SchemaMismatchError,
    SessionContext,
    Topic,
)

# "ci" runs in the default suite; HYPOTHESIS_PROFILE=sweep tries 20 times as many examples.
settings.register_profile(
    "ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "sweep", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TYPES: list[pa.DataType] = [
    pa.int8(),
    pa.int32(),
    pa.int64(),
    pa.uint16(),
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.string(),
    pa.large_string(),
    pa.binary(),
    pa.date32(),
    pa.timestamp("us"),
    pa.timestamp("us", tz="UTC"),
    pa.decimal128(10, 2),
    pa.list_(pa.int32()),
    pa.struct([("a", pa.int32()), ("b", pa.string())]),
    pa.dictionary(pa.int32(), pa.string()),
]
NAMES = ["a", "b", "c", "d", "e"]


def values(t: pa.DataType, n: int, nulls: bool) -> pa.Array:
    """``n`` values of type ``t`` (every third null when ``nulls``)."""
    if pa.types.is_dictionary(t):
        return values(pa.string(), n, nulls).dictionary_encode()
    base: list[Any]
    if pa.types.is_boolean(t):
        base = [i % 2 == 0 for i in range(n)]
    elif pa.types.is_integer(t):
        base = [i % 100 for i in range(n)]
    elif pa.types.is_floating(t):
        base = [i / 3 for i in range(n)]
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        base = [f"s{i}" for i in range(n)]
    elif pa.types.is_binary(t):
        base = [bytes([i % 256]) for i in range(n)]
    elif pa.types.is_date32(t):
        base = [dt.date(2024, 1, 1) + dt.timedelta(days=i) for i in range(n)]
    elif pa.types.is_timestamp(t):
        base = [dt.datetime(2024, 1, 1) + dt.timedelta(seconds=i) for i in range(n)]
    elif pa.types.is_decimal(t):
        base = [decimal.Decimal(i) / 4 for i in range(n)]
    elif pa.types.is_list(t):
        base = [list(range(i % 3)) for i in range(n)]
    else:
        base = [{"a": i, "b": str(i)} for i in range(n)]
    if nulls:
        base = [None if i % 3 == 0 else v for i, v in enumerate(base)]
    return pa.array(base, type=t)


@st.composite
def schemas(draw: st.DrawFn) -> pa.Schema:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    return pa.schema(
        [pa.field(n, draw(st.sampled_from(TYPES)), nullable=draw(st.booleans())) for n in names]
    )


@st.composite
def attempts(draw: st.DrawFn) -> tuple[pa.Schema, pa.RecordBatch, bool]:
    """A table schema, a batch that may deviate from it, and whether it should be accepted."""
    schema = draw(schemas())
    rows = draw(st.sampled_from([0, 1, 7, 300]))
    fields = list(schema)
    nulls = {f.name: f.nullable and draw(st.booleans()) for f in fields}
    mutation = draw(st.sampled_from(["none", "retype", "drop", "add", "rename", "nulls"]))
    ok = True
    if mutation == "retype":
        i = draw(st.integers(0, len(fields) - 1))
        new = draw(st.sampled_from(TYPES))
        # dictionary-of-string and string are different types; so are the others
        ok = new.equals(fields[i].type)
        fields[i] = pa.field(fields[i].name, new, nullable=True)
    elif mutation == "drop" and len(fields) > 1:
        fields.pop(draw(st.integers(0, len(fields) - 1)))
        ok = False
    elif mutation == "add":
        extra = next(n for n in ["x", "y", "z"] if n not in schema.names)
        fields.append(pa.field(extra, draw(st.sampled_from(TYPES))))
        ok = False
    elif mutation == "rename":
        i = draw(st.integers(0, len(fields) - 1))
        fields[i] = fields[i].with_name(fields[i].name + "_renamed")
        ok = False
    elif mutation == "nulls":
        i = draw(st.integers(0, len(fields) - 1))
        nulls[fields[i].name] = True
        fields[i] = fields[i].with_nullable(True)
        ok = schema.field(fields[i].name).nullable or rows == 0
    arrays = [values(f.type, rows, nulls.get(f.name, False) and rows > 0) for f in fields]
    batch = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))
    return schema, batch, ok


@given(attempts())
def test_random_schemas_and_batches_succeed_or_raise_pushtable_errors(
    attempt: tuple[pa.Schema, pa.RecordBatch, bool],
) -> None:
    schema, bad, should_accept = attempt
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=4)
    try:
        sink.write(bad, timeout=5)
        accepted = bad.num_rows
    except SchemaMismatchError:
        accepted = -1
    assert (accepted >= 0) == should_accept, (schema, bad.schema)
    good = pa.RecordBatch.from_arrays([values(f.type, 5, False) for f in schema], schema=schema)
    sink.write(good, timeout=5)  # the sink is still usable
    sink.close()
    n = ctx.sql("SELECT count(*) AS n FROM t").to_pydict()["n"][0]
    assert n == 5 + max(accepted, 0)


class Raising:
    def __arrow_c_array__(self, requested_schema: object = None) -> object:
        raise RuntimeError("producer blew up while exporting")


class RaisingStream:
    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        raise RuntimeError("producer blew up while exporting a stream")


class WrongCapsules:
    def __arrow_c_array__(self, requested_schema: object = None) -> object:
        return ("not", "capsules")


class NotACapsule:
    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        return 42


class NullStruct:
    """A top-level struct array with nulls: arrow-rs asserts (panics) on importing it."""

    def __arrow_c_array__(self, requested_schema: object = None) -> object:
        arr = pa.array([{"a": 1}, None], pa.struct([("a", pa.int64())]))
        return arr.__arrow_c_array__(requested_schema)


class ExplodingAttributes:
    """Every attribute lookup raises something other than AttributeError."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"no {name} for you")


class FailsMidStream:
    """A stream whose second batch raises."""

    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        schema = pa.schema([("a", pa.int64())])

        def gen() -> Any:
            yield pa.record_batch([pa.array([1])], schema=schema)
            raise ValueError("source went away")

        return pa.RecordBatchReader.from_batches(schema, gen()).__arrow_c_stream__()


@pytest.mark.parametrize(
    "hostile",
    [
        Raising(),
        RaisingStream(),
        WrongCapsules(),
        NotACapsule(),
        NullStruct(),
        ExplodingAttributes(),
        object(),
        b"x",
    ],
    ids=lambda o: type(o).__name__,
)
def test_broken_producers_raise_invalid_batch_errors(hostile: object) -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", pa.schema([("a", pa.int64())]))
    with pytest.raises(InvalidBatchError):
        sink.write(hostile, timeout=5)
    sink.write(pa.record_batch([pa.array([7])], names=["a"]))
    sink.close()
    assert ctx.sql("SELECT sum(a) AS s FROM t").to_pydict() == {"s": [7]}


def test_a_stream_failing_midway_keeps_what_was_written() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", pa.schema([("a", pa.int64())]))
    with pytest.raises(InvalidBatchError, match="source went away"):
        sink.write(FailsMidStream(), timeout=5)
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [1]}


@given(st.one_of(st.none(), st.integers(), st.text(), st.binary(), st.lists(st.integers())))
def test_non_arrow_objects_are_invalid_batches(junk: object) -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", pa.schema([("a", pa.int64())]))
    with pytest.raises(InvalidBatchError, match="expected Arrow data"):
        sink.write(junk)


def test_huge_string_column_round_trips() -> None:
    schema = pa.schema([("s", pa.string())])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=2)
    big = "x" * (1 << 20)
    batch = pa.record_batch([pa.array([big] * 64)], schema=schema)  # 64 MiB of text
    sink.write(batch)
    sink.close()
    assert ctx.sql("SELECT sum(length(s)) AS n FROM t").to_pydict() == {"n": [64 << 20]}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "hostile",
    [Raising(), RaisingStream(), ExplodingAttributes(), 42],
    ids=lambda o: type(o).__name__,
)
async def test_broken_producers_raise_invalid_batch_errors_from_awrite(hostile: object) -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", pa.schema([("a", pa.int64())]))
    with pytest.raises(InvalidBatchError):
        await sink.awrite(hostile, timeout=5)
    await sink.awrite(pa.record_batch([pa.array([7])], names=["a"]))
    await sink.aclose()
    assert ctx.sql("SELECT sum(a) AS s FROM t").to_pydict() == {"s": [7]}


def _bad_utf8() -> pa.Array:
    offsets = pa.py_buffer(struct.pack("<3i", 0, 2, 4))
    return pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])


def _bad_offsets() -> pa.Array:
    """Offsets that go backwards in the middle (first and last are in range)."""
    offsets = pa.py_buffer(struct.pack("<4i", 0, 3, 1, 4))
    return pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"abcd")])


def _bad_dictionary_keys() -> pa.Array:
    keys = pa.array([0, 7], pa.int32())  # 7: no such dictionary entry
    return pa.DictionaryArray.from_arrays(keys, pa.array(["a", "b"]), safe=False)


MALFORMED = {
    "utf8": (_bad_utf8, pa.string()),
    "offsets": (_bad_offsets, pa.string()),
    "dictionary_keys": (_bad_dictionary_keys, pa.dictionary(pa.int32(), pa.string())),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("where", ["table", "topic"])
def test_validate_full_refuses_a_malformed_batch_and_queues_nothing(kind: str, where: str) -> None:
    """A batch built from raw buffers that lies in its values (what pyarrow's cheap check and
    the default ``validate="basic"`` do not read) is refused under ``validate="full"`` with
    an error naming the table and column; nothing is queued and the sink stays usable."""
    make, data_type = MALFORMED[kind]
    schema = pa.schema([("s", data_type)])
    bad = pa.record_batch([make()], schema=schema)
    bad.validate()  # passes the constant-time check: only the values are wrong
    with pytest.raises(pa.ArrowInvalid):
        bad.validate(full=True)
    ctx = SessionContext()
    if where == "table":
        sink: Any = ctx.register_streaming_table("t", schema, capacity=4, validate="full")
    else:
        sink = Topic("t", schema, retain=4, validate="full")
        sink.subscribe(ctx, "t", start="earliest")
    with pytest.raises(InvalidBatchError, match=r"'t': column 's' of the batch is not valid"):
        sink.write(bad, timeout=5)
    assert sink.stats.batches == 0  # nothing was queued
    good = pa.record_batch([pa.array(["x", "y"]).cast(data_type)], schema=schema)
    sink.write(good, timeout=5)
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM t").to_pydict() == {"n": [2]}


def test_validate_basic_trusts_values_and_checks_schema_and_nulls() -> None:
    """The default trusts a same-process producer's values as DataFusion and DuckDB do (no
    work per byte), and still refuses what is cheap to catch: a wrong schema and nulls in a
    NOT NULL column, each leaving the sink usable."""
    schema = pa.schema([("s", pa.string()), pa.field("n", pa.int64(), nullable=False)])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=4)
    ints = pa.array([1, 2], pa.int64())
    sink.write(pa.record_batch([_bad_utf8(), ints], schema=schema), timeout=5)  # trusted
    with pytest.raises(SchemaMismatchError, match="'n' is declared NOT NULL"):
        sink.write(pa.record_batch([pa.array(["a", "b"]), pa.array([1, None])], ["s", "n"]))
    with pytest.raises(SchemaMismatchError):
        sink.write(pa.record_batch([pa.array([1.5]), pa.array([1])], ["s", "n"]))
    assert sink.stats.batches == 1
    sink.close()
    assert ctx.sql("SELECT sum(n) AS n FROM t").to_pydict() == {"n": [3]}


def test_validate_must_name_a_mode() -> None:
    ctx = SessionContext()
    with pytest.raises(ValueError, match="validate must be 'basic' or 'full'"):
        ctx.register_streaming_table("t", pa.schema([("a", pa.int64())]), validate="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="validate must be 'basic' or 'full'"):
        Topic("t", pa.schema([("a", pa.int64())]), validate="strict")  # type: ignore[arg-type]
