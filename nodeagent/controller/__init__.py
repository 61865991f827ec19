"""The thin cluster controller: watches the Kubernetes API, computes versioned config per
node and per server, serves it as a watch stream, keeps CRDs and Ingress status current.

    main.py        `nodeagent controller`: command-line arguments → ControllerSettings
    controller.py  the process: caches, recompute, config stream, the leader's write task
    inputs.py      which cache changes feed the config (a recompute) or the leader's writes
    compute.py     the config computation, pure: objects in, config out
    ingress.py     Ingress objects → Ingress routes, pure
    stream.py      the config watch stream (HTTP over TLS) and who may read what
    signing.py     POST /v1/certificates: TokenReview → a node's or a server's certificate
    servingtls.py  the config stream's serving certificate, issued in memory from the CA
    metrics.py     the controller's Prometheus metrics (certificates, refusals, recompute
                   duration, watch restarts)
    bootstrap.py   the PKI (CA, its ConfigMap, servers' tunnel certificate)
    status.py      Ingress/ClusterTunnel status, Events, the replicas' watcher reports
    crds.py        the CRDs, generated from clustertunnel.py, and their installation
"""
