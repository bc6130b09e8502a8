"""The client side of ``pushtable serve``: what runs in a producer's or a reader's process.

:mod:`~pushtable.flight.client.client` (``connect``, ``Client``, remote results), the producers
(``remote_sink``, ``idempotent``, over ``put_stream`` and ``transport``) and the asyncio face
(``aio``, ``aio_sink``, ``aio_threads``). Nothing here loads the server or DataFusion: a Spark
executor's producer imports it alone. The wire it speaks is :mod:`pushtable.flight.protocol`.
"""
