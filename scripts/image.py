"""Build the container image on this host and smoke-test it: `python -m scripts.image CMD`.

    .venv/bin/python -m scripts.image build    # base (cached), wheels, `podman build`
    .venv/bin/python -m scripts.image smoke    # server + agent from the image, real traffic
    .venv/bin/python -m scripts.image lock     # refresh requirements.lock (needs pip-tools)

Builds here run with no base image to pull and no package index reachable from inside a
build, so:

- **base**: a Debian root filesystem made with `debootstrap` (python3, its venv module
  and the agent's netfilter tools included), cached as a tarball under
  /var/cache/nodeagent-image/ (reruns skip it), imported with `podman import` as
  `localhost/nodeagent-base:SUITE`. `--base IMAGE` uses any other base instead (the
  Containerfile's default is the official Python slim image).
- **wheels**: built on the host from requirements.lock (pinned, hash-checked) plus
  nodeagent's own wheel, into build/wheels/, handed to the build as the `wheels` build
  context. The host's Python must be the base's minor version (3.11 for bookworm).
- **podman**: Debian's podman with `--runtime runc` and bounded ulimits (what works on
  these machines; `--podman-args` replaces them).

`smoke` runs the server and an agent as two containers on the host network: the server
as the image's non-root user, the agent as root with NET_ADMIN (its socket mark), certs
and configs mounted from a temporary directory. It passes bytes from a public TCP port
through the server, the tunnel and the agent to an echo service on the host, checks them,
and prints the image's size. docs/image.md describes all of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from scripts import ROOT

DEFAULT_TAG = "localhost/nodeagent:0.1.0"
DEFAULT_SUITE = "bookworm"
CACHE = Path(os.environ.get("NODEAGENT_IMAGE_CACHE", "/var/cache/nodeagent-image"))
WHEELS = ROOT / "build" / "wheels"
LOCK = ROOT / "requirements.lock"
# What the base needs: Python with venv (the Containerfile installs into one), the
# agent's netfilter tools, CA certificates, and useradd (passwd, in minbase already).
BASE_PACKAGES = ("python3", "python3-venv", "nftables", "iptables", "ipset", "iproute2",
                 "ca-certificates")
# The machines here need runc (crun refuses their hybrid cgroup setup) and ulimits below the
# host's hard limits.
PODMAN_ARGS = ("--runtime", "runc")
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


class ImageError(Exception):
    """A step failed; the message says which and what to do."""


def run(cmd: Sequence[str], *, quiet: bool = False, **kwargs: Any
        ) -> subprocess.CompletedProcess[str]:
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(list(cmd), text=True, capture_output=quiet, **kwargs)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:] if quiet else []
        raise ImageError(f"{cmd[0]} failed (exit {proc.returncode})"
                         + (": " + " | ".join(tail) if tail else ""))
    return proc


def podman(*args: str, podman_args: Sequence[str] = PODMAN_ARGS, quiet: bool = False,
           **kwargs: Any) -> subprocess.CompletedProcess[str]:
    if shutil.which("podman") is None:
        raise ImageError("podman is not installed (Debian: apt-get install podman runc)")
    return run(["podman", *podman_args, *args], quiet=quiet, **kwargs)


# ---------------------------------------------------------------- base


def base_tarball(suite: str) -> Path:
    """The cached root filesystem for `suite`, named by what it contains."""
    key = hashlib.sha256(" ".join((suite, *BASE_PACKAGES)).encode()).hexdigest()[:12]
    return CACHE / f"debian-{suite}-{key}.tar"


def build_base(suite: str = DEFAULT_SUITE, *, mirror: str | None = None,
               refresh: bool = False, podman_args: Sequence[str] = PODMAN_ARGS) -> str:
    """`localhost/nodeagent-base:SUITE`, from the cache or made now; returns its name."""
    name = f"localhost/nodeagent-base:{suite}"
    tarball = base_tarball(suite)
    if refresh or not tarball.exists():
        if shutil.which("debootstrap") is None:
            raise ImageError("debootstrap is not installed (Debian: apt-get install "
                             "debootstrap), or pass --base IMAGE")
        if os.geteuid() != 0:
            raise ImageError("debootstrap needs root")
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            rootfs = Path(tmp) / "rootfs"
            cmd = ["debootstrap", "--variant=minbase",
                   f"--include={','.join(BASE_PACKAGES)}", suite, str(rootfs)]
            run([*cmd, mirror] if mirror else cmd, quiet=True)
            # What an image does not need: package lists, caches, docs (as slim images).
            for junk in ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc",
                         "usr/share/man", "usr/share/info", "var/log"):
                shutil.rmtree(rootfs / junk, ignore_errors=True)
                (rootfs / junk).mkdir(parents=True, exist_ok=True)
            partial = tarball.with_suffix(".partial")
            run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."])
            partial.rename(tarball)
        refresh = True
    exists = subprocess.run(["podman", *podman_args, "image", "exists", name]).returncode == 0
    if refresh or not exists:
        podman("import", "--change", "CMD=/bin/bash", str(tarball), name,
               podman_args=podman_args, quiet=True)
    return name


# ---------------------------------------------------------------- wheels


def build_wheels(out: Path = WHEELS) -> list[Path]:
    """The lock's wheels (hash-checked) and nodeagent's own, in `out` (emptied first)."""
    if sys.version_info[:2] != (3, 11):
        raise ImageError(f"wheels must be built with Python 3.11 (the base's); this is "
                         f"{sys.version_info.major}.{sys.version_info.minor}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
           "--wheel-dir", str(out)]
    run([*pip, "--require-hashes", "-r", str(LOCK)])
    run([*pip, "--no-deps", str(ROOT)])
    return sorted(out.glob("*.whl"))


# ---------------------------------------------------------------- build


def build_image(tag: str = DEFAULT_TAG, *, base: str | None = None, suite: str = DEFAULT_SUITE,
                podman_args: Sequence[str] = PODMAN_ARGS) -> dict[str, Any]:
    started = time.monotonic()
    base_image = base or build_base(suite, podman_args=podman_args)
    base_seconds = time.monotonic() - started
    wheels = build_wheels()
    podman("build", *ULIMITS, "--build-arg", f"BASE={base_image}",
           "--build-context", f"wheels={WHEELS}", "-t", tag, "-f",
           str(ROOT / "Containerfile"), str(ROOT), podman_args=podman_args,
           stdout=sys.stderr)  # the build's progress; stdout keeps the one-line result
    return {"tag": tag, "base": base_image, "wheels": len(wheels),
            "seconds": round(time.monotonic() - started, 1),
            "base_seconds": round(base_seconds, 1),
            "size_bytes": image_size(tag, podman_args)}


def image_size(tag: str, podman_args: Sequence[str] = PODMAN_ARGS) -> int:
    out = podman("image", "inspect", "--format", "{{.Size}}", tag, podman_args=podman_args,
                 quiet=True).stdout
    return int(out.strip())


# ---------------------------------------------------------------- smoke


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def _echo_service() -> Iterator[int]:
    """An echo service on the host's loopback: the agent's node-local target."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return

            def echo(c: socket.socket) -> None:
                with c:
                    while data := c.recv(65536):
                        c.sendall(data)

            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def _through(port: int, payload: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


def smoke(tag: str = DEFAULT_TAG, *, podman_args: Sequence[str] = PODMAN_ARGS,
          timeout: float = 60.0) -> dict[str, Any]:
    """Run a server and an agent from `tag`, pass traffic, return what was seen."""
    from nodeagent.trust import pki  # the host's venv makes the lab's certificates

    token = os.urandom(16).hex()
    names = {role: f"nodeagent-smoke-{role}-{os.getpid()}" for role in ("server", "agent")}
    with tempfile.TemporaryDirectory(prefix="nodeagent-smoke-") as tmpdir, \
            _echo_service() as echo_port:
        tmp = Path(tmpdir)
        tmp.chmod(0o755)  # the server container runs as uid 65532
        ca = pki.create_ca("nodeagent image smoke test")
        ca.write(tmp / "ca.crt", tmp / "ca.key")
        pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"]).write(
            tmp / "server.crt", tmp / "server.key")
        (tmp / "server.key").chmod(0o644)  # a throwaway key, readable by the server's user
        tunnel_port, public_port = _free_port(), _free_port()
        server_cfg = {
            "tunnel": f"wss://127.0.0.1:{tunnel_port}/tunnel",
            "tls": {"cert_file": "/lab/server.crt", "key_file": "/lab/server.key"},
            "tokens": [{"node": "smoke-node", "token": token}],
            "tcp": [{"name": "echo", "listen": f"127.0.0.1:{public_port}",
                     "node": "smoke-node", "target": f"127.0.0.1:{echo_port}"}],
            "debug_socket": "/tmp/server.sock",
        }
        agent_cfg = {
            "node": "smoke-node", "server": f"wss://127.0.0.1:{tunnel_port}/tunnel",
            "token": token, "tls": {"ca_file": "/lab/ca.crt"},
            "allow": [f"127.0.0.1:{echo_port}"], "debug_socket": "/tmp/agent.sock",
            "reconnect": {"initial": 0.2, "maximum": 1},
        }
        for role, cfg in (("server", server_cfg), ("agent", agent_cfg)):
            (tmp / f"{role}.yaml").write_text(yaml.safe_dump(cfg))
        common = ["run", "--detach", "--rm", "--network", "host", *ULIMITS,
                  "-v", f"{tmp}:/lab:ro"]
        try:
            podman(*common, "--name", names["server"], tag, "server", "--config",
                   "/lab/server.yaml", podman_args=podman_args, quiet=True)
            podman(*common, "--name", names["agent"], "--user", "0",
                   "--cap-drop", "all", "--cap-add", "NET_ADMIN", tag, "agent",
                   "--config", "/lab/agent.yaml", podman_args=podman_args, quiet=True)
            payload = os.urandom(256 * 1024)
            deadline = time.monotonic() + timeout
            echoed = b""
            while True:
                try:
                    echoed = _through(public_port, payload)
                except OSError:
                    echoed = b""
                if echoed == payload or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            status = json.loads(podman(
                "exec", names["agent"], "nodeagent", "debug", "status", "--socket",
                "/tmp/agent.sock", "--json", podman_args=podman_args, quiet=True).stdout)
            if echoed != payload:
                raise ImageError(f"no traffic through the image's server and agent in "
                                 f"{timeout:g}s; agent tunnel: {status.get('tunnel')}\n"
                                 + _logs(names, podman_args))
            return {"tag": tag, "bytes_echoed": len(echoed),
                    "agent_tunnel": status["tunnel"]["state"],
                    "agent_version": status["version"],
                    "size_bytes": image_size(tag, podman_args)}
        finally:
            for name in names.values():
                subprocess.run(["podman", *podman_args, "rm", "--force", "--time", "2", name],
                               capture_output=True)


def _logs(names: dict[str, str], podman_args: Sequence[str]) -> str:
    out = []
    for role, name in names.items():
        proc = subprocess.run(["podman", *podman_args, "logs", name], capture_output=True,
                              text=True)
        out.append(f"--- {role} ---\n{proc.stdout}{proc.stderr}")
    return "\n".join(out)


# ---------------------------------------------------------------- lock


def refresh_lock() -> None:
    """requirements.lock from pyproject.toml's dependencies, with every file's hash."""
    if shutil.which("pip-compile") is None:
        raise ImageError("pip-compile is not installed: `pip install pip-tools` (in any "
                         "Python 3.11 environment), then run this again")
    run(["pip-compile", "--quiet", "--generate-hashes", "--strip-extras",
         "--no-emit-index-url", "--no-emit-find-links", "--upgrade",
         "--output-file", str(LOCK), str(ROOT / "pyproject.toml")], cwd=ROOT)


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.image",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("base", "make (or reuse) the debootstrap base image"),
                       ("build", "build the image (base, wheels, podman build)"),
                       ("smoke", "run server and agent from the image, pass traffic"),
                       ("lock", "refresh requirements.lock with pip-compile")):
        cmd = sub.add_parser(name, help=text)
        if name in ("build", "smoke"):
            cmd.add_argument("--tag", default=DEFAULT_TAG)
        if name in ("base", "build"):
            cmd.add_argument("--suite", default=DEFAULT_SUITE)
        if name == "base":
            cmd.add_argument("--mirror", help="Debian mirror URL (debootstrap's default)")
            cmd.add_argument("--refresh", action="store_true", help="rebuild the cache")
        if name == "build":
            cmd.add_argument("--base", help="base image instead of the debootstrap one")
        if name != "lock":
            cmd.add_argument("--podman-args", default=shlex.join(PODMAN_ARGS),
                             help="global podman flags (default: %(default)s)")
    args = parser.parse_args(argv)
    podman_args = tuple(shlex.split(getattr(args, "podman_args", "")))
    try:
        if args.command == "base":
            started = time.monotonic()
            name = build_base(args.suite, mirror=args.mirror, refresh=args.refresh,
                              podman_args=podman_args)
            print(f"base {name} ({base_tarball(args.suite)}) in "
                  f"{time.monotonic() - started:.1f}s")
        elif args.command == "build":
            built = build_image(args.tag, base=args.base, suite=args.suite,
                                podman_args=podman_args)
            print(f"image {built['tag']}: {mib(built['size_bytes'])} "
                  f"({built['size_bytes']} bytes), built in {built['seconds']}s "
                  f"(base {built['base']}: {built['base_seconds']}s; "
                  f"{built['wheels']} wheels)")
        elif args.command == "smoke":
            seen = smoke(args.tag, podman_args=podman_args)
            print(f"smoke {seen['tag']}: {seen['bytes_echoed']} bytes through server and "
                  f"agent containers (agent {seen['agent_version']}, tunnel "
                  f"{seen['agent_tunnel']}); image {mib(seen['size_bytes'])}")
        else:
            refresh_lock()
            print(f"wrote {LOCK.relative_to(ROOT)}")
    except ImageError as exc:
        print(f"scripts.image {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
