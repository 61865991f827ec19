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
    # a real HTTPS-proxy client for the CONNECT front (tests/e2e/test_connect.py)
    "curl": "curl",
    # UDP through the tunnel: a real DNS client (tests/e2e/test_udp.py) and the UDP
    # benchmark's load generators and baseline relay (scripts/bench/udp.py)
    "dig": "dnsutils",
    "iperf3": "iperf3",
    "socat": "socat",
    "dnsperf": "dnsperf",
    "dnsmasq": "dnsmasq-base",
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
    unknown = [n for n in wanted if n != ROOT and n not in TOOLS]
    if unknown:
        raise ValueError(f"needs({', '.join(unknown)}): not in tests/needs.py's TOOLS table")
    if ROOT in wanted and os.geteuid() != 0:
        return ("not root", "needs root (network namespaces, netfilter, socket marks); "
                            "run scripts/test as root")
    for tool in wanted:
        if tool != ROOT and shutil.which(tool) is None:
            package = TOOLS[tool]
            return (f"{package} not installed",
                    f"needs `{tool}` (Debian package {package}), which is not installed; "
                    f"{_hint()}")
    return None


def missing_packages() -> list[str]:
    """Debian packages of every tool in the table that is not on PATH, in table order."""
    return list(dict.fromkeys(pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None))


if __name__ == "__main__":
    if sys.argv[1:] != ["--missing-packages"]:
        sys.exit("usage: python3 tests/needs.py --missing-packages")
    print(" ".join(missing_packages()))
