"""What the tests need from the machine beyond Python: one table, tool -> Debian package.

A test that runs a system tool or needs root says so with a marker,
`@pytest.mark.needs("nft")` or `@pytest.mark.needs("root")`; `@pytest.mark.netns` implies
root, `ip` and `sysctl`. tests/conftest.py skips a test whose needs this machine does not
meet, with a reason naming the Debian package, and sums the skips up at the end of the run.
scripts/test installs the missing packages first when it runs as root on a host with
apt-get: `python3 tests/needs.py --missing-packages` tells it which (stdlib only, so it
runs before the virtualenv exists).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable

ROOT = "root"

# command -> the Debian package that provides it
TOOLS: dict[str, str] = {
    # network namespaces, veth links, policy routing (every netns test)
    "ip": "iproute2",
    "sysctl": "procps",
    # the netfilter backends and the tests that read the kernel's rules back
    "nft": "nftables",
    "iptables-legacy": "iptables",
    "iptables-legacy-restore": "iptables",
    "iptables-nft": "iptables",
    "ipset": "ipset",
    # the benchmarks' peers and load generator (scripts/bench*.py)
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "sshuttle": "sshuttle",
    "wrk": "wrk",
    # a real HTTPS-proxy client for the CONNECT front (tests/e2e/test_connect.py), and an
    # HTTP/2 client for the front (tests/e2e/test_http2.py)
    "curl": "curl",
    # starting a process without a capability (tests/e2e/test_startup_errors.py)
    "setpriv": "util-linux",
    # the newcomer test: a clone, and namespaces of its own (tests/e2e/test_newcomer.py)
    "git": "git",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    # real forward proxies an agent dials its server through (tests/e2e/test_proxy.py)
    "tinyproxy": "tinyproxy",
    "microsocks": "microsocks",
    # h2load, the HTTP/2 load generator (scripts/bench/h2.py)
    "h2load": "nghttp2-client",
    # UDP through the tunnel: a real DNS client (tests/e2e/test_udp.py) and the UDP
    # benchmark's load generators and baseline relay (scripts/bench/udp.py)
    "dig": "dnsutils",
    "iperf3": "iperf3",
    "socat": "socat",
    "dnsperf": "dnsperf",
    "dnsmasq": "dnsmasq-base",
    # PROXY protocol's real peers: HAProxy sends v2 to the server, nginx parses the v1
    # and v2 headers the server sends a backend (tests/e2e/test_proxy_protocol.py)
    "haproxy": "haproxy",
    "nginx": "nginx-light",
    # htpasswd files as Apache's tool writes them, for basic auth (tests/http/test_auth.py)
    "htpasswd": "apache2-utils",
}

# Tools only slow tests need (`scripts/test -m slow`): scripts/test installs them only
# for a run that selects slow tests, so the default run (CI) never pulls in a container
# engine. The image build and smoke test (tests/e2e/test_image.py, scripts/image.py).
SLOW_TOOLS: dict[str, str] = {
    # the C data-path prototype scripts.bench.bulk_parity builds (its headers: libssl-dev
    # and libhttp-parser-dev, which tests/tunnel/test_bulk_relay_prototype.py checks for
    # itself)
    "gcc": "gcc",
    "podman": "podman",
    "runc": "runc",
    "debootstrap": "debootstrap",
}

NETNS = (ROOT, "ip", "sysctl")


def _hint() -> str:
    if shutil.which("apt-get") is not None:
        return "run scripts/test as root to install it"
    return "install it with the system's package manager"


def unmet(needs: Iterable[str]) -> tuple[str, str] | None:
    """The first need this machine does not meet, as (group, reason); None if all are met.

    `group` is what the end-of-run summary counts by ("not root", "nftables not
    installed"); `reason` is the skip reason, naming the package and what to do.
    """
    wanted = list(dict.fromkeys(needs))
    packages = {**TOOLS, **SLOW_TOOLS}
    unknown = [n for n in wanted if n != ROOT and n not in packages]
    if unknown:
        raise ValueError(f"needs({', '.join(unknown)}): not in tests/needs.py's TOOLS table")
    if ROOT in wanted and os.geteuid() != 0:
        return ("not root", "needs root (network namespaces, netfilter, socket marks); "
                            "run scripts/test as root")
    for tool in wanted:
        if tool != ROOT and shutil.which(tool) is None:
            package = packages[tool]
            return (f"{package} not installed",
                    f"needs `{tool}` (Debian package {package}), which is not installed; "
                    f"{_hint()}")
    return None


def missing_packages(slow: bool = False) -> list[str]:
    """Debian packages of every tool in the table that is not on PATH, in table order;
    with `slow`, the slow tests' tools too."""
    table = {**TOOLS, **SLOW_TOOLS} if slow else TOOLS
    return list(dict.fromkeys(pkg for tool, pkg in table.items() if shutil.which(tool) is None))


if __name__ == "__main__":
    if sys.argv[1:] not in (["--missing-packages"], ["--missing-packages", "--slow"]):
        sys.exit("usage: python3 tests/needs.py --missing-packages [--slow]")
    print(" ".join(missing_packages(slow=sys.argv[2:] == ["--slow"])))
