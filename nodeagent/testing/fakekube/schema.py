"""Structural OpenAPI v3 schemas of CRDs: pruning, defaulting and validation of custom
objects, the way the API server handles them before a write (prune → default → validate).

Covers type, nullable, properties, additionalProperties, required, enum, minimum/maximum
(and exclusive*), minLength/maxLength, pattern, minItems/maxItems, uniqueItems, items,
default, x-kubernetes-preserve-unknown-fields, x-kubernetes-int-or-string, allOf/anyOf/
oneOf/not (validation only). Not covered: CEL rules (x-kubernetes-validations), formats,
ratcheting.
"""

from __future__ import annotations

import copy
import re
from typing import Any

Schema = dict[str, Any]


def _is_type(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return True


def _type_name(value: Any) -> str:
    for kind in ("boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, kind):
            return kind
    return "null" if value is None else type(value).__name__


def prune(value: Any, schema: Schema | None, *, root: bool = False) -> Any:
    """Drop fields the schema does not declare (unless it preserves unknown fields)."""
    if schema is None:
        return value
    if isinstance(value, dict):
        props: dict[str, Schema] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        out = {}
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                out[key] = item
            elif key in props:
                out[key] = prune(item, props[key])
            elif isinstance(additional, dict):
                out[key] = prune(item, additional)
            elif additional is True or preserve:
                out[key] = item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return value


def unknown_fields(value: Any, schema: Schema | None, path: str = "", *,
                   root: bool = False) -> list[str]:
    """The fields `prune` would drop, as `spec.a.b` paths: what `fieldValidation=Strict`
    refuses instead of dropping."""
    if schema is None:
        return []
    found: list[str] = []
    if isinstance(value, dict):
        props: dict[str, Schema] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            if key in props:
                found += unknown_fields(item, props[key], where)
            elif isinstance(additional, dict):
                found += unknown_fields(item, additional, where)
            elif not (additional is True or preserve):
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return found


def default(value: Any, schema: Schema | None) -> Any:
    """Fill `default`s of absent properties, recursively."""
    if schema is None:
        return value
    if isinstance(value, dict):
        out = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = default(out[key], sub)
        additional = schema.get("additionalProperties")
        if isinstance(additional, dict):
            for key in out:
                if key not in (schema.get("properties") or {}):
                    out[key] = default(out[key], additional)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [default(item, schema["items"]) for item in value]
    return value


def validate(value: Any, schema: Schema | None, path: str = "", *, root: bool = False
             ) -> list[tuple[str, str, str]]:
    """Errors as (field, type, detail), type like the API's causes: FieldValueRequired…"""
    if schema is None:
        return []
    errors: list[tuple[str, str, str]] = []
    here = path or "<root>"
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errors.append((here, "FieldValueTypeInvalid",
                           f'Invalid value: "null": {here} in body must be of type '
                           f'{schema["type"]}: "null"'))
        return errors
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_is_type(value, "integer") or isinstance(value, str)):
            errors.append((here, "FieldValueTypeInvalid",
                           f"Invalid value: {value!r}: must be an integer or a string"))
            return errors
    elif kind and not _is_type(value, kind):
        errors.append((here, "FieldValueTypeInvalid",
                       f'Invalid value: "{_type_name(value)}": {here} in body must be of '
                       f"type {kind}: \"{_type_name(value)}\""))
        return errors
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        errors.append((here, "FieldValueNotSupported",
                       f'Unsupported value: "{value}": supported values: {allowed}'))
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and (value < schema["minimum"] or (
                schema.get("exclusiveMinimum") and value == schema["minimum"])):
            errors.append((here, "FieldValueInvalid",
                           f"Invalid value: {value}: {here} in body should be greater than "
                           f"or equal to {schema['minimum']}"))
        if "maximum" in schema and (value > schema["maximum"] or (
                schema.get("exclusiveMaximum") and value == schema["maximum"])):
            errors.append((here, "FieldValueInvalid",
                           f"Invalid value: {value}: {here} in body should be less than or "
                           f"equal to {schema['maximum']}"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append((here, "FieldValueInvalid",
                           f"Invalid value: \"{value}\": {here} in body should be at least "
                           f"{schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append((here, "FieldValueTooLong",
                           f"Too long: may not be more than {schema['maxLength']} bytes"))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append((here, "FieldValueInvalid",
                           f"Invalid value: \"{value}\": {here} in body should match "
                           f"'{schema['pattern']}'"))
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append((here, "FieldValueInvalid",
                           f"Invalid value: {len(value)}: {here} in body should have at least "
                           f"{schema['minItems']} items"))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append((here, "FieldValueTooMany",
                           f"Too many: {len(value)}: must have at most {schema['maxItems']} "
                           "items"))
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                field = f"{path}.{key}" if path else key
                errors.append((field, "FieldValueRequired", "Required value"))
        props = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            field = f"{path}.{key}" if path else key
            if key in props:
                errors += validate(item, props[key], field)
            elif isinstance(additional, dict):
                errors += validate(item, additional, field)
    for sub in schema.get("allOf") or []:
        errors += validate(value, sub, path)
    if schema.get("anyOf") and all(validate(value, s, path) for s in schema["anyOf"]):
        errors.append((here, "FieldValueInvalid", "must validate at least one schema (anyOf)"))
    if schema.get("oneOf"):
        passing = sum(1 for s in schema["oneOf"] if not validate(value, s, path))
        if passing != 1:
            errors.append((here, "FieldValueInvalid", "must validate one and only one schema "
                                                      "(oneOf)"))
    if isinstance(schema.get("not"), dict) and not validate(value, schema["not"], path):
        errors.append((here, "FieldValueInvalid", "must not validate the schema (not)"))
    return errors
