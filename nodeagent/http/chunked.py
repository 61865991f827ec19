"""The chunk-size lines of a client's chunked request body, held to RFC 9112 §7.1, sans-IO.

h11 reads the body, but is lenient about its chunk-size lines: up to 20 hex digits (sizes
of 2^64 and more), whitespace before the CRLF, and anything after a `;`. This front
re-frames every body, so that cannot desynchronise it; but a proxy in front of it that
reads sizes modulo 2^64, or that stops at whitespace or a bad extension, frames the same
bytes differently, and the difference is a smuggled request. So each line must be

    chunk-size [ chunk-ext ] CRLF
    chunk-size = 1*16HEXDIG, below 2^63
    chunk-ext  = *( BWS ";" BWS token [ BWS "=" BWS ( token / quoted-string ) ] )

and at most `MAX_LINE` bytes. `ChunkedBodyCheck` follows the body as it arrives (the same
bytes h11 is fed, before h11 reads them) up to the last chunk: h11 still reads the
trailers and everything else.
"""

from __future__ import annotations

import re
from typing import Final

MAX_SIZE: Final = 2**63 - 1
MAX_LINE: Final = 4096
"""A chunk-size line with its extensions, CRLF included."""

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_LINE = re.compile(
    rb"([0-9A-Fa-f]{1,16})(?:[ \t]*;[ \t]*%b(?:[ \t]*=[ \t]*(?:%b|%b))?)*\r\n"
    % (_TOKEN, _TOKEN, _QUOTED)
)

PROBLEM: Final = (
    "bad chunk size line (RFC 9112: 1-16 hex digits below 2^63, then only ';' extensions, "
    "then CRLF)"
)

_SIZE, _DATA, _CRLF, _DONE = range(4)


def chunk_size(line: bytes) -> int | None:
    """The size a chunk-size line (CRLF included) declares, or None if it breaks the rule."""
    m = _LINE.fullmatch(line)
    if m is None:
        return None
    size = int(m.group(1), 16)
    return size if size <= MAX_SIZE else None


class ChunkedBodyCheck:
    """Follows one chunked body through `feed(bytes)` to its last chunk; `problem` is set
    (and stays) at the first chunk-size line or chunk end that breaks the rule."""

    __slots__ = ("_line", "_remaining", "_state", "problem")

    def __init__(self) -> None:
        self._state = _SIZE
        self._line = b""
        self._remaining = 0
        self.problem: str | None = None

    @property
    def done(self) -> bool:
        """The last chunk's size line was read (or the body was refused)."""
        return self._state == _DONE or self.problem is not None

    def feed(self, data: bytes) -> str | None:
        """The next bytes of the body (more may follow them); returns `problem`."""
        pos = 0
        end = len(data)
        while pos < end and not self.done:
            state = self._state
            if state == _DATA:
                take = min(self._remaining, end - pos)
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _CRLF
            elif state == _CRLF:
                piece = data[pos : pos + 2 - len(self._line)]
                pos += len(piece)
                self._line += piece
                if not b"\r\n".startswith(self._line):
                    self.problem = "chunk data not followed by CRLF"
                elif len(self._line) == 2:
                    self._line = b""
                    self._state = _SIZE
            else:
                eol = data.find(b"\n", pos)
                stop = end if eol < 0 else eol + 1
                line = self._line + data[pos:stop]
                pos = stop
                if len(line) > MAX_LINE:
                    self.problem = f"chunk size line over {MAX_LINE} bytes"
                elif eol < 0:
                    self._line = line
                else:
                    self._line = b""
                    size = chunk_size(line)
                    if size is None:
                        self.problem = PROBLEM
                    elif size:
                        self._remaining = size
                        self._state = _DATA
                    else:
                        self._state = _DONE
        return self.problem


__all__ = ["MAX_LINE", "MAX_SIZE", "PROBLEM", "ChunkedBodyCheck", "chunk_size"]
