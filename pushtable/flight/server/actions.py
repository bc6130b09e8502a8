"""The server's actions: each one's role, words and typed request, checked at the edge.

One table of ``{name: (role, what it does, request type)}``, and
each action's request, typed and checked at the edge.

A request names the fields its action needs; :func:`request` takes a JSON body apart into
one, so a missing or mistyped field is an :class:`~pushtable.InvalidRequestError` naming it
before anything runs, and the server's handler reads typed attributes. Fields an action
takes as options (a table's ``capacity``, a publish's ``advance``) stay in ``options`` for
the checks of :mod:`pushtable.flight.server.limits` and the handler.

Example:
    >>> request("offsets", {"name": "events"})
    Named(options={}, name='events')
    >>> request("consumed", {"name": "events", "consumer": "job"})
    Traceback (most recent call last):
    ...
    pushtable.errors.InvalidRequestError: action 'consumed' needs the field 'offset' (an integer)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from pushtable.errors import InvalidRequestError
from pushtable.flight.server.auth import ADMIN, READ, WRITE

__all__ = ["ACTIONS", "Action", "request"]


@dataclass(frozen=True)
class Request:
    """An action's body, checked.

    ``scope`` names the field that holds the table the action
    touches (a token's table scope is checked against it).
    """

    scope: ClassVar[str | None] = None
    options: dict[str, Any] = field(default_factory=dict, kw_only=True)

    @property
    def tables(self) -> list[str]:
        """The tables the action touches (for the token's scope)."""
        return [] if self.scope is None else [str(getattr(self, self.scope))]


@dataclass(frozen=True)
class Listing(Request):
    """No fields: ``tables``."""


@dataclass(frozen=True)
class Named(Request):
    """A table or topic by name: ``offsets``, ``close``, ``stats``."""

    scope: ClassVar[str | None] = "name"
    name: str


@dataclass(frozen=True)
class NewTable(Named):
    """``create_table``: the rest of the body is the table's options."""

    schema: str


@dataclass(frozen=True)
class Subscribe(Request):
    """``subscribe``: a server-side subscription of ``topic``; the rest are its options."""

    scope: ClassVar[str | None] = "topic"
    topic: str


@dataclass(frozen=True)
class Consumed(Named):
    """``consumed``: ``consumer`` has read every offset below ``offset``."""

    consumer: str
    offset: int


@dataclass(frozen=True)
class Producer(Named):
    """``producer``: an idempotent producer's last stored sequence."""

    producer_id: str


@dataclass(frozen=True)
class Leave(Request):
    """``leave``: the caller's own DoPut ``stream`` (its id) is over; no table named."""

    stream: str


@dataclass(frozen=True)
class Fail(Named):
    """``fail``: the producer's error, by message and class name."""

    message: str
    type: str


@dataclass(frozen=True)
class Epochs(Request):
    """``published``: the newest epoch of ``query`` published into ``table``."""

    scope: ClassVar[str | None] = "table"
    table: str
    query: str


@dataclass(frozen=True)
class Epoch(Epochs):
    """``discard``: an epoch's staged shares."""

    epoch: int


@dataclass(frozen=True)
class Publish(Epoch):
    """``publish``: the ``(partition, attempt[, rows])`` parts of an epoch.

    ``advance`` is in
    ``options``.
    """

    parts: list[Any]


@dataclass(frozen=True)
class Action:
    """What an action needs: a role, the words a refusal uses, and its request type.

    A tuple of roles means any one of them.
    """

    role: str | tuple[str, ...]
    does: str
    request: type[Request]


#: Every action the server answers, by name.
ACTIONS: dict[str, Action] = {
    "create_table": Action(ADMIN, "create", NewTable),
    "subscribe": Action(ADMIN, "subscribe to", Subscribe),
    "unsubscribe": Action(ADMIN, "unsubscribe", Named),
    "close": Action(WRITE, "close", Named),
    "fail": Action(WRITE, "fail", Fail),
    "stats": Action((READ, WRITE), "see", Named),
    "tables": Action((READ, WRITE), "list tables", Listing),
    "publish": Action(ADMIN, "publish an epoch to", Publish),
    "published": Action(ADMIN, "read the published epoch of", Epochs),
    "offsets": Action((READ, WRITE), "read the offsets of", Named),
    "producer": Action(WRITE, "push to", Producer),
    "leave": Action(WRITE, "leave a stream of", Leave),
    "consumed": Action(READ, "read", Consumed),
    "discard": Action(ADMIN, "discard staged shares of", Epoch),
}

_KINDS: dict[str, tuple[type, str]] = {
    "str": (str, "a string"),
    "int": (int, "an integer"),
    "list[Any]": (list, "a list"),
}


def request(kind: str, body: dict[str, Any]) -> Request:
    """``body`` as the request of action ``kind``.

    :class:`InvalidRequestError` names an
    unknown action, or a field that is missing or of the wrong kind.
    """
    action = ACTIONS.get(kind)
    if action is None:
        raise InvalidRequestError(f"unknown action {kind!r}; expected one of {', '.join(ACTIONS)}")
    values: dict[str, Any] = {}
    for f in fields(action.request):
        if f.name == "options":
            continue
        wanted, words = _KINDS[str(f.type)]
        if f.name not in body:
            raise InvalidRequestError(f"action {kind!r} needs the field {f.name!r} ({words})")
        value = body[f.name]
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise InvalidRequestError(
                f"action {kind!r}: the field {f.name!r} must be {words}, not {value!r}"
            )
        values[f.name] = value
    options = {k: v for k, v in body.items() if k not in values}
    return action.request(**values, options=options)
