"""Spark's rows as Arrow: the one schema every Spark path gives a micro-batch.

It also names the Spark types that have no Arrow form pushtable can store.

Every Spark path (``ForeachBatchBridge``, ``RemoteBridge``, ``format("pushtable")``) asks
:func:`arrow_schema` for a micro-batch's Arrow schema, on the driver, before any task runs:

- ``TIMESTAMP`` (Spark's instant) is ``timestamp[us, tz=UTC]``, as ``DataFrame.toArrow``
  gives it, whatever the session time zone: the same instants, one label, so a Lance dataset
  or a live table keeps one schema when the session's zone changes. Executors receive the
  session's zone as the label (``mapInArrow``); :func:`pushtable.lance_epochs.conform_to`
  relabels without a copy. ``TIMESTAMP_NTZ`` stays zone-less.
- A type Spark cannot hand over as Arrow (year-month and calendar intervals) or hands over
  only as its internal encoding (``VARIANT``, ``GEOMETRY``, ``GEOGRAPHY``: structs of binary
  blobs) is refused with :class:`UnsupportedSparkTypeError`, naming the column (its path for a
  nested field) and what to cast it to.

Example:
    >>> from pyspark.sql.types import StructType, StructField, TimestampType, DecimalType
    >>> arrow_schema(StructType([StructField("ts", TimestampType()),
    ...                          StructField("price", DecimalType(18, 2))]))
    ts: timestamp[us, tz=UTC]
    price: decimal128(18, 2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from pushtable.errors import UnsupportedSparkTypeError

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType

__all__ = ["UnsupportedSparkTypeError", "arrow_schema"]

#: the label of Spark's instants in Arrow, as ``DataFrame.toArrow`` writes it
TIMESTAMP_ZONE = "UTC"


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema of a DataFrame's micro-batches as the live tables and Lance get them.

    Raises :class:`UnsupportedSparkTypeError` for a column (or a nested field) whose type has
    no Arrow form pushtable can store.
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    for field in schema.fields:
        _check(field.name, field.dataType)
    return to_arrow_schema(
        schema, timezone=TIMESTAMP_ZONE, error_on_duplicated_field_names_in_struct=True
    )


def _check(path: str, dt: DataType) -> None:
    from pyspark.sql import types as t

    if isinstance(dt, t.StructType):
        for field in dt.fields:
            _check(f"{path}.{field.name}", field.dataType)
    elif isinstance(dt, t.ArrayType):
        _check(f"{path}[]", dt.elementType)
    elif isinstance(dt, t.MapType):
        _check(f"{path}.key", dt.keyType)
        _check(f"{path}.value", dt.valueType)
    elif isinstance(dt, t.UserDefinedType):
        _check(path, dt.sqlType())
    else:
        advice = _refused(dt)
        if advice is not None:
            raise UnsupportedSparkTypeError(
                f"column {path!r} has Spark type {dt.simpleString()}, which {advice} "
                f"(e.g. {_example(dt, path.replace('[]', '[0]'))})"
            )


def _refused(dt: DataType) -> str | None:
    """Why ``dt`` cannot go through, and what to do, or None when it can."""
    from pyspark.sql import types as t

    if isinstance(dt, (t.YearMonthIntervalType, t.CalendarIntervalType)):
        return "has no Arrow form: cast it to a string or a number of months"
    names = {"VariantType", "GeometryType", "GeographyType"}
    if type(dt).__name__ in names:  # Spark 4.x adds these; older versions have no class
        return "reaches Arrow only as Spark's internal binary encoding: convert it first"
    return None


def _example(dt: DataType, column: str) -> str:
    name = type(dt).__name__
    if name == "VariantType":
        return f"to_json({column})"
    if name in ("GeometryType", "GeographyType"):
        return f"ST_AsBinary({column})"
    return f"CAST({column} AS STRING)"
