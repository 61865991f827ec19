"""The test harness as a package, like `trio.testing`: what tests, benchmarks and demos
import to run nodeagent against real processes and a fake cluster.

- `fakekube`: a fake Kubernetes API server speaking the real list/watch protocol.
- `procs`: nodeagent roles as real subprocesses, with their logs and clean stops.
- `netns`: network namespaces joined by veth pairs (needs root).
- `memtls`: two TLS ends in memory, handshake done (no socket).

Nothing in the roles imports this package (an import-linter contract checks it).
"""
