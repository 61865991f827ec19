"""scripts.bench.config_propagation on a small cluster, for its functional facts only (the
figures are the benchmark's business): the controller and the simulated agents as real
processes, an Ingress edit that concerns one node reaches that node and no other node
receives anything, and a ClusterTunnel edit reaches every node, whether the watches are
the agents' own code or (`delivery`) receive-only ones."""

from __future__ import annotations

from pathlib import Path

from scripts.bench import config_propagation


async def test_a_targeted_change_reaches_its_node_only_and_a_fanout_every_node(
        tmp_path: Path) -> None:
    nodes, events = 100, 2
    result = await config_propagation.bench(nodes=nodes, hosts=2 * nodes, events=events,
                                              client_procs=1, idle=0.5, quiet=0.5,
                                              settle=0.0, say=lambda *_: None, directory=tmp_path,
                                              delivery=True)
    # (a) each edit reached its node (bench waits for it, or fails) and no other node
    assert result["targeted_unconcerned_applies"] == 0
    assert result["targeted_recomputes"] >= events
    # (b) every node applied every fan-out edit
    assert result["fanout_applies"] == nodes * events
    # (c) and to the receive-only watches that replaced the agents
    assert result["delivered_applies"] == nodes * events
    assert result["agent_apply_cpu_us"] > 0
