"""Active health checks (docs/health-checks.md): what to check (`HealthCheck`, a field of
HTTP routes, TCP mappings and Ingress rules), the wire contract between the server and an
agent, and the pure threshold logic the agent runs.

The agent checks its node's backends itself, next to them, never across the tunnel: the
server opens one stream per agent with metadata purpose `health`, sends one JSON line
`{"checks": [{"host", "port", "check"}]}` (again whenever its routes change), and the
agent answers a JSON line `{"host", "port", "state", "detail"}` for each target when its
state changes. The server balances only to backends not `unhealthy`.

An agent that predates this refuses the stream (its allow list has no such target): the
server then has no states for that node, which is how it behaved before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from nodeagent.config.base import Model

HEALTH_PURPOSE = "health"
HEALTH_TARGET_HOST = "nodeagent.health"  # never a DNS name the allow list can hold
MAX_LINE = 256 * 1024  # a request for many targets; reports are ~100 bytes

State = Literal["unknown", "healthy", "unhealthy"]


class HealthCheck(Model):
    """How an agent checks a backend: `tcp` (a connection opens) or `http` (a GET of
    `path` answers 2xx or 3xx), every `interval` seconds, each attempt within `timeout`;
    `healthy_threshold` successes in a row make it healthy, `unhealthy_threshold`
    failures in a row unhealthy (the server then stops sending to it)."""

    kind: Literal["tcp", "http"] = "tcp"
    path: str = "/healthz"
    interval: float = Field(default=5.0, ge=0.5, le=3600)
    timeout: float = Field(default=2.0, gt=0, le=300)
    healthy_threshold: int = Field(default=2, ge=1, le=100)
    unhealthy_threshold: int = Field(default=3, ge=1, le=100)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or any(c in v for c in " \r\n\t") or len(v) > 1024:
            raise ValueError(f"health check path {v[:40]!r} must start with / and hold no "
                             f"spaces or line breaks")
        return v


class CheckedTarget(Model):
    host: str = Field(max_length=255)
    port: int = Field(ge=1, le=65535)
    check: HealthCheck


class CheckRequest(Model):
    """The server → agent line: every target the server wants checked on this node."""

    checks: tuple[CheckedTarget, ...] = Field(default=(), max_length=1024)

    def line(self) -> bytes:
        return self.model_dump_json().encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> CheckRequest:
        """Raises ValueError for a line that is not a request."""
        try:
            return cls.model_validate_json(line)
        except ValidationError as exc:
            raise ValueError(f"bad health check request: {exc.error_count()} errors") from None


class HealthReport(Model):
    """The agent → server line: one target's state now."""

    host: str = Field(max_length=255)
    port: int = Field(ge=1, le=65535)
    state: State
    detail: str = Field(default="", max_length=300)

    def line(self) -> bytes:
        return self.model_dump_json().encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> HealthReport:
        try:
            return cls.model_validate_json(line)
        except ValidationError as exc:
            raise ValueError(f"bad health report: {exc.error_count()} errors") from None


@dataclass(slots=True)
class Thresholds:
    """One target's state from its check results (pure): `unknown` until a threshold is
    first met, then flips only after that many results in a row the other way."""

    healthy_threshold: int
    unhealthy_threshold: int
    state: State = "unknown"
    successes: int = 0
    failures: int = 0

    def observe(self, ok: bool) -> bool:
        """Count one result; True when the state changed."""
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.state != "healthy" and self.successes >= self.healthy_threshold:
                self.state = "healthy"
                return True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.state != "unhealthy" and self.failures >= self.unhealthy_threshold:
                self.state = "unhealthy"
                return True
        return False
