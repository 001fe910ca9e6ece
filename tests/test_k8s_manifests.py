"""deploy/k8s, offline: every overlay under deploy/k8s/overlays renders with `kubectl kustomize`;
every object validates against Kubernetes 1.30's OpenAPI schema (built-in kinds) or a vendored
CRD schema (deploy/k8s/schemas: a custom resource without one fails); every pdserve container's
command line, once its $(VAR)s are expanded from its env and ConfigMap, parses with pdserve's
own argument parser; and the invariants the deployment relies on hold (one test each, below).
Helpers: tests/k8s_helpers.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from k8s_helpers import (
    FIELD_REFS,
    Obj,
    PdserveContainer,
    PodTemplate,
    containers,
    name_of,
    overlay_names,
    parse_pdserve,
    pdserve_containers,
    pod_templates,
    render,
    schema_errors,
    selects,
)

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl is not installed: it renders the kustomize overlays")

OVERLAYS = overlay_names()
ACK = [name for name in OVERLAYS if name.startswith(("ack", "rbg"))]  # rbg: the ack overlay's pods in a RoleBasedGroup
ROLES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")
# overlays without a pdserve router: an endpoint picker routes, decode pods serve the API (gateway mode)
ROUTERLESS = {"gie-pd"}
ERDMA_ANNOTATION = "networking.alibabacloud.com/erdma"
ERDMA_NODE_LABEL = "aliyun.accelerator/erdma"


def roles_of(overlay: str) -> tuple[str, ...]:
    return WORKERS if overlay in ROUTERLESS else ROLES


def by_role(overlay: str) -> dict[str, PdserveContainer]:
    found = pdserve_containers(render(overlay))
    roles = [c.role for c in found]
    assert sorted(roles) == sorted(roles_of(overlay)), f"{overlay}: pdserve containers {roles}, want one per role"
    return {c.role: c for c in found}


def of_kind(overlay: str, kind: str) -> list[Obj]:
    return [o for o in render(overlay) if o["kind"] == kind]


def test_overlays_exist() -> None:
    assert {"cpu", "ack", "ack-cgpu", "rbg", "ack-gateway", "ack-gateway-v1alpha2", "gie-pd"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_their_schemas(overlay: str) -> None:
    objects = render(overlay)
    assert objects, f"{overlay} renders nothing"
    errors = [error for obj in objects for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)


def test_validation_rejects_what_the_api_server_would() -> None:
    """The checks above can fail: a typo in a built-in or a custom resource, a custom resource
    without a vendored schema, a flag pdserve does not have."""
    deployment = next(o for o in render("cpu") if o["kind"] == "Deployment")
    typo = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    assert any("replica" in e for e in schema_errors(typo))
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "m"},
               "spec": {"selector": {}, "podMetricEndpoints": [{"port": "http"}]}}
    assert any("podMetricEndpoints" in e for e in schema_errors(monitor))
    assert not schema_errors({**monitor, "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "http"}]}})
    unknown = {"apiVersion": "example.com/v1", "kind": "Frobnicator", "metadata": {"name": "f"}}
    assert any("no vendored schema" in e for e in schema_errors(unknown))
    assert any("has no apps/v1 Frobnicator" in e for e in schema_errors({**unknown, "apiVersion": "apps/v1"}))
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        parse_pdserve(["serve", "--role", "decode", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="block_size"):
        parse_pdserve(["serve", "--role", "decode", "--block-size", "24"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdserve_command_lines_parse(overlay: str) -> None:
    """Each pdserve container's command + args, $(VAR)s expanded from its env and ConfigMap, parse
    with `pdserve`'s own parser (an unknown flag fails) and make valid configs; one per role."""
    for role, container in by_role(overlay).items():
        assert container.ns.log_format == "json", f"{role}: log pipelines (Loki rules) read JSON lines"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prefill_and_decode_never_share_a_deployment(overlay: str) -> None:
    """One workload per role: a Deployment, or a RoleBasedGroup's role (its own workload)."""
    roles = by_role(overlay)
    for role, container in roles.items():
        pod = container.pod
        assert pod.workload["kind"] in ("Deployment", "RoleBasedGroup") and pod.workload_name == f"pdserve-{role}"
        in_pod = [c.role for c in pdserve_containers(render(overlay)) if c.pod.name == pod.name]
        assert in_pod == [role], f"{pod.name} runs {in_pod}"
        assert pod.labels["app.kubernetes.io/component"] == role
        assert pod.labels["app.kubernetes.io/part-of"] == pod.labels["app.kubernetes.io/name"] == "pdserve"
        assert selects(pod.selector, pod.labels)
        others = [c.pod for r, c in roles.items() if r != role]
        assert not any(selects(pod.selector, other.labels) for other in others)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_roles_agree_on_shared_settings_and_the_router_finds_the_workers(overlay: str) -> None:
    roles = by_role(overlay)
    prefill, decode = roles["prefill"].ns, roles["decode"].ns
    for field in ("model", "dtype", "block_size", "max_model_len", "kv_transport", "served_model_name"):
        assert getattr(prefill, field) == getattr(decode, field), field  # a KV layout mismatch is a 409
    if "router" not in roles:
        return  # the endpoint picker finds the workers (the InferencePool: test_k8s_gie_pd.py)
    router = roles["router"].ns
    for field in ("model", "max_model_len", "served_model_name"):
        assert getattr(router, field) == getattr(prefill, field), field
    assert router.queue == prefill.queue
    services = {s["metadata"]["name"]: s for s in of_kind(overlay, "Service")}
    for role in WORKERS:
        (member,) = getattr(router, role)
        assert member.startswith("dns:"), f"the router finds {role} workers by DNS, got {member}"
        _, name, port = member.split(":")
        service = services[name]
        assert service["spec"]["clusterIP"] == "None", f"{name} must be headless (one A record per pod)"
        assert not service["spec"].get("publishNotReadyAddresses", False)
        selector = {"matchLabels": service["spec"]["selector"]}
        assert selects(selector, roles[role].pod.labels)
        assert not any(selects(selector, roles[r].pod.labels) for r in ROLES if r != role)
        assert any(p["port"] == int(port) and p["targetPort"] == "http" for p in service["spec"]["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_match_the_flags_and_decode_advertises_its_pod_ip(overlay: str) -> None:
    roles = by_role(overlay)
    for container in roles.values():
        assert container.port("http") == container.ns.port, container.pod.name
    decode = roles["decode"]
    assert decode.port("kv") == decode.ns.kv_port
    # prefill workers dial the address decode advertises: a wildcard would send them to themselves
    assert decode.ns.kv_host == FIELD_REFS["status.podIP"], f"--kv-host is {decode.ns.kv_host}, not the pod's IP"
    assert all(c.port("kv") is None for c in roles.values() if c.role != "decode")


def admitted_peers(overlay: str, pod: PodTemplate, port_name: str, port_number: int) -> list[Obj] | None:
    """The `from` peers that the NetworkPolicies selecting `pod` admit on that port; None when no
    policy selects the pod for ingress (everything is admitted), [{}] for a rule open to all."""
    policies = [p for p in of_kind(overlay, "NetworkPolicy")
                if selects(p["spec"]["podSelector"], pod.labels) and "Ingress" in p["spec"].get("policyTypes", [])]
    if not policies:
        return None
    peers: list[Obj] = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports") or [{}]  # no ports: every port
            if any(_covers(p, port_name, port_number) for p in ports):
                peers += rule.get("from") or [{}]  # no from: every source
    return peers


def _covers(rule_port: Obj, name: str, number: int) -> bool:
    port = rule_port.get("port")
    if port is None:
        return True
    if isinstance(port, str):
        return port == name
    return port <= number <= rule_port.get("endPort", port)


def only_pods_of(overlay: str, roles: tuple[str, ...]) -> Callable[[Obj], bool]:
    """A peer that is a podSelector (this namespace) matching pods of `roles` and no other."""
    templates = pod_templates(render(overlay))

    def check(peer: Obj) -> bool:
        if set(peer) != {"podSelector"}:
            return False
        chosen = [t for t in templates if selects(peer["podSelector"], t.labels)]
        return bool(chosen) and all(t.labels.get("app.kubernetes.io/component") in roles for t in chosen)

    return check


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_guard_kv_and_control_ports(overlay: str) -> None:
    roles = by_role(overlay)
    for pod, container in containers(render(overlay)):
        for port in container.get("ports", []):
            if port.get("name") != "kv":
                continue
            peers = admitted_peers(overlay, pod, "kv", port["containerPort"])
            assert peers, f"{pod.name}: no NetworkPolicy covers its kv port"
            assert all(map(only_pods_of(overlay, ("prefill",)), peers)), f"{pod.name} kv admits {peers}"
    # who calls a worker's control port: with a router, the router (and prefill's keepalives to
    # decode); without one, decode's port is the public one and prefill's takes decode's jobs and
    # the endpoint picker's scrapes
    callers = {"prefill": ("router",), "decode": ("router", "prefill")} if "router" in roles else \
        {"prefill": ("decode", "epp")}
    for role, allowed in callers.items():
        pod = roles[role].pod
        peers = admitted_peers(overlay, pod, "http", roles[role].ns.port)
        assert peers, f"{pod.name}: no NetworkPolicy covers its control port"
        in_namespace = [p for p in peers if "podSelector" in p and "namespaceSelector" not in p]
        assert all(map(only_pods_of(overlay, allowed), in_namespace)), f"{pod.name} http admits {peers}"
        # what is left is Prometheus, admitted by namespace (components/monitoring)
        assert all(set(p) == {"namespaceSelector"} and p["namespaceSelector"] for p in peers if p not in in_namespace)
    public = roles["router"] if "router" in roles else roles["decode"]
    assert {} in (admitted_peers(overlay, public.pod, "http", public.ns.port) or [{}])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_probed_drained_and_hardened(overlay: str) -> None:
    for container in pdserve_containers(render(overlay)):
        spec, where = container.pod.spec, container.pod.name
        probes = {kind: container.container[kind]["httpGet"] for kind in
                  ("startupProbe", "readinessProbe", "livenessProbe")}
        assert all(probe["port"] == "http" for probe in probes.values()), where
        assert probes["readinessProbe"]["path"] == "/ready" and probes["livenessProbe"]["path"] == "/health", where
        pre_stop = container.container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep" and 0 < int(pre_stop[1]) < spec["terminationGracePeriodSeconds"] - 30, where
        security, pod_security = container.container["securityContext"], spec["securityContext"]
        assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] > 0, where
        assert pod_security["seccompProfile"]["type"] == "RuntimeDefault", where
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"], where
        assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"], where
        mounts = {m["mountPath"]: m["name"] for m in container.container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{where}: a read-only root needs a writable /tmp"
        resources = container.container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])


@pytest.mark.slow  # builds a worker of each role and a router on the tiny model (~10 s)
def test_probe_paths_are_routes_of_the_apps(model_dirs: dict[str, Path]) -> None:
    from k8s_helpers import app_get_routes

    routes = app_get_routes(model_dirs["tiny"])
    for overlay in OVERLAYS:
        for container in pdserve_containers(render(overlay)):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                path = container.container[kind]["httpGet"]["path"]
                assert path in routes[container.role], f"{overlay} {container.role} {kind}: no GET {path}"
    assert routes["decode"] >= {"/health", "/ready", "/metrics"} and "/no-such" not in routes["decode"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_pods(overlay: str) -> None:
    """Every Service, PodMonitor and PodDisruptionBudget selects some pod template; the named ports
    Services and PodMonitors point at exist on the selected pods."""
    templates = pod_templates(render(overlay))

    def port_names(pods: list[PodTemplate]) -> set[str]:
        return {p["name"] for pod in pods for c in pod.spec["containers"] for p in c.get("ports", []) if "name" in p}

    for obj in render(overlay):
        selector = {"Service": lambda o: {"matchLabels": o["spec"].get("selector", {})},
                    "PodMonitor": lambda o: o["spec"]["selector"],
                    "PodDisruptionBudget": lambda o: o["spec"]["selector"]}.get(obj["kind"])
        if selector is None:
            continue
        chosen = [t for t in templates if selects(selector(obj), t.labels)]
        assert chosen, f"{name_of(obj)} selects no pod"
        wanted = {p["targetPort"] for p in obj["spec"].get("ports", []) if isinstance(p.get("targetPort"), str)}
        wanted |= {e["port"] for e in obj["spec"].get("podMetricsEndpoints", []) if "port" in e}
        assert wanted <= port_names(chosen), f"{name_of(obj)}: ports {wanted - port_names(chosen)} missing"
    monitored = {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
                 for m in of_kind(overlay, "PodMonitor")}
    assert monitored in (set(), set(roles_of(overlay))), f"{overlay}: PodMonitors for {monitored}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay: str) -> None:
    for pod, container in containers(render(overlay)):
        image = container["image"]
        tag = image.rpartition("/")[2].partition(":")[2]
        assert ("@sha256:" in image or tag) and tag != "latest", f"{pod.name}: unpinned image {image}"
    assert len({c.container["image"] for c in pdserve_containers(render(overlay))}) == 1


@pytest.mark.parametrize("overlay", ACK)
def test_ack_roles_land_on_their_node_pools(overlay: str) -> None:
    """The seed's node pools: `workload-type: prefill|decode` labels, `workload-type=<role>:NoSchedule`
    taints. Each worker requires its pool and tolerates its taint only; the router tolerates none."""
    roles = by_role(overlay)
    for role in WORKERS:
        spec = roles[role].pod.spec
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        for term in terms:  # the terms are ORed: each must pin the pool
            assert {"key": "workload-type", "operator": "In", "values": [role]} in term["matchExpressions"], role
        tolerated = [t for t in spec.get("tolerations", []) if t.get("key") == "workload-type"]
        assert tolerated == [{"key": "workload-type", "operator": "Equal", "value": role, "effect": "NoSchedule"}]
        assert spec["imagePullSecrets"], f"{role}: images come from a private registry"
    router = roles["router"].pod.spec
    assert not [t for t in router.get("tolerations", []) if t.get("key") in ("workload-type", None)]


@pytest.mark.parametrize("overlay", ACK)
def test_erdma_on_both_roles_whenever_the_transport_is_nixl(overlay: str) -> None:
    """A decode pod off eRDMA makes the transfer fall back to TCP silently: both roles carry the
    annotation, an eRDMA device and node affinity on eRDMA nodes; UCX's TCP ports (its set-up and
    fallback) are pinned and open between the two roles only."""
    roles = by_role(overlay)
    assert roles["prefill"].ns.kv_transport == "nixl"
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        container, pod = roles[role].container, roles[role].pod
        assert pod.metadata["annotations"][ERDMA_ANNOTATION] == "1", role
        assert container["resources"]["limits"]["aliyun/erdma"] == "1", role
        terms = pod.spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        for term in terms["nodeSelectorTerms"]:
            assert {"key": ERDMA_NODE_LABEL, "operator": "In", "values": ["true"]} in term["matchExpressions"]
        first, _, last = roles[role].env["UCX_TCP_PORT_RANGE"].partition("-")
        for port in (int(first), int(last)):
            peers = admitted_peers(overlay, pod, "", port)
            assert peers and all(map(only_pods_of(overlay, (peer,)), peers)), f"{role} UCX port {port}: {peers}"
