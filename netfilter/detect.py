"""Which backend this host wants: nftables, or iptables-legacy.

The rule is the one Kubernetes components follow (kube-proxy, the iptables-wrapper
scripts in kube images): use what the host already uses. If legacy iptables has rules in
it (kube-proxy's KUBE-* chains, a CNI's), the host is a legacy host and our chains go there
too, next to theirs, so `iptables-legacy-save` shows the whole picture. Otherwise — nft is
there and legacy iptables is empty or absent, or `iptables` is itself the nf_tables
flavour — we use our own nftables table. Detection only reads; it never creates anything,
and reading never loads legacy tables (iptables-legacy-save lists only loaded ones).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from enum import StrEnum

from netfilter._run import Runner
from netfilter.iptables import CHAIN_PREFIX, ipset_available
from netfilter.model import NetfilterError


class Backend(StrEnum):
    NFTABLES = "nftables"
    IPTABLES_LEGACY = "iptables-legacy"


@dataclass(frozen=True)
class Detection:
    backend: Backend
    reason: str  # one line for the log and `nodeagent debug status`
    ipset: bool = False  # for iptables-legacy: whether lists go into ipsets


def _legacy_rules(runner: Runner) -> list[str]:
    """Rule lines in legacy iptables that are not ours (both families)."""
    found: list[str] = []
    for save in ("iptables-legacy-save", "ip6tables-legacy-save"):
        if shutil.which(save) is None:
            continue
        proc = runner.run([save], check=False)
        if proc.returncode != 0:
            continue
        for line in proc.stdout.splitlines():
            # Rules, and user chains (`:NAME - [0:0]`; built-ins show a policy instead).
            theirs = line.startswith("-A ") or (line.startswith(":") and " - [" in line)
            if theirs and CHAIN_PREFIX not in line:
                found.append(line)
    return found


def detect_backend(netns: str | None = None) -> Detection:
    """Pick the backend for this host (or for the named netns, in tests)."""
    runner = Runner(netns)
    have_nft = shutil.which("nft") is not None
    have_legacy = shutil.which("iptables-legacy-restore") is not None
    legacy = _legacy_rules(runner) if have_legacy else []
    if legacy:
        kube = any("KUBE-" in line for line in legacy)
        what = "kube-proxy's chains" if kube else f"{len(legacy)} rules/chains"
        return Detection(
            Backend.IPTABLES_LEGACY,
            f"legacy iptables holds {what}; using NODEAGENT-* chains next to them",
            ipset=ipset_available(runner),
        )
    if have_nft:
        version = runner.run(["iptables", "--version"], check=False).stdout \
            if shutil.which("iptables") else ""
        flavour = "iptables is nf_tables-based" if "nf_tables" in version else (
            "legacy iptables is empty")
        return Detection(Backend.NFTABLES, f"nft available and {flavour}; using inet nodeagent")
    if have_legacy:
        return Detection(
            Backend.IPTABLES_LEGACY, "no nft binary; using legacy iptables",
            ipset=ipset_available(runner),
        )
    raise NetfilterError("neither nft nor iptables-legacy-restore is installed")
