"""The asyncio face of the client at its public path (home: :mod:`pushtable.flight.client.aio`).

Example:
    >>> from pushtable.flight.aio import AsyncClient
    >>> AsyncClient.__module__
    'pushtable.flight.client.aio'
"""

from pushtable.flight.client.aio import *  # noqa: F403 (the public names, re-exported)
from pushtable.flight.client.aio import __all__ as __all__
