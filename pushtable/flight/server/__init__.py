"""The server side of ``pushtable serve``: what runs in the server's process.

:mod:`~pushtable.flight.server.server` (the Flight service, its calls and lifecycle) with its
parts: the tables it hosts (``tables``), ingest (``ingest``, ``acks``), remote SQL and Flight
SQL (``query``, ``sql``, ``catalog``, ``parameters``), Spark's staged epochs (``staging``), and
the boundary (``auth``, ``limits``, ``calls``, ``actions``, ``audit``), the browser view
(``ui``) and metrics over HTTP (``metrics_http``). Its client is
:mod:`pushtable.flight.client`; the wire between them is :mod:`pushtable.flight.protocol`.
"""
