"""Flight SQL's catalog commands answered for ``pushtable serve``.

What the server is, and which
tables a token can see, with the result schemas of the Flight SQL spec.

The catalog is the caller's view: only the tables its token covers appear, in every command
(as in the ``tables`` action). Tables live in DataFusion's catalog ``datafusion``, schema
``public`` (so ``datafusion.public.events`` names them in SQL too); every one has the table
type ``TABLE``. There are no keys: the key commands answer empty, correctly typed results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from pushtable import errors
from pushtable.flight.server.sql import Command

__all__ = ["CATALOG", "COMMANDS", "DB_SCHEMA", "answer", "result_schema"]

CATALOG = "datafusion"
DB_SCHEMA = "public"
TABLE_TYPE = "TABLE"

_UTF8 = pa.utf8()
_KEYS = pa.schema(
    [
        pa.field("pk_catalog_name", _UTF8),
        pa.field("pk_db_schema_name", _UTF8),
        pa.field("pk_table_name", _UTF8, False),
        pa.field("pk_column_name", _UTF8, False),
        pa.field("fk_catalog_name", _UTF8),
        pa.field("fk_db_schema_name", _UTF8),
        pa.field("fk_table_name", _UTF8, False),
        pa.field("fk_column_name", _UTF8, False),
        pa.field("key_sequence", pa.int32(), False),
        pa.field("fk_key_name", _UTF8),
        pa.field("pk_key_name", _UTF8),
        pa.field("update_rule", pa.uint8(), False),
        pa.field("delete_rule", pa.uint8(), False),
    ]
)
_INFO_VALUE = pa.dense_union(
    [
        pa.field("string_value", _UTF8),
        pa.field("bool_value", pa.bool_()),
        pa.field("bigint_value", pa.int64()),
        pa.field("int32_bitmask", pa.int32()),
        pa.field("string_list", pa.list_(pa.field("item", _UTF8))),
        pa.field(
            "int32_to_int32_list_map",
            pa.map_(pa.int32(), pa.list_(pa.field("item", pa.int32()))),
        ),
    ]
)
_SCHEMAS = {
    "CommandGetSqlInfo": pa.schema(
        [pa.field("info_name", pa.uint32(), False), pa.field("value", _INFO_VALUE, False)]
    ),
    "CommandGetTableTypes": pa.schema([pa.field("table_type", _UTF8, False)]),
    "CommandGetCatalogs": pa.schema([pa.field("catalog_name", _UTF8, False)]),
    "CommandGetDbSchemas": pa.schema(
        [pa.field("catalog_name", _UTF8), pa.field("db_schema_name", _UTF8, False)]
    ),
    "CommandGetTables": pa.schema(
        [
            pa.field("catalog_name", _UTF8),
            pa.field("db_schema_name", _UTF8),
            pa.field("table_name", _UTF8, False),
            pa.field("table_type", _UTF8, False),
        ]
    ),
    "CommandGetPrimaryKeys": pa.schema(
        [
            pa.field("catalog_name", _UTF8),
            pa.field("db_schema_name", _UTF8),
            pa.field("table_name", _UTF8, False),
            pa.field("column_name", _UTF8, False),
            pa.field("key_name", _UTF8),
            pa.field("key_sequence", pa.int32(), False),
        ]
    ),
    "CommandGetExportedKeys": _KEYS,
    "CommandGetImportedKeys": _KEYS,
    "CommandGetCrossReference": _KEYS,
    "CommandGetXdbcTypeInfo": pa.schema(
        [
            pa.field("type_name", _UTF8, False),
            pa.field("data_type", pa.int32(), False),
            pa.field("column_size", pa.int32()),
            pa.field("literal_prefix", _UTF8),
            pa.field("literal_suffix", _UTF8),
            pa.field("create_params", pa.list_(pa.field("item", _UTF8, False))),
            pa.field("nullable", pa.int32(), False),
            pa.field("case_sensitive", pa.bool_(), False),
            pa.field("searchable", pa.int32(), False),
            pa.field("unsigned_attribute", pa.bool_()),
            pa.field("fixed_prec_scale", pa.bool_(), False),
            pa.field("auto_increment", pa.bool_()),
            pa.field("local_type_name", _UTF8),
            pa.field("minimum_scale", pa.int32()),
            pa.field("maximum_scale", pa.int32()),
            pa.field("sql_data_type", pa.int32(), False),
            pa.field("datetime_subcode", pa.int32()),
            pa.field("num_prec_radix", pa.int32()),
            pa.field("interval_precision", pa.int32()),
        ]
    ),
}
_TABLE_SCHEMA = pa.field("table_schema", pa.binary(), False)


def result_schema(cmd: Command) -> pa.Schema:
    """The Arrow schema of a catalog command's result.

    ``GetTables`` with ``include_schema``
    gains the ``table_schema`` column.
    """
    schema = _SCHEMAS[cmd.kind]
    if cmd.kind == "CommandGetTables" and cmd.flag(5):
        schema = schema.append(_TABLE_SCHEMA)
    return schema


def sql_info(server_version: str) -> dict[int, object]:
    """``SqlInfo`` ids and their values: what this server is and what its SQL does.

    Ids and
    enums of FlightSql.proto; the SQL facts are DataFusion's.
    """
    return {
        0: "pushtable",  # FLIGHT_SQL_SERVER_NAME
        1: server_version,  # FLIGHT_SQL_SERVER_VERSION
        2: pa.__version__,  # FLIGHT_SQL_SERVER_ARROW_VERSION (the Arrow library's)
        3: True,  # FLIGHT_SQL_SERVER_READ_ONLY: remote SQL runs queries only
        4: True,  # FLIGHT_SQL_SERVER_SQL
        5: False,  # FLIGHT_SQL_SERVER_SUBSTRAIT
        8: _Int32(0),  # FLIGHT_SQL_SERVER_TRANSACTION: SQL_SUPPORTED_TRANSACTION_NONE
        9: False,  # FLIGHT_SQL_SERVER_CANCEL (a client ends a query by closing its stream)
        100: _Int32(0),  # FLIGHT_SQL_SERVER_STATEMENT_TIMEOUT: handles never expire
        101: _Int32(0),  # FLIGHT_SQL_SERVER_TRANSACTION_TIMEOUT
        500: False,  # SQL_DDL_CATALOG
        501: False,  # SQL_DDL_SCHEMA
        502: False,  # SQL_DDL_TABLE
        503: _Int32(3),  # SQL_IDENTIFIER_CASE: unquoted names fold to lower case
        504: '"',  # SQL_IDENTIFIER_QUOTE_CHAR
        505: _Int32(1),  # SQL_QUOTED_IDENTIFIER_CASE: quoted names keep their case
        506: True,  # SQL_ALL_TABLES_ARE_SELECTABLE (those the token covers)
        507: _Int32(0),  # SQL_NULL_ORDERING: nulls sort high (last ascending)
        513: "\\",  # SQL_SEARCH_STRING_ESCAPE
        515: True,  # SQL_SUPPORTS_COLUMN_ALIASING
        516: True,  # SQL_NULL_PLUS_NULL_IS_NULL
        520: True,  # SQL_SUPPORTS_EXPRESSIONS_IN_ORDER_BY
        521: True,  # SQL_SUPPORTS_ORDER_BY_UNRELATED
        522: _Int32(0b11),  # SQL_SUPPORTED_GROUP_BY: unrelated, beyond select
        523: True,  # SQL_SUPPORTS_LIKE_ESCAPE_CLAUSE
        524: False,  # SQL_SUPPORTS_NON_NULLABLE_COLUMNS (no DDL)
        528: _Int32(2),  # SQL_OUTER_JOINS_SUPPORT_LEVEL: full outer joins
        529: "schema",  # SQL_SCHEMA_TERM
        531: "catalog",  # SQL_CATALOG_TERM
        532: True,  # SQL_CATALOG_AT_START
    }


class _Int32(int):
    """An ``int32_bitmask`` value (an enum or a bitmask), not a ``bigint_value``."""


def _info_table(info: dict[int, object], wanted: Sequence[int]) -> pa.Table:
    ids = [i for i in (wanted or sorted(info)) if i in info]
    kinds: list[int] = []
    offsets: list[int] = []
    children: list[list[object]] = [[] for _ in range(6)]
    for i in ids:
        value = info[i]
        kind = (
            0
            if isinstance(value, str)
            else 1
            if isinstance(value, bool)
            else 3
            if isinstance(value, _Int32)
            else 2
            if isinstance(value, int)
            else 4
        )
        kinds.append(kind)
        offsets.append(len(children[kind]))
        children[kind].append(value)
    arrays = [pa.array(children[k], type=_INFO_VALUE.field(k).type) for k in range(len(children))]
    union = pa.UnionArray.from_dense(
        pa.array(kinds, pa.int8()),
        pa.array(offsets, pa.int32()),
        arrays,
        [f.name for f in _INFO_VALUE],
        list(range(6)),
    )
    return pa.Table.from_arrays(
        [pa.array(ids, pa.uint32()), union], schema=_SCHEMAS["CommandGetSqlInfo"]
    )


#: the longest filter pattern a catalog call takes (a name is far shorter)
MAX_PATTERN_CHARS = 1024


class _Like:
    r"""A Flight SQL filter pattern (``%`` any run, ``_`` one character, ``\`` escapes).

    Matched in time linear in the name for each of the pattern's characters (the segments
    between ``%`` are found leftmost, one after another), never by backtracking: as a regex,
    ``'%' * 55 + 'x'`` held the GIL for 9-13 s and froze every other tenant.
    """

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise errors.InvalidRequestError(
                f"a catalog filter pattern is at most {MAX_PATTERN_CHARS:,} characters, got "
                f"{len(pattern):,}"
            )
        segments: list[list[str | None]] = [[]]  # None: any one character
        escaped = False
        for ch in pattern:
            if escaped:
                segments[-1].append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == "%":
                segments.append([])
            else:
                segments[-1].append(None if ch == "_" else ch)
        self._segments = segments

    def matches(self, name: str) -> bool:
        """Whether ``name`` is matched as a whole."""
        if len(self._segments) == 1:  # no %: the name, character for character
            only = self._segments[0]
            return len(name) == len(only) and _fits(only, name, 0)
        first, *middle, last = self._segments
        end = len(name) - len(last)
        if len(first) > end or not _fits(first, name, 0) or not _fits(last, name, end):
            return False
        at = len(first)
        for segment in middle:
            found = _find(segment, name, at, end)
            if found < 0:
                return False
            at = found + len(segment)
        return True


def _fits(segment: list[str | None], name: str, at: int) -> bool:
    """Whether ``segment`` matches ``name`` at ``at``."""
    return all(want is None or name[at + i] == want for i, want in enumerate(segment))


def _find(segment: list[str | None], name: str, start: int, end: int) -> int:
    """The first place in ``name[start:end]`` where ``segment`` matches (-1: none)."""
    for at in range(start, end - len(segment) + 1):
        if _fits(segment, name, at):
            return at
    return -1


def _like(pattern: str | None) -> _Like | None:
    return None if pattern is None else _Like(pattern)


def _matches(pattern: _Like | None, name: str) -> bool:
    return pattern is None or pattern.matches(name)


def _in_catalog(cmd: Command, number: int = 1) -> bool:
    catalog = cmd.text(number)
    return catalog is None or catalog == CATALOG


# DataFusion's types as JDBC/ODBC name them: (name, XdbcDataType, column size, prefix/suffix)
_XDBC = [
    ("BOOLEAN", -7, 1, None),
    ("TINYINT", -6, 3, None),
    ("BIGINT", -5, 19, None),
    ("VARBINARY", -3, None, ("X'", "'")),
    ("VARCHAR", 12, None, ("'", "'")),
    ("DECIMAL", 3, 38, None),
    ("INTEGER", 4, 10, None),
    ("SMALLINT", 5, 5, None),
    ("REAL", 7, 7, None),
    ("DOUBLE", 8, 15, None),
    ("DATE", 91, 10, ("DATE '", "'")),
    ("TIME", 92, 8, ("TIME '", "'")),
    ("TIMESTAMP", 93, 26, ("TIMESTAMP '", "'")),
]


def _xdbc(wanted: int | None) -> pa.Table:
    rows = []
    for name, code, size, quote in sorted(_XDBC, key=lambda r: (r[1], r[0])):
        if wanted is not None and code != wanted:
            continue
        numeric = code in (-7, -6, -5, 3, 4, 5, 7, 8)
        datetime = code in (91, 92, 93)
        rows.append(
            {
                "type_name": name,
                "data_type": code,
                "column_size": size,
                "literal_prefix": quote[0] if quote else None,
                "literal_suffix": quote[1] if quote else None,
                "create_params": ["precision", "scale"] if code == 3 else None,
                "nullable": 1,
                "case_sensitive": code == 12,
                "searchable": 3,
                "unsigned_attribute": False if numeric else None,
                "fixed_prec_scale": code == 3,
                "auto_increment": False if numeric else None,
                "local_type_name": name,
                "minimum_scale": 0 if code == 3 else None,
                "maximum_scale": 38 if code == 3 else None,
                "sql_data_type": 9 if datetime else code,
                "datetime_subcode": {91: 1, 92: 2, 93: 3}.get(code),
                "num_prec_radix": 2 if code in (7, 8) else 10 if numeric else None,
                "interval_precision": None,
            }
        )
    return pa.Table.from_pylist(rows, schema=_SCHEMAS["CommandGetXdbcTypeInfo"])


def _db_schemas(cmd: Command, tables: Sequence[tuple[str, pa.Schema]], version: str) -> pa.Table:
    rows: list[dict[str, object]] = []
    if _in_catalog(cmd) and _matches(_like(cmd.text(2)), DB_SCHEMA):
        rows.append({"catalog_name": CATALOG, "db_schema_name": DB_SCHEMA})
    return pa.Table.from_pylist(rows, schema=result_schema(cmd))


def _tables(cmd: Command, tables: Sequence[tuple[str, pa.Schema]], version: str) -> pa.Table:
    names = _like(cmd.text(3))
    types = cmd.texts(4)
    rows = []
    if (
        _in_catalog(cmd)
        and _matches(_like(cmd.text(2)), DB_SCHEMA)
        and (not types or TABLE_TYPE in types)
    ):
        for name, table_schema in sorted(tables, key=lambda t: t[0]):
            if not _matches(names, name):
                continue
            row: dict[str, object] = {
                "catalog_name": CATALOG,
                "db_schema_name": DB_SCHEMA,
                "table_name": name,
                "table_type": TABLE_TYPE,
            }
            if cmd.flag(5):
                row["table_schema"] = _typed(table_schema).serialize().to_pybytes()
            rows.append(row)
    return pa.Table.from_pylist(rows, schema=result_schema(cmd))


#: Flight SQL's column metadata that ADBC's ``get_objects`` reads as ``xdbc_type_name``
TYPE_NAME = b"ARROW:FLIGHT:SQL:TYPE_NAME"


def sql_type_name(t: pa.DataType) -> str:
    """How SQL names an Arrow type (the names of ``CommandGetXdbcTypeInfo``)."""
    if pa.types.is_dictionary(t):
        return sql_type_name(t.value_type)
    checks = [
        (pa.types.is_boolean, "BOOLEAN"),
        (lambda x: pa.types.is_int8(x) or pa.types.is_uint8(x), "TINYINT"),
        (lambda x: pa.types.is_int16(x) or pa.types.is_uint16(x), "SMALLINT"),
        (lambda x: pa.types.is_int32(x) or pa.types.is_uint32(x), "INTEGER"),
        (lambda x: pa.types.is_int64(x) or pa.types.is_uint64(x), "BIGINT"),
        (pa.types.is_float32, "REAL"),
        (pa.types.is_float64, "DOUBLE"),
        (pa.types.is_decimal, "DECIMAL"),
        (lambda x: pa.types.is_string(x) or pa.types.is_large_string(x), "VARCHAR"),
        (lambda x: x == pa.string_view(), "VARCHAR"),
        (lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x), "VARBINARY"),
        (pa.types.is_date, "DATE"),
        (pa.types.is_time, "TIME"),
        (pa.types.is_timestamp, "TIMESTAMP"),
    ]
    return next((name for check, name in checks if check(t)), str(t).upper())


def _typed(schema: pa.Schema) -> pa.Schema:
    """``schema`` with each field's SQL type name in its Flight SQL metadata."""
    fields = [
        f.with_metadata({**(f.metadata or {}), TYPE_NAME: sql_type_name(f.type).encode()})
        for f in schema
    ]
    return pa.schema(fields, metadata=schema.metadata)


def _no_keys(cmd: Command, tables: Sequence[tuple[str, pa.Schema]], version: str) -> pa.Table:
    return result_schema(cmd).empty_table()  # keys: tables here have none


_Answer = Callable[[Command, Sequence[tuple[str, pa.Schema]], str], pa.Table]

#: Each catalog command's answer, by command: (command, the caller's tables, server version).
_ANSWERS: dict[str, _Answer] = {
    "CommandGetSqlInfo": lambda cmd, tables, version: _info_table(
        sql_info(version), cmd.numbers(1)
    ),
    "CommandGetTableTypes": lambda cmd, tables, version: pa.Table.from_pylist(
        [{"table_type": TABLE_TYPE}], schema=result_schema(cmd)
    ),
    "CommandGetCatalogs": lambda cmd, tables, version: pa.Table.from_pylist(
        [{"catalog_name": CATALOG}], schema=result_schema(cmd)
    ),
    "CommandGetDbSchemas": _db_schemas,
    "CommandGetTables": _tables,
    "CommandGetPrimaryKeys": _no_keys,
    "CommandGetExportedKeys": _no_keys,
    "CommandGetImportedKeys": _no_keys,
    "CommandGetCrossReference": _no_keys,
    "CommandGetXdbcTypeInfo": lambda cmd, tables, version: _xdbc(cmd.signed(1)),
}


def answer(cmd: Command, tables: Sequence[tuple[str, pa.Schema]], server_version: str) -> pa.Table:
    """The result of catalog command ``cmd`` over ``tables``.

    ``tables`` are (name, schema) pairs: those the
    caller's token covers.
    """
    found = _ANSWERS.get(cmd.kind)
    if found is None:
        raise ValueError(f"{cmd.kind} is not a catalog command")
    return found(cmd, tables, server_version)


#: The catalog commands answered (GetFlightInfo describes them, DoGet runs them).
COMMANDS = tuple(_ANSWERS)
