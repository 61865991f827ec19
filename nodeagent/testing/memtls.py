"""Two TLS ends in memory: `ssl.SSLObject`s over `ssl.MemoryBIO`s, handshake done.

Every case is a real TLS handshake and real records, with no socket and no task: what
tests of certificates, cipher suites and record sizes need.
"""

from __future__ import annotations

import dataclasses
import ssl


@dataclasses.dataclass
class MemoryTLS:
    """A client and a server end, and the four BIOs between them: what each end reads
    from (`*_in`) and writes to (`*_out`)."""

    client: ssl.SSLObject
    server: ssl.SSLObject
    client_in: ssl.MemoryBIO
    client_out: ssl.MemoryBIO
    server_in: ssl.MemoryBIO
    server_out: ssl.MemoryBIO

    def to_server(self) -> None:
        """Deliver what the client wrote."""
        self.server_in.write(self.client_out.read())

    def to_client(self) -> None:
        """Deliver what the server wrote."""
        self.client_in.write(self.server_out.read())


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
              server_hostname: str = "localhost", rounds: int = 20) -> MemoryTLS:
    """Run a handshake between two contexts; raises the first end's `ssl.SSLError`, once
    its alert reached the other end. TLS 1.3 servers check a client certificate after
    the client finished and send session tickets after the handshake, so the client
    reads once at the end, as `tunnel.dial` does: a rejection raises there, and the
    tickets are taken off the client's BIO."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    tls = MemoryTLS(
        client=client_ctx.wrap_bio(client_in, client_out, server_hostname=server_hostname),
        server=server_ctx.wrap_bio(server_in, server_out, server_side=True),
        client_in=client_in, client_out=client_out, server_in=server_in,
        server_out=server_out)
    done = {"client": False, "server": False}
    for _ in range(rounds):
        for name, end in (("client", tls.client), ("server", tls.server)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError:
                    tls.to_server() if name == "client" else tls.to_client()
                    raise
            tls.to_server()
            tls.to_client()
        if all(done.values()):
            break
    else:
        raise ssl.SSLError(f"no handshake in {rounds} rounds: {done}")
    tls.to_client()
    try:
        tls.client.read(1)
    except ssl.SSLWantReadError:
        pass
    return tls
