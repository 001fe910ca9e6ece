"""Helpers of tests/test_k8s_manifests.py: render an overlay with `kubectl kustomize`, validate its
objects (built-in kinds against Kubernetes' OpenAPI schemas from the kubernetes-validate package,
custom resources against deploy/k8s/schemas), expand a container's $(VAR) references as the
kubelet does, parse a pdserve container's command line with pdserve's own parser, and match
label selectors."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import math
import re
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import yaml
from kubernetes_validate import utils as kv

from pdserve.cli import build_parser
from pdserve.config import EngineArgs
from pdserve.config_flags import config_from_args
from pdserve.disagg.config import RouterConfig, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS_DIR = ROOT / "deploy" / "k8s" / "overlays"
SCHEMAS_DIR = ROOT / "deploy" / "k8s" / "schemas"
KUBERNETES_VERSION = "1.30"  # the oldest minor ACK still offers; the manifests use nothing newer

Obj = dict[str, Any]
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the RoleBasedGroup schema is 600 kB

# What the RoleBasedGroup controller (sigs.k8s.io/rbgs v0.7) adds to each role's pods and selects
# them by: the group's and the role's name; its workloads are <group>-<role>, its headless
# Services s-<group>-<role> (publishNotReadyAddresses: true, no ports).
RBG_GROUP_LABEL = "rbg.workloads.x-k8s.io/group-name"
RBG_ROLE_LABEL = "rbg.workloads.x-k8s.io/role-name"

# What the downward API gives a container, stood in by fixed values (fieldRef -> value).
FIELD_REFS = {"status.podIP": "10.0.0.7", "status.hostIP": "10.0.0.1", "metadata.name": "pod-0",
              "metadata.namespace": "pdserve", "spec.nodeName": "node-0", "spec.serviceAccountName": "default"}


def overlay_names() -> list[str]:
    """Every directory under deploy/k8s/overlays (one without a kustomization fails to render)."""
    return sorted(p.name for p in OVERLAYS_DIR.iterdir() if p.is_dir() and not p.name.startswith("."))


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    done = subprocess.run(["kubectl", "kustomize", str(OVERLAYS_DIR / overlay)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# -- schemas ------------------------------------------------------------------------------------

def is_builtin(api_version: str, kind: str = "") -> bool:
    """Kinds Kubernetes itself serves: the core group, groups without a dot (apps, batch, policy,
    autoscaling) and *.k8s.io, but for the *.k8s.io kinds that are CRDs (Gateway API, the Inference
    Extension: those have a vendored schema); everything else is a custom resource."""
    group = api_version.rpartition("/")[0]
    if kind and crd_schema_path(api_version, kind).is_file():
        return False
    return group == "" or "." not in group or group.endswith(".k8s.io")


def schema_errors(obj: Obj) -> list[str]:
    """Why `obj` would not pass the API server's schema (strict field validation); [] if it would."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    if is_builtin(api_version, kind):
        validator = _builtin_validator(api_version, kind)
        if validator is None:
            return [f"{name_of(obj)}: Kubernetes {KUBERNETES_VERSION} has no {api_version} {kind}"]
    else:
        validator = _crd_validator(api_version, kind)
        if validator is None:
            return [f"{name_of(obj)}: custom resource {api_version} {kind} has no vendored schema "
                    f"{crd_schema_path(api_version, kind).relative_to(ROOT)} (see its folder's README.md)"]
        vendored = crd_schema_version(api_version, kind)
        if vendored != api_version:
            return [f"{name_of(obj)}: {api_version}, but the vendored schema is {vendored}'s"]
    errors = [f"{name_of(obj)}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}"
              for e in validator.iter_errors(obj)]
    # a CRD that embeds pod templates checks them with its own copy of the schema (RBG's is its
    # Kubernetes' version); they validate against this Kubernetes' PodTemplateSpec too
    for template in pod_templates((obj,)) if not is_builtin(api_version, kind) else []:
        errors += [f"{template.name}: template.{'.'.join(map(str, e.absolute_path))}: {e.message[:300]}"
                   for e in _pod_template_validator().iter_errors({"metadata": template.metadata,
                                                                    "spec": template.spec})]
    return errors


def _kubernetes_schemas() -> tuple[str, str]:
    """(the kubernetes-validate version of KUBERNETES_VERSION, its folder of strict schemas)."""
    versions = [v for v in kv.all_versions() if kv.major_minor(v) == KUBERNETES_VERSION]
    assert versions, f"this kubernetes-validate has no Kubernetes {KUBERNETES_VERSION} schemas: {kv.all_versions()}"
    return versions[-1], f"kubernetes-json-schema/v{versions[-1]}-local-strict"


@functools.cache
def _builtin_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's strict schema of one kind (its `validate`, with the schemas loaded once)."""
    version, folder = _kubernetes_schemas()
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    try:
        schema = kv.schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        return None
    return _with_definitions(schema)


@functools.cache
def _pod_template_validator() -> jsonschema.Draft202012Validator:
    """Kubernetes' strict io.k8s.api.core.v1.PodTemplateSpec."""
    return _with_definitions({"$ref": "/api/_definitions.json#/$defs/io.k8s.api.core.v1.PodTemplateSpec",
                              "$id": "https://kubernetes.io/api/pod-template-spec",
                              "$schema": "https://json-schema.org/draft/2020-12/schema"})


def _with_definitions(schema: Obj) -> jsonschema.Draft202012Validator:
    version, folder = _kubernetes_schemas()
    definitions = kv.schema_contents(f"{folder}/_definitions.json", version)
    # both carry their $id (https://kubernetes.io/api/...), which the references resolve against
    registry: referencing.Registry[Any] = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def crd_schema_path(api_version: str, kind: str) -> Path:
    """deploy/k8s/schemas/<group>_<kind in lower case>.yaml: the CRD's openAPIV3Schema."""
    return SCHEMAS_DIR / f"{api_version.partition('/')[0]}_{kind.lower()}.yaml"


def crd_schema_version(api_version: str, kind: str) -> str:
    """The group/version whose schema the vendored file holds, as its first line names it."""
    group = api_version.partition("/")[0]
    first = crd_schema_path(api_version, kind).read_text().partition("\n")[0]
    found = re.search(rf"\b{re.escape(group)}/(v\w+)\b", first)
    assert found, f"{crd_schema_path(api_version, kind).name}: its first line names no {group}/<version>"
    return f"{group}/{found.group(1)}"


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    path = crd_schema_path(api_version, kind)
    if not path.is_file():
        return None
    return jsonschema.Draft202012Validator(strict(yaml.load(path.read_text(), Loader=_YAML_LOADER)))


def strict(schema: Obj) -> Obj:
    """`schema` where every object that lists its properties admits no other field (kubectl's
    strict field validation), unless it preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        if not isinstance(node, dict):
            return
        if "properties" in node and "additionalProperties" not in node and \
                not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for key in ("properties",):
            for child in node.get(key, {}).values():
                visit(child)
        for key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf"):
            visit(node.get(key))

    visit(schema)
    return schema


# -- pods, selectors ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PodTemplate:
    """The pod template of one workload (Deployment, StatefulSet, ...)."""

    workload: Obj
    metadata: Obj
    spec: Obj
    role: str = ""  # a RoleBasedGroup's role ("" for other workloads)

    @property
    def labels(self) -> dict[str, str]:
        labels = dict(self.metadata.get("labels", {}))
        if self.role:
            labels |= {RBG_GROUP_LABEL: self.workload["metadata"]["name"], RBG_ROLE_LABEL: self.role}
        return labels

    @property
    def name(self) -> str:
        return f"{name_of(self.workload)}[{self.role}]" if self.role else name_of(self.workload)

    @property
    def workload_name(self) -> str:
        """The object that runs the pods: the Deployment, or the role's workload of a RoleBasedGroup."""
        name = self.workload["metadata"]["name"]
        return f"{name}-{self.role}" if self.role else name

    @property
    def selector(self) -> Obj:
        if self.role:
            return {"matchLabels": {RBG_GROUP_LABEL: self.workload["metadata"]["name"], RBG_ROLE_LABEL: self.role}}
        return dict(self.workload["spec"]["selector"])


def pod_templates(objects: tuple[Obj, ...]) -> list[PodTemplate]:
    found = []
    for obj in objects:
        if obj["kind"] == "RoleBasedGroup":
            for role in obj["spec"]["roles"]:
                template = role.get("standalonePattern", {}).get("template", {})
                found.append(PodTemplate(obj, template.get("metadata", {}), template.get("spec", {}), role["name"]))
            continue
        spec = obj.get("spec", {})
        if obj["kind"] == "CronJob":
            spec = spec.get("jobTemplate", {}).get("spec", {})
        template = spec.get("template") if isinstance(spec, dict) else None
        if isinstance(template, dict) and "spec" in template and "containers" in template["spec"]:
            found.append(PodTemplate(obj, template.get("metadata", {}), template["spec"]))
    return found


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a pod's labels; {} selects all."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def config_map(objects: tuple[Obj, ...], name: str) -> dict[str, str]:
    (found,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    return dict(found.get("data", {}))


# -- pdserve containers -------------------------------------------------------------------------

@dataclass(frozen=True)
class PdserveContainer:
    """A container that runs `pdserve`, its command line expanded and parsed."""

    pod: PodTemplate
    container: Obj
    env: dict[str, str]
    argv: list[str]  # after `pdserve`, $(VAR)s expanded
    ns: argparse.Namespace

    @property
    def role(self) -> str:
        return "router" if self.ns.command == "router" else str(self.ns.role)

    def port(self, name: str) -> int | None:
        ports = [p["containerPort"] for p in self.container.get("ports", []) if p.get("name") == name]
        return ports[0] if ports else None


def pdserve_containers(objects: tuple[Obj, ...]) -> list[PdserveContainer]:
    found = []
    for pod in pod_templates(objects):
        for container in pod.spec["containers"]:
            command = container.get("command", [])
            if not command or Path(command[0]).name != "pdserve":
                continue
            env = container_env(container, objects)
            argv = [expand(arg, env) for arg in [*command[1:], *container.get("args", [])]]
            unresolved = [arg for arg in argv if "$(" in arg]
            assert not unresolved, f"{pod.name}: undefined variables in {unresolved}"
            found.append(PdserveContainer(pod, container, env, argv, parse_pdserve(argv, pod.name)))
    return found


def parse_pdserve(argv: list[str], where: str = "") -> argparse.Namespace:
    """`pdserve ARGV` as pdserve parses it, then its configs built and validated as the command
    would (AssertionError with argparse's or the config's message)."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            ns = build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{where}: pdserve {' '.join(argv)}\n{errors.getvalue().strip()}") from None
    try:
        if ns.command == "serve":
            config_from_args(EngineArgs, ns).validate()
            if ns.role != "colocated":
                config_from_args(WorkerConfig, ns, role=ns.role).validate()
        elif ns.command == "router":
            config_from_args(RouterConfig, ns).validate()
    except ValueError as exc:
        raise AssertionError(f"{where}: pdserve {' '.join(argv)}\n{exc}") from None
    return ns


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's expansion of command and args: $(VAR) becomes VAR's value when the container
    defines VAR, else stays as written; $$ is a literal $."""
    return _REFERENCE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: Obj, objects: tuple[Obj, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            data = config_map(objects, source["configMapRef"]["name"])
            env |= {source.get("prefix", "") + key: value for key, value in data.items()}
    for item in container.get("env", []):
        env[item["name"]] = _env_value(item, container, objects, env)
    return env


def _env_value(item: Obj, container: Obj, objects: tuple[Obj, ...], env: Mapping[str, str]) -> str:
    if "value" in item:
        return expand(str(item["value"]), env)
    source = item["valueFrom"]
    if "fieldRef" in source:
        return FIELD_REFS[source["fieldRef"]["fieldPath"]]
    if "configMapKeyRef" in source:
        return config_map(objects, source["configMapKeyRef"]["name"])[source["configMapKeyRef"]["key"]]
    if "resourceFieldRef" in source:
        ref = source["resourceFieldRef"]
        assert ref["resource"] in ("limits.cpu", "requests.cpu"), ref
        kind, resource = ref["resource"].split(".")
        amount = container.get("resources", {}).get(kind, {}).get(resource)
        assert amount is not None, f"{item['name']}: {ref['resource']} is not set"
        return str(math.ceil(cpu_cores(str(amount)) / cpu_cores(str(ref.get("divisor", "1")))))
    return "<secret>"


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def containers(objects: tuple[Obj, ...]) -> Iterator[tuple[PodTemplate, Obj]]:
    for pod in pod_templates(objects):
        for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            yield pod, container


def app_get_routes(model_dir: Path) -> dict[str, set[str]]:
    """The GET paths of the apps `pdserve serve --role prefill|decode` and `pdserve router` serve,
    built for real on `model_dir` (then shut down)."""
    from pdserve.disagg.router.app import create_router_app
    from pdserve.disagg.router.core import PDRouter
    from pdserve.disagg.worker.app import build_worker
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.qwen3_config import Qwen3ModelConfig
    from pdserve.tokenizer import load_tokenizer

    def gets(app: Any) -> set[str]:
        return {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}

    routes = {}
    for role in ("prefill", "decode"):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=16))
        worker = build_worker(engine, WorkerConfig(role=role, kv_transport="tcp"), "m")
        try:
            routes[role] = gets(worker.app)
        finally:
            worker.client.shutdown()
            worker.service.close()
    config = RouterConfig(prefill=("dns:pdserve-prefill:8000",), decode=("dns:pdserve-decode:8000",))
    router = PDRouter.from_config(config, load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                  str(model_dir), 1024)
    routes["router"] = gets(create_router_app(router, "m"))
    return routes
