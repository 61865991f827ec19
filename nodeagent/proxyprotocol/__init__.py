"""The PROXY protocol (haproxy's proxy-protocol.txt): the header a load balancer puts in
front of a connection to say whose it is, and the one the server puts in front of a
backend's. `header` is the sans-IO core (build v1/v2, parse v2), `receive` the thin trio
shell that reads one from a trusted load balancer's connection with a deadline and
counts and logs every refusal."""

from nodeagent.proxyprotocol.header import (
    V2_SIGNATURE,
    ProxyHeader,
    ProxyHeaderError,
    build_header,
    parse_v2,
    v2_length,
)

__all__ = ["V2_SIGNATURE", "ProxyHeader", "ProxyHeaderError", "build_header", "parse_v2",
           "v2_length"]
