"""deploy/k8s/overlays/autoscale*: the committed files are a fresh render of AutoscaleConfig's
defaults; every threshold, window, cooldown and bound in them (read back from the YAML) is the
local policy's; the router scales on its own signals (in-flight requests, CPU) within its own
bounds; the KEDA and CronHPA objects validate against the vendored CRD schemas; every query reads
series a live pdserve cluster exports; both overlays render with kustomize once ../cpu exists.
Pre-warm's cron schedules: tests/test_k8s_cron.py."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
import yaml
from test_observability_assets import exported, metric_names  # noqa: F401 - `exported` is a fixture

from pdserve.ops.autoscale import AutoscaleConfig, Reason
from pdserve.ops.k8s_autoscale import DEFAULT_BOUNDS, OVERLAYS, RenderOptions, main, render, scaling_metrics
from pdserve.ops.k8s_router_scale import RouterScaling

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS_DIR = ROOT / "deploy" / "k8s" / "overlays"
SCHEMAS = ROOT / "deploy" / "k8s" / "schemas"
DEFAULTS = AutoscaleConfig()
ROUTER_DEFAULTS = RouterScaling()
SCALED = {"pdserve-prefill", "pdserve-decode", "pdserve-router"}
# PromQL functions the metric-name parser of test_observability_assets does not know.
_FUNCTIONS = {"vector"}


def docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def committed(overlay: str, name: str) -> list[dict[str, Any]]:
    return docs(OVERLAYS_DIR / overlay / name)


def by_name(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def expected_metrics(c: AutoscaleConfig) -> dict[str, dict[str, tuple[str, float, float | None]]]:
    """role -> KEDA trigger name -> (metricType, threshold, histogram quantile or None), written
    out from the config's fields."""
    return {"prefill": {"queue-depth": ("Value", c.prefill_queue_target, None),
                        "queue-latency-p90-seconds": ("Value", c.prefill_queue_latency_target_s, 0.9)},
            "decode": {"running": ("AverageValue", c.decode_running_target, None),
                       "tpot-p99-seconds": ("Value", c.decode_tpot_target_ms / 1000, 0.99),
                       "tpot-avg-seconds": ("Value", c.decode_tpot_avg_target_ms / 1000, None)}}


def check_query(query: str, window_s: float, quantile: float | None) -> None:
    windows = {float(w) for w in re.findall(r"\[(\d+)s\]", query)}
    assert windows <= {window_s}, query
    if quantile is None:
        assert "histogram_quantile" not in query, query
    else:
        assert [float(q) for q in re.findall(r"histogram_quantile\(([\d.]+),", query)] == [quantile], query
        assert windows == {window_s}, query


def check_behavior(behavior: dict[str, Any], role: str, c: AutoscaleConfig) -> None:
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == c.autoscale_window_s
    if role == "prefill":  # locally one more worker per window
        assert up["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": c.autoscale_window_s}]
    assert down["stabilizationWindowSeconds"] == c.scale_in_cooldown_s
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": c.scale_in_cooldown_s}]


def check_router_behavior(behavior: dict[str, Any], c: AutoscaleConfig) -> None:
    assert behavior["scaleUp"] == {"stabilizationWindowSeconds": 0}  # a saturated router slows every stream
    assert behavior["scaleDown"] == {"stabilizationWindowSeconds": c.scale_in_cooldown_s, "policies": [
        {"type": "Pods", "value": 1, "periodSeconds": c.scale_in_cooldown_s}]}


def check_router_query(query: str, matchers: str = "") -> None:
    """The routers' in-flight requests, summed over routers (AverageValue divides by the target)."""
    assert query == f'sum(vllm:num_requests_running{{role="router"{"," + matchers if matchers else ""}}})', query


def check_router_keda(spec: dict[str, Any], c: AutoscaleConfig, router: RouterScaling) -> None:
    assert spec["scaleTargetRef"]["name"] == "pdserve-router"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == router.bounds
    check_router_behavior(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"], c)
    triggers = {t["type"]: t for t in spec["triggers"]}
    assert set(triggers) == {"prometheus", "cpu"} and len(spec["triggers"]) == 2
    in_flight, cpu = triggers["prometheus"], triggers["cpu"]
    assert in_flight["metricType"] == "AverageValue" and in_flight["metadata"]["ignoreNullValues"] == "false"
    assert float(in_flight["metadata"]["threshold"]) == router.in_flight_target
    assert in_flight["metadata"]["query"].startswith('sum(vllm:num_requests_running{role="router"')
    assert (cpu["metricType"], cpu["metadata"]) == ("AverageValue", {"value": f"{router.cpu_target_millicores}m"})


def check_router_hpa(spec: dict[str, Any], c: AutoscaleConfig, router: RouterScaling) -> str:
    """Checks the router's HPA; returns the External metric it reads (from the adapter)."""
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pdserve-router"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == router.bounds
    check_router_behavior(spec["behavior"], c)
    external, resource = spec["metrics"]
    assert external["type"] == "External" and external["external"]["target"] == {
        "type": "AverageValue", "averageValue": str(router.in_flight_target)}
    assert resource == {"type": "Resource", "resource": {"name": "cpu", "target": {
        "type": "AverageValue", "averageValue": f"{router.cpu_target_millicores}m"}}}
    return str(external["external"]["metric"]["name"])


def check_keda(objects: list[dict[str, Any]], c: AutoscaleConfig, bounds: dict[str, tuple[int, int]],
               router: RouterScaling = ROUTER_DEFAULTS) -> None:
    scaled = by_name(objects, "ScaledObject")
    assert set(scaled) == SCALED
    check_router_keda(scaled["pdserve-router"]["spec"], c, router)
    for role, metrics in expected_metrics(c).items():
        spec = scaled[f"pdserve-{role}"]["spec"]
        assert spec["scaleTargetRef"]["name"] == f"pdserve-{role}"
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == bounds[role]
        check_behavior(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"], role, c)
        triggers = {t["name"]: t for t in spec["triggers"] if t["type"] == "prometheus"}
        assert set(triggers) == set(metrics), role
        for name, (metric_type, threshold, quantile) in metrics.items():
            trigger = triggers[name]
            assert trigger["metricType"] == metric_type, name
            assert float(trigger["metadata"]["threshold"]) == pytest.approx(threshold), name
            assert trigger["metadata"]["ignoreNullValues"] == "false"  # no reading: no scale-in
            check_query(trigger["metadata"]["query"], c.autoscale_window_s, quantile)


def adapter_queries(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (config_map,) = by_name(objects, "ConfigMap").values()
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["externalRules"]
    return {rule["name"]["as"]: rule for rule in rules}


def check_hpa(objects: list[dict[str, Any]], c: AutoscaleConfig, bounds: dict[str, tuple[int, int]],
              router: RouterScaling = ROUTER_DEFAULTS) -> None:
    hpas, rules = by_name(objects, "HorizontalPodAutoscaler"), adapter_queries(objects)
    assert set(hpas) == SCALED
    in_flight = check_router_hpa(hpas["pdserve-router"]["spec"], c, router)
    check_router_query(rules[in_flight]["metricsQuery"], "<<.LabelMatchers>>")
    served = {in_flight}
    for role, metrics in expected_metrics(c).items():
        spec = hpas[f"pdserve-{role}"]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"pdserve-{role}"}
        assert (spec["minReplicas"], spec["maxReplicas"]) == bounds[role]
        check_behavior(spec["behavior"], role, c)
        found = {m["external"]["metric"]["name"]: m["external"]["target"] for m in spec["metrics"]}
        assert len(found) == len(metrics) and all(m["type"] == "External" for m in spec["metrics"])
        for name, (metric_type, threshold, quantile) in metrics.items():
            external = f"pdserve_{role}_{name.replace('-', '_')}"
            target = found[external]
            assert target["type"] == metric_type
            value = target["value" if metric_type == "Value" else "averageValue"]
            assert float(value) == pytest.approx(threshold), external
            check_query(rules[external]["metricsQuery"], c.autoscale_window_s, quantile)
            served.add(external)
    assert served == set(rules), "an adapter rule no HPA reads, or the reverse"


def load_all(overlay_dir: Path) -> list[dict[str, Any]]:
    return [doc for path in sorted(overlay_dir.glob("*.yaml")) for doc in docs(path)
            if isinstance(doc, dict) and "kind" in doc]


def test_committed_overlays_are_a_fresh_render_of_the_defaults() -> None:
    files = render(RenderOptions())
    on_disk = {f"{overlay}/{p.name}": p.read_text() for overlay in OVERLAYS
               for p in sorted((OVERLAYS_DIR / overlay).iterdir())}
    assert set(on_disk) == set(files), "render again: python -m pdserve.ops.k8s_autoscale"
    for name, text in files.items():
        assert on_disk[name] == text, f"{name} is stale: python -m pdserve.ops.k8s_autoscale"


def test_cli_writes_the_same_files_and_removes_stale_ones(tmp_path: Path) -> None:
    (tmp_path / "autoscale").mkdir()
    (tmp_path / "autoscale" / "old.yaml").write_text("kind: Gone\n")
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "kustomization.yaml").write_text("resources: []\n")  # not ours: kept
    assert main(["--out", str(tmp_path)]) == 0
    for overlay in OVERLAYS:
        for path in (OVERLAYS_DIR / overlay).iterdir():
            assert (tmp_path / overlay / path.name).read_text() == path.read_text()
    assert not (tmp_path / "autoscale" / "old.yaml").exists()
    assert (tmp_path / "cpu" / "kustomization.yaml").exists()


def test_objects_carry_the_local_policy_defaults() -> None:
    check_keda(committed("autoscale", "scaledobjects.yaml"), DEFAULTS, DEFAULT_BOUNDS)
    check_hpa(load_all(OVERLAYS_DIR / "autoscale-hpa"), DEFAULTS, DEFAULT_BOUNDS)
    # the defaults are the seed's numbers (DIGEST item 22); a changed default shows up here too
    assert (DEFAULTS.prefill_queue_target, DEFAULTS.prefill_queue_latency_target_s, DEFAULTS.autoscale_window_s,
            DEFAULTS.decode_running_target, DEFAULTS.decode_tpot_target_ms, DEFAULTS.decode_tpot_avg_target_ms,
            DEFAULTS.scale_in_cooldown_s) == (10, 1.5, 60, 10, 60, 50, 300)


def test_every_scale_out_rule_of_the_local_policy_has_a_metric() -> None:
    """A rule added to the local policy (a new Reason) fails here until it is rendered too."""
    rendered = [m.reason for m in scaling_metrics(DEFAULTS)]
    assert sorted(rendered) == sorted(set(get_args(Reason)) - {"idle", "prewarm", "bounds"})


def test_every_knob_reaches_the_objects(tmp_path: Path) -> None:
    flags = ["--autoscale-window-s", "120", "--prefill-queue-target", "25", "--prefill-queue-latency-target-s", "2.5",
             "--decode-running-high", "30", "--decode-running-target", "20", "--decode-tpot-target-ms", "80",
             "--decode-tpot-avg-target-ms", "70", "--scale-in-cooldown-s", "900", "--prefill", "2:6",
             "--decode", "3:12", "--prewarm", "07:00-09:00=decode:5", "--base", "../ack",
             "--prometheus-url", "http://prom.example:9090", "--promql-matchers", 'namespace="llm"',
             "--router", "3:9", "--router-in-flight-target", "200", "--router-cpu-target-millicores", "900"]
    assert main(["--out", str(tmp_path), *flags]) == 0
    config = AutoscaleConfig(autoscale_window_s=120, prefill_queue_target=25, prefill_queue_latency_target_s=2.5,
                             decode_running_high=30, decode_running_target=20, decode_tpot_target_ms=80,
                             decode_tpot_avg_target_ms=70, scale_in_cooldown_s=900)
    bounds, router = {"prefill": (2, 6), "decode": (3, 12)}, RouterScaling((3, 9), 200, 900)
    check_keda(docs(tmp_path / "autoscale" / "scaledobjects.yaml"), config, bounds, router)
    check_hpa(load_all(tmp_path / "autoscale-hpa"), config, bounds, router)
    for overlay in OVERLAYS:
        assert docs(tmp_path / overlay / "kustomization.yaml")[0]["resources"][0] == "../ack"
    for obj in docs(tmp_path / "autoscale" / "scaledobjects.yaml"):
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                assert trigger["metadata"]["serverAddress"] == "http://prom.example:9090"
                assert 'namespace="llm"' in trigger["metadata"]["query"]
    (router_object,) = (o for o in docs(tmp_path / "autoscale" / "scaledobjects.yaml")
                        if o["metadata"]["name"] == "pdserve-router")
    check_router_query(router_object["spec"]["triggers"][0]["metadata"]["query"], 'namespace="llm"')
    # a prewarm that names only decode: no prefill pre-warm objects, and no "EXAMPLE" left
    assert not (tmp_path / "autoscale" / "prewarm-prefill.yaml").exists()
    assert "EXAMPLE" not in (tmp_path / "autoscale" / "prewarm-decode.yaml").read_text()
    assert set(by_name(docs(tmp_path / "autoscale-hpa" / "cronhpa.yaml"), "CronHorizontalPodAutoscaler")) == {
        "pdserve-decode"}


def test_without_prewarm_an_example_interval_is_rendered_and_said_so() -> None:
    for path in (OVERLAYS_DIR / "autoscale" / "prewarm-prefill.yaml", OVERLAYS_DIR / "autoscale-hpa" / "cronhpa.yaml"):
        assert "EXAMPLE: rendered without --prewarm" in path.read_text() and "08:00-10:00" in path.read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (["--autoscale-window-s", "2.5"], "whole seconds"),
    (["--scale-in-cooldown-s", "3600"], "whole seconds"),
    (["--prewarm", "08:00-10:00=decode:9"], "above the maximum 8"),
    (["--prewarm", "10:01-10:00=prefill:2"], "covers the whole day"),
    (["--decode", "3:2"], "MIN <= MAX"),
    (["--decode-running-target", "20"], "decode_running_target <= decode_running_high"),
    (["--router", "0:2"], "MIN"),
    (["--router-in-flight-target", "0"], "router in-flight target 0: must be >= 1"),
    (["--router-cpu-target-millicores", "0"], "router CPU target 0m: must be >= 1m"),
])
def test_what_kubernetes_cannot_take_is_refused(flags: list[str], message: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), *flags])
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written when the options are refused"


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused (the API server would prune them silently): a
    misspelt field fails the test instead of vanishing."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    group = api_version.split("/")[0]
    schema = yaml.safe_load((SCHEMAS / f"{group}_{kind.lower()}.yaml").read_text())
    return jsonschema.Draft7Validator(strict(schema))


def with_prewarm_patches(overlay_dir: Path) -> list[dict[str, Any]]:
    """The KEDA overlay's ScaledObjects with its JSON patches applied (only `add .../-` is used)."""
    objects = copy.deepcopy(docs(overlay_dir / "scaledobjects.yaml"))
    kustomization = docs(overlay_dir / "kustomization.yaml")[0]
    for patch in kustomization["patches"]:
        if "target" in patch:
            (target,) = (o for o in objects if o["metadata"]["name"] == patch["target"]["name"])
            for op in docs(overlay_dir / patch["path"])[0]:
                assert (op["op"], op["path"]) == ("add", "/spec/triggers/-")
                target["spec"]["triggers"].append(op["value"])
    return objects


def test_crd_objects_validate_against_the_vendored_schemas() -> None:
    objects = [*with_prewarm_patches(OVERLAYS_DIR / "autoscale"), *committed("autoscale-hpa", "cronhpa.yaml")]
    assert sorted(o["kind"] for o in objects) == ["CronHorizontalPodAutoscaler"] * 2 + ["ScaledObject"] * 3
    assert sum(t["type"] == "cron" for o in objects if o["kind"] == "ScaledObject" for t in o["spec"]["triggers"]) == 2
    for obj in objects:
        errors = list(validator(obj["apiVersion"], obj["kind"]).iter_errors(obj))
        assert not errors, [e.message for e in errors]


def test_the_strict_schemas_catch_a_typo_and_a_non_string_trigger_value() -> None:
    prefill = committed("autoscale", "scaledobjects.yaml")[0]
    check = validator(prefill["apiVersion"], prefill["kind"])
    typo = copy.deepcopy(prefill)
    behavior = typo["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    behavior["scaleDown"]["stabilisationWindowSeconds"] = behavior["scaleDown"].pop("stabilizationWindowSeconds")
    assert not check.is_valid(typo)
    number = copy.deepcopy(prefill)
    number["spec"]["triggers"][0]["metadata"]["threshold"] = 10
    assert not check.is_valid(number)


def all_queries() -> list[str]:
    """Every PromQL the objects run: KEDA's triggers, and the adapter's rules as it would send them."""
    queries = [t["metadata"]["query"] for o in committed("autoscale", "scaledobjects.yaml")
               for t in o["spec"]["triggers"] if t["type"] == "prometheus"]
    for rule in adapter_queries(committed("autoscale-hpa", "prometheus-adapter-rules.yaml")).values():
        queries.append(rule["seriesQuery"])
        queries.append(rule["metricsQuery"].replace("<<.LabelMatchers>>", 'namespace="pdserve"'))
    assert len(queries) == 18
    return queries


def test_queries_name_the_routers_autoscaling_series() -> None:
    names = set().union(*(metric_names(q) - _FUNCTIONS for q in all_queries()))
    assert names == {"pdserve:prefill_queue_depth", "pdserve:router_dispatch_pending", "pdserve:decode_running",
                     "vllm:num_requests_running",
                     "pdserve:prefill_queue_latency_seconds_bucket",
                     "pdserve:request_time_per_output_token_seconds_bucket",
                     "pdserve:request_time_per_output_token_seconds_sum",
                     "pdserve:request_time_per_output_token_seconds_count"}


@pytest.mark.slow
def test_every_query_reads_series_a_live_cluster_exports(exported: set[str]) -> None:  # noqa: F811
    for query in all_queries():
        names = metric_names(query) - _FUNCTIONS
        assert names, query
        assert not names - exported, f"{sorted(names - exported)} not exported (query {query!r})"


def kustomize(overlay: str) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders the overlays with its built-in kustomize)")
    if not (OVERLAYS_DIR / "cpu" / "kustomization.yaml").exists():
        pytest.skip("deploy/k8s/overlays/cpu does not exist yet: the autoscale overlays build on it")
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAYS_DIR / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_on_the_cpu_overlay_and_leaves_replicas_to_the_autoscaler(overlay: str) -> None:
    objects = kustomize(overlay)
    deployments = by_name(objects, "Deployment")
    for component in ("router", "prefill", "decode"):
        assert "replicas" not in deployments[f"pdserve-{component}"]["spec"], f"{overlay}: {component} replicas fixed"
    kind = "ScaledObject" if overlay == "autoscale" else "HorizontalPodAutoscaler"
    scalers = by_name(objects, kind)
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scalers.values()} == SCALED
    crd_objects = [o for o in objects if o["kind"] in ("ScaledObject", "CronHorizontalPodAutoscaler")]
    assert len(crd_objects) == (3 if overlay == "autoscale" else 2)
    for obj in crd_objects:
        errors = list(validator(obj["apiVersion"], obj["kind"]).iter_errors(obj))
        assert not errors, [e.message for e in errors]
    if overlay == "autoscale":
        cron = [t for s in scalers.values() for t in s["spec"]["triggers"] if t["type"] == "cron"]
        assert len(cron) == 2, "the pre-warm patches did not apply"


def test_hpas_and_adapter_config_map_validate_against_kubernetes_1_30() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = [*committed("autoscale-hpa", "hpa.yaml"), *committed("autoscale-hpa", "prometheus-adapter-rules.yaml")]
    assert sorted(o["kind"] for o in objects) == ["ConfigMap"] + ["HorizontalPodAutoscaler"] * 3
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30", strict=True)
