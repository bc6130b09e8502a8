"""Who may do what on a ``pushtable serve`` server: bearer tokens, their roles, their tables.

A token is a credential for pushing data and reading live results, never for the server's
files or session. Three roles:

- ``read``: remote SQL (queries only), ``tables``, ``stats``;
- ``write``: push to (DoPut), ``close``, ``fail`` and advance the tables it covers (and see
  their schema and ``stats``, which a producer needs);
- ``admin``: everything, including ``create_table``, ``subscribe`` and Spark's
  stage / ``publish`` / ``published``.

A token may be limited to table names or ``fnmatch`` patterns (``"events*"``). Presented
tokens are compared with every configured secret in constant time; secrets are never logged
(logs and errors name the token's ``name``).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import pyarrow.flight as flight

from pushtable.errors import PermissionDeniedError
from pushtable.flight import protocol

__all__ = ["ADMIN", "READ", "ROLES", "WRITE", "Grant", "Tokens"]

READ, WRITE, ADMIN = "read", "write", "admin"
ROLES = (READ, WRITE, ADMIN)


@dataclass(frozen=True)
class Grant:
    """What one token may do: its ``roles`` (``admin`` implies the others) on ``tables``.

    Example:
        >>> dash = Grant("dashboard", roles={"read"}, tables=("events*",))
        >>> dash.require("read", "run SQL on", ["events_eu"])
        >>> try:
        ...     dash.require("write", "push to", ["events_eu"])
        ... except PermissionError as exc:
        ...     print(exc)
        token 'dashboard' may not push to 'events_eu': it lacks the 'write' role (it has: read)
    """

    name: str
    roles: frozenset[str] | set[str] = field(default_factory=lambda: frozenset(ROLES))
    tables: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        roles = frozenset(self.roles)
        unknown = roles - set(ROLES)
        if unknown or not roles:
            raise ValueError(
                f"token {self.name!r}: roles must be among {', '.join(ROLES)}; got "
                f"{', '.join(sorted(roles)) or 'none'}"
            )
        if ADMIN in roles:
            roles = frozenset(ROLES)
        object.__setattr__(self, "roles", roles)
        object.__setattr__(self, "tables", tuple(self.tables))

    def covers(self, table: str) -> bool:
        """Whether ``table`` matches one of the token's table patterns.

        A name outside the default schema (``information_schema.columns``, as the query
        wrote it) is covered only by an unscoped token (``*``): ``information_schema`` lists
        every table, so a pattern such as ``*s`` must not open it.
        """
        if "." in table:
            return "*" in self.tables
        return any(fnmatchcase(table, pattern) for pattern in self.tables)

    def require(self, role: str | tuple[str, ...], action: str, tables: Iterable[str] = ()) -> None:
        """Raise :class:`PermissionDeniedError` unless the token has ``role`` on ``tables``.

        For a tuple of roles, one of them is enough.
        """
        targets = list(tables)
        what = f"{action} {', '.join(map(repr, targets))}" if targets else action
        wanted = (role,) if isinstance(role, str) else role
        if not any(r in self.roles for r in wanted):
            needed = " or ".join(repr(r) for r in wanted)
            raise PermissionDeniedError(
                f"token {self.name!r} may not {what}: it lacks the {needed} role "
                f"(it has: {', '.join(r for r in ROLES if r in self.roles)})"
            )
        for table in targets:
            if not self.covers(table):
                raise PermissionDeniedError(
                    f"token {self.name!r} may not {action} {table!r}: the table is outside "
                    f"its scope ({', '.join(self.tables)})"
                )


#: The grant of a server without tokens (it trusts whoever can reach it) and of ``--token``.
OPEN = Grant("anonymous")


class Tokens:
    """The server's tokens: bearer secret → :class:`Grant`, looked up in constant time."""

    def __init__(self, grants: Mapping[str, Grant]) -> None:
        if any(not secret for secret in grants):
            raise ValueError("a token's secret must not be empty")
        names = [g.name for g in grants.values()]
        if len(set(names)) != len(names):
            raise ValueError("token names must be unique (logs tell tokens apart by name)")
        self._grants = dict(grants)
        self._entries = [(f"Bearer {s}".encode(), g) for s, g in grants.items()]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list[str]:
        """The tokens' names (what logs and messages show; never a secret)."""
        return [g.name for g in self._grants.values()]

    def with_token(self, secret: str, grant: Grant) -> Tokens:
        """These tokens and one more (``--token`` beside a config file's)."""
        if secret in self._grants:
            raise ValueError("token= repeats the secret of a named token")
        return Tokens({**self._grants, secret: grant})

    @classmethod
    def from_config(cls, specs: Iterable[Mapping[str, Any]]) -> Tokens:
        """Tokens from a config file's ``"tokens"`` list (see docs/network.md).

        Each entry has ``name``, ``secret`` or ``secret_env`` (the name of an environment
        variable holding it), ``role`` or ``roles``, and optionally ``tables`` (patterns).
        """
        grants: dict[str, Grant] = {}
        for spec in specs:
            spec = dict(spec)
            name = str(spec.pop("name", "") or "")
            if not name:
                raise ValueError(f"a token needs a 'name' (got the keys {sorted(spec)})")
            secret = spec.pop("secret", None)
            if (env := spec.pop("secret_env", None)) is not None:
                secret = os.environ.get(str(env))
                if not secret:
                    raise ValueError(f"token {name!r}: environment variable {env!r} is not set")
            if not secret:
                raise ValueError(f"token {name!r} needs a 'secret' or a 'secret_env'")
            roles = spec.pop("roles", None) or [spec.pop("role", None)]
            tables = spec.pop("tables", ["*"])
            if spec:
                raise ValueError(f"token {name!r}: unknown keys {sorted(spec)}")
            if str(secret) in grants:
                raise ValueError(f"token {name!r} repeats another token's secret")
            roles_set = {str(r) for r in roles if r is not None}
            grants[str(secret)] = Grant(name, roles_set, tuple(str(t) for t in tables))
        return cls(grants)

    def of_headers(self, headers: dict[str, list[Any]]) -> Grant | None:
        """The grant of a call's ``authorization: Bearer <secret>`` header (None: none matches)."""
        for key, values in headers.items():
            if key.lower() != protocol.AUTH_HEADER:
                continue
            for value in values:
                raw = value if isinstance(value, bytes) else str(value).encode()
                grant = self.match(raw)
                if grant is not None:
                    return grant
        return None

    def name_of(self, headers: dict[str, list[Any]]) -> str:
        """The name of the token a call carries (the open grant's on a server without tokens)."""
        return (self.of_headers(headers) or OPEN).name

    def match(self, header: bytes) -> Grant | None:
        """The grant whose ``Bearer <secret>`` equals ``header``.

        Every secret is compared, so the time taken does not depend on which one (if any)
        matched.
        """
        found = None
        for expected, grant in self._entries:
            if hmac.compare_digest(header, expected):
                found = grant
        return found


class _Caller(flight.ServerMiddleware):  # type: ignore[misc]
    def __init__(self, grant: Grant) -> None:
        super().__init__()
        self.grant = grant


class BearerAuth(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses every call without a known ``authorization: Bearer <token>``.

    It hands each accepted call its token's :class:`Grant` (see :func:`caller`).
    """

    def __init__(self, tokens: Tokens) -> None:
        super().__init__()
        self._tokens = tokens

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> _Caller:
        grant = self._tokens.of_headers(headers)
        if grant is None:
            raise flight.FlightUnauthenticatedError("pushtable: missing or invalid bearer token")
        return _Caller(grant)


def caller(context: Any) -> Grant:
    """The grant of the call's token (:data:`OPEN` on a server without tokens)."""
    middleware = context.get_middleware("auth")
    return middleware.grant if isinstance(middleware, _Caller) else OPEN
