"""A small node for netfilter tests: `pod` -> `node` (the agent's host) -> `remote`.

- pod:    10.200.1.2 / fd00:200:1::2, default route via node.
- node:   where our rules go; runs the "proxy": a plain listener (IP_TRANSPARENT so it
          serves REDIRECT and TPROXY alike) that answers with the destination it
          believes the client meant ("proxy HOST PORT").
- remote: owns the "remote" destinations (198.51.100.10, .20, 2001:db8:1::10, ::20) and
          answers "direct HOST PORT" — so a connection that bypasses the proxy still gets
          an answer, from an address inside our own namespaces.

Sockets are made in-process by switching this thread's namespace (pyroute2's pushns:
os.setns only exists from Python 3.12), and served by daemon threads.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pyroute2.netns import popns, pushns

from netfilter import sockets
from nodeagent.testing.netns import Topology

PROXY_TCP4 = 15001
PROXY_TCP6 = 15002
REMOTE_PORT = 8080
REMOTE4 = ("198.51.100.10", "198.51.100.20")
REMOTE6 = ("2001:db8:1::10", "2001:db8:1::20")
CLUSTER_IP = "10.96.0.10"
CLUSTER_IP_LEGACY = "10.96.0.11"

Answer = Callable[[socket.socket], str]


@contextmanager
def netns(real_name: str) -> Iterator[None]:
    pushns(real_name)
    try:
        yield
    finally:
        popns()


def _serve(listener: socket.socket, answer: Answer) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # listener closed at teardown
        with conn:
            try:
                conn.sendall(answer(conn).encode())
            except OSError:
                pass


class Lab:
    def __init__(self) -> None:
        self.topo = Topology()
        self.listeners: list[socket.socket] = []
        self.client_port = 20000 + secrets.randbelow(20000)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return self.topo.ns(name)

    def _build(self) -> None:
        t = self.topo
        for name in ("pod", "node", "remote"):
            t.add(name)
            # No duplicate address detection on link-local addresses either: while
            # they are tentative, neighbour discovery stalls the first IPv6 connection
            # for a SYN retransmit (1-2 s).
            for conf in ("default", "all"):
                t.exec(name, ["sysctl", "-qw", f"net.ipv6.conf.{conf}.accept_dad=0"])
        self.pod_if, self.node_pod_if = t.link(
            "pod", ["10.200.1.2/24", "fd00:200:1::2/64"],
            "node", ["10.200.1.1/24", "fd00:200:1::1/64"],
        )
        self.node_remote_if, _ = t.link(
            "node", ["10.200.2.1/24", "fd00:200:2::1/64"],
            "remote", ["10.200.2.2/24", "fd00:200:2::2/64"],
        )
        t.route("pod", "default", "10.200.1.1")
        t.exec("pod", ["ip", "-6", "route", "replace", "default", "via", "fd00:200:1::1"])
        t.route("remote", "default", "10.200.2.1")
        t.exec("remote", ["ip", "-6", "route", "replace", "default", "via", "fd00:200:2::1"])
        t.route("node", "198.51.100.0/24", "10.200.2.2")
        t.exec("node", ["ip", "-6", "route", "replace", "2001:db8:1::/64",
                        "via", "fd00:200:2::2"])
        for addr in REMOTE4:
            t.exec("remote", ["ip", "addr", "add", f"{addr}/32", "dev", "lo"])
        for addr in REMOTE6:
            t.exec("remote", ["ip", "addr", "add", f"{addr}/128", "dev", "lo"])

        def direct(conn: socket.socket) -> str:
            host, port = conn.getsockname()[:2]
            return f"direct {host} {port}\n"

        def proxy(port: int) -> Answer:
            def answer(conn: socket.socket) -> str:
                host, dport, _ = sockets.intercepted_destination(conn, port)
                return f"proxy {host} {dport}\n"
            return answer

        self.listen("remote", socket.AF_INET, "0.0.0.0", REMOTE_PORT, direct)
        self.listen("remote", socket.AF_INET6, "::", REMOTE_PORT, direct)
        self.listen("node", socket.AF_INET, "0.0.0.0", PROXY_TCP4, proxy(PROXY_TCP4),
                    transparent=True)
        self.listen("node", socket.AF_INET6, "::", PROXY_TCP6, proxy(PROXY_TCP6),
                    transparent=True)

    def listen(self, ns: str, family: socket.AddressFamily, host: str, port: int,
               answer: Answer, *, transparent: bool = False) -> None:
        with netns(self.ns(ns)):
            sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if transparent:
            sockets.set_transparent(sock)
        sock.bind((host, port))
        sock.listen(64)
        self.listeners.append(sock)
        threading.Thread(target=_serve, args=(sock, answer), daemon=True).start()

    def connect(self, ns: str, host: str, port: int = REMOTE_PORT, *,
                mark: int | None = None, timeout: float = 2.0) -> str:
        """Connect from namespace `ns` and return the answer line, or 'error: ...'."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with netns(self.ns(ns)):
            sock = socket.socket(family, socket.SOCK_STREAM)
        with sock:
            sock.settimeout(timeout)
            if mark is not None:
                sockets.set_mark(sock, mark)
            try:
                # A source port never used before in this lab: a reused 4-tuple could
                # meet a TIME_WAIT socket or conntrack entry of an earlier test's
                # connection (with other rules) and be answered by that instead.
                self.client_port += 1
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", self.client_port))
                sock.connect((host, port))
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    data += chunk
            except OSError as e:
                return f"error: {e}"
        return data.decode().strip()

    def sh(self, ns: str, args: list[str], *, input: str | None = None,
           check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.topo.exec(ns, args, input=input, check=check)

    def reset_node(self) -> None:
        """Forget every rule and route a test left in `node` (nft and iptables-legacy)."""
        self.sh("node", ["nft", "flush", "ruleset"])
        for tool in ("iptables-legacy", "ip6tables-legacy"):
            for table in ("nat", "mangle"):
                self.sh("node", [tool, "-t", table, "-F"], check=False)
                self.sh("node", [tool, "-t", table, "-X"], check=False)
        for fam in ("-4", "-6"):
            self.sh("node", ["ip", fam, "rule", "del", "pref", "1066"], check=False)
            self.sh("node", ["ip", fam, "route", "flush", "table", "1066"], check=False)

    def close(self) -> None:
        for sock in self.listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.topo.close()
