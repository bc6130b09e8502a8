"""Query parameters of Flight SQL prepared statements: placeholders, their types, bound values.

Positional ``?`` placeholders are made DataFusion's ``$1, $2, ...``; their types are as
DataFusion's planner infers them.

DataFusion plans ``$n`` placeholders and infers each one's type from where it stands
(``k > $1`` gives ``$1`` the type of ``k``); a ``?`` it parses but cannot bind, so each ``?``
outside string literals, quoted identifiers and comments becomes ``$n`` in order of
appearance. A query may use ``$n`` itself instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import datafusion
import pyarrow as pa

__all__ = ["bind", "has_placeholders", "parameter_schema"]

#: bound parameters are carried in the statement's handle through the client: kept small
MAX_BYTES = 1 << 20


def _segments(query: str) -> Iterator[tuple[str, bool]]:
    """``query`` cut into pieces, each with whether it is SQL code.

    The other pieces are string literals, quoted identifiers and comments.
    """
    i, n = 0, len(query)
    while i < n:
        ch = query[i]
        if ch in "'\"":  # a literal or a quoted identifier; a doubled quote escapes itself
            end = i + 1
            while end < n:
                if query[end] == ch:
                    if end + 1 < n and query[end + 1] == ch:
                        end += 2
                        continue
                    break
                end += 1
            yield query[i : end + 1], False
            i = end + 1
        elif query.startswith("--", i):
            end = query.find("\n", i)
            end = n if end < 0 else end
            yield query[i:end], False
            i = end
        elif query.startswith("/*", i):
            end = query.find("*/", i + 2)
            end = n if end < 0 else end + 2
            yield query[i:end], False
            i = end
        else:
            end = i + 1
            while end < n and query[end] not in "'\"" and not query.startswith(("--", "/*"), end):
                end += 1
            yield query[i:end], True
            i = end


def has_placeholders(query: str) -> bool:
    """Whether ``query`` holds a ``$n`` placeholder outside literals and comments.

    ``query`` has its ``?`` numbered already (``_native.number_placeholders``). Only then
    is its plan walked for them: an ordinary query has none to describe.
    """
    return any(code and _PLACEHOLDER.search(text) for text, code in _segments(query))


_PLACEHOLDER = re.compile(r"\$\d")


# Accessors of plan and expression nodes that lead to no sub-expression.
_LEAVES = frozenset(
    {
        "input",
        "schema",
        "data_type",
        "op",
        "alias",
        "id",
        "name",
        "table_name",
        "fqn",
        "projection",
        "skip",
        "fetch",
        "field",
        "display_name",
        "value_string",
        "is_distinct",
        "negated",
        "escape_char",
        "case_insensitive",
        "produce_one_row",
        "join_type",
        "join_constraint",
        "null_equals_null",
        "options",
        "partitioning_scheme",
    }
)


def parameter_schema(df: datafusion.DataFrame) -> pa.Schema:
    """The placeholders of a planned query, ``$1`` first, each with the type DataFusion inferred.

    The type is ``null`` where nothing decides it, e.g. ``SELECT $1``.
    """
    found: dict[str, pa.DataType] = {}
    _plan_params(df.logical_plan(), found, 0)
    names = sorted(found, key=lambda p: int(p[1:]) if p[1:].isdigit() else 1 << 30)
    return pa.schema([pa.field(name, found[name]) for name in names])


def _plan_params(plan: Any, found: dict[str, pa.DataType], depth: int) -> None:
    _node_params(plan, found, depth)
    for child in plan.inputs():
        _plan_params(child, found, depth + 1)


def _node_params(node: Any, found: dict[str, pa.DataType], depth: int) -> None:
    if depth > 500:
        raise ValueError("the query is nested too deeply to describe its parameters")
    try:
        variant = node.to_variant()
    except Exception:  # noqa: BLE001 - a kind datafusion-python cannot convert (a function call)
        operands = getattr(node, "rex_call_operands", None)
        try:
            parts = operands() if operands is not None else []
        except Exception:  # noqa: BLE001 - not a call either: nothing to descend into
            parts = []
        for part in parts:
            _node_params(part, found, depth + 1)
        return
    if type(variant).__name__ == "Placeholder":
        field = variant.field()
        found[str(variant.id())] = field.type if field is not None else pa.null()
        return
    for name in dir(variant):
        if name.startswith("_") or name in _LEAVES:
            continue
        accessor = getattr(variant, name)
        if not callable(accessor):
            continue
        try:
            value = accessor()
        except Exception:  # noqa: BLE001 - an accessor that needs arguments or does not apply
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            for part in item if isinstance(item, tuple) else [item]:
                if hasattr(part, "to_variant") and not hasattr(part, "inputs"):
                    _node_params(part, found, depth + 1)


def bind(params: pa.RecordBatch | None) -> dict[str, Any] | None:
    """DataFusion's ``param_values`` for a one-row batch of bound parameters.

    Column ``i`` binds ``$i+1``, whatever the client named it.
    """
    if params is None:
        return None
    if params.num_rows != 1:
        raise ValueError(
            f"bind one row of parameters per execution, got {params.num_rows}: a query runs "
            "once per set of values"
        )
    return {str(i + 1): params.column(i)[0] for i in range(params.num_columns)}
