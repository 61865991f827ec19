"""Reaching the tunnel server through a forward proxy: an HTTP CONNECT proxy or SOCKS5.

Branch offices often reach the internet only through one. The agent opens its TCP
connection to the proxy, asks it for a byte stream to the server, and then speaks TLS
(and the WebSocket upgrade) inside that stream exactly as it would on a direct socket:
the proxy never sees the tunnel's contents or its token.

- `url`: proxy URLs (`http://user:pass@host:port`, `socks5://...`), their redacted form
  for logs, and which proxy an endpoint goes through (`ProxyRules`: an explicit URL, or
  `HTTPS_PROXY`/`HTTP_PROXY`/`NO_PROXY` read as Kubernetes components read them).
- `handshake`: the proxy handshakes without I/O, bytes in and bytes out: HTTP CONNECT
  (the response parsed by h11) and SOCKS5 (the messages by socksio). tunnel.dial runs
  them over the socket. (Imported from there: config code names proxy URLs without
  loading h11 and socksio.)
"""

from tunnel.proxy.url import DIRECT, ProxyRules, ProxyURL, parse_proxy_url

__all__ = ["DIRECT", "ProxyRules", "ProxyURL", "parse_proxy_url"]
