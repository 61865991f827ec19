"""A fake Kubernetes API server for tests: real HTTP, the real list/watch protocol.

    fake = FakeKube(token="admin-token")          # auth required; tls=True for HTTPS
    url = await nursery.start(fake.serve)          # 127.0.0.1, random port
    fake.write_kubeconfig(tmp_path / "kubeconfig")

Fixtures (`fake_kube`, `kube`) live in `nodeagent.testing.fakekube.fixtures`; import them into a
conftest.py. `python -m nodeagent.testing.fakekube --port N` runs it as a separate process;
`localcluster.py` drives it the way a user drives a cluster (kubectl, processes run with the
applied workloads' flags) for the kubectl end-to-end test and `scripts/demo --cluster`.

Known differences from kube-apiserver, in one place (each module says more):
- Nothing runs by default: no scheduler, kubelet, Deployment/DaemonSet controller or cloud
  load balancer; workload and Service status is written by whoever needs it. The optional
  `workloads.WorkloadSimulator` (`--workloads`) stands in for the Deployment/StatefulSet,
  kubelet and EndpointSlice controllers, roughly; the scale subresource is `scale.py`.
- Types: only those nodeagent and its tests use (`registry.py`); no core v1 Endpoints and
  no events.k8s.io (kubectl describe reads core v1 Events, which are served).
- Apply: server-side apply merges maps but replaces lists whole (`patch.py`).
- CRD schemas: no CEL rules, formats or ratcheting (`schema.py`).
- OpenAPI: v3 only; `fieldValidation=Strict` rejects unknown fields of custom objects
  only, not of built-in kinds, and Warn sends no warning (`openapi.py`).
- RBAC: aggregated ClusterRoles are not aggregated (no admin/edit/view), no escalation
  check (`rbac.py`).
- Tables: watches are not served as Tables; only the listed types have their own columns
  (`table.py`).
- Authentication: bearer tokens from the fake's own table (ServiceAccount tokens with
  bound-token claims, checked by TokenReview) and x509 client certificates; no OIDC or
  authentication webhooks.
"""

from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.kubeconfig import write_kubeconfig
from nodeagent.testing.fakekube.pki import CertificateAuthority, CertPair
from nodeagent.testing.fakekube.server import (
    API_AUDIENCE,
    FakeKube,
    RecordedRequest,
    TokenInfo,
    request_matcher,
)
from nodeagent.testing.fakekube.store import Store

__all__ = [
    "API_AUDIENCE",
    "ApiError",
    "CertPair",
    "CertificateAuthority",
    "FakeKube",
    "RecordedRequest",
    "Store",
    "TokenInfo",
    "request_matcher",
    "write_kubeconfig",
]
