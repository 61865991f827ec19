"""The CONNECT front's config: which nodes the control plane (kube-apiserver's egress
selector, Prometheus) may reach and on which ports (`ConnectNode`, part of the servers'
RoutesConfig), and where the server listens for it (`ConnectFrontConfig`, a process
setting: a Unix socket, or TCP with mutual TLS).

`CONTROL_PLANE_PURPOSE` is the stream metadata the server puts on every stream the front
opens, so an agent checks those against its `control_plane` rules (NodeConfig) instead of
its ordinary allow list: a compromised server cannot pass a control-plane stream off as
anything wider than what the node's own config allows."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator, model_validator

from nodeagent.config.base import ConfigPath, ListenAddress, Model, PortRange

# Stream metadata key and value that mark a stream the CONNECT front opened.
PURPOSE_KEY = "purpose"
CONTROL_PLANE_PURPOSE = "control-plane"
KUBELET_PORT = 10250
# The client certificate kube-apiserver presents to the CONNECT front's TCP listener: the
# egress selector's `tlsConfig.clientCert`, for which docs/control-plane-access.md names
# kubeadm's apiserver-kubelet-client.crt (the certificate kube-apiserver already uses to
# reach kubelets). Its CN is this; its O (system:masters, or kubeadm:cluster-admins since
# kubeadm 1.29) is shared with admin credentials, so the default names the CN alone.
APISERVER_CLIENT_CN = "kube-apiserver-kubelet-client"


class ConnectNode(Model):
    """How the CONNECT front reaches one node."""

    # The names and addresses CONNECT may use for this node besides its name: its
    # InternalIP, ExternalIP and Hostname addresses (the controller copies them from the
    # Node). The first IP address is what the agent dials for a CONNECT by name.
    addresses: tuple[str, ...] = ()
    # Ports on the node's own addresses the control plane may reach.
    ports: tuple[PortRange, ...] = (PortRange(first=KUBELET_PORT, last=KUBELET_PORT),)
    # Ports on pod addresses inside the node's `node_cidrs` (webhooks, aggregated APIs);
    # empty: no pod address is reachable.
    pod_ports: tuple[PortRange, ...] = ()

    @field_validator("addresses")
    @classmethod
    def _lower(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a.lower() for a in v)

    def dial_host(self) -> str:
        """What the agent dials for a CONNECT by node name: the first IP address, or the
        node's loopback when none is known."""
        for address in self.addresses:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                continue
            return address
        return "127.0.0.1"


class ConnectTls(Model):
    """The TCP listener's TLS: its certificate, and the CA whose client certificates it
    accepts (always required: an unauthenticated client never gets a byte through)."""

    cert_file: ConfigPath | None = None  # None: the tunnel's certificate (tls.cert_file)
    key_file: ConfigPath | None = None
    client_ca_file: ConfigPath
    # Which of that CA's client certificates may use the front: its subject CN is one of
    # `allowed_subjects`, or one of its O is in `allowed_organizations`. The cluster's CA
    # also signs every kubelet's client certificate (CN system:node:<name>, O
    # system:nodes): without this, an edge node's kubelet credential would reach every
    # other node's kubelet through the front. "*" in allowed_subjects: any certificate of
    # the CA (only for a CA dedicated to the front's clients).
    allowed_subjects: tuple[str, ...] = (APISERVER_CLIENT_CN,)
    allowed_organizations: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _pair(self) -> ConnectTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if not self.allowed_subjects and not self.allowed_organizations:
            raise ValueError("allowed_subjects and allowed_organizations are both empty: "
                             "no client could use the front")
        if any(not v.strip() for v in self.allowed_subjects + self.allowed_organizations):
            raise ValueError("allowed_subjects and allowed_organizations take non-empty "
                             "names")
        return self


class ConnectFrontConfig(Model):
    """Where the server accepts HTTP CONNECT (and absolute-form HTTP proxy requests) from
    the control plane. Off unless `uds` or `listen` is set."""

    # A Unix socket (kube-apiserver's `transport.uds`): whoever may open the file is
    # trusted, so its mode and owner are the authentication.
    uds: ConfigPath | None = None
    uds_mode: int = Field(default=0o600, ge=0, le=0o777)
    uds_owner: int | None = None  # uid; None: the server's own
    uds_group: int | None = None  # gid; with uds_mode 0o660 lets a group in
    # TCP with mutual TLS (kube-apiserver's `transport.tcp` with a tlsConfig).
    listen: ListenAddress | None = None
    tls: ConnectTls | None = None
    # A client that has not sent its request head within this many seconds gets 408.
    head_timeout: float = Field(default=10.0, gt=0, le=300)
    # Streams open at once through the front; over it a request gets 503.
    max_streams: int = Field(default=10_000, ge=1)

    @field_validator("uds_mode")
    @classmethod
    def _mode(cls, v: int) -> int:
        if v & 0o007:
            raise ValueError(f"uds_mode {v:#o} lets every local user in; use 0o600 or 0o660")
        return v

    @model_validator(mode="after")
    def _tls(self) -> ConnectFrontConfig:
        if self.listen is not None and self.tls is None:
            raise ValueError("listen needs tls.client_ca_file: the TCP listener accepts only "
                             "clients with a certificate from that CA")
        return self

    @property
    def enabled(self) -> bool:
        return self.uds is not None or self.listen is not None
