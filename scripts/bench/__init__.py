"""The benchmarks, one module each, run from the repository root:

    sudo .venv/bin/python -m scripts.bench.tunnel --quick    # the tunnel against ssh -R
    .venv/bin/python -m scripts.bench                        # lists every benchmark

Each module's docstring says what it measures, how to run it (as root where it needs
network namespaces, netfilter or SO_MARK) and what it prints; docs/performance.md has
today's figures and the command behind each. Shared helpers (the load tools, the C load
generator, the simulated config-stream agents) are in `scripts.bench.lib`.
"""
