"""What operators see of every role: structured logs (and rate-limited ones), Prometheus
metrics, the health endpoint, the node-local debug socket and the `nodeagent debug` CLI,
and the one interface every role's listeners implement (`listener`)."""
