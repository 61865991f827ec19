"""Request-target normalisation, table-driven: what routing sees is what the backend gets."""

from __future__ import annotations

import pytest

from nodeagent.http.paths import BadTarget, clip, normalize_target

NORMALISED = [
    # target, normalised
    (b"/", b"/"),
    (b"/api/v1/items?x=1", b"/api/v1/items?x=1"),
    (b"*", b"*"),
    (b"/.well-known/acme", b"/.well-known/acme"),
    (b"/a/..b/c.", b"/a/..b/c."),
    (b"/api/../admin", b"/admin"),
    (b"/a/./b", b"/a/b"),
    (b"/a/b/../c", b"/a/c"),
    (b"/a/.", b"/a/"),
    (b"/a/..", b"/"),
    (b"/a/b/..", b"/a/"),
    (b"/.", b"/"),
    (b"/a//../b", b"/a/b"),
    (b"/a/./../b/", b"/b/"),
    (b"/api/%2e%2e/admin", b"/admin"),
    (b"/api/.%2E/admin", b"/admin"),
    (b"/api/%2e/x", b"/api/x"),
    (b"/%61%70%69/%7Euser", b"/api/~user"),
    (b"/a%2d_%2E~", b"/a-_.~"),
    (b"/caf%c3%a9", b"/caf%C3%A9"),
    (b"/a%20b%3f", b"/a%20b%3F"),
    (b"/a%3fb", b"/a%3Fb"),
    (b"/%25%32%65", b"/%252e"),  # one decoding only: an encoded '%' stays encoded
    (b"/x?q=/../%2e%2f\\", b"/x?q=/../%2e%2f\\"),  # the query is the backend's
    (b"/a/%2e%2e?q", b"/?q"),
]

REFUSED = [
    # target, the reason's words
    (b"/a%2fb", "encoded '/'"),
    (b"/a%2Fb", "encoded '/'"),
    (b"/a%5cb", "encoded '\\'"),
    (b"/a%00", "encoded NUL"),
    (b"/a\\b", "backslash"),
    (b"/..", "above the root"),
    (b"/a/../..", "above the root"),
    (b"/%2e%2e/etc/passwd", "above the root"),
    (b"/a/../../b", "above the root"),
    (b"/a%zz", "invalid percent-escape"),
    (b"/a%2", "invalid percent-escape"),
    (b"/a%", "invalid percent-escape"),
    (b"/a%+1", "invalid percent-escape"),
    (b"relative", "not a path"),
    (b"host:443", "not a path"),
    (b"../x", "not a path"),
]


@pytest.mark.parametrize(("target", "want"), NORMALISED, ids=[t.decode() for t, _ in NORMALISED])
def test_normalize(target: bytes, want: bytes) -> None:
    got = normalize_target(target)
    assert got == want
    assert normalize_target(got) == got  # idempotent: the backend reads the same path


@pytest.mark.parametrize(("target", "words"), REFUSED, ids=[t.decode() for t, _ in REFUSED])
def test_refused(target: bytes, words: str) -> None:
    with pytest.raises(BadTarget, match=words.replace("\\", "\\\\")):
        normalize_target(target)


def test_common_targets_are_not_copied() -> None:
    target = b"/api/v1/items/42?x=1"
    assert normalize_target(target) is target


def test_clip() -> None:
    assert clip("short") == "short"
    long = "/x" * 500
    assert clip(long).startswith(long[:100]) and clip(long).endswith("(1000 chars)")
    assert len(clip(long)) < 120
