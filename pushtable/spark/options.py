"""The options of a ``format("pushtable")`` sink or source, read by name.

What is missing or malformed is refused with an error that names the option.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Options"]


class Options:
    """The options of one ``format("pushtable")`` sink or source, read by name.

    Whatever is missing or malformed gets a clear error. Spark passes option names lower-cased.
    """

    def __init__(self, options: Mapping[str, str], role: str) -> None:
        self._options = {str(k).lower(): str(v) for k, v in options.items()}
        self.role = role

    def text(self, name: str, default: str | None = None) -> str | None:
        """Option ``name`` as given, or ``default`` when it is absent."""
        return self._options.get(name.lower(), default)

    def required(self, name: str, example: str) -> str:
        """Option ``name``; when absent or empty, a ValueError showing it set to ``example``."""
        value = self._options.get(name.lower())
        if not value:
            raise ValueError(
                f'format("pushtable") {self.role} needs option "{name}", e.g. '
                f'.option("{name}", "{example}")'
            )
        return value

    def number(self, name: str, kind: type[int] | type[float] = int) -> Any:
        """Option ``name`` as a ``kind`` of at least 0 (None: absent or empty)."""
        value = self._options.get(name.lower())
        if value is None or value == "":
            return None
        try:
            number = kind(value)
        except ValueError:
            raise ValueError(
                f'format("pushtable") {self.role}: option "{name}" must be '
                f"{'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None
        if number < 0:
            raise ValueError(
                f'format("pushtable") {self.role}: option "{name}" must be >= 0, got {value!r}'
            )
        return number

    def mapping(self, name: str) -> dict[str, str] | None:
        """A JSON object of strings (e.g. Lance's ``storage_options``)."""
        value = self._options.get(name.lower())
        if not value:
            return None
        try:
            found = json.loads(value)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise ValueError(
                f'format("pushtable") {self.role}: option "{name}" must be a JSON object, '
                f'e.g. \'{{"aws_region": "eu-west-1"}}\', got {value!r}'
            )
        return {str(k): str(v) for k, v in found.items()}

    def connection(self) -> dict[str, Any]:
        """The server's address and credentials: what :func:`pushtable.flight.connect` takes."""
        certs = self.text("tls_root_certs")
        return {
            "uri": self.required("uri", "grpc://127.0.0.1:8815"),
            "token": self.text("token"),
            "tls_root_certs": None if certs is None else Path(certs).read_bytes(),
        }
