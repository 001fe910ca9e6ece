"""deploy/k8s/overlays/gie-pd (pdserve behind llm-d's endpoint picker, no pdserve router), offline:
what the generic checks of test_k8s_manifests.py (schemas, command lines, probes, network policies
of every overlay) cannot say. One InferencePool holds exactly the prefill and decode pods, on the
port both serve (the header names the pool's target port); the picker's Deployment watches that
pool with the RBAC it needs and reads a PD configuration whose every reference resolves (decode
profile first, the prefix-based decider, a filter per role, the three scorers, max-score picker);
decode pods run in gateway mode and tell prefill pods where to send keepalives; the gateway's
route ends at the pool."""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest
import yaml
from k8s_helpers import Obj, pdserve_containers, pod_templates, render, selects

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl is not installed: it renders the kustomize overlays")

OVERLAY = "gie-pd"
SCORERS = {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"}
FILTERS = {"decode": "decode-filter", "prefill": "prefill-filter"}


def only(kind: str, name: str | None = None) -> Obj:
    (found,) = [o for o in render(OVERLAY) if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def epp_container() -> Obj:
    (container,) = only("Deployment", "pdserve-epp")["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def epp_config() -> Obj:
    """The EndpointPickerConfig the picker reads: the file its --config-file names, in the ConfigMap
    mounted there."""
    deployment = only("Deployment", "pdserve-epp")
    container = epp_container()
    path = flag(container["args"], "--config-file")
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = only("ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(config_map["data"][path.removeprefix(mount["mountPath"] + "/")])


def config_problems(config: Obj) -> list[str]:
    """What is wrong with a PD EndpointPickerConfig for this deployment ([] when nothing)."""
    problems = []
    plugins = {p.get("name", p["type"]): p for p in config.get("plugins", [])}
    types = {p["type"] for p in plugins.values()}
    if config.get("kind") != "EndpointPickerConfig" or not str(config.get("apiVersion", "")).endswith("/v1alpha1"):
        problems.append(f"not an EndpointPickerConfig: {config.get('apiVersion')} {config.get('kind')}")
    profiles = [p["name"] for p in config.get("schedulingProfiles", [])]
    if profiles[:1] != ["decode"] or set(profiles) != {"decode", "prefill"}:
        problems.append(f"profiles {profiles}: decode first, then prefill")
    handlers = [p for p in plugins.values() if p["type"] == "disagg-profile-handler"]
    decider = handlers[0].get("parameters", {}).get("deciders", {}).get("prefill") if len(handlers) == 1 else None
    if decider not in plugins or plugins[decider]["type"] != "prefix-based-pd-decider":
        problems.append(f"the profile handler's prefill decider {decider!r} is no declared prefix-based-pd-decider")
    elif plugins[decider].get("parameters", {}).get("nonCachedTokens", 0) <= 0:
        problems.append("nonCachedTokens <= 0 turns disaggregation off")
    if "prefix-cache-scorer" in types and "approx-prefix-cache-producer" not in types:
        problems.append("the prefix-cache scorer needs the approx-prefix-cache-producer's index")
    for profile in config.get("schedulingProfiles", []):
        refs = {ref["pluginRef"]: ref for ref in profile["plugins"]}
        problems += [f"{profile['name']}: {ref} is not declared" for ref in refs if ref not in plugins]
        used = {plugins[ref]["type"]: ref for ref in refs if ref in plugins}
        wanted = {FILTERS.get(profile["name"], "?"), "max-score-picker", *SCORERS}
        problems += [f"{profile['name']}: no {t}" for t in sorted(wanted - set(used))]
        problems += [f"{profile['name']}: {t} has no weight > 0" for t in SCORERS & set(used)
                     if refs[used[t]].get("weight", 1) <= 0]
    return problems


def test_no_router_decode_serves_the_api_in_gateway_mode() -> None:
    containers = {c.role: c for c in pdserve_containers(render(OVERLAY))}
    assert set(containers) == {"prefill", "decode"}
    decode = containers["decode"]
    assert decode.ns.gateway is True
    # prefill pods send their keepalives for decode's reservations there: the pod's own address
    assert decode.ns.advertise_url == f"http://{decode.ns.kv_host}:{decode.port('http')}"  # kv_host: the pod IP
    # a header may name only the prefill pods: the ready pods of a headless Service that selects them
    (allowed,) = decode.ns.gateway_prefill_allow
    assert allowed.startswith("dns:")
    service = only("Service", allowed.removeprefix("dns:"))
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses", False)
    chosen = [t for t in pod_templates(render(OVERLAY)) if selects({"matchLabels": service["spec"]["selector"]},
                                                                   t.labels)]
    assert [t.name for t in chosen] == [containers["prefill"].pod.name]
    # the job is signed: both roles read the same cluster secret
    assert decode.ns.cluster_secret_file == containers["prefill"].ns.cluster_secret_file is not None


def test_one_pool_over_prefill_and_decode_on_the_port_both_serve() -> None:
    pool = only("InferencePool")
    chosen = [t for t in pod_templates(render(OVERLAY)) if selects(pool["spec"]["selector"], t.labels)]
    containers = {c.pod.name: c for c in pdserve_containers(render(OVERLAY))}
    assert sorted(containers[t.name].role for t in chosen) == ["decode", "prefill"]
    for template in chosen:
        container = containers[template.name]
        assert template.labels["llm-d.ai/role"] == container.role  # what the picker's role filters read
        assert template.labels["llm-d.ai/engine-type"] == "vllm"  # the metric names it scrapes
        # x-prefiller-host-port names the pool's target port: prefill must serve its jobs there
        (port,) = pool["spec"]["targetPorts"]
        assert port["number"] == container.port("http") == container.ns.port, template.name


def test_the_pool_asks_the_picker_which_watches_that_pool() -> None:
    pool = only("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = only("Service", ref["name"])
    deployment = only("Deployment", "pdserve-epp")
    template = pod_templates((deployment,))[0]
    assert selects({"matchLabels": service["spec"]["selector"]}, template.labels)
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    container = epp_container()
    (target,) = [p for p in container["ports"] if p["name"] == grpc["targetPort"]]
    args = container["args"]
    assert target["containerPort"] == int(flag(args, "--grpc-port"))
    assert flag(args, "--pool-name") == pool["metadata"]["name"]
    namespace = flag(args, "--pool-namespace")
    (env,) = [e for e in container["env"] if f"$({e['name']})" == namespace]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    probe_port = int(flag(args, "--grpc-health-port"))
    assert container["readinessProbe"]["grpc"]["port"] == container["livenessProbe"]["grpc"]["port"] == probe_port


def test_the_picker_may_read_the_pool_and_its_pods() -> None:
    spec = only("Deployment", "pdserve-epp")["spec"]["template"]["spec"]
    binding = only("RoleBinding")
    assert {"kind": "ServiceAccount", "name": spec["serviceAccountName"]} in binding["subjects"]
    role = only("Role", binding["roleRef"]["name"])
    grants = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
              for resource in rule["resources"] for verb in rule["verbs"]}
    for group, resource in (("inference.networking.k8s.io", "inferencepools"), ("", "pods")):
        assert {(group, resource, v) for v in ("get", "list", "watch")} <= grants, resource


def test_the_picker_config_splits_prefill_and_decode() -> None:
    assert config_problems(epp_config()) == []


def test_the_route_ends_at_the_pool() -> None:
    route, pool = only("HTTPRoute"), only("InferencePool")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    gateway = only("Gateway")
    assert [ref["name"] for ref in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]


def test_the_config_checker_finds_mistakes() -> None:
    good = epp_config()

    def broken(edit: Any) -> list[str]:
        config = copy.deepcopy(good)
        edit(config)
        return config_problems(config)

    assert any("not declared" in p for p in broken(lambda c: c["schedulingProfiles"][0]["plugins"].append(
        {"pluginRef": "no-such-scorer"})))
    assert any("decode first" in p for p in broken(lambda c: c["schedulingProfiles"].reverse()))
    assert any("decider" in p for p in broken(lambda c: [p for p in c["plugins"] if p["type"] ==
                                                          "disagg-profile-handler"][0].update(parameters={})))
    assert any("nonCachedTokens" in p for p in broken(lambda c: [p for p in c["plugins"] if p["type"] ==
                                                                 "prefix-based-pd-decider"][0].update(
        parameters={"nonCachedTokens": 0})))
    assert any("no prefill-filter" in p for p in broken(lambda c: c["schedulingProfiles"][1]["plugins"].pop(0)))
    assert any("weight" in p for p in broken(lambda c: c["schedulingProfiles"][0]["plugins"][2].update(weight=0)))
