"""Transparent interception on the node: `rules` (config → netfilter model, no I/O) and
`listener` (the kernel kept in step, and the proxy serving what the rules catch)."""
