from nodeagent.testing.fakekube.fixtures import fake_kube, fake_kube_tls, kube

__all__ = ["fake_kube", "fake_kube_tls", "kube"]
