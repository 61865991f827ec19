"""A fake Kubernetes API server for tests: real HTTP, the real list/watch protocol.

    fake = FakeKube(token="admin-token")          # auth required; tls=True for HTTPS
    url = await nursery.start(fake.serve)          # 127.0.0.1, random port
    fake.write_kubeconfig(tmp_path / "kubeconfig")

Fixtures (`fake_kube`, `kube`) live in `tests.fakekube.fixtures`; import them into a
conftest.py. `python -m tests.fakekube --port N` runs it as a separate process.
"""

from tests.fakekube.kubeconfig import write_kubeconfig
from tests.fakekube.pki import CertificateAuthority, CertPair
from tests.fakekube.server import FakeKube, RecordedRequest, TokenInfo, request_matcher
from tests.fakekube.store import API_AUDIENCE, ApiError, Store

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
