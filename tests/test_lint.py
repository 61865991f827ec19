"""The code stays lint-clean and type-checked (strict mypy on the packages): the same
checks a reviewer would run, so a regression fails the suite, not just a style note."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_finds_nothing() -> None:
    result = _run("mypy", "--no-error-summary")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold() -> None:
    """The layering in pyproject.toml's [tool.importlinter]: tunnel and netfilter never
    import nodeagent, the protocol core does no I/O, roles do not import each other."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
