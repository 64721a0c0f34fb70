"""A connection that never finishes its request's headers is closed (labkit.http.serve):
silent ones, slowloris ones, and the second request of a keep-alive connection; requests sent
at once and responses that take long are not touched."""

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import pytest

from labkit.http.serve import HEADER_TIMEOUT_S, header_timeout_protocol
from tests.conftest import serve_asgi

CLOCK_S = 0.5  # the header clock of these servers
REQUEST = b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n"


class App:
    """Answers every request with 200, after ``delay_s``; counts the requests it saw."""

    def __init__(self, delay_s: float = 0.0):
        self.seen, self.delay_s = 0, delay_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.seen += 1
        await asyncio.sleep(self.delay_s)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes (b'' or a reset); False if it keeps the socket open
    for 30 s, far past its clock. The requests left unfinished cannot be answered."""
    try:
        while sock.recv(4096):
            pass  # the rest of a response we asked for
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_silent_and_slowloris_connections_are_closed_and_never_reach_the_app():
    app = App()
    with serve_asgi(app, http=header_timeout_protocol(CLOCK_S)) as base:
        silent = connect(base)
        slow = connect(base)
        slow.sendall(b"GET / HTTP/1.1\r\n")
        for line in (b"Host: test\r\n", b"X-One: 1\r\n", b"X-Two: 2\r\n"):
            time.sleep(CLOCK_S / 2)
            try:
                slow.sendall(line)  # never the blank line that ends the headers
            except OSError:
                break  # already closed
        assert closed_by_server(silent) and closed_by_server(slow)
        assert app.seen == 0
        # Many idle connections at once: the server answers others meanwhile, then closes all.
        idle = [connect(base) for _ in range(100)]
        assert httpx.get(base + "/").text == "ok"
        assert all(closed_by_server(sock) for sock in idle)
        for sock in [silent, slow, *idle]:
            sock.close()


def test_keep_alive_connections_get_the_clock_again_after_each_response():
    app = App()
    with serve_asgi(app, http=header_timeout_protocol(CLOCK_S)) as base:
        sock = connect(base)
        sock.sendall(REQUEST)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /second HTTP/1.1\r\nHost: test\r\n")  # and nothing more
        assert closed_by_server(sock)  # uvicorn's own keep-alive timer stopped at the data
        assert app.seen == 1
        sock.close()


def test_slow_responses_and_prompt_requests_are_not_cut():
    app = App(delay_s=4 * CLOCK_S)  # the app holds the response past the header clock
    with serve_asgi(app, http=header_timeout_protocol(CLOCK_S)) as base:
        with httpx.Client(base_url=base, timeout=30) as client:
            for _ in range(3):  # one keep-alive connection, three slow answers
                assert client.get("/").text == "ok"
        assert app.seen == 3


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_a_bad_clock_is_refused(bad):
    with pytest.raises(ValueError, match="header_timeout_s"):
        header_timeout_protocol(bad)
    assert header_timeout_protocol(None) is not None and HEADER_TIMEOUT_S == 60


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_the_cli_refuses_a_bad_header_timeout(command):
    args = [sys.executable, "-m", "labkit.cli", command, "--header-timeout", "-1"]
    if command == "serve":
        args.insert(4, "/nonexistent-model")
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "header_timeout_s" in done.stderr, done.stderr
