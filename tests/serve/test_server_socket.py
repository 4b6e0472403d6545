"""The server's own listening socket: connections accepted on it send without Nagle's delay.

Without TCP_NODELAY every keep-alive response waited ~40 ms (the client's delayed ACK) between its headers and its
body: a 44 ms floor under every request, TTFT included (benchmarks/serve_llm.py found it).
"""

from __future__ import annotations

import asyncio
import socket

from metainfer_gen.serve.server import bind_socket


def test_accepted_connections_have_tcp_nodelay():
    sock = bind_socket("127.0.0.1", 0)
    sock.listen(8)
    seen = {}

    async def main():
        async def handle(reader, writer):
            seen["nodelay"] = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)  # what uvicorn does with ``sockets=[sock]``
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        await asyncio.wait_for(reader.read(), 10)
        writer.close()
        server.close()
        await server.wait_closed()

    try:
        asyncio.run(main())
    finally:
        sock.close()
    assert seen["nodelay"] != 0
