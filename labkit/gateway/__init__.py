"""An inference gateway: one address, several model servers, a router between
(chapter 5: :ref:`ch05-choosing-backend`, :ref:`ch05-backend-dies`).

* :mod:`labkit.gateway.endpoints`: what the gateway knows of each backend (:class:`Endpoint`);
* :mod:`labkit.gateway.plugins`: the filters, scorers and pickers routing is built from;
* :mod:`labkit.gateway.routing`: the strategies, each a pipeline of those stages
  (:func:`make_router`);
* :mod:`labkit.gateway.prefix_index`: the gateway's approximate index of prompt prefixes;
* :mod:`labkit.gateway.backends`: the pool that keeps the endpoints current (scrapes,
  probes, ejection and re-admission);
* :mod:`labkit.gateway.config`: everything a gateway is told (:class:`GatewayConfig`);
* :mod:`labkit.gateway.proxy`: one attempt on one backend and the relay of its stream, with
  the first-byte and stream-idle timeouts;
* :mod:`labkit.gateway.server`: the OpenAI-compatible streaming proxy (:class:`Gateway`),
  served by ``labkit gateway --backend URL --backend URL``.

The gateway needs only the HTTP helpers below it (:mod:`labkit.http`); the fleets, loads and
fault experiments the labs run against it are harnesses (``labkit.harness``).
"""

from labkit.gateway.backends import BackendPool, parse_backend_metrics
from labkit.gateway.config import GatewayConfig
from labkit.gateway.endpoints import Endpoint, NoEndpointError, RoutingRequest, SaturatedError
from labkit.gateway.routing import STRATEGIES, Router, make_router
from labkit.gateway.server import Gateway, GatewayMetrics, routing_request

__all__ = ["STRATEGIES", "BackendPool", "Endpoint", "Gateway", "GatewayConfig", "GatewayMetrics",
           "NoEndpointError", "Router", "RoutingRequest", "SaturatedError", "make_router",
           "parse_backend_metrics", "routing_request"]
