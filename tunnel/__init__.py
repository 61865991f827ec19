"""The multiplexed tunnel: a sans-IO protocol core, transports, and trio endpoints.

This package knows nothing of Kubernetes, of nodeagent's config, or of netfilter.
"""
