"""The developer scripts: benchmarks (`scripts.bench`), the cluster demo and the CRD
generator. Each is a module run from the repository root with the checkout's virtualenv,
e.g. `.venv/bin/python -m scripts.bench.tunnel`, so imports need no path edits."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: where the benchmarks write `bench-results/` and find `manifests/`."""
