"""HTTP/2's connection preface (RFC 9113 §3.4): a plaintext connection that starts with it
speaks h2c with prior knowledge. Its own module so that the front tells h2c from HTTP/1.1
without loading HTTP/2 (`ondemand`); `h2session` checks it in what a client sends."""

from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

__all__ = ["PREFACE"]
