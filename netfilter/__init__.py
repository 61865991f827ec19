"""Node interception: a pure rule model and the nftables/iptables backends that apply it.

This package knows nothing of Kubernetes or of the tunnel. The agent builds an
`InterceptModel`, validates it against the host (`validate_model(model,
list_interfaces())`), sets up policy routing when `model.needs_policy_routing`, and hands
the model to the backend `detect_backend()` picked. Every call here blocks (subprocess or
netlink); run them in a worker thread from trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from netfilter._run import CommandFailed
    from netfilter.detect import Backend, Detection, detect_backend
    from netfilter.iptables import IptablesBackend, render_ipsets, render_iptables
    from netfilter.model import (
        Family,
        InterceptModel,
        InterceptRule,
        InvalidRule,
        Mode,
        NetfilterError,
        PortRange,
        Protocol,
        ProxyPorts,
        validate_model,
    )
    from netfilter.nftables import NftablesBackend, render_nftables
    from netfilter.routing import PolicyRouting, list_interfaces

# Where each name lives, loaded on first use (PEP 562): a process that needs only the
# rule model (the config's validation) or `sockets` does not load the nftables and
# iptables backends (tests/test_imports.py).
_HOME = {
    "CommandFailed": "_run",
    "Backend": "detect", "Detection": "detect", "detect_backend": "detect",
    "IptablesBackend": "iptables", "render_ipsets": "iptables", "render_iptables": "iptables",
    "Family": "model", "InterceptModel": "model", "InterceptRule": "model",
    "InvalidRule": "model", "Mode": "model", "NetfilterError": "model",
    "PortRange": "model", "Protocol": "model", "ProxyPorts": "model",
    "validate_model": "model",
    "NftablesBackend": "nftables", "render_nftables": "nftables",
    "PolicyRouting": "routing", "list_interfaces": "routing",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"netfilter.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Backend",
    "CommandFailed",
    "Detection",
    "Family",
    "InterceptModel",
    "InterceptRule",
    "InvalidRule",
    "IptablesBackend",
    "Mode",
    "NetfilterError",
    "NftablesBackend",
    "PolicyRouting",
    "PortRange",
    "Protocol",
    "ProxyPorts",
    "detect_backend",
    "list_interfaces",
    "render_ipsets",
    "render_iptables",
    "render_nftables",
    "validate_model",
]
