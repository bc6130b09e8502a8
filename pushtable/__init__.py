"""pushtable: run SQL over Arrow batches while producers are still pushing them.

Example:
    >>> import pyarrow as pa
    >>> from pushtable import SessionContext
    >>> ctx = SessionContext()
    >>> sink = ctx.register_streaming_table("t", pa.schema([("x", pa.int64())]), capacity=8)
    >>> sink.write(pa.record_batch([pa.array([1, 2])], names=["x"]))
    >>> sink.close()
    >>> ctx.sql("SELECT max(x) AS m FROM t").to_pydict()
    {'m': [2]}
"""

from __future__ import annotations

import importlib as _importlib
from importlib.metadata import version as _version
from importlib.util import find_spec as _find_spec
from typing import TYPE_CHECKING, Any

from pushtable import cpu as _cpu

_cpu.check()  # before the native core loads: a clear ImportError, not SIGILL

from pushtable import errors as _errors
from pushtable.errors import *  # noqa: F403  (every error class: pushtable.errors.__all__)
from pushtable.lazy import lazy_names
from pushtable.producer import SinkStats, SubscriptionStats, TopicStats

if TYPE_CHECKING:
    from pushtable.context import SessionContext, register_streaming_table
    from pushtable.dataframe import DataFrame
    from pushtable.explain import LiveExplanation, explain_live
    from pushtable.flight.client.client import connect
    from pushtable.flight.server.server import serve
    from pushtable.sink import TableSink
    from pushtable.topic import Subscription, Topic

#: Names loaded on first use, by module: ``import pushtable.flight.client.client`` (a Spark
#: executor's remote producer) then needs neither DataFusion nor the native core.
_LAZY = {
    "SessionContext": "pushtable.context",
    "register_streaming_table": "pushtable.context",
    "DataFrame": "pushtable.dataframe",
    "LiveExplanation": "pushtable.explain",
    "explain_live": "pushtable.explain",
    "connect": "pushtable.flight.client.client",
    "serve": "pushtable.flight.server.server",
    "TableSink": "pushtable.sink",
    "Subscription": "pushtable.topic",
    "Topic": "pushtable.topic",
}

_NO_CORE = (
    "pushtable's native core (pushtable/_native.abi3.so) is not built: run `make setup` in the "
    "source checkout (it builds the core with cargo and maturin), or install the pushtable wheel"
)


_load, __dir__ = lazy_names("pushtable", _LAZY, globals())


def __getattr__(name: str) -> Any:
    if name == "_native":  # ``from pushtable import _native``: name a missing core
        if _find_spec("pushtable._native") is None:
            raise ImportError(_NO_CORE)
        return _importlib.import_module("pushtable._native")
    return _load(name)


__version__ = _version("pushtable")

__all__ = [
    "DataFrame",
    "LiveExplanation",
    "SessionContext",
    "SinkStats",
    "Subscription",
    "SubscriptionStats",
    "TableSink",
    "Topic",
    "TopicStats",
    "connect",
    "explain_live",
    "register_streaming_table",
    "serve",
]
__all__ += _errors.__all__
