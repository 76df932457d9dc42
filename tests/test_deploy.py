"""Checks on the deployment files: the Kubernetes manifests under deploy/kubernetes and the
image's deploy/Dockerfile.

Pure file reads, no cluster and no Docker: base's ConfigMaps are read from the env files its
configMapGenerator names. The rendered checks run `kubectl kustomize` (local, no network) on
base, on every overlay and on base with each component, and apply the same rules to what
comes out; they are skipped where kubectl is not installed.

No schema validator runs here: none is installed offline (kubeconform needs its schemas
downloaded). The rules below read the fields they check; the CloudNativePG `Cluster` and the
PodMonitors are custom resources that a core-schema check would have to skip anyway.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.gateway.config import GatewayConfig
from services.runtime.config import ServerConfig, load_config
from storage_service.config import StorageConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
BASE = KUBE / "base"
COMPONENTS = KUBE / "components"
OVERLAYS = KUBE / "overlays"
DOCKERFILE = DEPLOY / "Dockerfile"
README = DEPLOY / "README.md"
SECRET_NAME = "system-secrets"
IMAGE_UID = 10001


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the manifests must say about one service."""

    app: str
    """Deployment and Service name, and the pods' `app` label; other services dial it."""
    module: str
    """What `python -m` runs."""
    env_prefix: str
    grpc_port: int
    metrics_port: int
    grpc_service: str
    """Full name of the service the readiness probe asks about."""
    targets: dict[str, str]
    """Target setting -> the Service it must dial."""


SPECS = (
    Spec(
        "gateway",
        "services.gateway",
        "SYSTEM_GATEWAY_",
        50051,
        9101,
        "system.gateway.v1.GameGatewayService",
        {"router_target": "router", "engine_target": "engine", "storage_target": "storage"},
    ),
    Spec(
        "router",
        "router_service",
        "SYSTEM_ROUTER_",
        50052,
        9102,
        "system.router.v1.RouterService",
        {"engine_target": "engine", "model_target": "model-gateway", "storage_target": "storage"},
    ),
    Spec(
        "engine",
        "engine_service",
        "SYSTEM_ENGINE_",
        50053,
        9103,
        "system.engine.v1.EngineService",
        {
            "storage_target": "storage",
            "gateway_target": "gateway-internal",
            "model_target": "model-gateway",
            "router_target": "router",
        },
    ),
    Spec(
        "model-gateway",
        "services.model_gateway",
        "SYSTEM_MODEL_",
        50054,
        9104,
        "system.model.v1.ModelGatewayService",
        {"storage_target": "storage", "relay_target": "gateway-internal"},
    ),
    Spec(
        "storage",
        "storage_service",
        "SYSTEM_STORAGE_",
        50055,
        9105,
        "system.storage.v1.StorageService",
        {},
    ),
)
BY_APP = {spec.app: spec for spec in SPECS}
STATELESS = frozenset({"gateway", "router", "engine", "model-gateway"})
"""Services whose replicas share nothing: each has an autoscaler. Storage joins them on
PostgreSQL; on SQLite it is one replica. Gateway replicas record in storage which players
each holds, and the engine's relay goes to that replica (decision 0023)."""
PUBLIC_PORT = ("gateway", 50051)
"""The one port reachable from anywhere."""
MIGRATE_JOB = "storage-migrate"
MIGRATE_MODULE = "storage_service.migrate"
STORAGE_IDLE_MIB = 149
"""The storage service's measured memory use when idle; its request must cover it."""
TOPOLOGY_KEYS = {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
MONITORING = "namespaces(system-assistant/scrape-metrics=true)"
"""Where scrapes may come from: the namespaces labelled so (see _peer_names)."""
DNS = "namespaces(kubernetes.io/metadata.name=kube-system)/pods(k8s-app=kube-dns)"
ANYWHERE = "anywhere"
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16")
"""What the internet egress must leave out: private networks and the cloud metadata range."""
EXTRA_SETTINGS = {"SERVICE_MODULE", "GRPC_DNS_RESOLVER"}
"""Variables a container may have beside its service's settings: what `python -m` runs, and
gRPC's resolver."""
LIBPQ_SETTINGS = {"PGSSLMODE", "PGSSLROOTCERT"}
"""libpq's own variables, which storage's database connections read."""
SECRET_NAMES = {SECRET_NAME, "system-db-app", "system-db-ca", "gateway-public-tls"}
"""Secrets the manifests read: the operator's, and those CloudNativePG and cert-manager make."""

# Env names that always hold a secret (a `_FILE` is a path to one); DATABASE_URL holds one only
# in its PostgreSQL form.
SECRET_ENV = re.compile(r"API_KEY|TOKENS?$|PASSWORD|SECRET")


def _is_secret_name(name: str) -> bool:
    return not name.endswith("_FILE") and bool(SECRET_ENV.search(name))


# --- loading -----------------------------------------------------------------------------------


def _load_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _yaml_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))


def _kustomization(folder: Path) -> dict[str, Any]:
    (doc,) = _load_all(folder / "kustomization.yaml")
    return doc


def _inline_patches(kustomization: dict[str, Any]) -> list[Any]:
    """Strategic-merge and JSON patches written inline in a kustomization, parsed."""
    docs: list[Any] = []
    for patch in kustomization.get("patches") or []:
        if isinstance(patch, dict) and isinstance(patch.get("patch"), str):
            docs.extend(d for d in yaml.safe_load_all(patch["patch"]) if d is not None)
    return docs


def _every_document() -> list[tuple[Path, Any]]:
    """Every YAML document under deploy/kubernetes, inline patches included."""
    found = []
    for path in _yaml_files(KUBE):
        for doc in _load_all(path):
            found.append((path, doc))
            if isinstance(doc, dict) and doc.get("kind") in ("Kustomization", "Component"):
                found.extend((path, patch) for patch in _inline_patches(doc))
    return found


def _env_file(path: Path) -> dict[str, str]:
    """A kustomize env file: KEY=VALUE lines; `#` lines and blank lines are skipped."""
    values = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.relative_to(ROOT)}: {line!r} is not KEY=VALUE"
        assert key not in values, f"{path.relative_to(ROOT)}: {key} appears twice"
        values[key] = value
    return values


def _generated_config_maps(folder: Path) -> list[dict[str, Any]]:
    """The ConfigMaps a kustomization's configMapGenerator makes, under their plain names."""
    maps = []
    for generator in _kustomization(folder).get("configMapGenerator") or []:
        data: dict[str, str] = {}
        for env in generator.get("envs") or []:
            data.update(_env_file(folder / env))
        for literal in generator.get("literals") or []:
            key, _, value = literal.partition("=")
            data[key] = value
        maps.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}}
            | {"data": data, "behavior": generator.get("behavior", "create")}
        )
    return maps


def _base_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in _kustomization(BASE)["resources"]:
        docs.extend(_load_all(BASE / name))
    return docs + _generated_config_maps(BASE)


@dataclasses.dataclass(frozen=True)
class Pod:
    """A pod template's name (its `app` label), labels and named container ports."""

    app: str
    labels: dict[str, str]
    ports: dict[str, int]


class Manifests:
    """Kubernetes objects, with the lookups the rules need."""

    def __init__(self, docs: Iterable[dict[str, Any]]) -> None:
        self.docs = list(docs)

    def of(self, kind: str) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in self.docs if d.get("kind") == kind}

    def workloads(self) -> list[dict[str, Any]]:
        """Deployments and Jobs: everything with a pod template."""
        return [d for d in self.docs if d.get("kind") in ("Deployment", "Job")]

    def settings(self, workload: dict[str, Any]) -> dict[str, str | None]:
        """The server container's environment as the kubelet builds it: the ConfigMaps of
        `envFrom`, then `env` entries over them. A variable from a Secret reads None."""
        container = _server_container(workload)
        config_maps = self.of("ConfigMap")
        values: dict[str, str | None] = {}
        for source in container.get("envFrom") or []:
            name = source["configMapRef"]["name"]
            assert name in config_maps, f"{_name(workload)}: envFrom names no ConfigMap {name}"
            values.update(config_maps[name].get("data") or {})
        for entry in container.get("env") or []:
            values[entry["name"]] = entry.get("value") if "valueFrom" not in entry else None
        return values

    def env_refs(self, workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The server container's variables that come from a Secret: name -> secretKeyRef."""
        return {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in _server_container(workload).get("env") or []
            if "secretKeyRef" in (e.get("valueFrom") or {})
        }

    def pods(self) -> list[Pod]:
        pods = []
        for workload in self.workloads():
            template = workload["spec"]["template"]
            ports = {
                p["name"]: p["containerPort"]
                for c in template["spec"]["containers"]
                for p in c.get("ports", [])
            }
            pods.append(
                Pod(template["metadata"]["labels"]["app"], template["metadata"]["labels"], ports)
            )
        return pods


def _name(doc: dict[str, Any]) -> str:
    return f"{doc['kind']} {doc['metadata']['name']}"


BASE_MANIFESTS = Manifests(_base_documents())
DEPLOYMENTS = BASE_MANIFESTS.of("Deployment")
SERVICES = BASE_MANIFESTS.of("Service")


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _server_container(workload: dict[str, Any]) -> dict[str, Any]:
    """The one container named `server` (a Deployment's has the port named `grpc`)."""
    servers = [c for c in _pod(workload)["containers"] if c["name"] == "server"]
    assert len(servers) == 1, f"{_name(workload)}: expected one container named server"
    return servers[0]


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    return port


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _env_entries(node: Any) -> Iterator[dict[str, Any]]:
    """Every container env entry anywhere in a document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "env" and isinstance(value, list):
                yield from (e for e in value if isinstance(e, dict) and "name" in e)
            else:
                yield from _env_entries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _env_entries(item)


def _deployment(spec: Spec) -> dict[str, Any]:
    assert spec.app in DEPLOYMENTS, f"no Deployment named {spec.app} in {BASE}"
    return DEPLOYMENTS[spec.app]


def _config_class(spec: Spec) -> type[ServerConfig]:
    config_module = importlib.import_module(f"{spec.module}.config")
    (config_cls,) = [
        c
        for c in vars(config_module).values()
        if isinstance(c, type)
        and issubclass(c, ServerConfig)
        and c.__module__ == config_module.__name__
    ]
    return config_cls


def _setting(spec: Spec, settings: dict[str, str | None], name: str) -> float:
    """A numeric setting as the service reads it: the manifests' value, else the default."""
    value = settings.get(f"{spec.env_prefix}{name.upper()}")
    if value is not None:
        return float(value)
    defaults = {f.name: f.default for f in dataclasses.fields(_config_class(spec))}
    return float(defaults[name])


def _target(value: str | None) -> tuple[str, int]:
    """`dns:///host:port` -> (host, port)."""
    assert value and value.startswith("dns:///"), (
        f"target {value!r}: clients balance over a headless Service's pods only with a "
        "dns:/// target"
    )
    host, _, port = value.removeprefix("dns:///").rpartition(":")
    return host, int(port)


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions); {} selects everything."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        if (
            (operator == "In" and labels.get(key) not in values)
            or (operator == "NotIn" and key in labels and labels[key] in values)
            or (operator == "Exists" and key not in labels)
            or (operator == "DoesNotExist" and key in labels)
        ):
            return False
    return True


per_service = pytest.mark.parametrize("spec", SPECS, ids=[s.app for s in SPECS])


# --- the rules, on any set of manifests (base's files, or a rendered overlay) -----------------


def check_settings_are_known(manifests: Manifests) -> None:
    """Every variable a workload's server container gets is one of its service's settings:
    load_config ignores unknown variables, so a misspelt one would pass unnoticed."""
    for workload in manifests.workloads():
        app = workload["spec"]["template"]["metadata"]["labels"]["app"]
        spec = BY_APP["storage" if app == MIGRATE_JOB else app]
        known = {
            f"{spec.env_prefix}{f.name.upper()}" for f in dataclasses.fields(_config_class(spec))
        }
        known |= EXTRA_SETTINGS | {f"{spec.env_prefix}CONFIG"}
        if spec.app == "storage":
            known |= LIBPQ_SETTINGS
        unknown = set(manifests.settings(workload)) - known
        assert not unknown, f"{_name(workload)}: no setting named {sorted(unknown)}"


def check_no_secret_literals(manifests: Manifests) -> None:
    """Secrets reach containers from Secrets only: never as an env literal or in a ConfigMap."""
    for config_map in manifests.of("ConfigMap").values():
        for key, value in (config_map.get("data") or {}).items():
            assert not _is_secret_name(key), f"{_name(config_map)}: {key} is a secret"
            if key.endswith("DATABASE_URL"):
                assert value.startswith("sqlite:"), (
                    f"{_name(config_map)}: a database URL is a secret"
                )
    for workload in manifests.workloads():
        for entry in _env_entries(workload):
            if _is_secret_name(entry["name"]) or entry["name"].endswith("DATABASE_URL"):
                ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
                literal = entry.get("value")
                if literal is not None and str(literal).startswith("sqlite:"):
                    continue
                assert ref and literal is None, f"{_name(workload)}: {entry['name']} is a literal"
                # Or a Secret the overlay generates (its name then carries a hash).
                known = SECRET_NAMES | set(manifests.of("Secret"))
                assert ref["name"] in known, f"{_name(workload)}: Secret {ref['name']}"


def check_grace_outlasts_the_longest_request(manifests: Manifests) -> None:
    """terminationGracePeriodSeconds covers the longest request deadline (the gateway's
    request_timeout_seconds) plus the drain, and the service's own drain + grace."""
    gateway = manifests.of("Deployment")["gateway"]
    deadline = _setting(BY_APP["gateway"], manifests.settings(gateway), "request_timeout_seconds")
    for name, deployment in manifests.of("Deployment").items():
        spec, settings = BY_APP[name], manifests.settings(deployment)
        period = _pod(deployment).get("terminationGracePeriodSeconds")
        assert isinstance(period, int), f"{name}: terminationGracePeriodSeconds is not set"
        drain = _setting(spec, settings, "drain_seconds")
        grace = _setting(spec, settings, "grace_seconds")
        assert period >= deadline + drain, (
            f"{name}: {period} s < deadline {deadline} + drain {drain}"
        )
        assert period > drain + grace, f"{name}: {period} s <= drain {drain} + grace {grace}"


def _on_sqlite(manifests: Manifests) -> bool:
    storage = manifests.of("Deployment")["storage"]
    url = manifests.settings(storage).get("SYSTEM_STORAGE_DATABASE_URL")
    return str(url).startswith("sqlite:")


def check_autoscaling(manifests: Manifests) -> None:
    """An autoscaler (autoscaling/v2, on CPU) for each service whose replicas share nothing:
    the stateless four, and storage once its database is PostgreSQL; those Deployments leave
    `replicas` to it. Storage on SQLite stays at one replica, recreated, never two at once."""
    deployments = manifests.of("Deployment")
    storage = deployments["storage"]
    on_sqlite = _on_sqlite(manifests)
    scaled = STATELESS if on_sqlite else STATELESS | {"storage"}
    autoscalers = {
        h["spec"]["scaleTargetRef"]["name"]: h
        for h in manifests.of("HorizontalPodAutoscaler").values()
        if h["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    }
    assert set(autoscalers) == scaled
    for name, hpa in autoscalers.items():
        assert hpa["apiVersion"] == "autoscaling/v2", name
        assert name in deployments, f"HPA {hpa['metadata']['name']} scales no Deployment"
        assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"], name
        cpu = [
            m
            for m in hpa["spec"]["metrics"]
            if m["type"] == "Resource" and m["resource"]["name"] == "cpu"
        ]
        assert cpu and cpu[0]["resource"]["target"]["type"] == "Utilization", name
        assert "replicas" not in deployments[name]["spec"], (
            f"{name}: `replicas` would reset the autoscaler's count on every apply"
        )
    for name in set(deployments) - scaled:
        assert deployments[name]["spec"].get("replicas") == 1, name
    strategy = storage["spec"].get("strategy", {}).get("type", "RollingUpdate")
    assert strategy == ("Recreate" if on_sqlite else "RollingUpdate")


def check_disruption_budgets(manifests: Manifests) -> None:
    """Each Deployment has one PodDisruptionBudget, which still lets a drain evict one pod
    when the Deployment is at its smallest (a budget that allows nothing blocks node drains)."""
    budgets = manifests.of("PodDisruptionBudget").values()
    minimum = {
        h["spec"]["scaleTargetRef"]["name"]: h["spec"]["minReplicas"]
        for h in manifests.of("HorizontalPodAutoscaler").values()
    }
    for name, deployment in manifests.of("Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        mine = [b for b in budgets if _selects(b["spec"]["selector"], labels)]
        assert len(mine) == 1, f"{name}: {len(mine)} PodDisruptionBudgets select its pods"
        (budget,) = mine
        assert budget["apiVersion"] == "policy/v1"
        smallest = minimum.get(name, deployment["spec"].get("replicas", 1))
        if "maxUnavailable" in budget["spec"]:
            assert isinstance(budget["spec"]["maxUnavailable"], int)
            assert budget["spec"]["maxUnavailable"] >= 1, name
        else:
            assert isinstance(budget["spec"]["minAvailable"], int)
            assert budget["spec"]["minAvailable"] < smallest, f"{name}: the budget allows nothing"


def check_topology_spread(manifests: Manifests) -> None:
    """Every Deployment's pods spread over zones and nodes, softly (ScheduleAnyway)."""
    for name, deployment in manifests.of("Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        constraints = _pod(deployment).get("topologySpreadConstraints") or []
        assert {c["topologyKey"] for c in constraints} == TOPOLOGY_KEYS, name
        for constraint in constraints:
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway", name
            assert constraint["maxSkew"] >= 1, name
            assert _selects(constraint["labelSelector"], labels), f"{name}: spreads other pods"


def _types(policy: dict[str, Any]) -> set[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return set(spec["policyTypes"])
    return {"Ingress"} | ({"Egress"} if "egress" in spec else set())


def _describe(selector: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    parts += [
        f"{e['key']} {e['operator']} {sorted(e.get('values') or [])}"
        for e in selector.get("matchExpressions") or []
    ]
    return ",".join(parts) or "all"


def _peer_names(peer: dict[str, Any], pods: list[Pod]) -> set[str]:
    """Who a policy peer is: the apps of this namespace's pods it selects, or a description
    of what lies outside (other namespaces, address blocks)."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return {f"ip({block['cidr']} except {sorted(block.get('except') or [])})"}
    namespaces, selector = peer.get("namespaceSelector"), peer.get("podSelector")
    if namespaces is not None:
        described = f"namespaces({_describe(namespaces)})"
        return {described + (f"/pods({_describe(selector)})" if selector is not None else "")}
    apps = {pod.app for pod in pods if _selects(selector, pod.labels)}
    return apps or {f"pods({_describe(selector or {})})"}


def _port_numbers(rule_ports: list[dict[str, Any]] | None, pod: Pod | None) -> set[tuple[str, Any]]:
    """(protocol, port) pairs a rule names; ("*", "*") for every port. Named ports resolve
    against `pod` (the policy's own pod, for ingress)."""
    if not rule_ports:
        return {("*", "*")}
    found = set()
    for entry in rule_ports:
        protocol, port = entry.get("protocol", "TCP"), entry.get("port", "*")
        if isinstance(port, str) and port != "*":
            assert pod is not None, f"named port {port} in an egress rule"
            port = pod.ports[port]
        if isinstance(port, int) and "endPort" in entry:
            found |= {(protocol, p) for p in range(port, entry["endPort"] + 1)}
        else:
            found.add((protocol, port))
    return found


def _ingress_sources(manifests: Manifests, pod: Pod, port: int) -> set[str]:
    """Who the NetworkPolicies let reach `port` (TCP) of `pod`."""
    pods = manifests.pods()
    sources: set[str] = set()
    for policy in manifests.of("NetworkPolicy").values():
        if "Ingress" not in _types(policy) or not _selects(
            policy["spec"]["podSelector"], pod.labels
        ):
            continue
        for rule in policy["spec"].get("ingress") or []:
            ports = _port_numbers(rule.get("ports"), pod)
            if not ({("TCP", port), ("TCP", "*"), ("*", "*")} & ports):
                continue
            peers = rule.get("from")
            if not peers:
                sources.add(ANYWHERE)
            for peer in peers or []:
                sources |= _peer_names(peer, pods)
    return sources


def _egress_destinations(manifests: Manifests, pod: Pod) -> set[tuple[str, str, Any]]:
    """(destination, protocol, port) the NetworkPolicies let `pod` open connections to."""
    pods = manifests.pods()
    found: set[tuple[str, str, Any]] = set()
    for policy in manifests.of("NetworkPolicy").values():
        if "Egress" not in _types(policy) or not _selects(
            policy["spec"]["podSelector"], pod.labels
        ):
            continue
        for rule in policy["spec"].get("egress") or []:
            names = {ANYWHERE} if not rule.get("to") else set()
            for peer in rule.get("to") or []:
                names |= _peer_names(peer, pods)
            found |= {
                (n, proto, port)
                for n in names
                for proto, port in _port_numbers(rule.get("ports"), None)
            }
    return found


def _expected_callers(manifests: Manifests) -> dict[tuple[str, int], set[str]]:
    """(app, container port) -> the apps whose *_target settings dial it."""
    services = manifests.of("Service")
    pods = {pod.app: pod for pod in manifests.pods()}
    callers: dict[tuple[str, int], set[str]] = {}
    for name, deployment in manifests.of("Deployment").items():
        for setting, value in manifests.settings(deployment).items():
            if not setting.endswith("_TARGET"):
                continue
            host, port = _target(value)
            service = services[host]
            (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
            callee = pods[service["spec"]["selector"]["app"]]
            target_port = service_port.get("targetPort", port)
            number = callee.ports[target_port] if isinstance(target_port, str) else target_port
            callers.setdefault((callee.app, number), set()).add(name)
    return callers


def check_network_policies(manifests: Manifests) -> None:
    """Everything is denied first; each internal port admits exactly the services that dial
    it, the public port admits anyone and is the only one that does, metrics ports admit the
    monitoring namespaces, and each pod may open exactly the connections it needs."""
    policies = manifests.of("NetworkPolicy").values()
    assert any(
        p["spec"]["podSelector"] == {}
        and _types(p) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
        for p in policies
    ), "no default-deny NetworkPolicy (ingress and egress) for the whole namespace"
    callers = _expected_callers(manifests)
    deployments = manifests.of("Deployment")
    for pod in manifests.pods():
        for port_name, port in pod.ports.items():
            sources = _ingress_sources(manifests, pod, port)
            where = f"{pod.app}:{port} ({port_name})"
            if (pod.app, port) == PUBLIC_PORT:
                assert sources == {ANYWHERE}, where
            elif port_name == "metrics":
                assert sources == {MONITORING}, f"{where} admits {sorted(sources)}"
            else:
                expected = callers.get((pod.app, port), set())
                assert sources == expected, (
                    f"{where} admits {sorted(sources)}, not {sorted(expected)}"
                )
        destinations = _egress_destinations(manifests, pod)
        assert {(DNS, "UDP", 53), (DNS, "TCP", 53)} <= destinations, f"{pod.app}: no DNS"
        inside = {(n, port) for n, proto, port in destinations if n in deployments}
        expected_inside = {
            (callee, port) for (callee, port), who in callers.items() if pod.app in who
        }
        assert inside == expected_inside, f"{pod.app} may call {sorted(inside)}"
        outside = {(n, proto, port) for n, proto, port in destinations if n not in deployments}
        outside -= {(DNS, "UDP", 53), (DNS, "TCP", 53)}
        assert all(n != ANYWHERE and port != "*" for n, _, port in outside), (
            f"{pod.app}: egress without a destination or a port: {sorted(outside)}"
        )
        if pod.app == "model-gateway":
            assert {port for _, _, port in outside} == {80, 443}, sorted(outside)
            for block in (
                p["ipBlock"]
                for policy in policies
                if _selects(policy["spec"]["podSelector"], pod.labels)
                for rule in policy["spec"].get("egress") or []
                for p in rule.get("to") or []
                if "ipBlock" in p and ipaddress.ip_network(p["ipBlock"]["cidr"]).version == 4
            ):
                excepted = [ipaddress.ip_network(e) for e in block.get("except") or []]
                for private in map(ipaddress.ip_network, PRIVATE_RANGES):
                    assert any(private.subnet_of(e) for e in excepted), (
                        f"model-gateway may reach {private}"
                    )
        elif pod.app in ("storage", MIGRATE_JOB):
            # The database's port, once the database is PostgreSQL; nothing else.
            expected_ports = set() if _on_sqlite(manifests) else {5432}
            assert {port for _, _, port in outside} == expected_ports, (
                f"{pod.app}: {sorted(outside)}"
            )
        else:
            assert not outside, f"{pod.app} may reach {sorted(outside)}"


def _storage_migrates(manifests: Manifests, storage: dict[str, Any]) -> bool:
    value = manifests.settings(storage).get("SYSTEM_STORAGE_RUN_MIGRATIONS")
    default = StorageConfig.__dataclass_fields__["run_migrations"].default
    return default if value is None else value.lower() in {"1", "true", "yes", "on"}


def check_one_schema_owner(manifests: Manifests) -> None:
    """Where the migration Job runs, storage pods do not migrate: they wait, not ready, for the
    schema their image needs (decision 0028). Where none runs (SQLite), storage migrates its
    own database at start; off, it would wait for ever."""
    storage = manifests.of("Deployment").get("storage")
    if storage is None:
        return
    job = MIGRATE_JOB in manifests.of("Job")
    migrates = _storage_migrates(manifests, storage)
    assert migrates != job, (
        "storage-migrate runs and storage migrates too: set SYSTEM_STORAGE_RUN_MIGRATIONS=false"
        if job
        else "no migration Job and SYSTEM_STORAGE_RUN_MIGRATIONS is off: storage never serves"
    )


CREDENTIAL_SETTINGS = ("SERVICE_TOKEN", "CALLER_TOKENS")
"""Each service's own token and the `caller=token` pairs its internal port accepts."""


def _credential_key(spec: Spec, setting: str) -> str:
    """The key of `system-secrets` a credential setting of `spec`'s service reads."""
    if setting == "CALLER_TOKENS":
        return "caller-tokens"
    return f"{spec.env_prefix.removeprefix('SYSTEM_').rstrip('_').lower()}-service-token"


def check_credentials_are_mounted_files(manifests: Manifests) -> None:
    """Service and caller tokens reach every Deployment as files of the mounted Secret
    (`<SETTING>_FILE`), which the kubelet rewrites on a rotation and the service reads again
    without a restart; never as variables, which a process reads once. The mount has no
    `subPath`: a subPath mount is never updated."""
    for workload in manifests.of("Deployment").values():
        spec = BY_APP[workload["spec"]["template"]["metadata"]["labels"]["app"]]
        settings = manifests.settings(workload)
        for setting in CREDENTIAL_SETTINGS:
            name = f"{spec.env_prefix}{setting}"
            where = f"{_name(workload)}: {name}"
            assert name not in settings, f"{where} as a variable: a rotation needs a restart"
            path = settings.get(f"{name}_FILE")
            assert path, f"{where}_FILE is not set"
            secret = _mounted_from(workload, path)
            # An overlay's secretGenerator adds a hash suffix to the name.
            assert re.fullmatch(rf"{SECRET_NAME}(-[a-z0-9]+)?", secret["secretName"]), (
                f"{where}_FILE: not from {SECRET_NAME}"
            )
            relative = {i["path"]: i["key"] for i in secret.get("items", [])}
            mount = _mount_of(workload, path)
            assert relative.get(path.removeprefix(mount["mountPath"] + "/")) == _credential_key(
                spec, setting
            ), f"{where}_FILE: not the key {_credential_key(spec, setting)}"
            assert "subPath" not in mount and mount.get("readOnly") is True, (
                f"{where}_FILE: mounted with subPath (never updated) or writable"
            )


def check_everything(manifests: Manifests) -> None:
    check_one_schema_owner(manifests)
    check_settings_are_known(manifests)
    check_no_secret_literals(manifests)
    check_credentials_are_mounted_files(manifests)
    check_grace_outlasts_the_longest_request(manifests)
    check_autoscaling(manifests)
    check_disruption_budgets(manifests)
    check_topology_spread(manifests)
    check_network_policies(manifests)


# --- the layout --------------------------------------------------------------------------------


def test_every_yaml_document_parses() -> None:
    documents = _every_document()
    assert documents, f"no YAML under {KUBE}"
    for path, doc in documents:
        assert isinstance(doc, dict), f"{path}: a document that is not a mapping"


def test_base_has_a_deployment_and_a_service_per_service() -> None:
    assert set(DEPLOYMENTS) == set(BY_APP)
    # The gateway's internal port has a Service of its own, so that exposing `gateway` (the
    # game servers' port) never exposes the relay.
    assert set(SERVICES) == set(BY_APP) | {"gateway-internal"}


def test_the_public_service_carries_only_the_game_servers_port() -> None:
    assert [p["name"] for p in SERVICES["gateway"]["spec"]["ports"]] == ["grpc"]
    internal = {p["name"]: p["port"] for p in SERVICES["gateway-internal"]["spec"]["ports"]}
    settings = BASE_MANIFESTS.settings(_deployment(BY_APP["gateway"]))
    assert internal["relay"] == int(settings["SYSTEM_GATEWAY_INTERNAL_PORT"] or 0)


def test_each_gateway_pod_advertises_its_own_internal_address() -> None:
    """Engine replicas reach the replica holding a player at the address it recorded in
    storage (decision 0023): the pod's IP, from the downward API, on the relay port."""
    gateway = _deployment(BY_APP["gateway"])
    [entry] = [
        e
        for e in _server_container(gateway).get("env", [])
        if e["name"] == "SYSTEM_GATEWAY_INTERNAL_ADVERTISE"
    ]
    assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    config = GatewayConfig(tokens=("sim=12345678",), internal_advertise="10.1.2.3")
    port = int(BASE_MANIFESTS.settings(gateway)["SYSTEM_GATEWAY_INTERNAL_PORT"] or 0)
    assert config.advertised_address(port) == f"10.1.2.3:{port}"
    assert _port(_server_container(gateway), "relay") == port
    assert "replicas" not in gateway["spec"]


def test_internal_services_are_headless_and_the_public_one_is_not() -> None:
    """Clients balance over pod addresses only when DNS hands them out: a headless Service.
    Game servers reach the public port through a virtual IP (or a load balancer)."""
    for name, service in SERVICES.items():
        if name == "gateway":
            assert service["spec"].get("clusterIP") != "None"
            assert service["spec"].get("type", "ClusterIP") in ("ClusterIP", "LoadBalancer")
        else:
            assert service["spec"].get("clusterIP") == "None", f"{name} is not headless"


def test_every_service_holds_and_checks_service_credentials_from_mounted_files() -> None:
    check_credentials_are_mounted_files(BASE_MANIFESTS)
    for spec in SPECS:
        settings = BASE_MANIFESTS.settings(_deployment(spec))
        for name in CREDENTIAL_SETTINGS:
            assert f"{spec.env_prefix}{name}" not in BASE_MANIFESTS.env_refs(_deployment(spec))
            assert str(settings[f"{spec.env_prefix}{name}_FILE"]).startswith("/etc/system/")


def test_every_base_file_is_listed_in_the_kustomization() -> None:
    kustomization = _kustomization(BASE)
    listed = set(kustomization.get("resources", []))
    files = {p.name for p in _yaml_files(BASE) if p.name != "kustomization.yaml"}
    assert files - listed == set(), "base files missing from base/kustomization.yaml"
    assert listed - files == set(), "base/kustomization.yaml lists files that do not exist"
    envs = {e for g in kustomization["configMapGenerator"] for e in g.get("envs", [])}
    on_disk = {p.relative_to(BASE).as_posix() for p in BASE.rglob("*.env")}
    assert envs == on_disk, "every env file under base/ makes a ConfigMap, and only those"


def test_base_kustomization_sets_common_labels() -> None:
    kustomization = _kustomization(BASE)
    pairs = [item.get("pairs", {}) for item in kustomization.get("labels", [])]
    assert any("app.kubernetes.io/part-of" in p for p in pairs) or kustomization.get(
        "commonLabels"
    ), "base/kustomization.yaml sets no common labels"


@pytest.mark.parametrize(
    ("component", "secret", "key"),
    [("postgres-external", SECRET_NAME, "database-url"), ("postgres-cnpg", "system-db-app", "uri")],
)
def test_postgres_components_set_the_url_from_a_secret(
    component: str, secret: str, key: str
) -> None:
    doc = _kustomization(COMPONENTS / component)
    assert doc["kind"] == "Component"
    assert "../postgres-common" in doc.get("components", []), "the migration Job and scaling"
    patched = [
        (patch["target"], e)
        for patch in doc.get("patches", [])
        for parsed in yaml.safe_load_all(patch["patch"])
        for e in _env_entries(parsed)
        if e["name"] == "SYSTEM_STORAGE_DATABASE_URL"
    ]
    assert patched, "the component does not set SYSTEM_STORAGE_DATABASE_URL"
    for target, entry in patched:
        # One patch for the Deployment and the migration Job: both dial the same database.
        assert re.fullmatch(target["kind"], "Deployment") and re.fullmatch(target["kind"], "Job")
        assert re.fullmatch(target["name"], "storage") and re.fullmatch(target["name"], MIGRATE_JOB)
        assert entry["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}
        assert "value" not in entry


def test_every_overlay_builds_on_base() -> None:
    overlays = sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
    assert {p.name for p in overlays} >= {"dev", "prod"}
    for overlay in overlays:
        assert "../../base" in _kustomization(overlay).get("resources", []), overlay.name


def test_the_readme_names_every_component() -> None:
    text = README.read_text(encoding="utf-8")
    for component in sorted(p.name for p in COMPONENTS.iterdir() if p.is_dir()):
        assert f"components/{component}" in text, f"deploy/README.md never mentions {component}"


# --- each Deployment ---------------------------------------------------------------------------


@per_service
def test_container_ports(spec: Spec) -> None:
    container = _server_container(_deployment(spec))
    assert _port(container, "grpc") == spec.grpc_port
    assert _port(container, "metrics") == spec.metrics_port


@per_service
def test_native_grpc_probes_on_the_grpc_port(spec: Spec) -> None:
    container = _server_container(_deployment(spec))
    # The gateway is probed on its internal port: the public one may serve TLS, which the
    # kubelet's gRPC probes do not speak; every port of a service answers for all its services.
    grpc_port = _port(container, "relay" if spec.app == "gateway" else "grpc")
    readiness = container["readinessProbe"]["grpc"]
    assert readiness["port"] == grpc_port
    assert readiness.get("service") == spec.grpc_service
    liveness = container["livenessProbe"]["grpc"]
    assert liveness["port"] == grpc_port
    assert liveness.get("service", "") == "", "liveness asks about the server as a whole"
    if "startupProbe" in container:
        assert container["startupProbe"]["grpc"]["port"] == grpc_port


def _workloads_in_files() -> list[dict[str, Any]]:
    """Every Deployment and Job in base and in the components' own files."""
    found = list(DEPLOYMENTS.values())
    for path in _yaml_files(COMPONENTS):
        found += [d for d in _load_all(path) if d.get("kind") in ("Deployment", "Job")]
    return found


WORKLOADS = _workloads_in_files()
per_workload = pytest.mark.parametrize("workload", WORKLOADS, ids=[_name(w) for w in WORKLOADS])


@per_workload
def test_runs_locked_down(workload: dict[str, Any]) -> None:
    pod = _pod(workload)
    pod_context = pod.get("securityContext", {})
    assert pod.get("automountServiceAccountToken") is False, _name(workload)
    assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault", _name(workload)
    for container in pod["containers"]:
        context = container.get("securityContext", {})
        name = f"{_name(workload)}/{container['name']}"
        assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, name
        assert context.get("readOnlyRootFilesystem") is True, name
        assert context.get("allowPrivilegeEscalation") is False, name
        assert "ALL" in context.get("capabilities", {}).get("drop", []), name


@per_workload
def test_resource_requests_and_limits(workload: dict[str, Any]) -> None:
    for container in _pod(workload)["containers"]:
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(kind, {})), (
                f"{_name(workload)}/{container['name']}: {kind} must set cpu and memory"
            )


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi)", quantity)
    assert match, f"memory quantity {quantity!r}: use Ki, Mi or Gi"
    return float(match.group(1)) * units[match.group(2)]


def test_storage_memory_request_covers_its_idle_use() -> None:
    resources = _server_container(_deployment(BY_APP["storage"]))["resources"]
    assert _mebibytes(resources["requests"]["memory"]) >= STORAGE_IDLE_MIB
    assert _mebibytes(resources["limits"]["memory"]) > _mebibytes(resources["requests"]["memory"])


@per_service
def test_termination_grace_lets_requests_finish(spec: Spec) -> None:
    """The services that run a player's request to its end (the gateway and the engine) wait
    that long on SIGTERM; terminationGracePeriodSeconds then outlasts it (check below)."""
    settings = BASE_MANIFESTS.settings(_deployment(spec))
    grace = _setting(spec, settings, "grace_seconds")
    if spec.app == "gateway":
        assert grace >= _setting(spec, settings, "request_timeout_seconds")
    if spec.app == "engine":
        assert grace >= _setting(spec, settings, "execute_timeout_seconds")
    drain = _setting(spec, settings, "drain_seconds")
    # Readiness fails after failureThreshold x periodSeconds; the drain keeps serving that long.
    readiness = _server_container(_deployment(spec))["readinessProbe"]
    assert drain >= readiness["periodSeconds"] * readiness["failureThreshold"]


def test_termination_grace_outlasts_the_longest_request_and_the_drain() -> None:
    check_grace_outlasts_the_longest_request(BASE_MANIFESTS)


def test_stateless_services_autoscale_and_storage_on_sqlite_stays_single() -> None:
    check_autoscaling(BASE_MANIFESTS)


def test_every_deployment_has_a_disruption_budget() -> None:
    check_disruption_budgets(BASE_MANIFESTS)


def test_every_deployment_spreads_over_zones_and_nodes() -> None:
    check_topology_spread(BASE_MANIFESTS)


def test_network_policies_admit_exactly_the_callers() -> None:
    check_network_policies(BASE_MANIFESTS)


def test_only_the_gateways_public_port_is_open_to_anyone() -> None:
    for pod in BASE_MANIFESTS.pods():
        for port in pod.ports.values():
            if ANYWHERE in _ingress_sources(BASE_MANIFESTS, pod, port):
                assert (pod.app, port) == PUBLIC_PORT, f"{pod.app}:{port} is open to anyone"
    (gateway,) = [p for p in BASE_MANIFESTS.pods() if p.app == "gateway"]
    assert ANYWHERE in _ingress_sources(BASE_MANIFESTS, gateway, PUBLIC_PORT[1])


@per_service
def test_runs_the_module_from_the_table(spec: Spec) -> None:
    container = _server_container(_deployment(spec))
    command = [*container.get("command", []), *container.get("args", [])]
    if "-m" in command:
        module = command[command.index("-m") + 1]
    else:
        module = _env(container).get("SERVICE_MODULE", {}).get("value")
    assert module == spec.module


@per_service
def test_settings_live_in_the_services_config_map(spec: Spec) -> None:
    """Settings come from the service's ConfigMap; the Deployment's own env holds what runs
    (SERVICE_MODULE), references to Secrets, and what only the pod knows (the downward API:
    the gateway's pod IP), nothing else."""
    container = _server_container(_deployment(spec))
    assert container["envFrom"] == [{"configMapRef": {"name": f"{spec.app}-config"}}]
    for entry in container.get("env", []):
        source = entry.get("valueFrom") or {}
        assert (
            entry["name"] == "SERVICE_MODULE" or "secretKeyRef" in source or "fieldRef" in source
        ), f"{spec.app}: {entry['name']} belongs in {spec.app}-config"
    settings = BASE_MANIFESTS.settings(_deployment(spec))
    for name in settings:
        assert name in EXTRA_SETTINGS or name.startswith(spec.env_prefix), (
            f"{spec.app}: {name} is not one of its settings ({spec.env_prefix}*)"
        )
    assert settings[f"{spec.env_prefix}HOST"] == "0.0.0.0"
    for setting, port in (("PORT", spec.grpc_port), ("METRICS_PORT", spec.metrics_port)):
        assert int(settings[f"{spec.env_prefix}{setting}"] or 0) == port


def test_settings_exist_in_the_config_classes() -> None:
    check_settings_are_known(BASE_MANIFESTS)


@per_service
def test_settings_pass_the_services_validation(spec: Spec, tmp_path: Path) -> None:
    """What the manifests give a service, with placeholder credentials, is a config it starts
    with: no value of the wrong type, no setting it refuses."""
    environ = {k: v for k, v in BASE_MANIFESTS.settings(_deployment(spec)).items() if v}
    for name in BASE_MANIFESTS.env_refs(_deployment(spec)):
        environ[name] = "placeholder-credential"
    # The mounted credential files (the Secret's keys), with placeholders.
    for name, text in (
        ("SERVICE_TOKEN_FILE", "placeholder-credential\n"),
        ("CALLER_TOKENS_FILE", "engine=placeholder-credential\n"),
    ):
        credential = tmp_path / name.lower()
        credential.write_text(text)
        environ[f"{spec.env_prefix}{name}"] = str(credential)
    environ[f"{spec.env_prefix}TOKENS"] = "dev-server=placeholder-token"
    if f"{spec.env_prefix}TOKENS_FILE" in environ:  # the gateway's mounted Secret
        tokens = tmp_path / "tokens"
        tokens.write_text("file-server=placeholder-token-2")
        environ[f"{spec.env_prefix}TOKENS_FILE"] = str(tokens)
    environ.pop(f"{spec.env_prefix}API_KEY", None)
    load_config(_config_class(spec), None, env_prefix=spec.env_prefix, environ=environ)


@per_service
def test_targets_dial_headless_services_by_dns(spec: Spec) -> None:
    settings = BASE_MANIFESTS.settings(_deployment(spec))
    targets = {n for n in settings if n.endswith("_TARGET")}
    assert targets == {f"{spec.env_prefix}{s.upper()}" for s in spec.targets}
    for setting, service_name in spec.targets.items():
        host, port = _target(settings[f"{spec.env_prefix}{setting.upper()}"])
        assert host == service_name, f"{spec.app}: {setting} should dial {service_name}"
        service_ports = {p["name"]: p["port"] for p in SERVICES[host]["spec"]["ports"]}
        assert port == service_ports.get("grpc", service_ports.get("relay"))
        assert SERVICES[host]["spec"].get("clusterIP") == "None"
    if spec.targets:
        # Short names resolve through the pod's DNS search path with the system resolver.
        assert settings.get("GRPC_DNS_RESOLVER") == "native"


@per_service
def test_service_exposes_the_grpc_port(spec: Spec) -> None:
    deployment = _deployment(spec)
    service = SERVICES[spec.app]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector and selector.items() <= pod_labels.items(), "Service selects no pods"
    assert selector.items() <= deployment["spec"]["selector"]["matchLabels"].items()
    (grpc,) = [p for p in service["spec"]["ports"] if p.get("name") == "grpc"]
    assert grpc["port"] == spec.grpc_port
    assert grpc.get("targetPort") in ("grpc", spec.grpc_port)


@per_service
def test_module_has_a_main(spec: Spec) -> None:
    """Fails until the service's package lands: the manifests would start nothing."""
    main = ROOT.joinpath(*spec.module.split("."), "__main__.py")
    assert main.is_file(), f"{main.relative_to(ROOT)} does not exist"


def test_storage_stays_single_on_sqlite() -> None:
    deployment = _deployment(BY_APP["storage"])
    container = _server_container(deployment)
    settings = BASE_MANIFESTS.settings(deployment)
    assert settings["SYSTEM_STORAGE_DATABASE_URL"] == "sqlite:////data/storage.db"
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    assert "/data" in mounts and not mounts["/data"].get("readOnly", False)
    volumes = {v["name"]: v for v in _pod(deployment).get("volumes", [])}
    data = volumes[mounts["/data"]["name"]]
    assert "emptyDir" in data or "persistentVolumeClaim" in data


def test_the_migration_job_runs_the_schema_upgrade_alone() -> None:
    (job,) = [w for w in WORKLOADS if w["kind"] == "Job"]
    assert job["metadata"]["name"] == MIGRATE_JOB
    assert job["spec"]["template"]["metadata"]["labels"]["app"] == MIGRATE_JOB
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["activeDeadlineSeconds"] > 0
    container = _server_container(job)
    env = _env(container)
    assert env["SERVICE_MODULE"]["value"] == MIGRATE_MODULE
    assert ROOT.joinpath(*MIGRATE_MODULE.split(".")).with_suffix(".py").is_file()
    assert container["envFrom"] == [{"configMapRef": {"name": "storage-config"}}]
    # The command serves nothing: on a loopback host its settings need no credentials.
    assert env["SYSTEM_STORAGE_HOST"]["value"] in ("127.0.0.1", "localhost")
    # Nor calls anything: storage-config's credential files are not mounted in its pod.
    for name in CREDENTIAL_SETTINGS:
        assert env[f"SYSTEM_STORAGE_{name}_FILE"]["value"] == ""
    listed = _kustomization(COMPONENTS / "postgres-common")["resources"]
    assert any(
        doc["metadata"]["name"] == MIGRATE_JOB
        for r in listed
        for doc in _load_all(COMPONENTS / "postgres-common" / r)
    )


# --- secrets -----------------------------------------------------------------------------------


def test_secrets_come_only_from_secret_refs() -> None:
    checked = 0
    for path, doc in _every_document():
        for entry in _env_entries(doc):
            if entry.get("$patch") == "delete":
                continue  # a patch removing the variable
            name = entry["name"]
            literal = entry.get("value")
            ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
            where = f"{path.relative_to(ROOT)}: env {name}"
            if _is_secret_name(name):
                assert literal is None and ref, f"{where} must come from a secretKeyRef"
            elif name.endswith("DATABASE_URL") and literal is not None:
                assert str(literal).startswith("sqlite:"), f"{where}: a database URL is a secret"
            else:
                continue
            if ref:
                assert ref["name"] in SECRET_NAMES, f"{where}: an unknown Secret {ref['name']}"
            checked += 1
    # The service and caller tokens are files (check_credentials_are_mounted_files); the
    # model's API key is still a variable in base.
    assert checked >= 1, "expected the API key to be checked"
    check_no_secret_literals(BASE_MANIFESTS)
    for folder in [BASE, *COMPONENTS.iterdir(), *OVERLAYS.iterdir()]:
        for config_map in _generated_config_maps(folder):
            for key in config_map["data"]:
                assert not _is_secret_name(key), f"{folder.name}: {key} in a ConfigMap"


def test_base_holds_no_secret_values() -> None:
    assert not BASE_MANIFESTS.of("Secret"), "base must not define Secrets; they hold real values"
    assert "secretGenerator" not in _kustomization(BASE)


# --- the image ---------------------------------------------------------------------------------


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions as (KEYWORD, arguments), grouped by stage; comments and line joins removed."""
    stages: list[list[tuple[str, str]]] = [[]]  # instructions before the first FROM
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append((keyword.upper(), arguments.strip()))
    return stages[1:]


def test_dockerfile_is_multi_stage() -> None:
    stages = _dockerfile_stages()
    assert len(stages) >= 2
    build = " ".join(args for stage in stages[:-1] for kw, args in stage if kw == "RUN")
    assert "gen_protos.py" in build, "a build stage generates the stubs"


def test_image_runs_as_a_non_root_user() -> None:
    final = _dockerfile_stages()[-1]
    users = [args for kw, args in final if kw == "USER"]
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # Numeric, so Kubernetes can check runAsNonRoot, and the same uid the manifests ask for.
    assert user == str(IMAGE_UID)
    for workload in WORKLOADS:
        assert _pod(workload)["securityContext"].get("runAsUser", IMAGE_UID) == IMAGE_UID


def test_image_selects_its_service_by_service_module() -> None:
    final = _dockerfile_stages()[-1]
    assert any(kw == "ARG" and args.startswith("SERVICE_MODULE") for kw, args in final)
    env = " ".join(args for kw, args in final if kw == "ENV")
    assert "SERVICE_MODULE=" in env
    assert re.search(r"PYTHONPATH=\S*/app/gen", env), "gen/ must be on PYTHONPATH"
    (entrypoint,) = [args for kw, args in final if kw in ("ENTRYPOINT", "CMD")][-1:]
    assert entrypoint.startswith("["), "exec form: Python is PID 1 and gets SIGTERM itself"
    assert "SERVICE_MODULE" in entrypoint


def test_image_has_no_dev_tools_and_every_package() -> None:
    final = _dockerfile_stages()[-1]
    runs = " ".join(args for kw, args in final if kw == "RUN")
    assert "[dev]" not in runs and "grpcio-tools" not in runs
    copied = {args.split()[-2].rstrip("/") for kw, args in final if kw == "COPY"}
    with (ROOT / "pyproject.toml").open("rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in include}
    assert packages <= copied, f"the runtime stage does not copy {sorted(packages - copied)}"


def test_dockerignore_keeps_what_the_image_copies() -> None:
    ignored = {
        line.strip().strip("/")
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    for stage in _dockerfile_stages():
        for kw, args in stage:
            if kw == "COPY" and not args.startswith("--from"):
                for source in args.split()[:-1]:
                    assert source.strip("/") not in ignored, f".dockerignore drops {source}"


# --- the rules hold: each can fail -------------------------------------------------------------


def _without(kind: str, name: str) -> Manifests:
    return Manifests(
        d for d in BASE_MANIFESTS.docs if (d["kind"], d["metadata"]["name"]) != (kind, name)
    )


def _edited(kind: str, name: str, edit: Any) -> Manifests:
    docs = yaml.safe_load(yaml.safe_dump(BASE_MANIFESTS.docs))
    (doc,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (kind, name)]
    edit(doc)
    return Manifests(docs)


def _add_router_ingress_from_model_gateway(policy: dict[str, Any]) -> None:
    policy["spec"]["ingress"][0]["from"].append(
        {"podSelector": {"matchLabels": {"app": "model-gateway"}}}
    )


def _open_storage_to_anyone(policy: dict[str, Any]) -> None:
    del policy["spec"]["ingress"][0]["from"]


def _caller_tokens_as_a_variable(deployment: dict[str, Any]) -> None:
    _server_container(deployment)["env"].append(
        {
            "name": "SYSTEM_ENGINE_CALLER_TOKENS",
            "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": "caller-tokens"}},
        }
    )


def _credentials_through_sub_path(deployment: dict[str, Any]) -> None:
    for mount in _server_container(deployment)["volumeMounts"]:
        if mount["name"] == "credentials":
            mount["subPath"] = "service-token"


@pytest.mark.parametrize(
    ("check", "broken"),
    [
        (check_disruption_budgets, lambda: _without("PodDisruptionBudget", "engine")),
        (check_autoscaling, lambda: _without("HorizontalPodAutoscaler", "router")),
        (
            check_autoscaling,
            lambda: _edited("Deployment", "engine", lambda d: d["spec"].update(replicas=2)),
        ),
        (
            check_topology_spread,
            lambda: _edited(
                "Deployment", "storage", lambda d: _pod(d).pop("topologySpreadConstraints")
            ),
        ),
        (
            check_grace_outlasts_the_longest_request,
            lambda: _edited(
                "Deployment", "router", lambda d: _pod(d).update(terminationGracePeriodSeconds=60)
            ),
        ),
        (check_network_policies, lambda: _without("NetworkPolicy", "default-deny")),
        (check_network_policies, lambda: _without("NetworkPolicy", "engine-egress")),
        (
            check_network_policies,
            lambda: _edited(
                "NetworkPolicy", "router-ingress", _add_router_ingress_from_model_gateway
            ),
        ),
        (
            check_network_policies,
            lambda: _edited("NetworkPolicy", "storage-ingress", _open_storage_to_anyone),
        ),
        (
            check_no_secret_literals,
            lambda: _edited(
                "ConfigMap",
                "gateway-config",
                lambda d: d["data"].update(SYSTEM_GATEWAY_TOKENS="a=b"),
            ),
        ),
        (
            check_credentials_are_mounted_files,
            lambda: _edited("Deployment", "engine", _caller_tokens_as_a_variable),
        ),
        (
            check_credentials_are_mounted_files,
            lambda: _edited("Deployment", "router", _credentials_through_sub_path),
        ),
        (
            check_credentials_are_mounted_files,
            lambda: _edited(
                "ConfigMap",
                "storage-config",
                lambda d: d["data"].pop("SYSTEM_STORAGE_SERVICE_TOKEN_FILE"),
            ),
        ),
        (
            check_settings_are_known,
            lambda: _edited(
                "ConfigMap",
                "router-config",
                lambda d: d["data"].update(SYSTEM_ROUTER_DRAIN_SECOND="5"),
            ),
        ),
        (
            check_one_schema_owner,
            lambda: _edited(
                "ConfigMap",
                "storage-config",
                lambda d: d["data"].update(SYSTEM_STORAGE_RUN_MIGRATIONS="false"),
            ),
        ),
    ],
    ids=[
        "no-pdb",
        "no-hpa",
        "replicas-beside-hpa",
        "no-spread",
        "short-grace",
        "no-default-deny",
        "no-egress",
        "extra-caller",
        "storage-open",
        "token-in-configmap",
        "caller-tokens-variable",
        "credentials-sub-path",
        "no-service-token-file",
        "misspelt-setting",
        "sqlite-waits-for-a-job",
    ],
)
def test_each_rule_fails_on_a_broken_manifest(check: Any, broken: Any) -> None:
    check(BASE_MANIFESTS)
    with pytest.raises(AssertionError):
        check(broken())


# --- rendered ----------------------------------------------------------------------------------

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed"
)


def _render(folder: Path) -> Manifests:
    result = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return Manifests(d for d in yaml.safe_load_all(result.stdout) if d is not None)


def _render_with(tmp_path: Path, *components: str) -> Manifests:
    """Base with the named components, through an overlay in tmp_path."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    # kustomize refuses absolute paths to bases and components.
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(BASE, overlay)],
                "components": [os.path.relpath(COMPONENTS / c, overlay) for c in components],
            }
        )
    )
    return _render(overlay)


def _mount_of(workload: dict[str, Any], path: str) -> dict[str, Any]:
    """The server container's volume mount a file path lies in."""
    mounts = _server_container(workload).get("volumeMounts", [])
    (mount,) = [m for m in mounts if path.startswith(m["mountPath"] + "/")]
    return dict(mount)


def _mounted_from(workload: dict[str, Any], path: str) -> dict[str, Any]:
    """The secret volume a file path of the server container lies in."""
    volumes = {v["name"]: v for v in _pod(workload).get("volumes", [])}
    mount = _mount_of(workload, path)
    secret = volumes[mount["name"]]["secret"]
    relative = path.removeprefix(mount["mountPath"] + "/")
    items = secret.get("items")
    assert items is None or relative in {i["path"] for i in items}, f"{path} is not mounted"
    return secret


@needs_kubectl
def test_base_renders() -> None:
    rendered = _render(BASE)
    assert {d["kind"] for d in rendered.docs} == {
        "Deployment",
        "Service",
        "ConfigMap",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    check_everything(rendered)
    # Generated names carry a hash; envFrom follows them.
    for deployment in rendered.of("Deployment").values():
        (source,) = _server_container(deployment)["envFrom"]
        assert re.fullmatch(
            rf"{deployment['metadata']['name']}-config-\w+", source["configMapRef"]["name"]
        )


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()))
def test_every_overlay_renders_and_keeps_the_rules(overlay: str) -> None:
    rendered = _render(OVERLAYS / overlay)
    check_everything(rendered)
    images = {c["image"] for w in rendered.workloads() for c in _pod(w)["containers"]}
    if overlay == "dev":
        (secret,) = rendered.of("Secret").values()
        refs = {r["name"] for w in rendered.workloads() for r in rendered.env_refs(w).values()}
        assert refs == {secret["metadata"]["name"]}, "references follow the generated name"
    if overlay == "prod":
        assert all(re.fullmatch(r"\S+@sha256:[0-9a-f]{64}", image) for image in images), images
        assert rendered.of("Service")["gateway"]["spec"]["type"] == "LoadBalancer"
        assert {"Cluster", "PodMonitor", "Job"} <= {d["kind"] for d in rendered.docs}


@needs_kubectl
@pytest.mark.parametrize("component", ["postgres-external", "postgres-cnpg"])
def test_postgres_components_render_with_the_migration_job(tmp_path: Path, component: str) -> None:
    rendered = _render_with(tmp_path, component)
    check_everything(rendered)  # storage autoscaled, rolling updates, database egress
    storage = rendered.of("Deployment")["storage"]
    (job,) = rendered.of("Job").values()
    assert job["metadata"]["name"] == MIGRATE_JOB
    assert _server_container(job)["image"] == _server_container(storage)["image"]
    job_settings, storage_settings = rendered.settings(job), rendered.settings(storage)
    assert job_settings["SERVICE_MODULE"] == MIGRATE_MODULE
    # The same database, reached the same way.
    url_ref = rendered.env_refs(storage)["SYSTEM_STORAGE_DATABASE_URL"]
    assert rendered.env_refs(job)["SYSTEM_STORAGE_DATABASE_URL"] == url_ref
    for name in LIBPQ_SETTINGS:
        assert job_settings.get(name) == storage_settings.get(name)
    # The Job migrates; storage pods wait for its schema (decision 0028).
    assert storage_settings["SYSTEM_STORAGE_RUN_MIGRATIONS"] == "false"
    assert not _storage_migrates(rendered, storage)
    if component == "postgres-external":
        assert url_ref == {"name": SECRET_NAME, "key": "database-url"}
    else:
        assert url_ref == {"name": "system-db-app", "key": "uri"}


@needs_kubectl
def test_the_cnpg_component_renders_a_cluster_over_tls(tmp_path: Path) -> None:
    rendered = _render_with(tmp_path, "postgres-cnpg")
    (cluster,) = rendered.of("Cluster").values()
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    assert cluster["metadata"]["name"] == "system-db"
    assert cluster["spec"]["instances"] >= 2
    assert cluster["spec"]["bootstrap"]["initdb"]["owner"]
    for workload in (rendered.of("Deployment")["storage"], rendered.of("Job")[MIGRATE_JOB]):
        settings = rendered.settings(workload)
        assert settings["PGSSLMODE"] in ("verify-full", "require")
        if settings["PGSSLMODE"] == "verify-full":
            secret = _mounted_from(workload, str(settings["PGSSLROOTCERT"]))
            assert secret["secretName"] == "system-db-ca"
            # The CA's certificate alone, not its private key.
            assert [i["key"] for i in secret["items"]] == ["ca.crt"]
    # The database port admits storage and the migration Job, besides the operator and the
    # instances themselves.
    database = Pod("system-db", {"cnpg.io/cluster": "system-db"}, {"postgresql": 5432})
    sources = _ingress_sources(rendered, database, 5432)
    assert {"storage", MIGRATE_JOB} <= sources
    assert sources - {"storage", MIGRATE_JOB, "pods(cnpg.io/cluster=system-db)"} == {
        "namespaces(kubernetes.io/metadata.name=cnpg-system)/pods(app.kubernetes.io/name=cloudnative-pg)"
    }
    (storage,) = [p for p in rendered.pods() if p.app == "storage"]
    assert ("pods(cnpg.io/cluster=system-db)", "TCP", 5432) in _egress_destinations(
        rendered, storage
    )


@needs_kubectl
def test_the_monitoring_component_renders_a_pod_monitor_per_service(tmp_path: Path) -> None:
    rendered = _render_with(tmp_path, "monitoring")
    check_everything(rendered)
    monitors = rendered.of("PodMonitor").values()
    pods = rendered.pods()
    covered = set()
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        selected = [p for p in pods if _selects(monitor["spec"]["selector"], p.labels)]
        assert selected, f"PodMonitor {monitor['metadata']['name']} selects no pods"
        for pod in selected:
            assert pod.ports[endpoint["port"]] == BY_APP[pod.app].metrics_port
            covered.add(pod.app)
    assert covered == set(BY_APP)


@needs_kubectl
def test_the_file_components_mount_their_secrets(tmp_path: Path) -> None:
    rendered = _render_with(tmp_path, "model-key-file", "gateway-public-tls")
    check_everything(rendered)
    model = rendered.of("Deployment")["model-gateway"]
    settings = rendered.settings(model)
    assert "SYSTEM_MODEL_API_KEY" not in settings, "a key and a key file is a start-up error"
    secret = _mounted_from(model, str(settings["SYSTEM_MODEL_API_KEY_FILE"]))
    assert secret["secretName"] == SECRET_NAME
    assert [i["key"] for i in secret["items"]] == ["model-api-key"]
    gateway = rendered.of("Deployment")["gateway"]
    settings = rendered.settings(gateway)
    for name in ("SYSTEM_GATEWAY_PUBLIC_TLS_CERT_FILE", "SYSTEM_GATEWAY_PUBLIC_TLS_KEY_FILE"):
        assert _mounted_from(gateway, str(settings[name]))["secretName"] == "gateway-public-tls"


CONFIG_FILES = COMPONENTS / "config-files"
BUNDLED_FILES = {
    ("router", "SYSTEM_ROUTER_BUTTON_PHRASINGS"): ROOT
    / "router_service"
    / "notification-buttons.json",
    ("engine", "SYSTEM_ENGINE_ADVANCEMENTS_FILE"): ROOT / "engine_service" / "advancements.json",
    ("engine", "SYSTEM_ENGINE_SIGNIN_REWARDS_FILE"): ROOT
    / "engine_service"
    / "signin_rewards.json",
}
"""The files `components/config-files` mounts that the image also bundles: the component's
copy is the bundled one, so adding the component changes nothing until an operator edits it."""


def _mounted_config(rendered: Manifests, workload: dict[str, Any], path: str) -> str:
    """The contents of the ConfigMap key a file path of the server container reads."""
    container = _server_container(workload)
    volumes = {v["name"]: v for v in _pod(workload).get("volumes", [])}
    (mount,) = [
        m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")
    ]
    assert mount.get("readOnly") is True, f"{path}: mounted writable"
    config_map = rendered.of("ConfigMap")[volumes[mount["name"]]["configMap"]["name"]]
    data: dict[str, str] = config_map["data"]
    return data[path.removeprefix(mount["mountPath"] + "/")]


@needs_kubectl
def test_the_config_files_component_mounts_each_services_files(tmp_path: Path) -> None:
    from router_service.semantic.config import SemanticConfig, load_semantic_config

    rendered = _render_with(tmp_path, "config-files")
    check_everything(rendered)
    deployments = rendered.of("Deployment")
    for (app, setting), bundled in BUNDLED_FILES.items():
        path = rendered.settings(deployments[app])[setting]
        assert path, f"{app}: {setting} is not set"
        text = _mounted_config(rendered, deployments[app], path)
        assert text == bundled.read_text(encoding="utf-8"), (
            f"components/config-files holds another {bundled.name} than {bundled.parent.name}: "
            f"copy {bundled.relative_to(ROOT)} there"
        )
    router = deployments["router"]
    path = rendered.settings(router)["SYSTEM_ROUTER_SEMANTIC_CONFIG"]
    assert path
    semantic = tmp_path / "system-semantic.json"
    semantic.write_text(_mounted_config(rendered, router, path), encoding="utf-8")
    # The router's own reader takes it, and it is the built-in defaults.
    assert load_semantic_config(semantic).to_json() == SemanticConfig().to_json()


# --- monitoring: the dashboard, the alerts and the adapter rule name only real metrics ---------

MONITORING_DIR = COMPONENTS / "monitoring"
DASHBOARD = MONITORING_DIR / "grafana-dashboard.json"
ALERTS = MONITORING_DIR / "alerts.yaml"
QUEUE_AUTOSCALING = COMPONENTS / "engine-queue-autoscaling"
ADAPTER_VALUES = QUEUE_AUTOSCALING / "prometheus-adapter-values.yaml"
METRIC_PACKAGES = ("services", "router_service", "engine_service", "storage_service")
PROMETHEUS_OWN = {"up": set[str]()}
"""Series Prometheus makes itself."""
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "endpoint", "service"}
"""Labels the Prometheus Operator puts on every series a PodMonitor scrapes."""
# The series each prometheus_client type exposes, by suffix (a Counter's name loses `_total`).
_EXPOSED = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
}
_PROMQL_CLAUSES = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def _defined_metrics() -> dict[str, set[str]]:
    """Every series the services' code defines (prometheus_client Counter, Gauge, Histogram,
    Summary with a literal name), with its label names."""
    found: dict[str, set[str]] = {}
    for package in METRIC_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            if "prometheus_client" not in source:
                continue
            for node in ast.walk(ast.parse(source)):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                kind = getattr(func, "id", None) or getattr(func, "attr", None)
                first = node.args[0] if node.args else None
                if kind not in _EXPOSED or not (
                    isinstance(first, ast.Constant) and isinstance(first.value, str)
                ):
                    continue
                labels_node = node.args[2] if len(node.args) > 2 else None
                for keyword in node.keywords:
                    if keyword.arg == "labelnames":
                        labels_node = keyword.value
                labels = set(ast.literal_eval(labels_node)) if labels_node is not None else set()
                name = first.value.removesuffix("_total") if kind == "Counter" else first.value
                for suffix in _EXPOSED[kind]:
                    extra = {"le"} if suffix == "_bucket" else set()
                    if kind == "Summary" and not suffix:
                        extra = {"quantile"}
                    found[name + suffix] = labels | extra
    return found


def _promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    for clause in re.findall(_PROMQL_CLAUSES, text):
        labels |= {label.strip() for label in clause.split(",") if label.strip()}
    text = re.sub(_PROMQL_CLAUSES, " ", text)
    # What is left: functions and aggregations (followed by a parenthesis), numbers, operators,
    # and the metric names.
    names = {
        m.group(1)
        for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text)
        if m.group(1).lower() not in _PROMQL_WORDS
    }
    return names, labels


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def _dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of the dashboard."""
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets") or []:
            queries.append((f"panel {panel['title']!r}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(<series selector>, <label>): the selector is PromQL, the label a label.
            found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["definition"])
            assert found, f"variable {variable['name']}: {variable['definition']}"
            queries.append((f"variable {variable['name']}", f"sum by ({found[2]}) ({found[1]})"))
    return queries


def _alert_queries() -> list[tuple[str, str]]:
    (rule,) = _load_all(ALERTS)
    return [
        (f"alert {r['alert']}", r["expr"])
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    ]


def _adapter_rules(kind: str = "custom") -> list[dict[str, Any]]:
    """The adapter's `custom` (per-pod) or `external` rules."""
    (values,) = _load_all(ADAPTER_VALUES)
    rules: list[dict[str, Any]] = values["rules"][kind]
    return rules


def _adapter_queries() -> list[tuple[str, str]]:
    return [
        (f"adapter rule {r['name']['as']}", r["seriesQuery"])
        for kind in ("custom", "external")
        for r in _adapter_rules(kind)
    ]


def test_the_promql_reader_finds_metrics_and_labels() -> None:
    names, labels = _promql_names(
        "histogram_quantile(0.99, sum by (le, grpc_method) (rate(grpc_server_handling_seconds_bucket"
        '{namespace="$namespace", job=~"a|b"}[$__rate_interval]))) / ignoring(x) up > bool 0.5'
    )
    assert names == {"grpc_server_handling_seconds_bucket", "up"}
    assert labels == {"le", "grpc_method", "namespace", "job", "x"}


def test_the_metric_reader_sees_every_kind() -> None:
    defined = _defined_metrics()
    assert defined["grpc_server_handled_total"] == {"grpc_service", "grpc_method", "grpc_code"}
    assert "model_tokens_total" in defined  # Counter("model_tokens"): exposed with _total
    assert defined["grpc_server_handling_seconds_bucket"] >= {"le", "grpc_method"}
    assert "gateway_connections" in defined  # a Gauge keeps its name


@pytest.mark.parametrize(
    "queries",
    [_dashboard_queries(_dashboard()), _alert_queries(), _adapter_queries()],
    ids=["dashboard", "alerts", "adapter"],
)
def test_monitoring_queries_name_only_defined_metrics(queries: list[tuple[str, str]]) -> None:
    """A renamed or removed metric fails here instead of leaving an empty panel, an alert that
    can never fire, or an autoscaler without its metric."""
    defined = _defined_metrics() | PROMETHEUS_OWN
    assert queries
    for where, expr in queries:
        names, labels = _promql_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - set(defined)
        assert not unknown, f"{where}: no metric named {sorted(unknown)} in the code"
        known_labels = TARGET_LABELS.union(*(defined[name] for name in names))
        assert labels <= known_labels, (
            f"{where}: {sorted(labels - known_labels)} label none of {sorted(names)}"
        )


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            # Every query stays in the chosen namespace: several installations, one Prometheus.
            assert 'namespace="$namespace"' in target["expr"], panel["title"]
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, panel["title"]


@needs_kubectl
def test_the_monitoring_component_ships_the_dashboard_and_alerts(tmp_path: Path) -> None:
    rendered = _render_with(tmp_path, "monitoring")
    config_map = rendered.of("ConfigMap")["system-assistant-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (content,) = config_map["data"].values()
    assert json.loads(content) == _dashboard()
    (rule,) = rendered.of("PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert all(r["labels"]["severity"] for g in rule["spec"]["groups"] for r in g["rules"])


@needs_kubectl
def test_the_engine_queue_autoscaling_adds_a_pods_metric_beside_cpu(tmp_path: Path) -> None:
    rendered = _render_with(tmp_path, "monitoring", "engine-queue-autoscaling")
    check_everything(rendered)
    hpa = rendered.of("HorizontalPodAutoscaler")["engine"]
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert set(kinds) == {"Resource", "Pods", "External"}
    pods = kinds["Pods"]["pods"]
    (rule,) = _adapter_rules()
    assert pods["metric"]["name"] == rule["name"]["as"]
    assert pods["target"]["type"] == "AverageValue"
    # The target stays below what one replica runs at once, so replicas come before queueing.
    workers = _setting(
        BY_APP["engine"],
        rendered.settings(rendered.of("Deployment")["engine"]),
        "interactive_workers",
    )
    assert 0 < float(pods["target"]["averageValue"]) < workers
    # The rule reads the engine's own RPC, by the names the interceptor gives it.
    method = re.search(r'grpc_method="(\w+)"', rule["seriesQuery"])
    assert method and f"rpc {method[1]}(" in (
        ROOT / "protos/system/engine/v1/engine.proto"
    ).read_text(encoding="utf-8")
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    # The event backlog: storage's gauge, the same on every storage replica (max, not sum),
    # of the namespace (no pod), one replica per queue-full of unclaimed tasks.
    backlog = kinds["External"]["external"]
    (external,) = _adapter_rules("external")
    assert backlog["metric"]["name"] == external["name"]["as"]
    assert re.fullmatch(r"\^(\w+)\$", external["name"]["matches"])[1] in _defined_metrics()
    assert external["metricsQuery"].startswith("max(")
    assert external["resources"]["overrides"] == {"namespace": {"resource": "namespace"}}
    assert backlog["target"]["type"] == "AverageValue"
    queue = _setting(
        BY_APP["engine"], rendered.settings(rendered.of("Deployment")["engine"]), "event_queue"
    )
    assert 0 < float(backlog["target"]["averageValue"]) <= queue
    # Without the component, CPU alone.
    (cpu,) = BASE_MANIFESTS.of("HorizontalPodAutoscaler")["engine"]["spec"]["metrics"]
    assert cpu["type"] == "Resource"


# --- strict schema validation, offline ----------------------------------------------------------

SCHEMA_VERSIONS = ("1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0")
"""The Kubernetes minor versions the manifests are checked against (kubernetes-validate's
bundled OpenAPI schemas: nothing is fetched)."""
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("postgresql.cnpg.io/v1", "Cluster"),
}
"""Kinds of operators' CRDs (Prometheus Operator, CloudNativePG): no schema is bundled, so
they are checked by the rules above only. Any other kind without a schema fails."""


def _strictly_invalid(docs: list[dict[str, Any]], version: str) -> list[str]:
    """What strict validation against `version`'s schemas finds wrong, one line per problem
    (unknown fields included); [] when every document is valid."""
    problems = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if (doc.get("apiVersion"), doc.get("kind")) not in CUSTOM_KINDS:
                problems.append(f"{where}: no {version} schema for {doc.get('apiVersion')}")
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}")
    return problems


def _every_rendering(tmp_path: Path) -> dict[str, Manifests]:
    renderings = {"base": _render(BASE)}
    for overlay in sorted(p for p in OVERLAYS.iterdir() if p.is_dir()):
        renderings[f"overlays/{overlay.name}"] = _render(overlay)
    for component in sorted(p.name for p in COMPONENTS.iterdir() if p.is_dir()):
        if component == "postgres-common":
            continue  # shared by the two postgres components, rendered with each of them
        folder = tmp_path / component
        folder.mkdir()
        renderings[f"components/{component}"] = _render_with(folder, component)
    return renderings


@needs_kubectl
def test_every_rendering_is_valid_against_each_kubernetes_version_strictly(
    tmp_path: Path,
) -> None:
    renderings = _every_rendering(tmp_path)
    assert len(renderings) >= 9
    # The overlays and components repeat most of the base's documents: each distinct document
    # is validated once per version (396 documents, 156 distinct).
    found: dict[tuple[str, str], list[str]] = {}

    def invalid(doc: dict[str, Any], version: str) -> list[str]:
        key = (json.dumps(doc, sort_keys=True), version)
        if key not in found:
            found[key] = _strictly_invalid([doc], version)
        return found[key]

    problems = [
        f"{name} ({version}): {problem}"
        for name, rendered in renderings.items()
        for version in SCHEMA_VERSIONS
        for doc in rendered.docs
        for problem in invalid(doc, version)
    ]
    assert not problems, "\n".join(problems)


def test_strict_validation_finds_an_unknown_field_a_wrong_type_and_an_unknown_kind() -> None:
    deployment = copy.deepcopy(next(d for d in BASE_MANIFESTS.docs if d["kind"] == "Deployment"))
    assert _strictly_invalid([deployment], "1.34.0") == []
    misspelled = copy.deepcopy(deployment)
    misspelled["spec"]["replica"] = 2
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    for broken, named in (
        (misspelled, "'replica' was unexpected) at spec"),
        (wrong_type, "at spec.replicas"),
        (unknown, "Widget/w: no 1.34.0 schema"),
    ):
        (problem,) = _strictly_invalid([broken], "1.34.0")
        assert named in problem, problem
