"""Pieces of the Kubernetes objects the generators (k8s_autoscale.py, k8s_router_scale.py) build:
metadata with pdserve's labels, a reference to one of its Deployments, a number as Kubernetes and
KEDA spell it."""

from __future__ import annotations

from typing import Any

Manifest = dict[str, Any]  # one Kubernetes object (or part of one) as YAML will show it


def metadata(name: str, component: str | None) -> Manifest:
    labels = {"app.kubernetes.io/part-of": "pdserve", "app.kubernetes.io/name": "pdserve"}
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return {"name": name, "labels": labels}


def deployment_ref(component: str) -> Manifest:
    """The scale target `pdserve-<component>` (router, prefill, decode: deploy/k8s/base)."""
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"pdserve-{component}"}


def decimal(value: float) -> str:
    """10.0 -> '10', 0.06 -> '0.06': a KEDA threshold and a Kubernetes quantity alike."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def one_pod_per_cooldown(cooldown_s: int) -> Manifest:
    """An HPA's `behavior.scaleDown`: the highest recommendation over the cooldown, one pod per cooldown."""
    return {"stabilizationWindowSeconds": cooldown_s,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": max(1, cooldown_s)}]}
