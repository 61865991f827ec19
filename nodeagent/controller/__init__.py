"""The thin cluster controller: watches the Kubernetes API, computes versioned config per
node and per server, serves it as a watch stream, keeps CRDs and Ingress status current.

    main.py        `nodeagent controller`: command-line arguments → ControllerSettings
    controller.py  the process: caches, recompute, config stream, the leader's write task
    inputs.py      which cache changes feed the config (a recompute) or the leader's writes
    compute.py     the config computation, pure: objects in, config out
    ingress.py     Ingress objects → Ingress routes, pure
    stream.py      the config watch stream (HTTP)
    bootstrap.py   the agent token Secret and the PKI (CA, servers' certificate)
    status.py      Ingress/ClusterTunnel status, Events, the replicas' watcher reports
    crds.py        the CRDs, generated from nodeagent.crd, and their installation
"""
