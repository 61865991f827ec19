"""The thin cluster controller: watches the Kubernetes API, computes versioned config per
node and per server, serves it as a watch stream, keeps CRDs and Ingress status current."""
