"""Regression test for what ``benchmarks/bench_api.py`` found: under 200 concurrent
clients a few POSTs got no answer (the connection reset). uvicorn closed keep-alive
connections idle for 5 s, the very timeout httpx (and many clients) use on their
side, so a client reusing a connection at that moment lost its request. ``keyshred
serve`` keeps idle connections for ``KEEP_ALIVE_SECONDS``, longer than the clients'
and proxies' usual idle timeouts, so the client side always closes first."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from keyshred.api.server import KEEP_ALIVE_SECONDS
from tests.api.conftest import ApiServer

_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            return data  # closed by the server
        data += chunk
    return data


def test_an_idle_keep_alive_connection_outlives_the_clients_usual_timeout(
    server: ApiServer,
) -> None:
    assert KEEP_ALIVE_SECONDS > 60  # above httpx's 5 s and nginx's / load balancers' 60 s
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(_REQUEST)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)  # past uvicorn's default of 5 s, which closed it here
        sock.sendall(_REQUEST)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
