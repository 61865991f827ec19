"""Running the netfilter tools (nft, iptables-*-restore, ipset), optionally in a named netns.

Every backend talks to the kernel through one `Runner`, so tests and benchmarks can
point a backend at a throwaway network namespace (`ip netns exec NAME ...`) and the
agent uses the host's own (netns=None).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from netfilter.model import NetfilterError


class CommandFailed(NetfilterError):
    """A netfilter tool refused our input; nothing it was asked to do took effect."""

    def __init__(self, args: Sequence[str], returncode: int, stderr: str) -> None:
        detail = stderr.strip().splitlines()
        # The first lines of nft/iptables-restore errors name the offending line; that is
        # what an operator needs, not a 10,000-element set echoed back.
        short = "; ".join(line.strip() for line in detail[:3])
        super().__init__(f"{' '.join(args)} exited {returncode}: {short}")
        self.args_run = list(args)
        self.returncode = returncode
        self.stderr = stderr


@dataclass(frozen=True)
class Runner:
    netns: str | None = None

    def argv(self, args: Sequence[str]) -> list[str]:
        if self.netns is None:
            return list(args)
        return ["ip", "netns", "exec", self.netns, *args]

    def run(
        self, args: Sequence[str], *, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(
                self.argv(args), input=input, capture_output=True, text=True, check=False
            )
        except FileNotFoundError as e:
            raise CommandFailed(args, 127, f"{args[0]} not found ({e})") from None
        if check and proc.returncode != 0:
            raise CommandFailed(args, proc.returncode, proc.stderr)
        return proc

    @contextlib.contextmanager
    def namespace(self) -> Iterator[None]:
        """Switch this thread into the runner's netns, for netlink sockets made inside.

        A netlink socket keeps the namespace it was created in, so callers create the
        socket here and may use it after the block ends.
        """
        if self.netns is None:
            yield
            return
        from pyroute2.netns import popns, pushns

        if not os.path.exists(f"/run/netns/{self.netns}"):
            raise NetfilterError(f"no network namespace {self.netns!r}")
        pushns(self.netns)
        try:
            yield
        finally:
            popns()
