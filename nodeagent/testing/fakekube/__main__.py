"""Run the fake API server as its own process, for end-to-end tests with real processes.

    python -m nodeagent.testing.fakekube --port 0 --token admin --kubeconfig /tmp/kc \
        [--tls] [--rbac] [--workloads --workload-start-delay S]

Prints one JSON line on stdout once listening — {"url", "port", "kubeconfig"} — and serves
until killed. Tests drive faults through the /_fake/ endpoints (see `control.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import trio

from nodeagent.testing.fakekube.server import FakeKube
from nodeagent.testing.fakekube.store import DEFAULT_NAMESPACES
from nodeagent.testing.fakekube.workloads import WorkloadSimulator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nodeagent.testing.fakekube",
                                     description="fake Kubernetes API server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--tls", action="store_true", help="HTTPS with a throwaway CA")
    parser.add_argument("--token", help="require this bearer token (user admin)")
    parser.add_argument("--rbac", action="store_true",
                        help="authorize everyone but system:masters by stored RBAC objects")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for this server here")
    parser.add_argument("--bookmark-interval", type=float, default=1.0)
    parser.add_argument("--history-limit", type=int, default=None,
                        help="auto-compact history beyond this many revisions")
    parser.add_argument("--namespace", action="append", default=[],
                        help="extra namespace to create (repeatable)")
    parser.add_argument("--workloads", action="store_true",
                        help="run the simulated workload controller (workloads.py)")
    parser.add_argument("--workload-start-delay", type=float, default=1.0,
                        help="seconds from a simulated pod's creation to Ready")
    parser.add_argument("--workload-node", default="node-1",
                        help="node of simulated pods whose template names none")
    parser.add_argument("--workload-pod-ip", default="127.0.0.1",
                        help="the address every simulated pod holds")
    args = parser.parse_args(argv)

    fake = FakeKube(token=args.token, tls=args.tls, bookmark_interval=args.bookmark_interval,
                    history_limit=args.history_limit, rbac=args.rbac,
                    namespaces=(*DEFAULT_NAMESPACES, *args.namespace))

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(fake.serve, host=args.host, port=args.port))
            if args.workloads:
                await nursery.start(WorkloadSimulator(
                    fake.store, start_delay=args.workload_start_delay,
                    node=args.workload_node, pod_ip=args.workload_pod_ip).run)
            if args.kubeconfig:
                fake.write_kubeconfig(args.kubeconfig)
            print(json.dumps({"url": url, "port": fake.port, "kubeconfig": args.kubeconfig}),
                  flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
