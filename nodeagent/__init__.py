"""nodeagent: connect Kubernetes nodes behind NAT to a cloud side."""

__version__ = "0.1.0"
