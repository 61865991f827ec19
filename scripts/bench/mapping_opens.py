"""The server's cost per new connection through a TCP mapping, this tree against another.

The connection path has two halves: the agent's (dial, answer, splice: `tunnel_cpu
--relays`, `tunnel_instructions --relays`) and the server's, measured here: accept the
client, send the OPEN, take the ACCEPT, splice, carry both FINs, close. One process runs
the server role (`Server` with one TCP mapping and the tunnel listener on loopback TCP,
no TLS) and the clients; the agent (a TunnelConnection whose reader dials each stream
from its splice loop) and benchtool's C echo run in processes of their own, so what this
process spends is the server's work plus the client's few syscalls, the same in both
trees. Each client connects, sends one byte, reads the echo and closes first (or, with
`--close-first`, the target closes first: benchtool's `echoclose`).

    .venv/bin/python -m scripts.bench.mapping_opens --tree /work/base  # instructions, A/B
    .venv/bin/python -m scripts.bench.mapping_opens --cpu --conns 3000 # CPU µs, this tree

`--tree`: callgrind counts the server process's instructions (the machine has no
hardware counters) with this tree's and then the other tree's `nodeagent` and `tunnel`
packages, in interleaved rounds; one run with a single connection is subtracted
(interpreter, imports, handshake), so what is left is per connection. Prints one JSON
object: median instructions per connection for each tree, and the median, min and max
of the rounds' ratios (this / other). `--cpu`: CPU µs per connection of this process and
of the agent's (from /proc), wall-clock-free but load-sensitive, and the tasks spawned
and task steps per connection in this process (trio instrument; these do not move with
the load; the client's task takes 3 of the steps), and the median wall-clock time of
one connection (connect to the client's close; this one moves with the load).

`--agent-role`: the agent process runs the agent role itself (`Agent` with an allow list
naming the echo target: `take_stream`, its counters and callbacks), and what is measured
is that process: with `--tree`, callgrind counts the agent's instructions with each
tree's packages (the server is this checkout's, not counted); with `--cpu`, its CPU per
connection is the figure to read. `--tls`: the tunnel is TLS (`tls://`, a throwaway CA
and server certificate) as in production and in `scripts.bench.tunnel`, not `tcp://`;
the agent process then runs the agent role in any case.

    .venv/bin/python -m scripts.bench.mapping_opens --agent-role --tree /work/base --close-first
    .venv/bin/python -m scripts.bench.mapping_opens --tls --tree /work/base --close-first

`--syscalls`: system calls per connection by name (`strace -c`; a run with one
connection subtracted), of this process (the server and its clients: the clients' few are
the same in every tree) or with `--agent-role` of the agent's, for this tree and, with
`--tree`, the other one too.

    .venv/bin/python -m scripts.bench.mapping_opens --syscalls --agent-role --tls --close-first
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from scripts.bench.lib.tools import callgrind_instructions

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "0123456789abcdef0123"


class _Steps(trio.abc.Instrument):
    """Tasks spawned and task steps run in this process (load-independent counts)."""

    def __init__(self) -> None:
        self.spawned = 0
        self.steps = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _connection(address: tuple[str, int], close_first: bool) -> None:
    sock = socket.socket()
    sock.setblocking(False)
    try:
        try:
            sock.connect(address)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
        sock.send(b"x")
        got = b""
        while not got:
            await trio.lowlevel.wait_readable(sock)
            got = sock.recv(16)
        if not close_first:
            sock.shutdown(socket.SHUT_WR)
        while True:
            await trio.lowlevel.wait_readable(sock)
            if not sock.recv(16):
                break
    finally:
        sock.close()


async def server_side(conns: int, close_first: bool, echo_port: int, *,
                      agent_role: bool = False, agent_prefix: list[str] | None = None,
                      agent_env: dict[str, str] | None = None,
                      certs: Path | None = None) -> dict[str, float]:
    import logging
    logging.getLogger().setLevel(logging.WARNING)  # no line per connection either way
    from nodeagent.config import ServerConfig
    from nodeagent.ops.listener import Listeners
    from nodeagent.server.listeners import server_listeners
    from nodeagent.server.main import server_ssl_context
    from nodeagent.server.server import Server

    debug = tempfile.mkdtemp(prefix="mapping-opens-")
    tunnel: dict[str, object] = {"url": "tcp://127.0.0.1:0", "insecure": True}
    tls = {}
    if certs is not None:
        tunnel = {"url": "tls://127.0.0.1:0"}
        tls = {"tls": {"cert_file": str(certs / "server.crt"),
                       "key_file": str(certs / "server.key")}}
    config = ServerConfig.model_validate({
        "tunnel": tunnel, **tls,
        "tokens": [{"node": "*", "token": TOKEN}], "debug_socket": f"{debug}/server.sock",
        "tcp": [{"name": "bench", "listen": "127.0.0.1:0", "node": "edge-1",
                 "target": f"127.0.0.1:{echo_port}"}]})
    server = Server(config)
    context = server_ssl_context(config)
    listeners = server.listeners = Listeners(server_listeners(
        server, tunnel_context=(lambda: context) if context is not None else None,
        reuse_port=False, runs_connect_front=False))
    out: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        bound = await listeners.start_all(nursery)
        tunnel_port = int(bound["tunnel"][0].rsplit(":", 1)[1])
        host, port = bound["tcp:bench"][0].rsplit(":", 1)
        agent = await trio.lowlevel.open_process(
            [*(agent_prefix or []), sys.executable, "-P", "-m", "scripts.bench.mapping_opens",
             "--agent", str(tunnel_port), str(echo_port),
             *(["--agent-role"] if agent_role or certs is not None else []),
             *(["--agent-ca", str(certs / "ca.crt")] if certs is not None else [])],
            cwd=ROOT, stdin=subprocess.PIPE,
            stderr=subprocess.PIPE if agent_prefix else None,
            env=agent_env or dict(os.environ,
                                  PYTHONPATH=os.environ.get("PYTHONPATH") or str(ROOT)))
        stderr = bytearray()
        try:
            # Under callgrind the agent takes a minute to start.
            with trio.fail_after(600 if agent_prefix else 30):
                while "edge-1" not in server.tunnel.sessions:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            address = (host, int(port))
            await _connection(address, close_first)  # warm: the loops start here
            steps = _Steps()
            trio.lowlevel.add_instrument(steps)
            agent_cpu, t0 = _cpu_of(agent.pid), time.process_time()
            latencies = []
            for _ in range(conns):
                started = time.perf_counter()
                await _connection(address, close_first)
                latencies.append(time.perf_counter() - started)
            out["server_cpu_us_per_conn"] = (time.process_time() - t0) / conns * 1e6
            out["agent_cpu_us_per_conn"] = (_cpu_of(agent.pid) - agent_cpu) / conns * 1e6
            trio.lowlevel.remove_instrument(steps)
            # The client's own task is one step per wait (connect, echo, EOF): 3.
            out["server_tasks_spawned_per_conn"] = steps.spawned / conns
            out["server_task_steps_per_conn"] = steps.steps / conns
            out["latency_p50_us"] = statistics.median(latencies) * 1e6
            accepted = server.outcomes.counts["accepted"]
            if accepted != conns + 1:
                raise SystemExit(f"{accepted} of {conns + 1} connections accepted: "
                                 f"{dict(server.outcomes.counts)}")
            # The agent ends on its stdin's EOF, normally (callgrind writes its counts).
            assert agent.stdin is not None
            await agent.stdin.aclose()
            if agent.stderr is not None:
                async with agent.stderr:
                    async for chunk in agent.stderr:
                        stderr += chunk
            with trio.fail_after(120):
                await agent.wait()
        finally:
            if agent.returncode is None:
                agent.terminate()
                await agent.wait()
        listeners.stop_all()
        nursery.cancel_scope.cancel()
    shutil.rmtree(debug, ignore_errors=True)
    if agent_prefix and "--tool=callgrind" in agent_prefix:
        match = re.search(r"Collected : (\d+)", stderr.decode(errors="replace"))
        if match is None:
            raise SystemExit(f"no instruction count from the agent:\n{stderr[-2000:]!r}")
        out["agent_instructions"] = int(match.group(1))
    return out


async def _until_stdin_closes(scope: trio.CancelScope) -> None:
    """The agent process ends when the bench closes its stdin (a clean exit, so that
    callgrind writes its counts)."""
    while True:
        await trio.lowlevel.wait_readable(0)
        if not os.read(0, 4096):
            break
    scope.cancel()


async def agent_role_side(tunnel_port: int, echo_port: int, ca: str | None) -> None:
    """The node's side as the agent role runs it: `Agent` with its allow list (`ca`: the
    tunnel is TLS, its server's certificate signed by that CA)."""
    import logging
    logging.getLogger().setLevel(logging.WARNING)
    from nodeagent.agent.agent import Agent
    from nodeagent.agent.main import agent_ssl_context
    from nodeagent.config import AgentConfig

    debug = tempfile.mkdtemp(prefix="mapping-opens-agent-")
    scheme: dict[str, object] = {"server": f"tcp://127.0.0.1:{tunnel_port}", "insecure": True}
    if ca is not None:
        scheme = {"server": f"tls://127.0.0.1:{tunnel_port}",
                  "tls": {"ca_file": ca, "server_name": "localhost"}}
    config = AgentConfig.model_validate({
        "node": "edge-1", **scheme, "token": TOKEN, "allow": [f"127.0.0.1:{echo_port}"],
        "debug_socket": f"{debug}/agent.sock", "keepalive": {"interval": 3600}})
    agent = Agent(config, ssl_context=agent_ssl_context(config))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_stdin_closes, nursery.cancel_scope)
            await agent.run()
    finally:
        shutil.rmtree(debug, ignore_errors=True)


async def agent_side(tunnel_port: int, echo_port: int) -> None:
    """The node's side: its reader dials every stream from the splice loop (no task)."""
    from tunnel import protocol as p
    from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
    from tunnel.relay import relay_incoming_now
    from tunnel.transports import PeerInfo, StreamTransport

    def ignore(*args: object) -> None:
        pass

    def take(incoming: IncomingStream) -> bool:
        return relay_incoming_now(incoming, "127.0.0.1", echo_port, timeout=5, mark=None,
                                  on_accepted=ignore, on_refused=ignore, on_finished=ignore)

    async def refuse(incoming: IncomingStream) -> None:
        await incoming.refuse(p.StreamReason.REFUSED, "bench agent")

    stream = await trio.open_tcp_stream("127.0.0.1", tunnel_port)
    conn = TunnelConnection(StreamTransport(stream, PeerInfo("server")), p.Role.DIALER,
                            EndpointSettings(ping_interval=0, open_rate=1e9), refuse,
                            take_stream=take)
    await conn.dial_handshake(p.Hello(identity={"node": "edge-1", "token": TOKEN}))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_until_stdin_closes, nursery.cancel_scope)
        await conn.run()


def make_certs(directory: Path) -> Path:
    """A throwaway CA (ca.crt) and a server certificate for localhost and 127.0.0.1."""
    from nodeagent.trust import pki
    ca = pki.create_ca("mapping-opens-ca")
    ca.write(directory / "ca.crt", directory / "ca.key")
    pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"]).write(
        directory / "server.crt", directory / "server.key")
    return directory


def run_cpu(conns: int, close_first: bool, *, agent_role: bool = False,
            agent_tree: Path | None = None, tls: bool = False) -> dict[str, float]:
    """One run; with `agent_tree`, the agent process runs under callgrind with that
    tree's packages (`agent_instructions`)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _run_cpu(conns, close_first, agent_role=agent_role, agent_tree=agent_tree,
                        certs=make_certs(Path(tmp)) if tls else None)


def _run_cpu(conns: int, close_first: bool, *, agent_role: bool,
             agent_tree: Path | None, certs: Path | None,
             strace_to: Path | None = None) -> dict[str, float]:
    from scripts.bench.lib.tools import build_benchtool
    tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        echo_port = int(probe.getsockname()[1])
    echo = subprocess.Popen([str(tool), "echoclose" if close_first else "echo",
                             str(echo_port)])
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", echo_port)).close()
                break
            except OSError:
                time.sleep(0.02)
        if agent_tree is None:
            return trio.run(functools.partial(server_side, conns, close_first, echo_port,
                                              agent_role=agent_role, certs=certs))
        with tempfile.TemporaryDirectory() as tmp:
            for package in ("nodeagent", "tunnel"):
                (Path(tmp) / package).symlink_to(agent_tree / package)
            env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}", PYTHONHASHSEED="0")
            prefix = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out"]
            if strace_to is not None:
                prefix = ["strace", "-c", "-f", "-o", str(strace_to)]
            return trio.run(functools.partial(
                server_side, conns, close_first, echo_port, agent_role=agent_role,
                agent_prefix=prefix, agent_env=env, certs=certs))
    finally:
        echo.terminate()
        echo.wait()


def _strace_counts(path: Path) -> dict[str, int]:
    """Calls by syscall from `strace -c` output."""
    counts = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            counts[fields[-1]] = int(fields[3])
    return counts


def syscalls(tree: Path, conns: int, close_first: bool, agent_role: bool,
             tls: bool) -> dict[str, int]:
    """`strace -c` counts of one run with `tree`'s packages: the agent's process with
    `agent_role`, else the server's (with its clients)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "strace.out"
        if agent_role:
            with tempfile.TemporaryDirectory() as certs:
                _run_cpu(conns, close_first, agent_role=True, agent_tree=tree,
                         certs=make_certs(Path(certs)) if tls else None, strace_to=out)
            return _strace_counts(out)
        for package in ("nodeagent", "tunnel"):
            (Path(tmp) / package).symlink_to(tree / package)
        env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}")
        subprocess.run(
            ["strace", "-c", "-o", str(out), sys.executable, "-P", "-m",
             "scripts.bench.mapping_opens", "--cpu", "--conns", str(conns),
             *(["--close-first"] if close_first else []), *(["--tls"] if tls else [])],
            cwd=ROOT, env=env, capture_output=True, check=True)
        return _strace_counts(out)


def syscalls_per_connection(tree: Path, conns: int, close_first: bool, agent_role: bool,
                            tls: bool) -> dict[str, float]:
    one = syscalls(tree, 1, close_first, agent_role, tls)
    many = syscalls(tree, conns + 1, close_first, agent_role, tls)
    per = {name: (count - one.get(name, 0)) / conns for name, count in many.items()}
    per = {name: round(v, 2) for name, v in sorted(per.items(), key=lambda kv: -kv[1])
           if v >= 0.01}
    return {"total": round(sum(per.values()), 2), **per}


def instructions(tree: Path, conns: int, close_first: bool, agent_role: bool,
                 tls: bool) -> int:
    """Instructions callgrind counted in the server's process with `tree`'s packages,
    or with `agent_role` in the agent's."""
    if agent_role:
        return int(run_cpu(conns, close_first, agent_role=True, agent_tree=tree,
                           tls=tls)["agent_instructions"])
    return callgrind_instructions(
        tree, "scripts.bench.mapping_opens",
        ["--cpu", "--conns", str(conns), *(["--close-first"] if close_first else []),
         *(["--tls"] if tls else [])],
        ("nodeagent", "tunnel"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.mapping_opens",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="the other checkout: instructions, A/B")
    parser.add_argument("--cpu", action="store_true", help="CPU µs per connection, this tree")
    parser.add_argument("--conns", type=int, default=0,
                        help="connections (default 200 with --tree, 3000 with --cpu)")
    parser.add_argument("--close-first", action="store_true",
                        help="the target closes first (benchtool echoclose)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--tree)")
    parser.add_argument("--agent-role", action="store_true",
                        help="the agent process runs the agent role (Agent, its allow list); "
                             "with --tree its instructions are counted, not the server's")
    parser.add_argument("--syscalls", action="store_true",
                        help="system calls per connection (strace -c): this tree, and --tree's")
    parser.add_argument("--tls", action="store_true",
                        help="a TLS tunnel (tls://), as in production, not tcp://")
    parser.add_argument("--agent-ca", help=argparse.SUPPRESS)
    parser.add_argument("--agent", nargs=2, type=int, metavar=("TUNNEL_PORT", "ECHO_PORT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        if args.agent_role:
            trio.run(agent_role_side, *args.agent, args.agent_ca)
        else:
            trio.run(agent_side, *args.agent)
        return
    if args.syscalls:
        if shutil.which("strace") is None:
            raise SystemExit("strace is not installed (Debian package: strace)")
        trees = {"this": ROOT, **({"other": args.tree.resolve()} if args.tree else {})}
        print(json.dumps({
            "unit": ("agent" if args.agent_role else "server_and_clients")
            + "_syscalls_per_connection", "tls": args.tls, "close_first": args.close_first,
            **{name: syscalls_per_connection(tree, args.conns or 1000, args.close_first,
                                             args.agent_role, args.tls)
               for name, tree in trees.items()}}), flush=True)
        return
    if args.cpu or args.tree is None:
        result = run_cpu(args.conns or 3000, args.close_first, agent_role=args.agent_role,
                         tls=args.tls)
        print(json.dumps({k: round(v, 1) for k, v in result.items()}), flush=True)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package: valgrind)")
    conns = args.conns or 200
    trees = {"this": ROOT, "other": args.tree.resolve()}
    start = {name: instructions(tree, 1, args.close_first, args.agent_role, args.tls)
             for name, tree in trees.items()}
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        rounds.append({name: (instructions(tree, conns, args.close_first, args.agent_role,
                                           args.tls) - start[name])
                       / (conns - 1) for name, tree in trees.items()})
    ratios = [r["this"] / r["other"] for r in rounds]
    print(json.dumps({
        "phase": ("mapping_open_close_first" if args.close_first else "mapping_open")
        + ("_tls" if args.tls else ""),
        "unit": ("agent" if args.agent_role else "server") + "_instructions_per_connection",
        "this": round(statistics.median(r["this"] for r in rounds)),
        "other": round(statistics.median(r["other"] for r in rounds)),
        "ratio": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
    }), flush=True)


if __name__ == "__main__":
    main()
