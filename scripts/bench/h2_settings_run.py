"""`python -m scripts.bench.h2_settings_run JSON ARGS...`: `python -m nodeagent ARGS...`
with the front's HTTP/2 settings replaced first, for `scripts.bench.h2 --variants`
(benchmark only: the product has no setting for them).

JSON maps `H2Settings` fields to values (the client-facing settings' defaults); keys
prefixed `pool_` replace those of `h2pool.UPSTREAM_SETTINGS` (h2c backends) instead, and
an unprefixed key applies to both.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def patch(overrides: dict[str, int]) -> None:
    from nodeagent.http import h2pool, h2session

    client = {k: v for k, v in overrides.items() if not k.startswith("pool_")}
    upstream = {**client, **{k[5:]: v for k, v in overrides.items() if k.startswith("pool_")}}
    init = h2session.H2Settings.__init__
    names = [f.name for f in dataclasses.fields(h2session.H2Settings)]
    defaults = list(init.__defaults__ or ())
    for name, value in client.items():
        defaults[names.index(name)] = value
    init.__defaults__ = tuple(defaults)  # every H2Settings(...) without that field
    h2pool.UPSTREAM_SETTINGS = dataclasses.replace(h2pool.UPSTREAM_SETTINGS, **upstream)


def main() -> int:
    patch(json.loads(sys.argv[1]))
    from nodeagent.cli import main as nodeagent

    sys.argv = ["nodeagent", *sys.argv[2:]]
    return nodeagent()


if __name__ == "__main__":
    sys.exit(main())
