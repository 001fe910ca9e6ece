"""The router's own scaling, rendered into both autoscale overlays beside the workers' (by
k8s_autoscale.py: a KEDA ScaledObject, or an autoscaling/v2 HPA with its prometheus-adapter rule).

Routers are interchangeable in front of one pool: each resolves the same worker Services, each
request lives in one router from admission to its last byte, and the queue is either each router's
own (memory: each places its own jobs) or one Redis stream they share (docs/DEPLOY.md, "Several
routers"). So their count follows their own load, never the workers':

    in-flight  sum(vllm:num_requests_running{role="router"})  AverageValue  in_flight_target
               -> ceil(requests the routers relay / in_flight_target) routers
    cpu        the router pods' CPU use (metrics-server)       AverageValue  cpu_target_millicores a pod

A router relays every streamed chunk on one event loop, so one core is its ceiling: CPU follows the
chunks a second it relays (what a stream costs it), in-flight the connections it holds (a client
socket and a decode stream each) and moves first when a burst arrives. The larger count wins (HPA
arithmetic: k8s_autoscale.py). Scale-up at once (a saturated router delays every stream it holds);
scale-down one router per `scale_in_cooldown_s`, after the highest count over that cooldown held:
the router removed finishes its streams on SIGTERM (deploy/k8s/base/router.yaml), so only new
requests move.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ops.k8s_objects import Manifest, decimal, deployment_ref, metadata, one_pod_per_cooldown

ROUTER_IN_FLIGHT = "vllm:num_requests_running"  # the router's: requests sent on to workers, not finished
_ROLE = 'role="router"'
DEFAULT_ROUTER_BOUNDS = (2, 8)
DEFAULT_IN_FLIGHT_TARGET = 128
DEFAULT_CPU_TARGET_MILLICORES = 700


@dataclass(frozen=True, slots=True)
class RouterScaling:
    """How many routers, on what signal (`--router*` flags of k8s_autoscale.py)."""

    bounds: tuple[int, int] = DEFAULT_ROUTER_BOUNDS  # at least two: a router restarting leaves one serving
    in_flight_target: int = DEFAULT_IN_FLIGHT_TARGET  # requests one router relays at once
    cpu_target_millicores: int = DEFAULT_CPU_TARGET_MILLICORES  # a router's CPU use, of the one core its loop can use

    @property
    def external_name(self) -> str:
        """The in-flight metric as prometheus-adapter serves it to the HPA."""
        return "pdserve_router_in_flight"

    def query(self, matchers: str = "") -> str:
        """The in-flight PromQL; `matchers` are added to the router's role matcher."""
        return f"sum({ROUTER_IN_FLIGHT}{{{_ROLE}{',' + matchers if matchers else ''}}})"

    @property
    def cpu_quantity(self) -> str:
        return f"{self.cpu_target_millicores}m"

    def validate(self) -> None:
        low, high = self.bounds
        if not 1 <= low <= high:
            raise ValueError(f"router bounds {low}:{high}: need 1 <= MIN <= MAX")
        if self.in_flight_target < 1:
            raise ValueError(f"router in-flight target {self.in_flight_target}: must be >= 1")
        if self.cpu_target_millicores < 1:
            raise ValueError(f"router CPU target {self.cpu_target_millicores}m: must be >= 1m")


def router_behavior(cooldown_s: int) -> Manifest:
    """Up at once (the HPA's default rate), down one router per cooldown (module docstring)."""
    return {"scaleUp": {"stabilizationWindowSeconds": 0}, "scaleDown": one_pod_per_cooldown(cooldown_s)}


def router_scaled_object(scaling: RouterScaling, cooldown_s: int, prometheus_url: str, matchers: str) -> Manifest:
    """KEDA's ScaledObject for the router Deployment: a Prometheus trigger on in-flight requests
    (no reading is an error: no scale-in), a `cpu` trigger on the pods' CPU."""
    low, high = scaling.bounds
    triggers = [
        {"type": "prometheus", "name": "in-flight", "metricType": "AverageValue",
         "metadata": {"serverAddress": prometheus_url, "query": scaling.query(matchers),
                      "threshold": decimal(scaling.in_flight_target), "ignoreNullValues": "false"}},
        {"type": "cpu", "name": "cpu", "metricType": "AverageValue", "metadata": {"value": scaling.cpu_quantity}},
    ]
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": metadata("pdserve-router", "router"),
            "spec": {"scaleTargetRef": deployment_ref("router"), "minReplicaCount": low, "maxReplicaCount": high,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": router_behavior(cooldown_s)}},
                     "triggers": triggers}}


def router_hpa(scaling: RouterScaling, cooldown_s: int) -> Manifest:
    """The autoscaling/v2 HPA: in-flight as an External metric (`router_adapter_rule`), CPU as a
    Resource metric (metrics-server)."""
    low, high = scaling.bounds
    metrics = [
        {"type": "External", "external": {"metric": {"name": scaling.external_name},
                                          "target": {"type": "AverageValue",
                                                     "averageValue": decimal(scaling.in_flight_target)}}},
        {"type": "Resource", "resource": {"name": "cpu",
                                          "target": {"type": "AverageValue", "averageValue": scaling.cpu_quantity}}},
    ]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata("pdserve-router", "router"),
            "spec": {"scaleTargetRef": deployment_ref("router"), "minReplicas": low, "maxReplicas": high,
                     "metrics": metrics, "behavior": router_behavior(cooldown_s)}}


def router_adapter_rule(scaling: RouterScaling) -> Manifest:
    """prometheus-adapter's externalRule for the in-flight metric, namespaced as the workers' are."""
    return {"seriesQuery": f'{ROUTER_IN_FLIGHT}{{{_ROLE},namespace!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
            "name": {"matches": f"^{ROUTER_IN_FLIGHT}$", "as": scaling.external_name},
            "metricsQuery": scaling.query("<<.LabelMatchers>>")}
