"""requirements.lock, what the image installs: it pins every runtime dependency of
pyproject.toml with hashes, and names no package index (the builder's pip config does).
Refresh: `python -m scripts.image lock` (docs/image.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from scripts import ROOT


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def pins() -> dict[str, list[str]]:
    """name -> its hashes, from the lock."""
    text = (ROOT / "requirements.lock").read_text()
    found: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=\S)", text):
        match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if match:
            found[_name(match.group(1))] = re.findall(r"--hash=sha256:([0-9a-f]{64})", block)
    return found


def test_every_runtime_dependency_is_pinned_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = pins()
    missing = [d for d in project["dependencies"] if _name(d) not in locked]
    assert not missing, f"not in requirements.lock (run python -m scripts.image lock): {missing}"
    unhashed = [name for name, hashes in locked.items() if not hashes]
    assert not unhashed


def test_the_lock_names_no_index_or_local_path() -> None:
    text = (ROOT / "requirements.lock").read_text()
    assert not re.search(r"^\s*--(index-url|extra-index-url|find-links|trusted-host)", text,
                         re.M)
    assert "file://" not in text and "/opt/" not in text


def test_the_image_script_runs_without_podman() -> None:
    """Its help (and import) needs neither podman nor root: the default suite stays free
    of a container engine; the build itself is the slow tests/e2e/test_image.py."""
    proc = subprocess.run([sys.executable, "-m", "scripts.image", "--help"], cwd=ROOT,
                          capture_output=True, text=True, env={"PATH": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    assert "build" in proc.stdout and "smoke" in proc.stdout
