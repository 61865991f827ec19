"""A newcomer's first hour, scripted from the README so the README cannot drift: a clean
clone of the repository, the install (the README's venv variant of `pip install .`),
`nodeagent --version`, then the standalone quickstart exactly as written: the `nodeagent
certs` commands, the two YAML files, `--check`, the server and the agent, the curl
through the tunnel, and `nodeagent debug ...` as printed.

The quickstart runs in a network namespace of its own (its fixed ports 8443, 8080, 2222
are free there, and /etc/netns/NS/hosts points tunnel.example.com at its loopback) and a
mount namespace with its own /run/nodeagent (the default debug sockets the README's
`nodeagent debug` finds), so it touches nothing of the host's.

The clone is of the last commit (what a newcomer gets): commit a README change before
running this. The install needs no package index for the project's dependencies: the new venv sees
those of the project's own venv (a .pth file), and pip builds and installs the clone into
it as the README says; building needs setuptools, which pip fetches as for any install
(or finds in PIP_FIND_LINKS).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodeagent.testing.netns import Topology, topology

pytestmark = [pytest.mark.needs("root", "ip", "git", "curl", "nsenter", "unshare")]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = "hello from port 3000 on edge-1"


def blocks(markdown: str) -> list[tuple[str, str, str]]:
    """Fenced code blocks as (language, code dedented, the text since the previous block)."""
    found = []
    last = 0
    for match in re.finditer(r"^( *)```(\w+)\n(.*?)^\1```", markdown, re.M | re.S):
        found.append((match[2], textwrap.dedent(match[3]), markdown[last:match.start()]))
        last = match.end()
    return found


def section(readme: str, title: str) -> str:
    return readme.partition(f"\n## {title}\n")[2].partition("\n## ")[0]


def commands(code: str) -> list[str]:
    """Shell lines without comments (a ` #` outside quotes starts one in these blocks)."""
    out = []
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


@dataclass
class Namespaces:
    """A network namespace (with its hosts file) and a mount namespace (with its own
    /run/nodeagent) that every command of the quickstart runs in."""

    topo: Topology
    ns: str
    holder: subprocess.Popen[bytes]
    env: dict[str, str]
    cwd: Path
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, command: str) -> list[str]:
        # `cd` inside: a working directory carried into the namespaces (nsenter --wd) is
        # one of the outer mount namespace, and a rename there fails with EXDEV.
        return ["nsenter", "-t", str(self.holder.pid), "-m", "ip", "netns", "exec", self.ns,
                "sh", "-c", f"cd {shlex.quote(str(self.cwd))} && {command}"]

    def run(self, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command), cwd=self.cwd, env=self.env, text=True,
                              capture_output=True, timeout=timeout)

    def start(self, command: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(self.argv(command), cwd=self.cwd, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.background.append(proc)
        return proc


@pytest.fixture
def namespaces(tmp_path: Path) -> Iterator[Namespaces]:
    with topology() as topo:
        ns = topo.add("newcomer")
        hosts = Path("/etc/netns") / ns / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text("127.0.0.1 localhost tunnel.example.com grafana.example.com\n")
        holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             "mkdir -p /run/nodeagent && mount -t tmpfs -o mode=0755 tmpfs /run/nodeagent "
             "&& echo ready && exec sleep 3600"], stdout=subprocess.PIPE)
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        work = tmp_path / "quickstart"
        work.mkdir()
        spaces = Namespaces(topo, ns, holder, dict(os.environ), work)
        try:
            yield spaces
        finally:
            for proc in spaces.background:  # SIGTERM first: they clean up their sockets
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in spaces.background:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            holder.kill()
            holder.wait()
            hosts.unlink()
            hosts.parent.rmdir()


def _is_checkout() -> bool:
    if shutil.which("git") is None:
        return True  # the needs("git") marker skips it, naming the package
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"],
                          capture_output=True).returncode == 0


def install(tmp_path: Path, readme: str) -> dict[str, str]:
    """Clone the repository and install it as the README's Install section says (its
    venv variant: `pipx` is not part of this machine); returns the environment of a
    user whose venv is activated."""
    clone = tmp_path / "nodeagent"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True,
                   timeout=120)
    home = tmp_path / "home"
    shims = tmp_path / "shims"
    home.mkdir()
    shims.mkdir()
    # `python3` is the interpreter the project's venv was made with: its packages (seen
    # through the .pth below) were built for it.
    (shims / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join([str(shims), *(d for d in os.environ["PATH"].split(os.pathsep)
                                          if d and d != venv_bin)])
    env = {**os.environ, "HOME": str(home), "PATH": path, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)

    install_section = section(readme, "Install")
    venv_line = next(line for _, code, _ in blocks(install_section)
                     for line in commands(code) if "-m venv" in line)
    venv_dir = Path(re.search(r"-m venv (\S+)", venv_line)[1].replace("~", str(home)))  # type: ignore[index]
    subprocess.run(["python3", "-m", "venv", str(venv_dir)], env=env, check=True, timeout=120)
    purelib = venv_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages"
    (purelib / "_project_dependencies.pth").write_text(site.getsitepackages()[0] + "\n")
    done = subprocess.run(["sh", "-c", venv_line], cwd=clone, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, f"{venv_line}:\n{done.stdout}{done.stderr}"
    env["PATH"] = f"{venv_dir / 'bin'}{os.pathsep}{env['PATH']}"  # `source .../activate`
    return env


@pytest.mark.skipif(not _is_checkout(), reason="needs a git checkout of nodeagent to clone")
def test_from_a_clean_clone_to_traffic_as_the_readme_says(tmp_path: Path,
                                                         namespaces: Namespaces) -> None:
    readme = (ROOT / "README.md").read_text()
    env = install(tmp_path, readme)
    namespaces.env = env

    # The install section's own check.
    first = commands(blocks(section(readme, "Install"))[0][1])
    assert "nodeagent --version" in first, first
    version = subprocess.run(["nodeagent", "--version"], env=env, text=True,
                             capture_output=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("nodeagent "), version
    installed = subprocess.run(
        ["python", "-c", "import nodeagent; print(nodeagent.__file__)"], env=env,
        cwd=namespaces.cwd, capture_output=True, text=True, timeout=60).stdout
    assert installed.startswith(str(tmp_path / "home")), installed  # the clone, installed

    quickstart = blocks(section(readme, "Standalone quickstart"))
    languages = [language for language, _, _ in quickstart]
    assert languages == ["sh", "yaml", "yaml", "sh"], languages
    (_, certs, _), (_, server_yaml, before_server), (_, agent_yaml, before_agent), \
        (_, run, _) = quickstart

    # 1. Certificates and the token.
    for command in commands(certs):
        assert command.startswith("nodeagent certs "), command
        done = namespaces.run(command)
        assert done.returncode == 0, f"{command}: {done.stderr}"
    # 2-3. The files, named as the text before each block names them.
    for code, before in ((server_yaml, before_server), (agent_yaml, before_agent)):
        name = re.findall(r"`(\w+\.yaml)`", before)[-1]
        (namespaces.cwd / name).write_text(code)
    # The sample service the routes name (127.0.0.1:3000 on the node).
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "index.html").write_text(SAMPLE + "\n")
    namespaces.start(f"{shlex.quote(sys.executable)} -m http.server 3000 --bind 127.0.0.1 "
                     f"--directory {shlex.quote(str(tmp_path / 'www'))}",
                     tmp_path / "sample.log")

    # 4. Run them, and look.
    results: dict[str, str] = {}
    for command in commands(run):
        if command.endswith("--check"):
            done = namespaces.run(command)
            assert done.returncode == 0 and "valid." in done.stdout, done
        elif command.startswith(("nodeagent server", "nodeagent agent")):
            namespaces.start(command, tmp_path / f"{command.split()[1]}.log")
        elif command.startswith("curl "):
            for _ in range(100):  # the agent connects within a second or two
                done = namespaces.run(f"{command} --silent --max-time 5")
                if SAMPLE in done.stdout:
                    break
                time.sleep(0.2)
            assert SAMPLE in done.stdout, (done, logs(tmp_path))
        elif "--watch" in command:
            continue  # redraws until Ctrl-C: the same view as without it
        else:
            done = namespaces.run(command)
            assert done.returncode == 0, f"{command}: {done.stderr}\n{logs(tmp_path)}"
            results[command] = done.stdout
    assert "edge-1" in results["nodeagent debug status"], results
    assert "open" in results["nodeagent debug tunnels"], results
    as_json = next(out for command, out in results.items() if command.endswith("--json"))
    rows = json.loads(as_json)["tunnels"]
    assert [(row["node"], row["state"]) for row in rows] == [("edge-1", "open")], as_json
    for name in ("server", "agent"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}"
                     for p in sorted(tmp_path.glob("*.log")))
