"""Names a package loads on first use (PEP 562), so a light module loads without the heavy ones.

Importing one light module of it (``pushtable.flight.client.client``) does not load the heavy ones
(DataFusion, the native core).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    package: str, names: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``names`` (name -> its defining module).

    The module is imported when the name is first read, and the name then kept in
    ``namespace`` (the package's globals).
    """

    def getattr_(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *names})

    return getattr_, dir_
