"""Durable topics: a topic's batches stored in a Lance dataset, acknowledged once committed.

:mod:`pushtable.durable.store` holds the dataset (appends, reads by offset or time, upkeep,
restart); :mod:`pushtable.durable.log` the offsets, group commits, idempotent producers and
reads that join history to the live stream. Users reach them through
``Topic(..., persist=...)`` and ``pushtable serve --data-dir``.
"""

from pushtable.durable.log import DurableLog, Start
from pushtable.durable.store import LogStore

__all__ = ["DurableLog", "LogStore", "Start"]
