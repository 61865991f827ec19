"""Authorization as kube-apiserver does it: request attributes from the URL, the RBAC
authorizer over stored Roles/ClusterRoles and their bindings, the 403 it answers, the
validation RBAC objects get on write, and the bootstrap policy a new cluster starts with.

Pure: no I/O, no trio. `server.py` builds `RequestAttributes` for every request and asks
`RbacAuthorizer.authorize()` when the FakeKube has `rbac=True`; members of `system:masters`
are allowed everything before RBAC is asked, as by the real server's privileged-group
authorizer.

Follows `plugin/pkg/auth/authorizer/rbac` and `apiserver/pkg/endpoints/request`:
- verbs are distinct (get ≠ list ≠ watch); `*` matches any verb, group and resource;
  `resource/subresource` rules (`pods/log`, `ingresses/status`) and `*/subresource`;
- `resourceNames` restricts get/update/patch/delete to those names, and list/watch only
  when a `metadata.name=<x>` field selector names one object (the request info does that
  for real too); create and collection requests never match a `resourceNames` rule;
- RoleBindings grant in their own namespace only (Roles or ClusterRoles);
  ClusterRoleBindings grant everywhere, cluster-scoped resources and non-resource URLs
  included (`/apis/*`-style prefixes);
- subjects: User, Group, ServiceAccount (`system:serviceaccount:<ns>:<name>`, the
  namespace defaulting to the RoleBinding's), groups such as `system:serviceaccounts`,
  `system:serviceaccounts:<ns>`, `system:authenticated`.

Differences from a real cluster: aggregated ClusterRoles (`aggregationRule`) are stored but
not aggregated, so the bootstrap policy holds only `cluster-admin`, `system:discovery`,
`system:basic-user` and `system:public-info-viewer` (not admin/edit/view); there is no
escalation check (anyone may create a Role granting more than they hold, where the real
server demands `escalate`/`bind`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.registry import RBAC
from nodeagent.testing.fakekube.selectors import SelectorError, parse_field_selector

Obj = dict[str, Any]

MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
SA_PREFIX = "system:serviceaccount:"
NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


@dataclass(frozen=True)
class UserInfo:
    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""
    extra: dict[str, list[str]] = field(default_factory=dict, hash=False, compare=False)

    def to_api(self) -> Obj:
        doc: Obj = {"username": self.name, "groups": list(self.groups)}
        if self.uid:
            doc["uid"] = self.uid
        if self.extra:
            doc["extra"] = {k: list(v) for k, v in self.extra.items()}
        return doc


def service_account_groups(namespace: str) -> tuple[str, ...]:
    return ("system:serviceaccounts", f"system:serviceaccounts:{namespace}")


@dataclass(frozen=True)
class RequestAttributes:
    """What the authorizer sees of a request (`authorizer.Attributes`)."""

    user: UserInfo
    verb: str
    resource_request: bool
    path: str = ""
    namespace: str = ""
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""

    @property
    def combined_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


_METHOD_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update",
                 "PATCH": "patch", "DELETE": "delete"}


def request_attributes(user: UserInfo, method: str, path: str, query: dict[str, str]
                       ) -> RequestAttributes:
    """The attributes of an HTTP request, as `RequestInfoFactory.NewRequestInfo` makes them."""
    parts = [p for p in path.split("/") if p]
    non_resource = RequestAttributes(user, method.lower(), False, path=path)
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return non_resource
    verb = _METHOD_VERBS.get(method)
    if verb is None:
        return non_resource
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("true", "1") else "list"
        try:
            reqs = parse_field_selector(query.get("fieldSelector"), lambda _: True)
        except SelectorError:
            reqs = []
        named = [r.value for r in reqs if r.path == "metadata.name" and r.op == "="]
        if named and "/" not in named[0] and named[0] not in (".", ".."):
            name = named[0]
    elif not name and verb == "delete":
        verb = "deletecollection"
    return RequestAttributes(user, verb, True, path=path, namespace=namespace,
                             api_group=group, api_version=version, resource=resource,
                             subresource=subresource, name=name)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


def forbidden(attrs: RequestAttributes, reason: str = "") -> ApiError:
    """The 403 kube-apiserver answers (`responsewriters.Forbidden`)."""
    who = attrs.user.name
    if not attrs.resource_request:
        message = f'User "{who}" cannot {attrs.verb} path "{attrs.path}"'
    elif attrs.namespace:
        message = (f'User "{who}" cannot {attrs.verb} resource "{attrs.combined_resource}" '
                   f'in API group "{attrs.api_group}" in the namespace "{attrs.namespace}"')
    else:
        message = (f'User "{who}" cannot {attrs.verb} resource "{attrs.combined_resource}" '
                   f'in API group "{attrs.api_group}" at the cluster scope')
    if reason:
        message = f"{message}: {reason}"
    if not attrs.resource_request:
        return ApiError(403, "Forbidden", f"forbidden: {message}", details={})
    qualified = f"{attrs.resource}.{attrs.api_group}" if attrs.api_group else attrs.resource
    prefix = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    details: Obj = {"kind": attrs.resource}
    if attrs.name:
        details["name"] = attrs.name
    if attrs.api_group:
        details["group"] = attrs.api_group
    return ApiError(403, "Forbidden", f"{prefix} is forbidden: {message}", details=details)


# -- the authorizer ---------------------------------------------------------------------------

def _matches(values: Iterable[str], wanted: str) -> bool:
    return any(v == "*" or v == wanted for v in values)


def _resource_matches(rule: Obj, attrs: RequestAttributes) -> bool:
    for resource in rule.get("resources") or ():
        if resource in ("*", attrs.combined_resource):
            return True
        if attrs.subresource and resource == f"*/{attrs.subresource}":
            return True
    return False


def _non_resource_matches(rule: Obj, path: str) -> bool:
    for url in rule.get("nonResourceURLs") or ():
        if url == "*" or url == path or (url.endswith("*") and path.startswith(url[:-1])):
            return True
    return False


def rule_allows(rule: Obj, attrs: RequestAttributes) -> bool:
    """`rbac.RuleAllows`."""
    if not _matches(rule.get("verbs") or (), attrs.verb):
        return False
    if not attrs.resource_request:
        return _non_resource_matches(rule, attrs.path)
    names = rule.get("resourceNames") or ()
    return (_matches(rule.get("apiGroups") or (), attrs.api_group)
            and _resource_matches(rule, attrs)
            and (not names or attrs.name in names))


def _subject_applies(subject: Obj, user: UserInfo, binding_namespace: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name", "")
    if kind == "User":
        return bool(user.name == name)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return bool(namespace) and user.name == f"{SA_PREFIX}{namespace}:{name}"
    return False


def _describe_subject(subject: Obj, binding_namespace: str) -> str:
    name = subject.get("name", "")
    if subject.get("kind") == "ServiceAccount":
        name = f"{name}/{subject.get('namespace') or binding_namespace}"
    return f'{subject.get("kind")} "{name}"'


ObjectsOf = Callable[[str], Iterable[Obj]]  # plural in rbac.authorization.k8s.io → objects


class RbacAuthorizer:
    """Answers from whatever `objects_of` returns now (the store's live objects)."""

    def __init__(self, objects_of: ObjectsOf) -> None:
        self._objects_of = objects_of

    def _role_rules(self, ref: Obj, namespace: str, errors: list[str]) -> list[Obj] | None:
        kind, name = ref.get("kind"), ref.get("name")
        if kind == "ClusterRole":
            candidates = [o for o in self._objects_of("clusterroles")
                          if o["metadata"]["name"] == name]
            missing = f'clusterrole.{RBAC} "{name}" not found'
        elif kind == "Role" and namespace:
            candidates = [o for o in self._objects_of("roles")
                          if o["metadata"]["name"] == name
                          and o["metadata"].get("namespace") == namespace]
            missing = f'role.{RBAC} "{name}" not found'
        else:
            return None
        if not candidates:
            errors.append(missing)
            return None
        return list(candidates[0].get("rules") or [])

    def rules(self, user: UserInfo, namespace: str) -> tuple[list[Obj], list[str]]:
        """Every rule that applies to `user` in `namespace` (cluster-wide bindings, then
        the namespace's), and the errors met (a binding to a missing role), as a
        SelfSubjectRulesReview reports them."""
        errors: list[str] = []
        rules: list[Obj] = []
        for binding in self._objects_of("clusterrolebindings"):
            if any(_subject_applies(s, user, "") for s in binding.get("subjects") or []):
                rules += self._role_rules(binding.get("roleRef") or {}, "", errors) or []
        if namespace:
            for binding in self._objects_of("rolebindings"):
                if binding["metadata"].get("namespace") != namespace or not any(
                        _subject_applies(s, user, namespace)
                        for s in binding.get("subjects") or []):
                    continue
                rules += self._role_rules(binding.get("roleRef") or {}, namespace,
                                          errors) or []
        return rules, errors

    def authorize(self, attrs: RequestAttributes) -> Decision:
        errors: list[str] = []
        for binding in self._objects_of("clusterrolebindings"):
            decision = self._visit(binding, "", attrs, errors)
            if decision is not None:
                return decision
        if attrs.namespace:
            for binding in self._objects_of("rolebindings"):
                if binding["metadata"].get("namespace") != attrs.namespace:
                    continue
                decision = self._visit(binding, attrs.namespace, attrs, errors)
                if decision is not None:
                    return decision
        return Decision(False, f"RBAC: [{', '.join(errors)}]" if len(errors) > 1 else
                        f"RBAC: {errors[0]}" if errors else "")

    def _visit(self, binding: Obj, namespace: str, attrs: RequestAttributes,
               errors: list[str]) -> Decision | None:
        subject = next((s for s in binding.get("subjects") or []
                        if _subject_applies(s, attrs.user, namespace)), None)
        if subject is None:
            return None
        ref = binding.get("roleRef") or {}
        rules = self._role_rules(ref, namespace, errors)
        if not any(rule_allows(rule, attrs) for rule in rules or ()):
            return None
        name = binding["metadata"]["name"]
        what = (f'RoleBinding "{name}/{namespace}"' if namespace
                else f'ClusterRoleBinding "{name}"')
        return Decision(True, f'RBAC: allowed by {what} of {ref.get("kind")} '
                              f'"{ref.get("name")}" to {_describe_subject(subject, namespace)}')


# -- bootstrap policy -------------------------------------------------------------------------

def _cluster_role(name: str, rules: list[Obj]) -> Obj:
    return {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRole",
            "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping":
                                                  "rbac-defaults"},
                         "annotations": {"rbac.authorization.kubernetes.io/autoupdate":
                                         "true"}},
            "rules": rules}


def _cluster_binding(name: str, groups: list[str]) -> Obj:
    return {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping":
                                                  "rbac-defaults"},
                         "annotations": {"rbac.authorization.kubernetes.io/autoupdate":
                                         "true"}},
            "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": RBAC, "kind": "Group", "name": g} for g in groups]}


def bootstrap_policy() -> list[Obj]:
    """The default ClusterRoles/bindings every cluster has that matter to a client."""
    health = ["/healthz", "/livez", "/readyz", "/version", "/version/"]
    return copy.deepcopy([
        _cluster_role("cluster-admin", [
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            {"nonResourceURLs": ["*"], "verbs": ["*"]}]),
        _cluster_binding("cluster-admin", [MASTERS]),
        _cluster_role("system:discovery", [
            {"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/openapi",
                                 "/openapi/*", *health], "verbs": ["get"]}]),
        _cluster_binding("system:discovery", [AUTHENTICATED]),
        _cluster_role("system:basic-user", [
            {"apiGroups": ["authorization.k8s.io"],
             "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
             "verbs": ["create"]}]),
        _cluster_binding("system:basic-user", [AUTHENTICATED]),
        _cluster_role("system:public-info-viewer", [
            {"nonResourceURLs": health, "verbs": ["get"]}]),
        _cluster_binding("system:public-info-viewer", [AUTHENTICATED, UNAUTHENTICATED]),
    ])
