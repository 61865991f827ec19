"""What kube-apiserver checks of a Service's load balancer fields: `spec.loadBalancerClass`
on create and update, and the status a load balancer controller writes through the
`status` subresource (`status.loadBalancer.ingress`, its ports and `ipMode`, and
`status.conditions`), with the defaulting the real server applies there (an ingress
entry with an `ip` and no `ipMode` gets `VIP`). As in pkg/apis/core/validation:
`ValidateLoadBalancerStatus`, `validateLoadBalancerClassField` and metav1's
`ValidateConditions`; problems are field causes, raised together as one 422.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from nodeagent.testing.fakekube.errors import Causes

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?\Z")
# PortStatus.error: CamelCase, or foo.example.com/CamelCase for a provider's own
_PORT_ERROR = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                         r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?\Z")
_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)\Z")
IP_MODES = ("VIP", "Proxy")
PROTOCOLS = ("TCP", "UDP", "SCTP")
Obj = dict[str, Any]


def qualified_name_problem(value: Any) -> str | None:
    """Why `value` is not a qualified name (`prefix.example.com/Name`), or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    prefix, _, name = value.rpartition("/")
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return ("name part must consist of alphanumeric characters, '-', '_' or '.', and "
                "must start and end with an alphanumeric character")
    return None


def admit_load_balancer_class(spec: Obj, old_spec: Obj | None, causes: Causes) -> None:
    """`spec.loadBalancerClass`: only with type LoadBalancer, a qualified name, and
    immutable while the Service stays a LoadBalancer."""
    cls = spec.get("loadBalancerClass")
    field = "spec.loadBalancerClass"
    if cls is not None:
        if spec.get("type") != "LoadBalancer":
            causes.append((field, "FieldValueForbidden",
                           "Forbidden: may only be used when `type` is 'LoadBalancer'"))
        elif (problem := qualified_name_problem(cls)) is not None:
            causes.append((field, "FieldValueInvalid", f'Invalid value: "{cls}": {problem}'))
    if old_spec is not None and old_spec.get("type") == "LoadBalancer" and \
            spec.get("type") == "LoadBalancer" and old_spec.get("loadBalancerClass") != cls:
        causes.append((field, "FieldValueInvalid",
                       f'Invalid value: "{cls}": may not change once set'))


def admit_service_status(service: Obj, causes: Causes) -> None:
    """Default and check what a status write leaves on a Service."""
    status = service.get("status")
    if status is None:
        return
    if not isinstance(status, dict):
        causes.append(("status", "FieldValueTypeInvalid", "must be an object"))
        return
    ingress = (status.get("loadBalancer") or {}).get("ingress") or []
    path = "status.loadBalancer.ingress"
    if ingress and (service.get("spec") or {}).get("type") != "LoadBalancer":
        causes.append((path, "FieldValueForbidden",
                       "Forbidden: may only be used when `spec.type` is 'LoadBalancer'"))
        return
    for i, entry in enumerate(ingress):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            causes.append((where, "FieldValueTypeInvalid", "must be an object"))
            continue
        ip, hostname, mode = entry.get("ip"), entry.get("hostname"), entry.get("ipMode")
        if ip:
            try:
                ipaddress.ip_address(str(ip))
            except ValueError:
                causes.append((f"{where}.ip", "FieldValueInvalid",
                               f'Invalid value: "{ip}": must be a valid IP address'))
            if mode is None:
                entry["ipMode"] = mode = "VIP"  # the defaulting of LoadBalancerIPMode
        if mode is not None and not ip:
            causes.append((f"{where}.ipMode", "FieldValueForbidden",
                           "Forbidden: may not be specified when `ip` is not set"))
        elif mode is not None and mode not in IP_MODES:
            causes.append((f"{where}.ipMode", "FieldValueNotSupported",
                           f'Unsupported value: "{mode}": supported values: "Proxy", "VIP"'))
        if hostname:
            if not isinstance(hostname, str) or not _SUBDOMAIN.match(hostname):
                causes.append((f"{where}.hostname", "FieldValueInvalid",
                               f'Invalid value: "{hostname}": a lowercase RFC 1123 '
                               "subdomain must consist of lower case alphanumeric "
                               "characters, '-' or '.'"))
            else:
                try:
                    ipaddress.ip_address(hostname)
                    causes.append((f"{where}.hostname", "FieldValueInvalid",
                                   f'Invalid value: "{hostname}": must be a DNS name, not '
                                   "an IP address"))
                except ValueError:
                    pass
        for j, port in enumerate(entry.get("ports") or []):
            _port_status(f"{where}.ports[{j}]", port, causes)
    _conditions(status.get("conditions"), causes)


def _port_status(where: str, port: Any, causes: Causes) -> None:
    if not isinstance(port, dict):
        causes.append((where, "FieldValueTypeInvalid", "must be an object"))
        return
    number = port.get("port")
    if not isinstance(number, int) or not 0 < number < 65536:
        causes.append((f"{where}.port", "FieldValueInvalid",
                       f"Invalid value: {number!r}: must be between 1 and 65535, inclusive"))
    protocol = port.get("protocol")
    if protocol is None:
        causes.append((f"{where}.protocol", "FieldValueRequired", "Required value"))
    elif protocol not in PROTOCOLS:
        causes.append((f"{where}.protocol", "FieldValueNotSupported",
                       f'Unsupported value: "{protocol}": supported values: "SCTP", "TCP", '
                       '"UDP"'))
    error = port.get("error")
    if error is not None and (not isinstance(error, str) or len(error) > 316
                              or not _PORT_ERROR.match(error)):
        causes.append((f"{where}.error", "FieldValueInvalid",
                       f'Invalid value: "{error}": must be CamelCase, or '
                       "foo.example.com/CamelCase"))


def _conditions(conditions: Any, causes: Causes) -> None:
    """metav1 Conditions, as ValidateConditions checks them (a list keyed by type)."""
    if conditions is None:
        return
    if not isinstance(conditions, list):
        causes.append(("status.conditions", "FieldValueTypeInvalid", "must be a list"))
        return
    seen: set[str] = set()
    for i, cond in enumerate(conditions):
        where = f"status.conditions[{i}]"
        if not isinstance(cond, dict):
            causes.append((where, "FieldValueTypeInvalid", "must be an object"))
            continue
        kind = cond.get("type")
        if (problem := qualified_name_problem(kind)) is not None:
            causes.append((f"{where}.type", "FieldValueInvalid",
                           f'Invalid value: "{kind}": {problem}'))
        elif kind in seen:
            causes.append((f"{where}.type", "FieldValueDuplicate",
                           f'Duplicate value: "{kind}"'))
        seen.add(str(kind))
        if cond.get("status") not in ("True", "False", "Unknown"):
            causes.append((f"{where}.status", "FieldValueNotSupported",
                           f'Unsupported value: "{cond.get("status")}": supported values: '
                           '"False", "True", "Unknown"'))
        reason = cond.get("reason")
        if not reason:
            causes.append((f"{where}.reason", "FieldValueRequired", "Required value"))
        elif not isinstance(reason, str) or len(reason) > 1024 or not _REASON.match(reason):
            causes.append((f"{where}.reason", "FieldValueInvalid",
                           f'Invalid value: "{reason}": a condition reason must start with '
                           "alphabetic character, optionally followed by a string of "
                           "alphanumeric characters or '_,:', and must end with an "
                           "alphanumeric character or '_'"))
        if not isinstance(cond.get("message", ""), str) or len(cond.get("message", "")) \
                > 32768:
            causes.append((f"{where}.message", "FieldValueTooLong",
                           "Too long: may not be more than 32768 bytes"))
        when = cond.get("lastTransitionTime")
        if not when:
            causes.append((f"{where}.lastTransitionTime", "FieldValueRequired",
                           "Required value: must be set"))
        elif not isinstance(when, str) or not _RFC3339.match(when):
            causes.append((f"{where}.lastTransitionTime", "FieldValueInvalid",
                           f'Invalid value: "{when}": must be an RFC 3339 time'))
        generation = cond.get("observedGeneration", 0)
        if not isinstance(generation, int) or generation < 0:
            causes.append((f"{where}.observedGeneration", "FieldValueInvalid",
                           f"Invalid value: {generation!r}: must be greater than or equal "
                           "to zero"))
