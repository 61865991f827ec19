"""The config stream between the controller and the agents and servers it configures.

`protocol` is the wire contract both ends share (paths, heartbeat header, line format);
`client` keeps one watch open and applies what arrives. The controller's side is
`nodeagent.controller.configserver`.
"""
