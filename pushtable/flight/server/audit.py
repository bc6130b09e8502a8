"""The audit trail of ``pushtable serve``: one structured log line per call.

Lines go to the ``pushtable.audit`` logger at INFO, as JSON (``peer``, ``token`` — the
token's name, never its secret —, ``action``, ``table``, ``rows``, ``outcome``,
``duration_s``), and the same fields ride on the record as ``record.audit`` for handlers
that ship structured logs (route the logger anywhere with the ``logging`` module).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from pushtable import metrics

__all__ = ["AuditRecord", "audit_log", "audited"]

audit_log = logging.getLogger("pushtable.audit")


@dataclass
class AuditRecord:
    """One call: who (peer, token name), what (action, table), how much, how it ended."""

    peer: str
    token: str
    action: str
    table: str | None = None
    rows: int = 0
    outcome: str = "ok"
    duration_s: float = 0.0


@contextlib.contextmanager
def audited(peer: str, token: str, action: str, table: str | None = None) -> Iterator[AuditRecord]:
    """Log the call the block handles once it ends; the block may add ``rows``/``table``.

    The outcome is ``ok`` or the error's class name (a refusal: ``PermissionDeniedError``,
    ``ResourceLimitError``…); an exception is logged and re-raised.
    """
    record = AuditRecord(peer=peer, token=token, action=action, table=table)
    started = time.monotonic()
    try:
        yield record
    except BaseException as exc:
        record.outcome = type(exc).__name__
        raise
    finally:
        record.duration_s = round(time.monotonic() - started, 6)
        fields: dict[str, Any] = asdict(record)
        audit_log.info(json.dumps(fields), extra={"audit": fields})
        metrics.CALLS.labels(action=record.action, outcome=record.outcome).inc()
