"""Validation and defaulting of RBAC objects on write (`pkg/apis/rbac/validation`):
rules need verbs and either api groups + resources or (cluster roles only) non-resource
URLs; bindings need a roleRef that never changes and subjects of a known kind."""

from __future__ import annotations

from typing import Any

from nodeagent.testing.fakekube.registry import RBAC, ResourceType

Obj = dict[str, Any]
Causes = list[tuple[str, str, str]]


def _check_rule(rule: Any, path: str, namespaced: bool, causes: Causes) -> None:
    if not isinstance(rule, dict):
        causes.append((path, "FieldValueTypeInvalid", "Invalid value: must be an object"))
        return
    if not rule.get("verbs"):
        causes.append((f"{path}.verbs", "FieldValueRequired",
                       "Required value: verbs must contain at least one value"))
    urls = rule.get("nonResourceURLs")
    if urls:
        if namespaced:
            causes.append((f"{path}.nonResourceURLs", "FieldValueInvalid",
                           f"Invalid value: {urls}: namespaced rules cannot apply to "
                           "non-resource URLs"))
        if rule.get("apiGroups") or rule.get("resources") or rule.get("resourceNames"):
            causes.append((f"{path}.nonResourceURLs", "FieldValueInvalid",
                           f"Invalid value: {urls}: rules cannot apply to both regular "
                           "resources and non-resource URLs"))
        return
    if not rule.get("apiGroups"):
        causes.append((f"{path}.apiGroups", "FieldValueRequired",
                       "Required value: resource rules must supply at least one api group"))
    if not rule.get("resources"):
        causes.append((f"{path}.resources", "FieldValueRequired",
                       "Required value: resource rules must supply at least one resource"))


def admit(rt: ResourceType, obj: Obj, old: Obj | None, causes: Causes) -> None:
    """Defaulting and validation of Role, ClusterRole, RoleBinding, ClusterRoleBinding."""
    if rt.plural in ("roles", "clusterroles"):
        rules = obj.get("rules")
        if rules is None:
            rules = [] if rt.plural == "roles" or obj.get("aggregationRule") else None
        for i, rule in enumerate(rules or []):
            _check_rule(rule, f"rules[{i}]", rt.namespaced, causes)
        return
    ref = obj.get("roleRef")
    kinds = ("Role", "ClusterRole") if rt.namespaced else ("ClusterRole",)
    if not isinstance(ref, dict):
        causes.append(("roleRef", "FieldValueRequired", "Required value"))
    else:
        if ref.get("apiGroup") != RBAC:
            causes.append(("roleRef.apiGroup", "FieldValueNotSupported",
                           f'Unsupported value: "{ref.get("apiGroup", "")}": supported '
                           f'values: "{RBAC}"'))
        if ref.get("kind") not in kinds:
            causes.append(("roleRef.kind", "FieldValueNotSupported",
                           f'Unsupported value: "{ref.get("kind", "")}": supported values: '
                           + ", ".join(f'"{k}"' for k in kinds)))
        if not ref.get("name"):
            causes.append(("roleRef.name", "FieldValueRequired", "Required value"))
        if old is not None and old.get("roleRef") != ref:
            causes.append(("roleRef", "FieldValueInvalid",
                           f"Invalid value: {ref}: cannot change roleRef"))
    for i, subject in enumerate(obj.get("subjects") or []):
        path = f"subjects[{i}]"
        if not isinstance(subject, dict):
            causes.append((path, "FieldValueTypeInvalid", "Invalid value: must be an object"))
            continue
        kind = subject.get("kind")
        if kind in ("User", "Group"):
            subject.setdefault("apiGroup", RBAC)
        elif kind == "ServiceAccount":
            # Defaulted to "", which the API omits when it writes the object (omitempty);
            # kept, it makes every `kubectl apply` of a binding "configured".
            if not subject.get("apiGroup"):
                subject.pop("apiGroup", None)
            if not subject.get("namespace") and not rt.namespaced:
                causes.append((f"{path}.namespace", "FieldValueRequired", "Required value"))
        else:
            causes.append((f"{path}.kind", "FieldValueNotSupported",
                           f'Unsupported value: "{kind or ""}": supported values: '
                           '"Group", "ServiceAccount", "User"'))
        if not subject.get("name"):
            causes.append((f"{path}.name", "FieldValueRequired", "Required value"))
