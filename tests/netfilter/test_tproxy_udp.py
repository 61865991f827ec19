"""TPROXY for UDP (DNS-sized datagrams): the original destination per datagram, and
replies that come back from the address the client sent to."""

from __future__ import annotations

import socket
import threading

import pytest

from netfilter import sockets
from netfilter.model import InterceptModel, InterceptRule, Mode
from netfilter.nftables import NftablesBackend
from netfilter.routing import PolicyRouting
from tests.netfilter.lab import REMOTE4, Lab, netns
from tests.netfilter.models import PORTS

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]

UDP_PORT = 5353


def _serve_one(listener: socket.socket, ns: str) -> None:
    try:
        data, source, original = sockets.recv_with_original_dst(listener)
    except OSError:
        return
    # The reply socket must live in the node's namespace, like the listener.
    with netns(ns):
        reply = sockets.transparent_udp_reply_socket(original)
    with reply:
        reply.sendto(f"proxy {original[0]} {original[1]} {data.decode()}".encode(),
                     source[:2])


def test_udp_tproxy_v4(lab: Lab, nft: NftablesBackend) -> None:
    model = InterceptModel(
        rules=(InterceptRule.parse("dns", "udp", ["198.51.100.0/24"], ports=[UDP_PORT]),),
        proxy_ports=PORTS, mode=Mode.TPROXY,
    )
    PolicyRouting(model.tproxy_mark, model.route_table, netns=lab.ns("node")).ensure()
    nft.apply(model)

    with netns(lab.ns("node")):
        listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with listener:
        sockets.set_transparent(listener)
        sockets.enable_recv_original_dst(listener)
        listener.settimeout(3)  # the server thread gives up rather than hang
        listener.bind(("0.0.0.0", PORTS.udp4))
        server = threading.Thread(target=_serve_one, args=(listener, lab.ns("node")), daemon=True)
        server.start()

        with netns(lab.ns("pod")):
            client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with client:
            client.settimeout(2)
            client.sendto(b"query", (REMOTE4[0], UDP_PORT))
            data, source = client.recvfrom(512)
        server.join(2)
    assert data == f"proxy {REMOTE4[0]} {UDP_PORT} query".encode()
    # The answer comes from the address the client asked, so a connected UDP client
    # (and every DNS resolver) accepts it.
    assert source == (REMOTE4[0], UDP_PORT)
