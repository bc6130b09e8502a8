"""``/metrics`` over HTTP for ``pushtable serve``: Prometheus text behind the server's tokens.

A server with tokens answers a scrape only with ``Authorization: Bearer <secret>`` of one of
them (Prometheus' ``authorization`` scrape setting), and shows that token only what its
scope covers: a sample labelled with a table or topic outside the scope is left out, so a
token scoped to ``alerts*`` learns nothing of the other tables, not even their names. A
server without tokens trusts whoever can reach it, as its Flight port does: bind it where
the operator says (``--host``).

Example:
    >>> from pushtable.flight.server.auth import Grant, Tokens
    >>> app = MetricsApp(Tokens({"s3cret": Grant("prom", {"read"}, ("alerts*",))}))
    >>> got = []
    >>> _ = app({"HTTP_AUTHORIZATION": ""}, lambda status, headers: got.append(status))
    >>> got
    ['401 Unauthorized']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pushtable import metrics
from pushtable.flight.server.auth import OPEN, Grant, Tokens

__all__ = ["MetricsApp", "scoped"]

Start = Callable[[str, list[tuple[str, str]]], Any]


class MetricsApp:
    """The WSGI app answering ``GET /metrics`` for one server's tokens."""

    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    def __call__(self, environ: dict[str, Any], start: Start) -> Iterable[bytes]:
        """The registry's samples the caller's token may see (401 without a known token)."""
        grant: Grant | None = OPEN
        if len(self._tokens):
            header = str(environ.get("HTTP_AUTHORIZATION", "")).encode()
            grant = self._tokens.match(header)
        if grant is None:
            start(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="pushtable"')],
            )
            return [b"pushtable: missing or invalid bearer token\n"]
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        text = generate_latest(metrics.REGISTRY).decode()
        start("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Cache-Control", "no-store")])
        return [scoped(text, grant).encode()]


def scoped(text: str, grant: Grant) -> str:
    """The lines of Prometheus ``text`` that ``grant`` may see.

    Every sample labelled with a table or topic it does not cover is dropped (the comment
    lines stay: they name metrics, not tables).
    """
    if "*" in grant.tables:
        return text
    kept = []
    for line in text.splitlines(keepends=True):
        if not line.startswith("#"):
            labels = _labels(line)
            if labels is None:  # cannot tell which tables it names: not shown (fail closed)
                continue
            names = [v for k, v in labels if k in ("table", "topic")]
            if not all(grant.covers(name) for name in names):
                continue
        kept.append(line)
    return "".join(kept)


def _labels(line: str) -> list[tuple[str, str]] | None:
    """The labels of a sample line, parsed (None: malformed).

    Values are read as quoted strings with their escapes, so a ``}`` or ``,`` inside one (a
    table named ``payroll}2026``) is part of the value: cut at the first ``}``, the label
    was never seen and the sample was shown to every token.
    """
    start = line.find("{")
    space = line.find(" ")
    if start < 0 or 0 <= space < start:
        return []  # no labels
    out: list[tuple[str, str]] = []
    at = start + 1
    while True:
        while at < len(line) and line[at] in " ,":
            at += 1
        if at >= len(line):
            return None
        if line[at] == "}":
            return out
        eq = line.find("=", at)
        if eq < 0 or eq + 1 >= len(line) or line[eq + 1] != '"':
            return None
        name = line[at:eq].strip()
        value: list[str] = []
        at = eq + 2
        while True:
            if at >= len(line):
                return None
            ch = line[at]
            if ch == "\\" and at + 1 < len(line):
                value.append({"n": "\n", '"': '"', "\\": "\\"}.get(line[at + 1], line[at + 1]))
                at += 2
                continue
            if ch == '"':
                at += 1
                break
            value.append(ch)
            at += 1
        out.append((name, "".join(value)))
