"""HTTP pieces shared by labkit's servers and clients, below both (chapters 2, 5 and 8).

One home each: OpenAI's error object and its handlers (:mod:`labkit.http.openai`), a server's
URL as labkit keys it (:mod:`labkit.http.urls`), the server-sent events of a streamed
completion (:mod:`labkit.http.sse`), a ``/metrics`` page read into numbers
(:mod:`labkit.http.metrics`), and the client side: a connection pool held to a concurrency
and one streamed completion as a client sees it end (:mod:`labkit.http.client`); and the
server side's uvicorn, with a clock on requests that never finish arriving
(:mod:`labkit.http.serve`). The
engine's server, the gateway, the benchmark client and the monitor all use these; none of
them defines its own.
"""
