"""What every part of the config model is built from: the strict pydantic base `Model`,
addresses (`HostPort`, `ListenAddress`, `PortRange`, CIDRs), node names, timing
(`Keepalive`, `Reconnect`), and loading: `parse_config` / `load_config` turn a document
into a model or one `ConfigError` naming the file and every bad field; `redacted` is what
config dumps show."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from tunnel.backoff import (
    DEFAULT_INITIAL,
    DEFAULT_MAXIMUM,
    DEFAULT_RETRY_AFTER_JITTER,
    DEFAULT_UNREACHABLE_MAXIMUM,
)
from tunnel.proxy import parse_proxy_url
from tunnel.urls import parse_endpoint

# Anchored with \Z, not $: `$` also matches before a final newline, so `re.match` would
# take "edge-1\n". Use `fullmatch`; the \Z keeps a caller's `match` safe too.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


DNS_NAME = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")


def valid_node_name(name: str) -> bool:
    """A Kubernetes node name: a DNS-1123 subdomain (lower case, at most 253 characters).
    Node names become dict keys, metric labels and log fields: nothing else gets in."""
    return DNS_NAME.fullmatch(name) is not None


DEFAULT_AGENT_SOCKET = "/run/nodeagent/agent.sock"


DEFAULT_SERVER_SOCKET = "/run/nodeagent/server.sock"


# SO_MARK of the agent's own sockets; its netfilter rules skip this mark. Bit 20: clear
# of kube-proxy's 0x4000/0x8000 masquerade/drop bits.
DEFAULT_SOCKET_MARK = 0x100000


M = TypeVar("M", bound="BaseModel")


class ConfigError(Exception):
    """Invalid configuration; the message names the source, the field and the problem
    (one line each when there are several)."""


class StartupFailed(Exception):
    """A valid config this host cannot honour (a port in use, a missing capability): the
    message is one line naming the setting and saying what to do, which the CLI prints
    instead of a traceback (exit code 3)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.detail = message


class ConfigProblems:
    """Runs independent checks of one config and raises their ConfigErrors together, so a
    file with a missing certificate and a missing token file says both at once.

        problems = ConfigProblems()
        with problems.check():
            context = load_tls(config)
        problems.raise_any()
    """

    def __init__(self) -> None:
        self.errors: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as exc:
            self.errors.append(str(exc))

    def raise_any(self) -> None:
        if self.errors:
            raise ConfigError("\n".join(self.errors))


class Model(BaseModel):
    # defer_build: a model's validator and serializer (pydantic-core, outside Python's
    # heap) are built when it is first used, not at import: a role builds only the models
    # it reads, and a model used only inside another is never built on its own.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              defer_build=True)


# ------------------------------------------------------------------ small types


def _relative_to_file(value: Path, info: ValidationInfo) -> Path:
    # A config file's relative paths name files beside it (as nginx, frp and systemd
    # units do), so `--check` or the service runs the same from any directory. A document
    # that is not a file (flags, the controller's config) has no base: paths stay as given.
    base = info.context.get("base_dir") if isinstance(info.context, dict) else None
    if base is None or value.is_absolute() or str(value) == "":
        return value
    return Path(base) / value


# A path in a config document: relative to the file it is written in.
ConfigPath = Annotated[Path, AfterValidator(_relative_to_file)]


def _cidr_as_text(value: Any) -> Any:
    # pydantic would read a bare number as an address (5 → 0.0.0.5/32): in a config
    # file that is always a mistake, so a CIDR must be written as text.
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a CIDR; write it as text, e.g. 10.0.0.0/8")
    # Checked here so a bad one is one line: the union below would report a line per
    # member, in pydantic's words ("lax-or-strict[...]: Input is not a valid IPv4 network").
    try:
        return ipaddress.ip_network(value)
    except ValueError:
        pass
    try:
        within = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not a CIDR (e.g. 10.0.0.0/8, fd00::/64)") from None
    raise ValueError(f"{value!r} has host bits set; the network is {within}")


Cidr = Annotated[ipaddress.IPv4Network | ipaddress.IPv6Network, BeforeValidator(_cidr_as_text)]


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


# A transport protocol, lower-case inside; `TCP` and `UDP` (Kubernetes' spelling, as in
# a Service's ports) are accepted too, so the CRD schema lists both spellings.
TransportProtocol = Annotated[
    Literal["tcp", "udp"], BeforeValidator(_lower),
    WithJsonSchema({"type": "string", "enum": ["tcp", "udp", "TCP", "UDP"]})]


def _split_host_port(text: str) -> tuple[str, str]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected [ipv6]:port")
        return host, rest[1:]
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: expected host:port")
    return host, port


def _parse_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"port {text!r} out of range 1-65535")
    return int(text)


# A node's config names the same few hosts in many rules, and every config line is parsed
# whole: this address parse was a visible share of a simulated agent's CPU per config
# (`python -m scripts.bench.config_propagation`, profiled). Failures raise, so they are
# not cached. The controller checks every node's addresses at a fan-out: more entries
# than nodes, or an LRU cycling through 5,000 addresses misses every time.
@functools.lru_cache(maxsize=1 << 14)
def _check_host(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not DNS_NAME.fullmatch(host.lower()):
        raise ValueError(f"{host!r} is neither an IP address nor a DNS name")
    return host.lower()


def _refuse_bare_port(value: Any, example: str) -> None:
    # `metrics_listen: 9100` would otherwise be told it "should be a mapping": the text
    # form is what a file means.
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(f"{value!r} is a number; write host:port as text, e.g. "
                         f"'{example.format(value)}'")


class HostPort(Model):
    """`host:port`, `[v6]:port`; parsed from that string form."""

    host: str
    port: int

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            host, port = _split_host_port(value)
            return {"host": host, "port": _parse_port(port)}
        _refuse_bare_port(value, "127.0.0.1:{}")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 < v < 65536:
            raise ValueError(f"port {v} out of range 1-65535")
        return v

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class ListenAddress(HostPort):
    """Like HostPort but also accepts `:port` for all addresses, and port 0 (tests)."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.startswith(":"):
                value = "0.0.0.0" + value
            host, port = _split_host_port(value)
            if not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"port {port!r} out of range 0-65535")
            return {"host": host, "port": int(port)}
        _refuse_bare_port(value, ":{}")
        return value

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v < 65536:
            raise ValueError(f"port {v} out of range 0-65535")
        return v


class PortRange(Model):
    first: int
    last: int

    # One wrap validator, not a `before` and an `after` one: a range already built (the
    # controller builds every node's config from validated rules) passes through with
    # one Python call instead of two; pydantic runs a model's validators again on an
    # instance given to a field, and a fan-out builds 5,000 configs.
    @model_validator(mode="wrap")
    @classmethod
    def _checked(cls, value: Any, handler: ModelWrapValidatorHandler[PortRange]
                 ) -> PortRange:
        if isinstance(value, PortRange):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"first": value, "last": value}
        elif isinstance(value, str):
            a, _, b = value.partition("-")
            first = _parse_port(a.strip())
            value = {"first": first, "last": _parse_port(b.strip()) if b else first}
        self = handler(value)
        for v in (self.first, self.last):
            if not 0 < v < 65536:
                raise ValueError(f"port {v} out of range 1-65535")
        if self.first > self.last:
            raise ValueError(f"port range {self.first}-{self.last} is reversed")
        return self

    def contains(self, port: int) -> bool:
        return self.first <= port <= self.last


MIN_TOKEN_LENGTH = 16
_BOM = "\ufeff"


def token_text(raw: str) -> str:
    """A token as written (inline or in a file) to the token compared: the same rule for
    both, on the agent and the server. Surrounding whitespace goes (a file's final newline,
    a pasted space), and so does a leading UTF-8 byte-order mark: editors (Notepad) add
    one invisibly, and kept it would make the token silently never match a copy written
    without it. What remains must be printable ASCII (it travels in an HTTP header on
    wss://) of at least 16 characters; ValueError says what is wrong otherwise, never
    what the token is."""
    value = raw.removeprefix(_BOM).strip()
    if len(value) < MIN_TOKEN_LENGTH:
        raise ValueError(f"token is shorter than {MIN_TOKEN_LENGTH} characters")
    bad = next((c for c in value if not " " < c < "\x7f"), None)
    if bad is not None:
        raise ValueError(f"token holds a character that is not printable ASCII "
                         f"(U+{ord(bad):04X}); write it as letters, digits and punctuation")
    return value


def _inline_token(value: Any) -> Any:
    return token_text(value) if isinstance(value, str) else value


# An inline `token:`: read by the same rule as a token file.
InlineToken = Annotated[str, BeforeValidator(_inline_token)]


def _read_secret(path: Path) -> str:
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a token is printable ASCII") from None
    try:
        return token_text(raw)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


class Keepalive(Model):
    interval: float = Field(default=15.0, gt=0, le=3600)  # seconds between PINGs
    # No answer (and no byte, nor the peer's TCP acknowledging ours) for this long: the
    # tunnel is dead.
    timeout: float = Field(default=10.0, gt=0, le=3600)


class Reconnect(Model):
    """The agent's reconnect delays (tunnel/backoff.py: ReconnectPolicy says why)."""

    # The first retry's delay; it doubles, with jitter, up to one of the caps below.
    initial: float = Field(default=DEFAULT_INITIAL, gt=0, le=60)
    # After a refused handshake or a failed TLS handshake: doubling up to this.
    maximum: float = Field(default=DEFAULT_MAXIMUM, gt=0, le=3600)
    # While the server is unreachable (connect refused or timed out): doubling up to this.
    unreachable_maximum: float = Field(default=DEFAULT_UNREACHABLE_MAXIMUM, gt=0, le=3600)
    # A server that is busy says when to come back; we wait that long times 1..1+this.
    retry_after_jitter: float = Field(default=DEFAULT_RETRY_AFTER_JITTER, ge=0, le=10)


# ------------------------------------------------------------------ what a node does


def _check_tunnel_url(url: str, *, dial: bool = False) -> str:
    """A tunnel URL as the transports will read it (tunnel/urls.py), so that a bad host or
    port is a config error at load, not an exception when the listener or dialer starts.
    `dial`: the agent dials it, where port 0 means nothing."""
    if not re.match(r"^(tls|tcp|wss|ws)://", url):
        raise ValueError(f"{url!r}: use tls://host:port, wss://host[:port]/path, ws://, tcp://")
    endpoint = parse_endpoint(url)  # its ValueError says what is wrong
    if dial and endpoint.port == 0:
        raise ValueError(f"{url!r}: port 0 cannot be dialed; give the server's port")
    return url



def controller_url_address(url: str) -> tuple[str, int]:
    """(host, port) of a controller URL: `https://host:port` (its TLS config stream) or,
    in tests, `http://host:port`. ValueError saying what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: use http://host:port or https://host:port")
    try:
        port = parts.port  # ValueError for a port that is not a number in 0-65535
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"{url!r}: the port is not a number in 1-65535")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _check_controller_url(url: str) -> str:
    controller_url_address(url)  # its ValueError says what is wrong
    return url


ControllerUrl = Annotated[str, AfterValidator(_check_controller_url)]
"""A controller's URL, checked at load as the config stream's client reads it."""

# pydantic's messages speak of Python types ("Input should be a valid tuple"); a config
# file has YAML's: text, numbers, true/false, lists and mappings.
_TYPE_MESSAGES = {
    "tuple_type": "should be a list", "list_type": "should be a list",
    "set_type": "should be a list", "frozen_set_type": "should be a list",
    "dict_type": "should be a mapping (key: value)",
    "model_type": "should be a mapping (key: value)",
    "model_attributes_type": "should be a mapping (key: value)",
    "int_type": "should be a whole number", "int_parsing": "should be a whole number",
    "int_from_float": "should be a whole number",
    "float_type": "should be a number", "float_parsing": "should be a number",
    "bool_type": "should be true or false", "bool_parsing": "should be true or false",
    "string_type": "should be text", "path_type": "should be a path (text)",
    "none_required": "should be empty (null)",
}
_YAML_TYPES = {str: "text", int: "a number", float: "a number", bool: "true/false",
               list: "a list", dict: "a mapping", type(None): "empty"}


def _message(err: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field (typo?)"
    if kind == "missing":
        return "required field is missing"
    if kind in _TYPE_MESSAGES:
        got = _YAML_TYPES.get(type(err.get("input")))
        return _TYPE_MESSAGES[kind] + (f", not {got}" if got else "")
    message: str = err["msg"].removeprefix("Value error, ")
    # "Input should be greater than 0", "String should have at least 16 characters".
    for subject in ("Input ", "String ", "List ", "Tuple ", "Dictionary "):
        if message.startswith(subject + "should"):
            return message.removeprefix(subject)
    return message


def format_errors(source: str, exc: ValidationError) -> str:
    """pydantic errors as one line per problem: `source: field.path: problem`, in a
    config file's words. A check that found several problems raises them as lines of one
    message; each becomes a line of its own."""
    lines = []
    for err in exc.errors():
        loc = ""
        for part in err["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        for message in _message(err).splitlines():
            lines.append(f"{source}: {loc or '(top level)'}: {message}")
    return "\n".join(lines)


def raise_problems(problems: list[str]) -> None:
    """For a model validator that checks several things: every problem found, at once
    (format_errors gives each its line)."""
    if problems:
        raise ValueError("\n".join(problems))


def parse_config(model: type[M], doc: Any, source: str, *, base_dir: Path | None = None
                 ) -> M:
    """Validate a parsed document; raises ConfigError naming every bad field. `base_dir`:
    the directory of the file the document was read from; relative paths in it
    (ConfigPath fields) are taken from there."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, "
                          f"got {type(doc).__name__}")
    try:
        return model.model_validate(doc, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise ConfigError(format_errors(source, exc)) from None


def load_config(model: type[M], path: Path) -> M:
    """Read and validate a YAML file; raises ConfigError with a human message."""
    import yaml  # files only: a role in controller mode never loads it (~1.3 MiB)

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8"
                          ) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    # absolute(), not resolve(): a file reached through a symlink (a mounted ConfigMap's
    # ..data/) names its neighbours in the directory it was opened from.
    return parse_config(model, doc, str(path), base_dir=path.absolute().parent)


# Fields whose values are secrets wherever they appear in a config document.
SECRET_FIELDS = frozenset({"key_pem", "token", "htpasswd"})


REDACTED = "[redacted]"
# Fields holding a URL that may carry a password (user:password@host).
URL_FIELDS = frozenset({"proxy"})


def _redacted_url(value: Any) -> Any:
    if not isinstance(value, str) or value.strip().lower() == "direct":
        return value
    try:
        return str(parse_proxy_url(value))  # its password as [redacted]
    except ValueError:
        return REDACTED  # not a URL we can read: hide it all


def redacted(doc: Any) -> Any:
    """A JSON config document with every secret value replaced (as Envoy's config_dump
    does): what the debug socket and `nodeagent debug config` show, so a dump pasted
    into a ticket leaks no private key or token. File paths to secrets stay visible; a
    proxy URL keeps all but its password."""
    if isinstance(doc, dict):
        return {key: REDACTED if key in SECRET_FIELDS and value is not None
                else _redacted_url(value) if key in URL_FIELDS
                else redacted(value) for key, value in doc.items()}
    if isinstance(doc, list):
        return [redacted(value) for value in doc]
    return doc
