"""deploy/observability: the Grafana dashboards and the alert rules parse, and every metric their
queries name is in a live scrape of a tiny PD cluster (router + prefill + decode); the
PodMonitors select one role each, by the labels docs/OBSERVABILITY.md documents."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from helpers import random_prompt
from metrics_helpers import scrape
from pd_fixtures import start_cluster, stop_cluster

ASSETS = Path(__file__).resolve().parent.parent / "deploy" / "observability"
ROLES = ("router", "prefill", "decode")
# Series Prometheus records itself for every target (not exported by pdserve).
PROMETHEUS_OWN = {"up"}
_PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "delta", "histogram_quantile", "absent",
    "max_over_time", "min_over_time", "avg_over_time", "and", "or", "unless", "bool", "offset", "label_values",
}
# The seed's alerts (DIGEST item 20-21), by the rule that implements each.
REQUIRED_ALERTS = {"PdservePrefillQueueLatencyHigh", "PdserveKVCacheFragmentation", "PdserveKVTransferTimeouts",
                   "PdserveNoAvailableBlock", "PdserveCannotAllocate", "PdserveWorkerDown", "PdserveRoleAbsent"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label matchers, ranges, grouping labels stripped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)
    text = re.sub(r"(?<![A-Za-z0-9_:])\d[\w.]*", "", text)  # numbers and durations (offset 5m)
    text = re.sub(r"label_values\(([^,)]+)(,[^)]*)?\)", r"\1", text)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text)) - _PROMQL_WORDS


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted((ASSETS / "dashboards").glob("*.json"))}


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def rules() -> dict[str, Any]:
    return yaml.safe_load((ASSETS / "prometheus-rules.yaml").read_text())


def rule_list(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in document["spec"]["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def exported(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name a tiny PD cluster exports, after a request and an error went through (its
    prefill worker with a KV disk tier, whose series exist only with --kv-disk-dir)."""
    disk_dir = tmp_path_factory.mktemp("kv-disk")
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1,
                            engine_options={"prefill": {"kv_disk_dir": str(disk_dir)}})
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": random_prompt(20, seed=4),
                                                      "max_tokens": 3}).status_code == 200
            assert http.post("/v1/completions", json={"prompt": [1], "model": "nope"}).status_code == 404
        names: set[str] = set()
        for url in [cluster.router.url, *(served.url for served, _ in cluster.workers)]:
            names |= scrape(url).names
        cluster.wait_until_idle()
        return names
    finally:
        stop_cluster(cluster)


def test_one_dashboard_per_role_plus_overview() -> None:
    found = dashboards()
    assert set(found) == {"pdserve-prefill", "pdserve-decode", "pdserve-transfer", "pdserve-overview"}
    for name, dashboard in found.items():
        assert dashboard["uid"] == name and dashboard["panels"], name
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


@pytest.mark.slow
def test_every_dashboard_query_names_exported_metrics(exported: set[str]) -> None:
    for name, dashboard in dashboards().items():
        for query in dashboard_queries(dashboard):
            names = metric_names(query)
            assert names, f"{name}: no metric in {query!r}"
            missing = names - exported
            assert not missing, f"{name}: {sorted(missing)} not exported (query {query!r})"


@pytest.mark.slow
def test_alert_rules_are_valid_and_read_exported_metrics(exported: set[str]) -> None:
    document = rules()
    assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["kind"] == "PrometheusRule"
    alerts = rule_list(document)
    assert {rule["alert"] for rule in alerts} >= REQUIRED_ALERTS
    for rule in alerts:
        assert rule["labels"]["severity"] in ("info", "warning", "critical") and rule["annotations"]["summary"]
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        missing = names - exported - PROMETHEUS_OWN
        assert not missing, f"{rule['alert']}: {sorted(missing)} not exported"


def test_log_rules_match_the_stable_log_messages() -> None:
    document = yaml.safe_load((ASSETS / "loki-rules.yaml").read_text())
    exprs = " ".join(rule["expr"] for group in document["groups"] for rule in group["rules"])
    for message in ("KV cache transfer timed out", "No available block", "Cannot allocate for request"):
        assert f'|= "{message}"' in exprs, message


def test_one_pod_monitor_per_role() -> None:
    for role in ROLES:
        monitor = yaml.safe_load((ASSETS / f"podmonitor-{role}.yaml").read_text())
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
        assert monitor["metadata"]["name"] == f"pdserve-{role}"
        assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "pdserve",
                                                             "app.kubernetes.io/component": role}
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"


def test_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, phase) (rate(pdserve:ttft_phase_seconds_bucket{role="router",'
            'phase="transfer"}[$__rate_interval]))) > 1 and vllm:kv_cache_usage_perc offset 5m')
    assert metric_names(expr) == {"pdserve:ttft_phase_seconds_bucket", "vllm:kv_cache_usage_perc"}
    assert metric_names("label_values(vllm:num_requests_running, model_name)") == {"vllm:num_requests_running"}
