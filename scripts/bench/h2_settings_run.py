"""`python -m scripts.bench.h2_settings_run JSON ARGS...`: `python -m nodeagent ARGS...`
with the front's HTTP/2 settings replaced first, for `scripts.bench.h2 --variants`
(benchmark only: the product has no setting for them).

JSON maps `H2Settings` fields to values (the client-facing settings' defaults); keys
prefixed `pool_` replace those of `h2pool.UPSTREAM_SETTINGS` (h2c backends) instead, and
an unprefixed key applies to both. Keys prefixed `tunnel_` replace the defaults of the
tunnel protocol's `Settings` (`tunnel_initial_stream_window`: the credit each side gives
a stream), for the server and the agent alike.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def patch(overrides: dict[str, int]) -> None:
    from nodeagent.http import h2pool, h2session
    from tunnel.protocol import wire

    tunnel = {k[7:]: v for k, v in overrides.items() if k.startswith("tunnel_")}
    overrides = {k: v for k, v in overrides.items() if not k.startswith("tunnel_")}
    client = {k: v for k, v in overrides.items() if not k.startswith("pool_")}
    upstream = {**client, **{k[5:]: v for k, v in overrides.items() if k.startswith("pool_")}}
    _set_defaults(h2session.H2Settings, client)  # every H2Settings(...) without that field
    h2pool.UPSTREAM_SETTINGS = dataclasses.replace(h2pool.UPSTREAM_SETTINGS, **upstream)
    _set_defaults(wire.Settings, tunnel)  # each tunnel connection's `Settings()`


def _set_defaults(cls: type, values: dict[str, int]) -> None:
    init = cls.__init__  # type: ignore[misc]
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = list(init.__defaults__ or ())
    for name, value in values.items():
        defaults[names.index(name)] = value
    init.__defaults__ = tuple(defaults)


def main() -> int:
    patch(json.loads(sys.argv[1]))
    from nodeagent.cli import main as nodeagent

    sys.argv = ["nodeagent", *sys.argv[2:]]
    return nodeagent()


if __name__ == "__main__":
    sys.exit(main())
