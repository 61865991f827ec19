"""The review APIs a client posts to ask the server a question: TokenReview (who is this
token?), Self/Local/SubjectAccessReview (may this user do that?) and
SelfSubjectRulesReview (what may I do here? `kubectl auth can-i --list`). Nothing is
stored; the answers come from the same authenticator and authorizer requests meet."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nodeagent.testing.fakekube.authentication import API_AUDIENCE, Authenticator
from nodeagent.testing.fakekube.errors import ApiError, bad_request
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.rbac import Decision, RequestAttributes, UserInfo
from nodeagent.testing.fakekube.registry import ResourceType


def token_review(review: Obj, authenticator: Authenticator) -> Obj:
    spec = review.get("spec") or {}
    token = spec.get("token")
    if not token:
        raise ApiError(422, "Invalid", 'TokenReview.authentication.k8s.io "" is invalid: '
                                       "spec.token: Required value")
    wanted = spec.get("audiences") or [API_AUDIENCE]
    info = authenticator.tokens.get(token)
    status: Obj
    if info is None:
        status = {"user": {}, "error": "[invalid bearer token, service account token "
                                       "has expired or is not valid]"}
    elif not (matched := [a for a in wanted if a in info.audiences]):
        status = {"user": {}, "error": f"[invalid bearer token, token audiences "
                                       f"{json.dumps(info.audiences)} is invalid for the "
                                       f"target audiences {json.dumps(wanted)}]"}
    elif error := authenticator.token_invalid(info):
        status = {"user": {}, "error": f"[invalid bearer token, {error}]"}
    else:
        status = {"authenticated": True, "user": info.user(), "audiences": matched}
    return {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}


def access_review(rt: ResourceType, review: Any, user: UserInfo, namespace: str | None,
                  decide: Callable[[RequestAttributes], Decision]) -> Obj:
    """(Self|Local)SubjectAccessReview, answered by the authorizer requests meet."""
    if not isinstance(review, dict):
        raise bad_request("the body of the request was in an unknown format")
    spec = review.get("spec")
    name = (review.get("metadata") or {}).get("name", "")
    if not isinstance(spec, dict):
        spec = {}
    resource, non_resource = spec.get("resourceAttributes"), spec.get(
        "nonResourceAttributes")
    kind = f"{rt.kind}.{rt.group}"
    if not isinstance(resource, dict | None) or not isinstance(non_resource, dict | None):
        raise bad_request("resourceAttributes and nonResourceAttributes are objects")
    if bool(resource) == bool(non_resource):
        raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: spec.resourceAttributes:'
                                       " Invalid value: exactly one of "
                                       "nonResourceAttributes or resourceAttributes must "
                                       "be specified")
    if rt.plural != "selfsubjectaccessreviews":
        groups = spec.get("groups") or []
        if not spec.get("user") and not groups:
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: spec.user: Invalid '
                                           'value: "": at least one of user or group must '
                                           "be specified")
        user = UserInfo(spec.get("user", ""), tuple(groups), spec.get("uid", ""),
                        dict(spec.get("extra") or {}))
    if rt.plural == "localsubjectaccessreviews":
        if non_resource:
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: '
                                           "spec.nonResourceAttributes: Invalid value: "
                                           "disallowed on this kind of request")
        assert resource is not None  # exactly one of the two is set (checked above)
        if resource.get("namespace", namespace) != namespace:
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: '
                                           "spec.resourceAttributes.namespace: Invalid "
                                           "value: must match metadata.namespace")
        resource = {**resource, "namespace": namespace}
    if resource is not None:
        attrs = RequestAttributes(
            user, resource.get("verb", ""), True, namespace=resource.get("namespace", ""),
            api_group=resource.get("group", ""), api_version=resource.get("version", ""),
            resource=resource.get("resource", ""),
            subresource=resource.get("subresource", ""), name=resource.get("name", ""))
    else:
        assert non_resource is not None
        attrs = RequestAttributes(user, non_resource.get("verb", ""), False,
                                  path=non_resource.get("path", ""))
    decision = decide(attrs)
    status: Obj = {"allowed": decision.allowed}
    if decision.reason:
        status["reason"] = decision.reason
    meta: Obj = {"creationTimestamp": None}
    if namespace:
        meta["namespace"] = namespace
    return {"kind": rt.kind, "apiVersion": "authorization.k8s.io/v1", "metadata": meta,
            "spec": spec, "status": status}


# (user, namespace) -> (the rules that apply, errors met while collecting them)
RulesOf = Callable[[UserInfo, str], tuple[list[Obj], list[str]]]


def rules_review(review: Any, user: UserInfo, rules_of: RulesOf) -> Obj:
    """SelfSubjectRulesReview: the requesting user's rules in spec.namespace, split into
    resource and non-resource rules as the API server reports them."""
    if not isinstance(review, dict):
        raise bad_request("the body of the request was in an unknown format")
    spec: Obj = review["spec"] if isinstance(review.get("spec"), dict) else {}
    namespace = spec.get("namespace", "")
    if not isinstance(namespace, str):
        namespace = ""
    rules, errors = rules_of(user, namespace)
    resource_rules, non_resource_rules = [], []
    for rule in rules:
        if rule.get("nonResourceURLs"):
            non_resource_rules.append({"verbs": list(rule.get("verbs") or []),
                                       "nonResourceURLs": list(rule["nonResourceURLs"])})
        else:
            entry: Obj = {"verbs": list(rule.get("verbs") or []),
                          "apiGroups": list(rule.get("apiGroups") or []),
                          "resources": list(rule.get("resources") or [])}
            if rule.get("resourceNames"):
                entry["resourceNames"] = list(rule["resourceNames"])
            resource_rules.append(entry)
    status: Obj = {"resourceRules": resource_rules, "nonResourceRules": non_resource_rules,
                   "incomplete": bool(errors)}
    if errors:
        status["evaluationError"] = ", ".join(errors)
    return {"kind": "SelfSubjectRulesReview", "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}
