"""Label and field selectors with the API server's syntax and matching rules.

Label selectors (`labels.Parse` in apimachinery): `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
`k notin (a,b)`, `k` (exists), `!k` (does not exist), `k>N`, `k<N`; `!=` and `notin` also
match objects without the label. Field selectors: `path=v`, `path==v`, `path!=v` on the
fields each resource supports (others are a 400 "field label not supported").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_KEY_RE = re.compile(rf"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?{_NAME}\Z")
_VALUE_RE = re.compile(rf"^({_NAME})?\Z")


class SelectorError(ValueError):
    pass


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # = != in notin exists !exists gt lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("gt", "lt"):
            try:
                have = int(value or "")
            except ValueError:
                return False
            want = int(self.values[0])
            return have > want if self.op == "gt" else have < want
        raise AssertionError(self.op)


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise SelectorError(f"invalid label key {key!r}")
    return key


def _check_value(value: str) -> str:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise SelectorError(f"invalid label value {value!r}")
    return value


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("unbalanced parenthesis")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise SelectorError("unbalanced parenthesis")
    parts.append("".join(current))
    return parts


_SET_RE = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)\Z")
_CMP_RE = re.compile(r"^(?P<key>[^=!<>\s]+)\s*(?P<op>==|=|!=|>|<)\s*(?P<value>[^=!<>\s]*)\Z")


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text or not text.strip():
        return []
    reqs = []
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"empty requirement in {text!r}")
        if m := _SET_RE.match(part):
            values = tuple(v.strip() for v in m["values"].split(","))
            if m["op"] == "in" and values == ("",):
                raise SelectorError(f"{part!r}: for 'in' operator, values set can't be empty")
            reqs.append(Requirement(_check_key(m["key"]), m["op"],
                                    tuple(sorted(_check_value(v) for v in values))))
        elif m := _CMP_RE.match(part):
            op = {"==": "=", ">": "gt", "<": "lt"}.get(m["op"], m["op"])
            value = m["value"]
            if op in ("gt", "lt") and not re.fullmatch(r"-?\d+", value):
                raise SelectorError(f"{part!r}: for 'Gt', 'Lt' operators, the value must be an"
                                    " integer")
            reqs.append(Requirement(_check_key(m["key"]), op, (_check_value(value),)))
        elif part.startswith("!"):
            reqs.append(Requirement(_check_key(part[1:].strip()), "!exists"))
        elif re.fullmatch(r"\S+", part):
            reqs.append(Requirement(_check_key(part), "exists"))
        else:
            raise SelectorError(f"unable to parse requirement {part!r}")
    return reqs


def labels_match(reqs: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    op: str  # = or !=
    value: str


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def parse_field_selector(text: str | None, supported: Callable[[str], bool]
                         ) -> list[FieldRequirement]:
    if not text or not text.strip():
        return []
    reqs = []
    for raw in re.split(r"(?<!\\),", text):
        part = raw.strip()
        m = re.match(r"^(?P<path>[^=!]+?)\s*(?P<op>==|=|!=)\s*(?P<value>.*)\Z", part)
        if not m:
            raise SelectorError(f"invalid selector: {part!r}; can't understand {part!r}")
        path = m["path"].strip()
        if not supported(path):
            raise SelectorError(f'field label not supported: {path}')
        reqs.append(FieldRequirement(path, "=" if m["op"] == "==" else m["op"],
                                     _unescape(m["value"].strip())))
    return reqs


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The selector string value of a dotted path ("" when absent; booleans lowercase)."""
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return ""
        node = node.get(part)
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def fields_match(reqs: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    for r in reqs:
        have = field_value(obj, r.path)
        if (have == r.value) != (r.op == "="):
            return False
    return True
