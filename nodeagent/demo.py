"""`nodeagent demo`: a server, an agent and a sample service on loopback, with traffic.

The server and the agent run as real `nodeagent` processes (the same commands a user
runs), started from config files the demo writes into a temporary directory; the sample
HTTP service runs inside the demo process. The demo then sends real requests through the
tunnel, prints what happened with the measured latency, and keeps the stack running until
Ctrl-C or SIGTERM (or --seconds). It exits 1 if traffic did not flow; on a signal it stops
the server and the agent, removes its directory (which holds the demo CA's key) and
exits 0.
"""

from __future__ import annotations

import functools
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import h11
import httpx
import trio
import yaml

from nodeagent.ops.debugcli import program_command
from nodeagent.trust import pki

NODE = "demo-node"
HOST = "hello.demo.local"


async def _sample_service(stream: trio.SocketStream) -> None:
    """A tiny keep-alive HTTP/1.1 service: answers every GET with a greeting."""
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                body = (f"hello from the sample service on {NODE}: you asked for "
                        f"{event.target.decode()}\n").encode()
                headers = [("content-type", "text/plain"), ("content-length", str(len(body)))]
                await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
                await stream.send_all(conn.send(h11.Data(data=body)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
            elif isinstance(event, h11.EndOfMessage):
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
            else:  # ConnectionClosed, or anything unexpected
                return
    except (h11.ProtocolError, trio.BrokenResourceError):
        return
    finally:
        await stream.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _status(sock: Path) -> dict[str, Any]:
    transport = httpx.AsyncHTTPTransport(uds=str(sock))
    async with httpx.AsyncClient(transport=transport, timeout=2) as client:
        doc: dict[str, Any] = (await client.get("http://debug/status")).json()
        return doc


async def _wait_for_agent(sock: Path, seconds: float) -> bool:
    with trio.move_on_after(seconds):
        while True:
            try:
                if (await _status(sock))["agents"]:
                    return True
            except (httpx.HTTPError, OSError, ValueError, KeyError):
                pass
            await trio.sleep(0.05)
    return False


def _say(text: str = "") -> None:
    print(text, flush=True)


async def _measure(client: httpx.AsyncClient, url: str, host: str | None, n: int) -> list[float]:
    headers = {"Host": host} if host else {}
    timings = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.get(url, headers=headers)
        r.raise_for_status()
        timings.append((time.perf_counter() - t0) * 1000)
    return timings


async def _tcp_request(port: int, payload: bytes) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        got = b""
        while chunk := await stream.receive_some(65536):
            got += chunk
    return got, (time.perf_counter() - t0) * 1000


def run_demo(*, seconds: float | None, transport: str) -> int:
    with tempfile.TemporaryDirectory(prefix="nodeagent-demo-") as tmpdir:
        return trio.run(_run, Path(tmpdir), seconds, transport)


async def _run(tmp: Path, seconds: float | None, transport: str) -> int:
    token = secrets.token_urlsafe(24)
    ca = pki.create_ca("nodeagent demo CA")
    ca.write(tmp / "ca.crt", tmp / "ca.key")
    server_cert = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
    server_cert.write(tmp / "server.crt", tmp / "server.key")

    outcome: list[bool] = []
    # SIGINT and SIGTERM cancel the stack: its processes get SIGTERM and are waited for
    # (_process), and run_demo removes the directory. The watcher lives in the nursery,
    # inside the receiver's block, so it never outlives it.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, signals, nursery.cancel_scope)
            # The sample service, standing for a service on the node.
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, _sample_service, 0, host="127.0.0.1"))
            service_port = listeners[0].socket.getsockname()[1]
            outcome.append(await _with_stack(tmp, token, service_port, seconds, transport))
            nursery.cancel_scope.cancel()
    ok = all(outcome)  # no outcome: a signal stopped the demo, which is how it ends
    _say("stopped." if ok else "FAILED: traffic did not flow through the tunnel.")
    return 0 if ok else 1


async def _cancel_on_signal(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


async def _with_stack(tmp: Path, token: str, service_port: int, seconds: float | None,
                      transport: str) -> bool:
    tunnel_port, tcp_port, http_port = _free_port(), _free_port(), _free_port()
    path = "/tunnel" if transport == "wss" else ""
    tunnel_url = f"{transport}://127.0.0.1:{tunnel_port}{path}"
    server_cfg = {
        "server_id": "demo-server",
        "tunnel": tunnel_url,
        "tls": {"cert_file": str(tmp / "server.crt"), "key_file": str(tmp / "server.key")},
        "tokens": [{"node": NODE, "token": token}],
        "tcp": [{"name": "sample", "listen": f"127.0.0.1:{tcp_port}", "node": NODE,
                 "target": f"127.0.0.1:{service_port}"}],
        "http": [{"name": "public", "listen": f"127.0.0.1:{http_port}", "routes": [
            {"host": HOST, "node": NODE, "target": f"127.0.0.1:{service_port}"}]}],
        "debug_socket": str(tmp / "server.sock"),
    }
    agent_cfg = {
        "node": NODE, "server": tunnel_url, "token": token,
        "tls": {"ca_file": str(tmp / "ca.crt")},
        "allow": [f"127.0.0.1:{service_port}"], "debug_socket": str(tmp / "agent.sock"),
        "reconnect": {"initial": 0.1, "maximum": 2},
    }
    (tmp / "server.yaml").write_text(yaml.safe_dump(server_cfg))
    (tmp / "agent.yaml").write_text(yaml.safe_dump(agent_cfg))
    kind = "WebSocket over TLS" if transport == "wss" else "TLS over TCP"
    _say("nodeagent demo: a server, an agent and a sample service on 127.0.0.1")
    _say(f"  working directory   {tmp}  (configs, certificates, logs)")
    _say(f"  sample service      127.0.0.1:{service_port}  (stands for a service on the node)")
    _say(f"  tunnel              {tunnel_url}  ({kind}, token auth)")

    async with _process(["server", "--config", str(tmp / "server.yaml")],
                        tmp / "server.log") as server, \
            _process(["agent", "--config", str(tmp / "agent.yaml")],
                     tmp / "agent.log") as agent:
        t0 = time.monotonic()
        if not await _wait_for_agent(tmp / "server.sock", 20):
            _say("\nFAILED: the agent did not connect within 20 s. Logs:")
            _say((tmp / "server.log").read_text() + (tmp / "agent.log").read_text())
            return False
        _say(f"\n1. the agent dialed out and connected in {time.monotonic() - t0:.2f} s "
             f"(server pid {server.pid}, agent pid {agent.pid})")
        ok = await _traffic(tmp, service_port, tcp_port, http_port)
        _say("\nthe stack keeps running; try it yourself:")
        _say(f"  curl -H 'Host: {HOST}' http://127.0.0.1:{http_port}/")
        nodeagent = program_command()
        _say(f"  {nodeagent} debug status --socket {tmp / 'agent.sock'}")
        _say(f"  {nodeagent} debug tunnels --socket {tmp / 'server.sock'}")
        _say(f"  {nodeagent} debug streams --socket {tmp / 'agent.sock'} --watch")
        if seconds is None:
            _say("press Ctrl-C to stop")
            await trio.sleep_forever()
        else:
            _say(f"stopping in {seconds:g} s (--seconds)")
            await trio.sleep(seconds)
    return ok


@asynccontextmanager
async def _process(args: list[str], log: Path) -> AsyncIterator[trio.Process]:
    with log.open("ab") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nodeagent", *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


async def _traffic(tmp: Path, service_port: int, tcp_port: int, http_port: int) -> bool:
    ok = True
    async with httpx.AsyncClient(timeout=5) as client:
        try:
            r = await client.get(f"http://127.0.0.1:{http_port}/demo", headers={"Host": HOST})
            _say(f"2. HTTP  GET http://{HOST}/demo via 127.0.0.1:{http_port} -> "
                 f"{r.status_code}: {r.text.strip()}")
            ok &= r.status_code == 200 and "sample service" in r.text
            direct = await _measure(client, f"http://127.0.0.1:{service_port}/", None, 50)
            tunneled = await _measure(client, f"http://127.0.0.1:{http_port}/", HOST, 50)
            _say(f"   latency over 50 keep-alive requests: median "
                 f"{statistics.median(tunneled):.2f} ms through the tunnel vs "
                 f"{statistics.median(direct):.2f} ms direct")
            r = await client.get(f"http://127.0.0.1:{http_port}/",
                                 headers={"Host": "unknown.test"})
            _say(f"   a Host with no route gets {r.status_code}: {r.text.strip()}")
            ok &= r.status_code == 404
        except httpx.HTTPError as exc:
            _say(f"2. HTTP through the tunnel FAILED: {exc!r}")
            ok = False
    try:
        request = b"GET /tcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        reply, ms = await _tcp_request(tcp_port, request)
        first = reply.split(b"\r\n", 1)[0].decode(errors="replace")
        _say(f"3. TCP   127.0.0.1:{tcp_port} -> tunnel -> 127.0.0.1:{service_port}: "
             f"'{first}' in {ms:.2f} ms (new connection + new stream)")
        ok &= first.startswith("HTTP/1.1 200")
    except OSError as exc:
        _say(f"3. TCP through the tunnel FAILED: {exc}")
        ok = False
    try:
        agent = await _status(tmp / "agent.sock")
        tunnel = agent["tunnel"]
        _say(f"4. agent status: tunnel {tunnel['state']}, rtt {tunnel['rtt_ms']} ms, "
             f"{tunnel['bytes_in']} bytes in / {tunnel['bytes_out']} out, streams "
             f"{agent['streams_by_outcome']}")
    except (httpx.HTTPError, OSError, KeyError) as exc:
        _say(f"4. could not read the agent's debug socket: {exc}")
    return bool(ok)
