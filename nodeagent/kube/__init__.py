"""nodeagent's Kubernetes access: credentials, REST client, informers, leader election, Events.

Import from here; the submodules are an implementation detail of this package. The
controller logic lives elsewhere and only consumes this API (never the other way round).

    async with KubeClient(load_credentials()) as kube:
        informers = SharedInformers(kube)
        ingresses = informers.cache(INGRESSES)
        slices = informers.cache(ENDPOINTSLICES)
        slices.add_index("service", lambda o: [o["metadata"].get("labels", {}).get(
            "kubernetes.io/service-name", "")])
        recompute = Debouncer(controller.recompute, delay=0.05)
        for cache in (ingresses, slices):
            cache.add_handler(recompute.trigger)
        elector = LeaderElector(kube, name="nodeagent-controller", namespace=ns,
                                identity=pod_name)

        async def lead() -> None:                      # only while holding the Lease
            async with trio.open_nursery() as nursery:
                await nursery.start(recompute.run)
                recompute.trigger()

        async with trio.open_nursery() as nursery:
            await nursery.start(informers.run)         # returns once every cache synced;
            await elector.run(lead)                    # standbys keep warm caches too
"""

from nodeagent.kube.client import (
    KubeClient,
    ListPage,
    Object,
    ObjectList,
    WatchEvent,
    WatchStream,
    object_key,
    selector_string,
)
from nodeagent.kube.credentials import (
    ConfigurationAuth,
    Credentials,
    CredentialsError,
    TokenFileAuth,
    load_credentials,
    load_incluster,
    load_kubeconfig,
)
from nodeagent.kube.errors import (
    AlreadyExists,
    ApiUnreachable,
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    KubeError,
    NotFound,
    ServerError,
    Unauthorized,
)
from nodeagent.kube.events import EventRecorder, object_reference
from nodeagent.kube.informer import (
    Cache,
    CacheEvent,
    Debouncer,
    Informer,
    SharedInformers,
)
from nodeagent.kube.leader import LeaderElector
from nodeagent.kube.resources import (
    CONFIGMAPS,
    CUSTOMRESOURCEDEFINITIONS,
    ENDPOINTSLICES,
    EVENTS,
    INGRESSCLASSES,
    INGRESSES,
    LEASES,
    NAMESPACES,
    NODEAGENT_GROUP,
    NODEAGENT_VERSION,
    NODES,
    PODS,
    SECRETS,
    SERVICES,
    TOKENREVIEWS,
    Resource,
    custom_resource,
)
from tunnel.backoff import Backoff

__all__ = [
    "CONFIGMAPS",
    "CUSTOMRESOURCEDEFINITIONS",
    "ENDPOINTSLICES",
    "EVENTS",
    "INGRESSCLASSES",
    "INGRESSES",
    "LEASES",
    "NAMESPACES",
    "NODEAGENT_GROUP",
    "NODEAGENT_VERSION",
    "NODES",
    "PODS",
    "SECRETS",
    "SERVICES",
    "TOKENREVIEWS",
    "AlreadyExists",
    "ApiUnreachable",
    "Backoff",
    "BadRequest",
    "Cache",
    "CacheEvent",
    "ConfigurationAuth",
    "Conflict",
    "Credentials",
    "CredentialsError",
    "Debouncer",
    "EventRecorder",
    "Forbidden",
    "Gone",
    "Informer",
    "Invalid",
    "KubeClient",
    "KubeError",
    "LeaderElector",
    "ListPage",
    "NotFound",
    "Object",
    "ObjectList",
    "Resource",
    "ServerError",
    "SharedInformers",
    "TokenFileAuth",
    "Unauthorized",
    "WatchEvent",
    "WatchStream",
    "custom_resource",
    "load_credentials",
    "load_incluster",
    "load_kubeconfig",
    "object_key",
    "object_reference",
    "selector_string",
]
