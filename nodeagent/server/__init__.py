"""The server role: terminates the agents' tunnels and carries public TCP ports and HTTP
(routed by Host and path, Ingress) through them.

`server.py` is the Server itself, `main.py` the entry point (from a config file, or from
the controller's config stream).
"""
