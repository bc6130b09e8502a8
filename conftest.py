"""The README and docs/ run as tests (tests/docs_support.py): each Python block and shell
command, in order, so a snippet that stops working fails the build."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sybil.integration.pytest import pytest_integration as sybil_collector

from tests.docs_support import DOCS, in_document_order

pytest_collect_file = sybil_collector(*DOCS)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """After every other reordering (pytest-randomly's wrapper too: this one is outermost),
    each document's blocks in their order."""
    yield
    in_document_order(items)
