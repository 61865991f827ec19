"""What a request may do: the authorizer chain and impersonation.

The chain is system:masters, then RBAC when the fake runs with `rbac=True` (`rbac.py`),
else allow; a test's `deny()` (`faults.py`) is checked after it. Impersonation
(`Impersonate-User`/`-Group`/`-Uid`, kubectl --as/--as-group) is authorized through the
same chain before the request is handled as the impersonated user.
"""

from __future__ import annotations

from collections.abc import Callable

from nodeagent.testing.fakekube.errors import bad_request
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.rbac import (
    AUTHENTICATED,
    MASTERS,
    SA_PREFIX,
    UNAUTHENTICATED,
    Decision,
    ObjectsOf,
    RbacAuthorizer,
    RequestAttributes,
    UserInfo,
    forbidden,
    service_account_groups,
)

# True when a test has asked for this request to be refused
Denied = Callable[[RequestAttributes], bool]


class Authorizer:
    def __init__(self, rbac_objects: ObjectsOf, *, rbac: bool, denied: Denied) -> None:
        self.rbac = rbac
        self._rbac = RbacAuthorizer(rbac_objects)
        self._denied = denied

    def decide(self, attrs: RequestAttributes) -> Decision:
        """The authorizer chain: system:masters, then RBAC when on, else allow."""
        if MASTERS in attrs.user.groups or not self.rbac:
            return Decision(True)
        return self._rbac.authorize(attrs)

    def rules(self, user: UserInfo, namespace: str) -> tuple[list[Obj], list[str]]:
        """What `user` may do in `namespace` (SelfSubjectRulesReview): everything for
        system:masters or without RBAC, else the RBAC rules that apply."""
        if MASTERS in user.groups or not self.rbac:
            return [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]},
                    {"verbs": ["*"], "nonResourceURLs": ["*"]}], []
        return self._rbac.rules(user, namespace)

    def authorize(self, attrs: RequestAttributes) -> None:
        """Raises 403 Forbidden unless the chain allows and no test denies."""
        decision = self.decide(attrs)
        if not decision.allowed:
            raise forbidden(attrs, decision.reason)
        if attrs.resource_request and self._denied(attrs):
            raise forbidden(attrs)

    def impersonate(self, user: UserInfo, headers: dict[str, str], groups: list[str]
                    ) -> UserInfo:
        """`Impersonate-User`/`-Group`/`-Uid` (kubectl --as/--as-group), each name allowed
        by an `impersonate` rule on users, serviceaccounts, groups or uids."""
        name = headers.get("impersonate-user")
        uid = headers.get("impersonate-uid")
        if name is None:
            if groups or uid:
                raise bad_request("requested impersonation of groups or uid without "
                                  "impersonating a user")
            return user
        sa_namespace = ""
        if name.startswith(SA_PREFIX) and name.count(":") == 3:
            sa_namespace, sa_name = name.removeprefix(SA_PREFIX).split(":")
            self.authorize(RequestAttributes(user, "impersonate", True,
                                             namespace=sa_namespace,
                                             resource="serviceaccounts", name=sa_name))
        else:
            self.authorize(RequestAttributes(user, "impersonate", True, resource="users",
                                             name=name))
        for group in groups:
            self.authorize(RequestAttributes(user, "impersonate", True, resource="groups",
                                             name=group))
        if uid:
            self.authorize(RequestAttributes(user, "impersonate", True,
                                             api_group="authentication.k8s.io",
                                             resource="uids", name=uid))
        if sa_namespace and not groups:
            groups = list(service_account_groups(sa_namespace))
        extra = AUTHENTICATED if name != "system:anonymous" else UNAUTHENTICATED
        if extra not in groups:
            groups = [*groups, extra]
        return UserInfo(name, tuple(groups), uid or "")
