"""``kiln serve``'s socket: ``bind_socket`` makes a TCP socket whose accepted connections have Nagle's
algorithm off (TCP_NODELAY) under any event loop. Without it, plain asyncio (no uvloop) left Nagle on
and every keep-alive response written in two parts waited ~40 ms for the client's delayed ACK."""
from __future__ import annotations

import asyncio
import socket

import pytest

from kiln.errors import KilnError
from kiln.server.cli import bind_socket


def test_listening_socket_is_tcp_with_nodelay():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # what asyncio looks at before setting TCP_NODELAY
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_connections_accepted_by_plain_asyncio_have_nodelay():
    async def main() -> int:
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = bind_socket("127.0.0.1", 0)
        server = await loop.create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    # asyncio.run uses the default (selector) loop, never uvloop, whatever is installed
    assert asyncio.run(main()) != 0


def test_bad_port_and_host_are_clear_errors():
    with pytest.raises(KilnError, match="between 0 and 65535"):
        bind_socket("127.0.0.1", 70000)
    with pytest.raises(KilnError, match="cannot listen on host"):
        bind_socket("no-such-host.invalid", 0)
