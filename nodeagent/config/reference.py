"""The configuration reference (docs/configuration.md), generated from the config models
so it cannot drift from what the loader accepts.

Each file kind (the server's and the agent's YAML file) is rendered from its model: every
field with its type, its default and its description. A description is the field's
`description` metadata when it has one, else the comments the model's source puts on the
field (the lines just above it and the comment at the end of its line); a field with
neither says "no description" rather than having one made up here. The models stay the
one place to document a field.

`python -m nodeagent.config.reference` prints the reference; with `--check FILE` it exits
1 with one line if FILE differs (the suite runs the same comparison).

Imports nothing but `nodeagent.config` and the standard library: `nodeagent.config` sits
at the bottom of the layers, so its reference does too.
"""

from __future__ import annotations

import argparse
import ast
import enum
import functools
import inspect
import io
import ipaddress
import json
import sys
import tokenize
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.config import (
    SECRET_FIELDS,
    AgentConfig,
    Model,
    NodeConfig,
    RoutesConfig,
    ServerConfig,
)

NO_DESCRIPTION = "no description"

REGENERATE = "python -m nodeagent.config.reference > docs/configuration.md"


@dataclass(frozen=True)
class FileKind:
    """One kind of config file: its title, the command that reads it, its root model,
    and the model whose fields the running process re-applies on SIGHUP (in controller
    mode they come from the controller instead)."""

    title: str
    command: str
    model: type[Model]
    reloadable: type[Model]


FILE_KINDS = (
    FileKind("Server file", "nodeagent server --config FILE", ServerConfig, RoutesConfig),
    FileKind("Agent file", "nodeagent agent --config FILE", AgentConfig, NodeConfig),
)


INTRO = f"""\
# Configuration reference

<!-- Generated from the config models by `python -m nodeagent.config.reference`;
do not edit: change the models (nodeagent/config/) and run
`{REGENERATE}`. The suite fails when this file differs. -->

Without Kubernetes, the server and the agent each read one YAML file
(`nodeagent server --config FILE`, `nodeagent agent --config FILE`); in controller mode
the same models arrive from the controller instead. Examples:
[`examples/server.yaml`](../examples/server.yaml),
[`examples/agent.yaml`](../examples/agent.yaml).

- Unknown fields are refused (a typo is an error, not ignored). An invalid file prints
  one line per bad field, all of them at once (`agent.yaml: allow[0].ports[0]: port
  '99999' out of range 1-65535`), and the process exits 2 with nothing started; the files
  it names (certificates, keys, token files) are checked next, again all at once.
  `--check` validates a file and those files, prints a summary and exits.
- Relative paths (`cert_file: server.crt`) are relative to the directory of the config
  file, wherever the process is started from.
- A token, inline (`token:`) or in a file (`token_file:`), is read the same way on both
  sides: surrounding whitespace and a leading UTF-8 byte-order mark (which some editors
  add invisibly) are dropped; what remains must be at least 16 printable ASCII
  characters.
- Each file has two parts. *What the process does* (the server's routes, the agent's
  allow list and interception) is re-read on `SIGHUP`, and an invalid new file is
  refused while the running config stays; in controller mode the controller sends this
  part. *What the process needs to run* (listeners, credentials, the debug socket) is
  read at start; the certificate, key and CA files it names (and the server's token
  files) are reloaded when their contents change.
- Secret values ({", ".join(f"`{name}`" for name in sorted(SECRET_FIELDS))}) are shown as
  `[redacted]` by `nodeagent debug config`.
- Types: *host:port* is `host:port` or `[v6]:port`; a *CIDR* is written as text
  (`10.0.0.0/8`); a *list* is a YAML sequence; a *map* a YAML mapping. A type in a link
  is a mapping described further down.

The ClusterTunnel custom resource is not described here: its schema, with a description
per field, is generated from its model into `manifests/crds.yaml`.
"""


def render_reference() -> str:
    """The whole reference, as Markdown."""
    out = [INTRO]
    seen: set[type[Model]] = set()
    shared = _shared_models()
    for kind in FILE_KINDS:
        out.append(_render_kind(kind))
        own = [m for m in _nested_models(kind.model) if m not in shared and m not in seen]
        if own:
            out.append(f"### Types used by the {kind.title.lower()}\n")
            for model in own:
                out.append(_render_model(model, "####"))
            seen.update(own)
    if shared:
        out.append("## Types used by both files\n")
        for model in _ordered(shared):
            out.append(_render_model(model, "###"))
    return "\n".join(out).rstrip("\n") + "\n"


def documented_fields() -> dict[str, set[str]]:
    """Every model the reference documents, with its field names (for the test that
    every field appears)."""
    result: dict[str, set[str]] = {}
    for kind in FILE_KINDS:
        for model in (kind.model, *_nested_models(kind.model)):
            result[model.__name__] = set(model.model_fields)
    return result


# ------------------------------------------------------------------ file kinds


def _render_kind(kind: FileKind) -> str:
    model = kind.model
    lines = [
        f"## {kind.title}\n",
        f"Read by `{kind.command}` (model `{model.__name__}`). "
        + (_docstring(model) or NO_DESCRIPTION),
        "",
    ]
    reloaded = [name for name in model.model_fields if name in kind.reloadable.model_fields]
    at_start = [name for name in model.model_fields if name not in reloaded]
    lines.append(f"### What it does (`{kind.reloadable.__name__}`, re-read on SIGHUP)\n")
    lines.append(_docstring(kind.reloadable) or NO_DESCRIPTION)
    lines.append("")
    lines.append(_field_table(model, reloaded))
    lines.append("### What it needs to run (read at start)\n")
    lines.append(_field_table(model, at_start))
    return "\n".join(lines)


def _shared_models() -> set[type[Model]]:
    reach = [set(_nested_models(kind.model)) for kind in FILE_KINDS]
    return set.intersection(*reach) if reach else set()


def _ordered(models: set[type[Model]]) -> list[type[Model]]:
    order: list[type[Model]] = []
    for kind in FILE_KINDS:
        order += [m for m in _nested_models(kind.model) if m in models and m not in order]
    return order


def _nested_models(root: type[Model]) -> list[type[Model]]:
    """The models reachable from `root`'s fields, in order of first appearance."""
    found: list[type[Model]] = []
    queue = [root]
    while queue:
        model = queue.pop(0)
        for field in model.model_fields.values():
            for nested in _models_in(field.annotation):
                if nested is not root and nested not in found:
                    found.append(nested)
                    queue.append(nested)
    return found


def _models_in(annotation: Any) -> Iterator[type[Model]]:
    if isinstance(annotation, type) and issubclass(annotation, Model):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


# ------------------------------------------------------------------ one model


def _render_model(model: type[Model], level: str) -> str:
    return "\n".join(
        [
            f"{level} {model.__name__}\n",
            _docstring(model) or NO_DESCRIPTION,
            "",
            _field_table(model, list(model.model_fields)),
        ]
    )


def _field_table(model: type[Model], names: Sequence[str]) -> str:
    rows: list[str] = []
    for name in names:
        field = model.model_fields[name]
        default = (
            "required"
            if field.is_required()
            else _default(name, field.get_default(call_default_factory=True))
        )
        description = field.description or _source_comment(model, name) or NO_DESCRIPTION
        limits = _constraints(name, field.metadata)
        if limits:
            description += f" ({limits})"
        cells = (f"`{name}`", _type_name(field.annotation), default, description)
        # A `|` inside a cell (a comment, a pattern) would end the cell.
        rows.append(
            "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
        )
    return (
        "\n".join(["| field | type | default | description |", "|---|---|---|---|", *rows]) + "\n"
    )


def _docstring(model: type[Model]) -> str:
    # A model's own docstring only: pydantic's BaseModel has one of its own.
    doc = model.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if isinstance(doc, str) else ""


def _constraints(name: str, metadata: list[Any]) -> str:
    words = {
        "gt": ">",
        "ge": "≥",
        "lt": "<",
        "le": "≤",
        "min_length": "at least",
        "max_length": "at most",
        "pattern": "matching",
    }
    parts: list[str] = []
    for item in metadata:
        for attribute, word in words.items():
            value = getattr(item, attribute, None)
            if value is None:
                continue
            if attribute == "pattern":
                parts.append(f"{word} `{value}`")
            elif attribute.endswith("_length"):
                parts.append(f"{word} {value} long")
            else:
                parts.append(f"{word} {_number(name, value)}")
    return ", ".join(parts)


def _number(name: str, value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and name.endswith("_mode"):
        return f"0{value:o}"  # how YAML writes an octal number: 0600
    if isinstance(value, int) and name.endswith("_mark"):
        return f"{value:#x}"
    return str(value)


# ------------------------------------------------------------------ types and defaults

_SCALARS: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    Path: "path",
    type(None): "null",
}
_NETWORKS = {ipaddress.IPv4Network, ipaddress.IPv6Network}


def _type_name(annotation: Any) -> str:
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if isinstance(annotation, type) and issubclass(annotation, Model):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        if set(args) == _NETWORKS:
            return "CIDR"
        return " or ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return " or ".join(f"`{json.dumps(arg)}`" for arg in args)
    if origin is tuple:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    return f"`{getattr(annotation, '__name__', annotation)}`"


def _default(name: str, value: Any) -> str:
    if isinstance(value, Model):
        if _is_empty_default(value):
            return f"the defaults of [{type(value).__name__}](#{type(value).__name__.lower()})"
        return f"`{_flow(value.model_dump(mode='json'))}`"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"`{_number(name, value)}`"
    if isinstance(value, tuple | list | dict) and not value:
        return "none"
    return f"`{_flow(_plain(value))}`"


def _is_empty_default(value: Model) -> bool:
    try:
        return value == type(value)()
    except ValueError:  # the model has required fields: not its defaults
        return False


def _plain(value: Any) -> Any:
    if isinstance(value, Model):
        return value.model_dump(mode="json")
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path | ipaddress.IPv4Network | ipaddress.IPv6Network):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _flow(value: Any) -> str:
    """A value as YAML flow style, as it would be written in a file."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value)


# ------------------------------------------------------------------ comments in the source


def _source_comment(model: type[Model], name: str) -> str:
    """The comment the source puts on field `name`: the comment lines right above it
    (no blank line between) and the comment ending its line, from the class that
    declares the field."""
    for cls in model.__mro__:
        if issubclass(cls, Model) and name in inspect.get_annotations(cls):
            return _field_comments(cls.__module__, cls.__qualname__).get(name, "")
    return ""


@functools.cache
def _field_comments(module_name: str, qualname: str) -> dict[str, str]:
    module = sys.modules[module_name]
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):  # no source shipped: no comments to read
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row = token.start[0]
        if token.type == tokenize.COMMENT:
            comments[row] = token.string.lstrip("#").strip()
        elif token.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    only_comment = set(comments) - code_lines
    result: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name == qualname):
            continue
        for statement in node.body:
            if not (
                isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            ):
                continue
            above: list[str] = []
            row = statement.lineno - 1
            while row in only_comment:
                above.insert(0, comments[row])
                row -= 1
            end = statement.end_lineno or statement.lineno
            inline = [
                comments[r]
                for r in range(statement.lineno, end + 1)
                if r in comments and r not in only_comment
            ]
            text = " ".join(part for part in (*above, *inline) if part)
            if text:
                result[statement.target.id] = text
    return result


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodeagent.config.reference",
        description="Print the configuration reference (Markdown) generated from the "
        "config models.",
    )
    parser.add_argument(
        "--check",
        type=Path,
        metavar="FILE",
        help="exit 1 if FILE differs from the generated reference",
    )
    args = parser.parse_args(argv)
    text = render_reference()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    try:
        current = args.check.read_text()
    except OSError as exc:
        print(f"{args.check}: cannot read: {exc.strerror}; run `{REGENERATE}`", file=sys.stderr)
        return 1
    if current != text:
        print(
            f"{args.check} is out of date with the config models; run `{REGENERATE}`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
