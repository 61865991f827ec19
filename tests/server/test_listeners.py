"""The server's listeners: one list built from its config, started in one place; the
debug status lists them with what each is."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from nodeagent.ops.listener import Listeners
from nodeagent.server.listeners import server_listeners
from tests.server.test_policy import connect, make_server
from tests.tunnel.test_endpoint import echo_handler


async def test_every_listener_of_a_server_starts_and_shows_in_its_status(
        tmp_path: Path) -> None:
    server = make_server({
        "tcp": [{"name": "ssh", "listen": "127.0.0.1:0", "node": "edge-1",
                 "target": "127.0.0.1:22"}],
        "http": [{"name": "public", "listen": "127.0.0.1:0", "routes": []}],
    }, debug_socket=str(tmp_path / "server.sock"), metrics_listen="127.0.0.1:0")
    listeners = server.listeners = Listeners(server_listeners(
        server, tunnel_context=None, reuse_port=False, runs_connect_front=True))
    async with trio.open_nursery() as nursery:
        bound = await listeners.start_all(nursery)
        assert list(bound) == ["tunnel", "tcp:ssh", "http:public", "debug", "health"]
        host, port = bound["tcp:ssh"][0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # listening (no agent: the connection is reset)
        status = server.status()
        assert status["listeners"] == bound
        details = {d["name"]: d for d in status["listener_details"]}
        assert details["tcp:ssh"]["kind"] == "tcp"
        assert details["tcp:ssh"]["node"] == "edge-1"
        assert details["http:public"]["tls"] is False
        assert details["tunnel"]["accepting"] is True
        listeners.drain(close_idle=False)
        assert server.status()["listener_details"][0]["accepting"] is False
        listeners.stop_all()


async def test_stopping_a_tcp_mapping_resets_its_open_connections(tmp_path: Path) -> None:
    """A mapping's connections are carried by the tunnel connection's splice loop, not by
    tasks of its listener: stopping the listener still ends them (a reset)."""
    server = make_server({"tcp": [{"name": "echo", "listen": "127.0.0.1:0",
                                   "node": "edge-1", "target": "127.0.0.1:7"}]},
                         debug_socket=str(tmp_path / "server.sock"))
    listeners = server.listeners = Listeners(server_listeners(
        server, tunnel_context=None, reuse_port=False, runs_connect_front=False))
    async with trio.open_nursery() as nursery:
        bound = await listeners.start_all(nursery)
        await connect(server, nursery, "edge-1", handler=echo_handler)
        host, port = bound["tcp:echo"][0].rsplit(":", 1)
        client = socket.create_connection((host, int(port)), timeout=5)
        with client:
            client.sendall(b"hello")
            got = b""
            with trio.fail_after(10):
                while len(got) < 5:
                    await trio.lowlevel.wait_readable(client)
                    got += client.recv(5)
            assert got == b"hello"  # through the agent's echo
            next(lst for lst in listeners.all if lst.name == "tcp:echo").stop()
            with trio.fail_after(10), pytest.raises(ConnectionResetError):
                while True:
                    await trio.lowlevel.wait_readable(client)
                    if not client.recv(65536):
                        break
        listeners.stop_all()
        nursery.cancel_scope.cancel()
