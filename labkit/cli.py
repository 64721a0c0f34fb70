"""``labkit`` on the command line (chapter 2, :ref:`ch02-streaming`).

    labkit serve MODEL_DIR [vLLM's flags]   an OpenAI-compatible server for the teaching engine
    labkit tiny-model PATH                  write a tiny random Llama with a real tokenizer
    labkit gateway [--backend URL ...]      a streaming gateway in front of servers (chapter 5)
"""

from __future__ import annotations

import argparse
import os
import sys

from labkit.engine.args import engine_args, serve_parser


def gateway_parser(subparsers) -> argparse.ArgumentParser:
    """``labkit gateway``: :class:`labkit.gateway.Gateway` behind uvicorn (chapter 5).
    Host and port default to vllm-router's (127.0.0.1:30000, vllm-router 0.1.17
    ``router_args.py``)."""
    from labkit.gateway.routing import STRATEGIES

    p = subparsers.add_parser("gateway", help="an OpenAI-compatible gateway in front of "
                                              "several servers")
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a backend server's base URL, e.g. http://127.0.0.1:8001 (repeat); "
                        "none: start empty and add them with POST /add_worker, as an "
                        "autoscaler does")
    p.add_argument("--strategy", choices=STRATEGIES, default="endpoint_picker")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and the admin routes")
    p.add_argument("--open-admin-routes", action="store_true",
                   help="serve the admin routes without --api-key on a non-loopback --host "
                        "(anyone who reaches the gateway can then add a backend)")
    p.add_argument("--first-byte-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a streamed attempt waits for its first event before the "
                        "request goes to another backend (default 60)")
    p.add_argument("--stream-idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a relayed stream may go without a byte before it is cut "
                        "with an error event (default 10)")
    p.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                   help="close a connection that has not sent a whole request's headers this "
                        "long after it opened or after its last response (default 60, as "
                        "nginx's client_header_timeout)")
    p.add_argument("--session-header", default="x-session-id",
                   help="header whose value keys consistent_hash routing")
    p.add_argument("--seed", type=int, default=None, help="seed of the router's randomness")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    tiny = sub.add_parser("tiny-model", help="write a tiny random Llama model directory")
    tiny.add_argument("path")
    gateway_parser(sub)
    sub.add_parser("doctor", help="check this machine for the labs; say which path each takes")
    ns = parser.parse_args(argv)
    if ns.command == "doctor":
        from labkit.doctor import main as doctor

        return doctor()
    if ns.command == "tiny-model":
        from labkit.engine.tiny import write_tiny_model

        print(write_tiny_model(ns.path))
        return 0
    if ns.command == "gateway":
        return gateway(ns)
    return serve(ns)


def gateway(ns: argparse.Namespace) -> int:
    """Serve a :class:`labkit.gateway.Gateway` until SIGTERM; returns the exit status."""
    from labkit.gateway import Gateway, GatewayConfig
    from labkit.gateway.config import check_exposure
    from labkit.http.serve import header_timeout_protocol, run

    timeouts = {name: value for name, value in (
        ("first_byte_timeout_s", ns.first_byte_timeout),
        ("stream_idle_timeout_s", ns.stream_idle_timeout)) if value is not None}
    try:
        check_exposure(ns.host, ns.api_key, ns.open_admin_routes)
        config = GatewayConfig(ns.strategy, seed=ns.seed, session_header=ns.session_header,
                               api_key=ns.api_key, **timeouts)
        app = Gateway(ns.backend, config).app
        http = header_timeout_protocol(ns.header_timeout)
    except ValueError as err:
        print(f"labkit gateway: {err}", file=sys.stderr)
        return 2
    run(app, ns.host, ns.port, http)
    return 0


def serve(ns: argparse.Namespace) -> int:
    """Start the engine, then the HTTP server; returns the process exit status."""
    from labkit.engine.async_engine import AsyncLLMEngine
    from labkit.engine.server import build_app
    from labkit.http.serve import header_timeout_protocol, run

    try:
        http = header_timeout_protocol(ns.header_timeout)
        engine = AsyncLLMEngine(engine_args(ns), ns.served_model_name or ns.model)
    except (ValueError, RuntimeError) as err:  # RuntimeError: the device ran out at startup
        print(f"labkit serve: {err}", file=sys.stderr)
        return 2
    api_key = ns.api_key or os.environ.get("VLLM_API_KEY")
    limits = {} if ns.max_request_bytes is None else {"max_request_bytes": ns.max_request_bytes}
    app = build_app(engine, api_key=api_key, **limits)
    try:
        run(app, ns.host, ns.port, http)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
