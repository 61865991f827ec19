"""The agent role: on every node, holds the tunnel to the servers, dials node-local
targets for the streams they open, and intercepts selected pod traffic.

`agent.py` is the Agent itself, `intercept/` the node's transparent proxy, `main.py` the
entry point (from a config file, or from the controller's config stream).
"""
