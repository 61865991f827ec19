"""The Ingress route table at scale: 10,000 hosts and 20,000 paths.

Measures, in one process: translating the Ingress objects (translate_ingresses), the full
rebuild of the server's table from them (build_ingress_table), a swap (the rebuild plus
freeing the table it replaces, as a route update costs the server), lookups (median and p99 over
a mix of exact, wildcard, prefix, default and missing hosts), and the memory the table
holds (tracemalloc of the build, and the RSS growth). Targets (issue 4): rebuild ≤ 100 ms,
lookup ≤ 20 µs median, ≤ 200 MB. Prints each figure and the targets, and writes
bench-results/routes.json. From the repository root:

    .venv/bin/python -m scripts.bench.route_table [--hosts 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from nodeagent.controller.ingress import translate_ingresses
from nodeagent.server.routetables import build_ingress_table
from scripts import ROOT


def objects(hosts: int) -> dict[str, list[dict[str, Any]]]:
    """`hosts` Ingresses, one host each (every tenth a wildcard), two paths per host."""
    ingresses, services, slices = [], [], []
    for i in range(hosts):
        ns, name = f"ns{i % 200}", f"app{i}"
        host = f"*.t{i}.example.com" if i % 10 == 0 else f"app{i}.example.com"
        ingresses.append({"metadata": {"namespace": ns, "name": name,
                                       "creationTimestamp": "2026-01-01T00:00:00Z"},
                          "spec": {"ingressClassName": "nodeagent", "rules": [{
                              "host": host, "http": {"paths": [
                                  {"path": "/", "pathType": "Prefix", "backend": {"service": {
                                      "name": name, "port": {"number": 80}}}},
                                  {"path": f"/api/v{i % 3}", "pathType": "Exact",
                                   "backend": {"service": {"name": name,
                                                           "port": {"number": 80}}}}]}}]}})
        services.append({"metadata": {"namespace": ns, "name": name},
                         "spec": {"ports": [{"port": 80, "targetPort": 8080}]}})
        slices.append({"metadata": {"namespace": ns, "name": f"{name}-x",
                                    "labels": {"kubernetes.io/service-name": name}},
                       "ports": [{"port": 8080}],
                       # on node k = i % 500, inside its podCIDR 10.(k/256).(k%256).0/24
                       "endpoints": [{"addresses": [f"10.{i % 500 // 256}.{i % 500 % 256}."
                                                    f"{i // 500 % 250 + 1}"],
                                      "nodeName": f"n{i % 500}",
                                      "conditions": {"ready": True}}]})
    nodes = [{"metadata": {"name": f"n{k}"},
              "spec": {"podCIDRs": [f"10.{k // 256}.{k % 256}.0/24"]}}
             for k in range(500)]
    return {"ingresses": ingresses, "services": services, "slices": slices, "nodes": nodes}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.route_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "routes.json")
    args = parser.parse_args()
    objs = objects(args.hosts)
    classes = [{"metadata": {"name": "nodeagent"},
                "spec": {"controller": "nodeagent.io/ingress-controller"}}]
    translate_s, build_s, swap_s = [], [], []
    kept: list[Any] = []  # keep old tables alive: `rebuild` is the build alone
    table: Any = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        translation = translate_ingresses(
            ingresses=objs["ingresses"], ingress_classes=classes, services=objs["services"],
            endpoint_slices=objs["slices"], secrets=[], nodes=objs["nodes"])
        translate_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        built, refused = build_ingress_table(translation.routes)
        build_s.append(time.perf_counter() - t0)
        kept.append(built)
        assert not refused and not translation.problems, (refused, translation.problems[:3])
    kept.clear()
    for _ in range(args.repeat):
        # What a server pays on a route update: build the new table, free the old one.
        t0 = time.perf_counter()
        table, _ = build_ingress_table(translation.routes)
        swap_s.append(time.perf_counter() - t0)
    paths = len(translation.routes.rules)
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    table, _ = build_ingress_table(translation.routes)
    table_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rng = random.Random(1)
    probes = []
    for _ in range(50_000):
        i = rng.randrange(args.hosts)
        host = f"x.t{i}.example.com" if i % 10 == 0 else f"app{i}.example.com"
        probes.append(rng.choice([(host, "/"), (host, f"/api/v{i % 3}"),
                                  (host, "/some/deep/path?q=1"), ("nobody.test", "/")]))
    timings = []
    for host, path in probes:
        t0 = time.perf_counter_ns()
        table.lookup(host, path)
        timings.append(time.perf_counter_ns() - t0)
    timings.sort()
    result = {
        "hosts": args.hosts, "paths": paths,
        "translate_ms_median": statistics.median(translate_s) * 1000,
        "rebuild_ms_median": statistics.median(build_s) * 1000,
        "swap_ms_median": statistics.median(swap_s) * 1000,
        "lookup_us_median": timings[len(timings) // 2] / 1000,
        "lookup_us_p99": timings[int(len(timings) * 0.99)] / 1000,
        "table_mb_tracemalloc": table_bytes / 1e6,
        "process_max_rss_mb": rss_after / 1024,
        "rss_growth_mb_last_build": (rss_after - rss_before) / 1024,
    }
    for key, value in result.items():
        print(f"{key:28} {value:,.2f}" if isinstance(value, float) else f"{key:28} {value:,}")
    print(f"targets: rebuild {result['rebuild_ms_median']:.1f} ms (<= 100), lookup "
          f"{result['lookup_us_median']:.2f} µs median (<= 20), table "
          f"{result['table_mb_tracemalloc']:.0f} MB (<= 200)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
