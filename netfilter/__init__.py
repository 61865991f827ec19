"""Node interception: a pure rule model and the nftables/iptables backends that apply it.

This package knows nothing of Kubernetes or of the tunnel. The agent builds an
`InterceptModel`, validates it against the host (`validate_model(model,
list_interfaces())`), sets up policy routing when `model.needs_policy_routing`, and hands
the model to the backend `detect_backend()` picked. Every call here blocks (subprocess or
netlink); run them in a worker thread from trio.
"""

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
