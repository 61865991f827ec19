"""Benchmark the netfilter backends on a list of 10,000 destination CIDRs.

Runs in a throwaway network namespace (root needed), with this process switched into it
so `nft` is called exactly as the agent calls it (no `ip netns exec` in the timings).
Measures, for the nftables backend:
  - full apply of a new 10,000-destination model onto an empty host (validate + render +
    one `nft -f -` transaction), and onto a host holding a different 10,000-entry table
    (a config change);
  - re-apply of the unchanged model, both the same object (the agent's reconcile loop)
    and an equal model built afresh (includes validation and rendering);
  - rule counts for 10 vs 10,000 destinations, read back from the kernel.
And for comparison the iptables-legacy backend (rule counts; apply times with and without
ipset). Prints a table and writes bench-results/netfilter.json. As root, from the
repository root:

    sudo .venv/bin/python -m scripts.bench.netfilter_rules [--repeat N]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from netfilter.iptables import IptablesBackend, ipset_available, plan_iptables
from netfilter.model import (
    InterceptModel,
    InterceptRule,
    PortRange,
    Protocol,
    ProxyPorts,
)
from netfilter.nftables import NftablesBackend, plan_nftables

TARGET_APPLY_MS = 200.0
TARGET_REAPPLY_MS = 20.0


def model_with(count: int, *, offset: int = 0) -> InterceptModel:
    """`count` disjoint, non-adjacent /28s (so none merge), IPv4 and a tenth IPv6."""
    v4 = [ipaddress.IPv4Network((int(ipaddress.IPv4Address("10.0.0.0")) + (i + offset) * 32, 28))
          for i in range(count - count // 10)]
    v6 = [ipaddress.IPv6Network((int(ipaddress.IPv6Address("fd00::")) + ((i + offset) << 80), 48))
          for i in range(count // 10)]
    return InterceptModel(
        rules=(InterceptRule("bulk", Protocol.TCP, (*v4, *v6), ports=(PortRange(443, 443),),
                             exclude=(v4[0],), host_traffic=True),),
        proxy_ports=ProxyPorts(tcp4=15001, tcp6=15002),
        exclude=(ipaddress.ip_network("10.0.0.1/32"),),
    )


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(samples), 2),
            "min_ms": round(min(samples), 2), "max_ms": round(max(samples), 2),
            "runs": len(samples)}


def kernel_rule_count() -> int:
    proc = subprocess.run(["nft", "-j", "list", "table", "inet", "nodeagent"],
                          capture_output=True, text=True, check=True)
    return sum(1 for o in json.loads(proc.stdout)["nftables"] if "rule" in o)


def bench(repeat: int) -> dict[str, object]:
    from pyroute2.netns import pushns

    # One namespace for the whole run; this thread (and the nft processes it starts)
    # lives in it from here on.
    name = f"na-bench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        pushns(name)
        return _bench_in_netns(repeat)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _bench_in_netns(repeat: int) -> dict[str, object]:
    nft = NftablesBackend()
    big, big_other = model_with(10_000), model_with(10_000, offset=20_000)
    nft.apply(model_with(10))  # warm up: imports, the netlink socket
    nft.remove()

    results: dict[str, object] = {}

    def fresh_apply() -> None:
        nft.remove()
        model = model_with(10_000)  # a new object: nothing cached
        start = time.perf_counter()
        assert nft.apply(model)
        fresh_samples.append((time.perf_counter() - start) * 1000)

    fresh_samples: list[float] = []
    for _ in range(repeat):
        fresh_apply()
    results["nft_full_apply_empty_host"] = summary(fresh_samples)

    models = [model_with(10_000) for _ in range(repeat)]
    plan_samples = timed(lambda: plan_nftables(models.pop()), repeat)
    results["nft_validate_and_render"] = summary(plan_samples)

    change_samples: list[float] = []
    for i in range(repeat):
        model = model_with(10_000, offset=20_000 if i % 2 == 0 else 0)
        start = time.perf_counter()
        assert nft.apply(model)
        change_samples.append((time.perf_counter() - start) * 1000)
    results["nft_full_apply_replacing_10k_table"] = summary(change_samples)

    nft.apply(big)
    gen = nft.generation()
    results["nft_reapply_same_object"] = summary(
        timed(lambda: nft.apply(big) and sys.exit("re-apply ran a transaction"), repeat * 4))
    # Equal models built afresh (outside the timing: that is config parsing, not us).
    fresh = [model_with(10_000) for _ in range(repeat)]
    results["nft_reapply_equal_model_built_afresh"] = summary(
        timed(lambda: nft.apply(fresh.pop()), repeat))
    assert nft.generation() == gen, "a no-op re-apply changed the ruleset"
    results["nft_verify_full_readback"] = summary(timed(lambda: nft.verify(big), 3))

    counts: dict[str, dict[str, int]] = {"nftables_kernel": {}, "nftables_rendered": {},
                                         "iptables_rules": {}, "iptables_ipset": {}}
    for count in (10, 10_000):
        model = model_with(count)
        nft.apply(model)
        counts["nftables_kernel"][str(count)] = kernel_rule_count()
        counts["nftables_rendered"][str(count)] = sum(
            len(c.rules) for c in plan_nftables(model).chains)
        for flavour, use_ipset in (("iptables_rules", False), ("iptables_ipset", True)):
            plans = plan_iptables(model, use_ipset=use_ipset)
            counts[flavour][str(count)] = sum(
                len(s) for p in plans.values() for s in p.chains.values())
    results["rule_counts"] = counts
    nft.remove()
    del big_other

    ipt_results: dict[str, object] = {}
    flavours = [("rules", False)] + ([("ipset", True)] if ipset_available() else [])
    for label, use_ipset in flavours:
        ipt = IptablesBackend(use_ipset=use_ipset)
        ipt_samples = []
        for _ in range(max(1, repeat // 2)):
            ipt.remove()
            model = model_with(10_000)
            start = time.perf_counter()
            ipt.apply(model)
            ipt_samples.append((time.perf_counter() - start) * 1000)
        ipt_results[f"iptables_{label}_full_apply_empty_host"] = summary(ipt_samples)
        ipt_results[f"iptables_{label}_reapply_unchanged"] = summary(
            timed(lambda ipt=ipt, model=model: ipt.apply(model), repeat))
        ipt.remove()
    if not ipset_available():
        ipt_results["iptables_ipset"] = "skipped: ipset tool not installed"
    results["iptables_legacy"] = ipt_results
    return results


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.netfilter_rules",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default="bench-results/netfilter.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("scripts.bench.netfilter_rules: needs root (network namespaces, nft)",
              file=sys.stderr)
        return 2
    results = bench(args.repeat)
    results["targets"] = {"full_apply_ms": TARGET_APPLY_MS, "reapply_ms": TARGET_REAPPLY_MS}
    results["nft_version"] = subprocess.run(["nft", "--version"], capture_output=True,
                                            text=True).stdout.strip()
    results["kernel"] = os.uname().release
    # The timings are wall clock on a shared 2-core machine: record how busy it was.
    results["load_average"] = [round(x, 2) for x in os.getloadavg()]

    rows = [(k, v) for k, v in results.items() if isinstance(v, dict) and "median_ms" in v]
    rows += [(k, v) for k, v in results["iptables_legacy"].items()  # type: ignore[union-attr]
             if isinstance(v, dict)]
    print(f"{'measurement (10,000 destinations)':<44} {'median':>9} {'min':>9} {'max':>9}")
    for key, s in rows:
        print(f"{key:<44} {s['median_ms']:>7.1f}ms {s['min_ms']:>7.1f}ms {s['max_ms']:>7.1f}ms")
    print()
    print(f"{'rule count':<22} {'10 dest':>10} {'10,000 dest':>12}")
    for flavour, c in results["rule_counts"].items():  # type: ignore[union-attr]
        print(f"{flavour:<22} {c['10']:>10} {c['10000']:>12}")
    apply_ms = results["nft_full_apply_empty_host"]["median_ms"]  # type: ignore[index]
    reapply_ms = results["nft_reapply_same_object"]["median_ms"]  # type: ignore[index]
    ok = apply_ms <= TARGET_APPLY_MS and reapply_ms <= TARGET_REAPPLY_MS
    results["targets_met"] = ok
    print(f"\ntargets: full apply {apply_ms:.1f} ms (<= {TARGET_APPLY_MS:.0f}), "
          f"re-apply {reapply_ms:.1f} ms (<= {TARGET_REAPPLY_MS:.0f}): "
          f"{'met' if ok else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
