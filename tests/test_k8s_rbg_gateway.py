"""deploy/k8s/overlays/rbg (pdserve as one RoleBasedGroup) and overlays/ack-gateway* (behind the
Gateway API Inference Extension), offline: what the generic checks of test_k8s_manifests.py (which
render these overlays too: schemas, command lines, probes, node pools, eRDMA) cannot say. The
RoleBasedGroup runs exactly the ack overlay's pods, starts its roles in an order that can finish,
keeps prefill and decode together while they roll out or scale, and is scaled by the autoscale
overlay's policy through its scaling adapters; the InferencePool selects the routers on the port
they serve; every pdserve pod carries the labels the gateway and its pickers read."""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest
from k8s_helpers import Obj, overlay_names, pdserve_containers, pod_templates, render, schema_errors, selects

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl is not installed: it renders the kustomize overlays")

GATEWAY_OVERLAYS = ("ack-gateway", "ack-gateway-v1alpha2")
RBG_LABELS = {"router": "both", "prefill": "prefill", "decode": "decode"}  # llm-d.ai/role


def only(overlay: str, kind: str) -> Obj:
    (found,) = [o for o in render(overlay) if o["kind"] == kind]
    return found


def by_name(overlay: str, kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] == kind}


def roles_of(group: Obj) -> dict[str, Obj]:
    return {role["name"]: role for role in group["spec"]["roles"]}


# -- the RoleBasedGroup ---------------------------------------------------------------------------

def test_the_group_runs_the_ack_overlays_pods() -> None:
    """Each role's pod template and replica count are the ack overlay's workload's, whole (eRDMA,
    node pools, taints, /models, /kvcache, probes), and nothing else runs them."""
    group = only("rbg", "RoleBasedGroup")
    assert not [o for o in render("rbg") if o["kind"] in ("Deployment", "StatefulSet", "ReplicaSet", "Pod")]
    ack = {**by_name("ack", "Deployment"), **by_name("ack", "StatefulSet")}
    for name, role in roles_of(group).items():
        workload = ack[f"pdserve-{name}"]
        assert role["standalonePattern"]["template"] == workload["spec"]["template"], name
        assert role["replicas"] == workload["spec"]["replicas"], name
    assert set(roles_of(group)) == {"redis", "router", "prefill", "decode"}


def test_roles_start_in_an_order_that_completes() -> None:
    """A role is created once the roles it depends on are Ready. pdserve's router is Ready only with
    a ready prefill and decode worker, so it comes after them (the other way round nothing would
    ever start); prefill workers pull from Redis, so they come after it. Readiness probes gate each."""
    roles = roles_of(only("rbg", "RoleBasedGroup"))
    depends = {name: set(role.get("dependencies", [])) for name, role in roles.items()}
    assert depends["router"] >= {"prefill", "decode"} and "redis" in depends["prefill"]
    started: set[str] = set()
    while len(started) < len(roles):
        ready = {name for name, needs in depends.items() if name not in started and needs <= started}
        assert ready, f"no role can start after {sorted(started)}: {depends}"
        started |= ready
    for name, role in roles.items():
        (container,) = role["standalonePattern"]["template"]["spec"]["containers"]
        assert "readinessProbe" in container, f"{name}: its dependants would wait on a pod that is merely running"


def test_prefill_and_decode_roll_and_scale_together() -> None:
    """In-place updates where possible, one pod at a time with no surge (no spare GPU), and a
    CoordinatedPolicy the controller finds (the group's own name) that bounds the skew between
    prefill and decode, rolling out and scaling."""
    group = only("rbg", "RoleBasedGroup")
    roles = roles_of(group)
    for name in ("prefill", "decode"):
        rolling = roles[name]["rolloutStrategy"]["rollingUpdate"]
        assert rolling["type"] == "InPlaceIfPossible" and rolling["maxSurge"] == 0 and rolling["maxUnavailable"] == 1
        grace = rolling["inPlaceUpdateStrategy"]["gracePeriodSeconds"]
        pre_stop = roles[name]["standalonePattern"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]
        assert grace >= int(pre_stop["exec"]["command"][1]), f"{name}: restarted before the router drops it"
    policy = only("rbg", "CoordinatedPolicy")
    assert policy["metadata"]["name"] == group["metadata"]["name"], "the controller reads the policy of its own name"
    (rule,) = policy["spec"]["policies"]
    assert sorted(rule["roles"]) == ["decode", "prefill"]
    assert {"maxSkew"} <= set(rule["strategy"]["rollingUpdate"]) and {"maxSkew"} <= set(rule["strategy"]["scaling"])


def test_keda_scales_prefill_and_decode_through_the_scaling_adapters() -> None:
    """The autoscale overlay's ScaledObjects (bounds, behaviour, triggers), retargeted at the
    RoleBasedGroupScalingAdapters <group>-<role>; prefill's queue depth read as the Redis stream's
    lag (the stream and group the prefill workers consume, the same threshold)."""
    group = only("rbg", "RoleBasedGroup")
    roles = roles_of(group)
    ours, theirs = by_name("rbg", "ScaledObject"), by_name("autoscale", "ScaledObject")
    assert set(ours) == {"pdserve-prefill", "pdserve-decode"}
    for name, scaled in ours.items():
        role = name.removeprefix("pdserve-")
        assert roles[role]["scalingAdapter"] == {"enable": True}, role
        assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": group["apiVersion"],
                                                   "kind": "RoleBasedGroupScalingAdapter",
                                                   "name": f"{group['metadata']['name']}-{role}"}
        reference = theirs[name]["spec"]
        for field in ("minReplicaCount", "maxReplicaCount", "advanced"):
            assert scaled["spec"][field] == reference[field], (name, field)
        triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
        expected = {t["name"]: t for t in reference["triggers"] if t["type"] != "cron"}  # pre-warm: an example
        if role == "prefill":
            depth = expected.pop("queue-depth")
            lag = triggers.pop("stream-backlog")
            prefill = next(c for c in pdserve_containers(render("rbg")) if c.role == "prefill")
            assert lag["type"] == "redis-streams" and lag["metricType"] == depth["metricType"]
            assert lag["metadata"]["stream"] == f"pdserve:{prefill.ns.queue_deployment}:prefill"
            assert lag["metadata"]["consumerGroup"] == "prefill"
            assert float(lag["metadata"]["lagCount"]) == float(depth["metadata"]["threshold"])
            host, _, port = lag["metadata"]["address"].partition(":")
            assert prefill.ns.queue.startswith(f"redis://{host.split('.')[0]}:{port}/")
        assert triggers == expected, name


def test_disruption_budgets_work_for_the_groups_pods() -> None:
    """The group's pods are controlled by RoleInstances, which have no scale subresource: the
    disruption controller computes only an integer minAvailable for them."""
    budgets = by_name("rbg", "PodDisruptionBudget")
    assert budgets
    for name, budget in budgets.items():
        assert "maxUnavailable" not in budget["spec"] and isinstance(budget["spec"]["minAvailable"], int), name


# -- the gateway ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", overlay_names())
def test_every_pdserve_pod_carries_the_inference_labels(overlay: str) -> None:
    for container in pdserve_containers(render(overlay)):
        labels = container.pod.labels
        assert labels["alibabacloud.com/inference-workload"] == "pdserve", container.pod.name
        assert labels["alibabacloud.com/inference-backend"] == labels["llm-d.ai/engine-type"] == "vllm"
        assert labels["llm-d.ai/role"] == RBG_LABELS[container.role], container.pod.name


def pool_selector(pool: Obj) -> Obj:
    selector = pool["spec"]["selector"]
    return selector if pool["apiVersion"].endswith("/v1") else {"matchLabels": selector}


def pool_port(pool: Obj) -> int:
    if pool["apiVersion"].endswith("/v1"):
        (port,) = pool["spec"]["targetPorts"]
        return int(port["number"])
    return int(pool["spec"]["targetPortNumber"])


@pytest.mark.parametrize("overlay", GATEWAY_OVERLAYS)
def test_the_inference_pool_selects_the_routers_on_their_serving_port(overlay: str) -> None:
    pool = only(overlay, "InferencePool")
    selector = pool_selector(pool)
    chosen = [t for t in pod_templates(render(overlay)) if selects(selector, t.labels)]
    containers = {c.role: c for c in pdserve_containers(render(overlay))}
    assert [t.name for t in chosen] == [containers["router"].pod.name], "the pool is pdserve's routers only"
    router = containers["router"]
    assert pool_port(pool) == router.port("http") == router.ns.port, "the port the routers serve (and /metrics on)"
    picker = pool["spec"].get("endpointPickerRef") or pool["spec"]["extensionRef"]
    assert picker.get("kind", "Service") == "Service" and ("port" in picker or "portNumber" in picker)  # a CEL rule
    route = only(overlay, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {"group": pool["apiVersion"].partition("/")[0], "kind": "InferencePool",
                       "name": pool["metadata"]["name"]}
    gateways = by_name(overlay, "Gateway")
    assert all(ref["name"] in gateways for ref in route["spec"]["parentRefs"])
    models = by_name(overlay, "InferenceModel")
    assert bool(models) == pool["apiVersion"].endswith("/v1alpha2")
    for model in models.values():
        assert model["spec"]["modelName"] == router.ns.served_model_name, "the `model` clients send"
        assert model["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


# -- the checks can fail ------------------------------------------------------------------------------

def test_validation_rejects_mistakes_in_the_new_kinds() -> None:
    group = only("rbg", "RoleBasedGroup")

    def changed(edit: Any) -> Obj:
        copied = copy.deepcopy(group)
        edit(copied)
        return copied

    assert not schema_errors(group)
    assert any("dependency" in e for e in schema_errors(changed(lambda g: g["spec"]["roles"][0].update(dependency=[]))))
    typo = changed(lambda g: g["spec"]["roles"][1]["standalonePattern"]["template"]["spec"]["containers"][0]
                   .update(imagePullPolicyy="Always"))
    assert any("imagePullPolicyy" in e for e in schema_errors(typo))
    assert any("v1alpha2's" in e for e in schema_errors({**group, "apiVersion": "workloads.x-k8s.io/v1alpha1"}))
    pool = only("ack-gateway", "InferencePool")
    assert not schema_errors(pool)
    older = {**pool, "spec": {**pool["spec"], "targetPortNumber": 8000}}
    assert any("targetPortNumber" in e for e in schema_errors(older))
