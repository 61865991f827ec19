"""Which backends the routes want checked, and how the balancer reads the states."""

from __future__ import annotations

from nodeagent.config import RoutesConfig
from nodeagent.http.balancer import Balancer
from nodeagent.http.routetable import Backend, Route
from nodeagent.server.healthwatch import BackendHealth, Reported, wanted_checks

CHECK = {"kind": "http", "path": "/healthz"}


def test_wanted_checks_by_node() -> None:
    routes = RoutesConfig.model_validate({
        "tcp": [{"listen": "127.0.0.1:1000", "node": "a", "target": "10.0.0.1:22",
                 "health_check": {"kind": "tcp"}},
                {"listen": "127.0.0.1:1001", "node": "a", "target": "10.0.0.9:22"}],
        "http": [{"listen": "127.0.0.1:1002", "routes": [
            {"host": "x.test", "node": "b", "target": "10.0.1.1:80", "health_check": CHECK},
            {"host": "y.test", "target": "10.0.1.2:80", "health_check": CHECK}]}],
        "ingress": {"rules": [{"name": "ns/web", "health_check": CHECK, "backends": [
            {"node": "a", "target": "10.0.0.2:8080"}, {"node": "b", "target": "10.0.1.1:80"},
            {"target": "example.com:80"}]}]},
    })
    wanted = wanted_checks(routes)
    assert {node: [(c.host, c.port, c.check.kind) for c in checks]
            for node, checks in wanted.items()} == {
        "a": [("10.0.0.1", 22, "tcp"), ("10.0.0.2", 8080, "http")],
        "b": [("10.0.1.1", 80, "http")],  # once, though two routes name it
    }


def test_balancer_skips_unhealthy_until_none_is_left() -> None:
    health = BackendHealth()
    a, b = Backend("n", "10.0.0.1", 80), Backend("n", "10.0.0.2", 80)
    route = Route(name="r", backends=(a, b))
    balancer = Balancer(unhealthy=health.unhealthy)
    assert {balancer.candidates(route)[0] for _ in range(4)} == {a, b}
    health.states[("n", "10.0.0.2", 80)] = Reported("unhealthy", "503", 0)
    assert all(balancer.candidates(route) == (a,) for _ in range(4))
    health.states[("n", "10.0.0.1", 80)] = Reported("unhealthy", "503", 0)
    assert {balancer.candidates(route)[0] for _ in range(4)} == {a, b}  # all: as before
    health.forget("n")
    assert len(balancer.candidates(route)) == 2


async def test_watch_asks_records_and_ignores_what_it_did_not_ask() -> None:
    import trio
    import trio.testing

    from nodeagent.config.health import CheckRequest, HealthReport
    from nodeagent.ops.logs import get_logger
    from nodeagent.server.healthwatch import HealthWatch

    routes = RoutesConfig.model_validate({"ingress": {"rules": [{
        "name": "ns/web", "health_check": CHECK,
        "backends": [{"node": "a", "target": "10.0.0.2:8080"}]}]}})
    ends: list[trio.abc.Stream] = []
    opened = trio.Event()

    async def open_stream(node: str, target: object, metadata: dict[str, str]) -> object:
        assert node == "a" and metadata == {"purpose": "health"}
        server_end, agent_end = trio.testing.memory_stream_pair()
        ends.append(agent_end)
        opened.set()
        return server_end

    async def wait_for_node(node: str) -> None:
        pass

    health = BackendHealth()
    watch = HealthWatch(open_stream=open_stream, wait_for_node=wait_for_node,  # type: ignore[arg-type]
                        health=health, log=get_logger("test"))
    watch.update(routes)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        with trio.fail_after(5):
            await opened.wait()
            agent = ends[0]
            line = await agent.receive_some(65536)
            request = CheckRequest.parse(line.rstrip(b"\n"))
            assert [(c.host, c.port) for c in request.checks] == [("10.0.0.2", 8080)]
            await agent.send_all(HealthReport(host="10.9.9.9", port=1, state="unhealthy")
                                 .line())  # not asked: ignored
            await agent.send_all(HealthReport(host="10.0.0.2", port=8080,
                                              state="unhealthy", detail="503").line())
            await trio.testing.wait_all_tasks_blocked()
        assert list(health.states) == [("a", "10.0.0.2", 8080)]
        assert health.unhealthy(Backend("a", "10.0.0.2", 8080))
        # A malformed report ends the stream and forgets the node's states.
        await agent.send_all(b"garbage\n")
        await trio.testing.wait_all_tasks_blocked()
        assert not health.states
        watch.stop()
        nursery.cancel_scope.cancel()


def test_load_balancer_ports_skip_unhealthy_backends_and_are_checked() -> None:
    from nodeagent.config import LoadBalancerPort
    from nodeagent.server.loadbalancers import BalancedPort

    config = LoadBalancerPort.model_validate({
        "port": 5432, "proxy_protocol": "v1", "health_check": {"kind": "tcp"},
        "backends": [{"node": "a", "target": "10.0.0.1:5432"},
                     {"node": "b", "target": "10.0.0.2:5432"}]})
    routes = RoutesConfig.model_validate({"load_balancers": [
        {"name": "ns/db", "ports": [config.model_dump()]}]})
    assert {node: [(c.host, c.port) for c in checks]
            for node, checks in wanted_checks(routes).items()} == {
        "a": [("10.0.0.1", 5432)], "b": [("10.0.0.2", 5432)]}
    port = BalancedPort(service="ns/db", config=config)
    port.set_backends(config, "0.0.0.0")
    assert {m.proxy_protocol for m in port.mappings} == {"v1"}
    health = BackendHealth()

    def unhealthy(m: object) -> bool:
        return health.unhealthy(Backend(m.node, m.target.host, m.target.port))  # type: ignore[attr-defined]

    picks = {port.pick(lambda node: True, unhealthy).node for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}
    health.states[("b", "10.0.0.2", 5432)] = Reported("unhealthy", "refused", 0)
    assert {port.pick(lambda node: True, unhealthy).node for _ in range(4)} == {"a"}  # type: ignore[union-attr]
    health.states[("a", "10.0.0.1", 5432)] = Reported("unhealthy", "refused", 0)
    assert {port.pick(lambda node: True, unhealthy).node for _ in range(4)} == {"a", "b"}  # type: ignore[union-attr]
