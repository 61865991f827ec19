"""The server role: terminates the agents' tunnels and carries public TCP ports and HTTP
(routed by Host and path, Ingress) through them.

One module per job: `routetables` (the routes in force), `agentauth` (who an agent is and
revoking it), `datapath` (what a stream may reach, DNS-safe dialing), `refusals` (their
count and log), `openers` (the streams agents open, the HTTP fronts' upstreams),
`tcpmappings`, `connect`/`connectfront` and `dnat` (the control plane's ways to nodes),
`debugviews`, `readiness`. `server.py` wires them into a `Server`; `listeners.py` lists
its listeners; `main.py` is the entry point (from a config file, or from the
controller's config stream); `workers.py` runs several server processes on one host.
"""
