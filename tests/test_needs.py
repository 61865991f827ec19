"""The suite's own rules (tests/conftest.py, tests/needs.py): a test that needs a missing
tool is skipped naming its Debian package and counted in the summary; a test that leaks
fails itself, not the tests after it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import needs

REPO = Path(__file__).resolve().parents[1]


def pytest_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_a_missing_tool_names_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert needs.unmet(["nft"]) == (
        "nftables not installed",
        "needs `nft` (Debian package nftables), which is not installed; "
        "install it with the system's package manager")
    (tmp_path / "nft").write_text("#!/bin/sh\n")
    (tmp_path / "nft").chmod(0o755)
    assert needs.unmet(["nft"]) is None
    assert needs.unmet(["nft", "ipset"])[0] == "ipset not installed"  # type: ignore[index]
    assert "nftables" not in needs.missing_packages()
    assert {"iproute2", "iptables", "ipset", "openssh-server", "sshuttle", "wrk"} <= set(
        needs.missing_packages())


def test_root_comes_first_and_unknown_needs_are_a_mistake(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    group, reason = needs.unmet(["nft", "root"])  # type: ignore[misc]
    assert group == "not root" and "run scripts/test as root" in reason
    with pytest.raises(ValueError, match="frobnicate"):
        needs.unmet(["frobnicate"])


def test_the_script_lists_missing_packages_for_scripts_test(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "tests/needs.py", "--missing-packages"], cwd=REPO,
                         capture_output=True, text=True, env={"PATH": str(tmp_path)},
                         check=True).stdout.split()
    assert out == list(dict.fromkeys(needs.TOOLS.values()))


def test_slow_tools_are_installed_only_for_a_slow_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "podman" not in needs.missing_packages()
    assert {"podman", "runc", "debootstrap"} <= set(needs.missing_packages(slow=True))
    assert needs.unmet(["podman"]) == (
        "podman not installed",
        "needs `podman` (Debian package podman), which is not installed; "
        "install it with the system's package manager")
    out = subprocess.run([sys.executable, "tests/needs.py", "--missing-packages", "--slow"],
                         cwd=REPO, capture_output=True, text=True,
                         env={"PATH": str(tmp_path)}, check=True).stdout.split()
    assert out[-3:] == ["podman", "runc", "debootstrap"]


def test_tests_needing_missing_tools_are_skipped_and_summed_up(tmp_path: Path) -> None:
    """The netfilter tests on a machine without `ip` and `nft` (PATH holds nothing)."""
    result = pytest_run("-q", "tests/netfilter/test_detect.py", env={"PATH": str(tmp_path)})
    assert result.returncode == 0, result.stdout
    assert "4 skipped" in result.stdout
    if os.geteuid() == 0:
        assert "SKIPPED [4] tests/conftest.py" in result.stdout
        assert "needs `ip` (Debian package iproute2)" in result.stdout
        assert "skipped 4 tests this machine cannot run: 4 iproute2 not installed" in (
            result.stdout)
    else:
        assert "needs root" in result.stdout
        assert "skipped 4 tests this machine cannot run: 4 not root" in result.stdout


LEAKY = '''
import gc
import socket
import subprocess
import sys

import pytest


class Holder:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the garbage collector frees it
        self.sock = socket.socket()


def test_fails_and_leaks_a_socket() -> None:
    holder = Holder()
    assert holder is None


def test_leaves_a_process_running() -> None:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.filterwarnings("error")
def test_unrelated_and_strict_about_warnings() -> None:
    gc.collect()
'''


def test_a_leaking_test_fails_itself_not_the_next_one(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY))
    args = ["-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_leaky.py")]
    # Without the guard the unrelated test pays for the leak (the failure the issue saw).
    bare = pytest_run(*args)
    assert "FAILED" in bare.stdout and "test_unrelated_and_strict_about_warnings" in bare.stdout
    # With it, each leak fails the test that made it, and the unrelated test passes.
    guarded = pytest_run("-p", "tests.conftest", "-rA", *args)
    out = guarded.stdout
    assert re.search(r"^PASSED \S*test_leaky.py::test_unrelated_and_strict_about_warnings$",
                     out, re.M), out
    assert "ERROR at teardown of test_fails_and_leaks_a_socket" in out
    assert "unclosed <socket.socket" in out
    assert "ERROR at teardown of test_leaves_a_process_running" in out
    assert "still running:" in out and "time.sleep(60)" in out
    # The process test's body passed; its teardown is the error.
    assert "1 failed, 2 passed, 2 errors" in out
