"""What the benchmarks share: the load tools and the C load generator (tools.py,
benchtool.c), the in-process tunnel pair (loopback.py), the simulated config-stream agents
(config_clients.py)."""
