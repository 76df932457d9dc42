"""Checks on the deployment files: the Kubernetes manifests under deploy/kubernetes and the
image's deploy/Dockerfile.

Pure file reads, no cluster and no Docker. The one exception renders the kustomizations with
`kubectl kustomize` (local, no network), and is skipped where kubectl is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.runtime.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
BASE = KUBE / "base"
DOCKERFILE = DEPLOY / "Dockerfile"
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
    """Target setting -> the app it must point at."""


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
        {"engine_target": "engine", "model_target": "model-gateway"},
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
        {"storage_target": "storage"},
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

# Env names that always hold a secret; DATABASE_URL holds one only in its PostgreSQL form.
SECRET_ENV = re.compile(r"API_KEY|TOKENS?$|PASSWORD|SECRET")


# --- loading -----------------------------------------------------------------------------------


def _load_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _yaml_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))


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


def _base_kustomization() -> dict[str, Any]:
    (doc,) = _load_all(BASE / "kustomization.yaml")
    return doc


def _base_objects(kind: str) -> dict[str, dict[str, Any]]:
    objects = {}
    for path in _yaml_files(BASE):
        if path.name == "kustomization.yaml":
            continue
        for doc in _load_all(path):
            if doc.get("kind") == kind:
                objects[doc["metadata"]["name"]] = doc
    return objects


DEPLOYMENTS = _base_objects("Deployment")
SERVICES = _base_objects("Service")


def _pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def _server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The one container with a port named `grpc`."""
    servers = [
        c
        for c in _pod(deployment)["containers"]
        if any(p.get("name") == "grpc" for p in c.get("ports", []))
    ]
    assert len(servers) == 1, (
        f"Deployment {deployment['metadata']['name']}: expected exactly one container with a "
        f"port named grpc, found {len(servers)}"
    )
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


per_service = pytest.mark.parametrize("spec", SPECS, ids=[s.app for s in SPECS])


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
    env = _env(_server_container(_deployment(BY_APP["gateway"])))
    assert internal["relay"] == int(env["SYSTEM_GATEWAY_INTERNAL_PORT"]["value"])


@per_service
def test_every_service_holds_and_checks_service_credentials(spec: Spec) -> None:
    env = _env(_server_container(_deployment(spec)))
    for name in ("SERVICE_TOKEN", "CALLER_TOKENS"):
        ref = env[f"{spec.env_prefix}{name}"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == SECRET_NAME


def test_every_base_file_is_listed_in_the_kustomization() -> None:
    listed = set(_base_kustomization().get("resources", []))
    files = {p.name for p in _yaml_files(BASE) if p.name != "kustomization.yaml"}
    assert files - listed == set(), "base files missing from base/kustomization.yaml"
    assert listed - files == set(), "base/kustomization.yaml lists files that do not exist"


def test_base_kustomization_sets_common_labels() -> None:
    kustomization = _base_kustomization()
    pairs = [item.get("pairs", {}) for item in kustomization.get("labels", [])]
    assert any("app.kubernetes.io/part-of" in p for p in pairs) or kustomization.get(
        "commonLabels"
    ), "base/kustomization.yaml sets no common labels"


def test_postgres_component_is_a_component() -> None:
    (doc,) = _load_all(KUBE / "components" / "postgres-external" / "kustomization.yaml")
    assert doc["kind"] == "Component"
    urls = [
        e
        for patch in _inline_patches(doc)
        for e in _env_entries(patch)
        if e["name"] == "SYSTEM_STORAGE_DATABASE_URL"
    ]
    assert urls, "the component does not set SYSTEM_STORAGE_DATABASE_URL"
    for entry in urls:
        assert entry["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME
        # An env entry may not carry both; null removes base's literal SQLite URL.
        assert "value" in entry and entry["value"] is None


def test_dev_overlay_builds_on_base() -> None:
    (doc,) = _load_all(KUBE / "overlays" / "dev" / "kustomization.yaml")
    assert "../../base" in doc.get("resources", [])


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


@per_service
def test_runs_locked_down(spec: Spec) -> None:
    deployment = _deployment(spec)
    pod_context = _pod(deployment).get("securityContext", {})
    for container in _pod(deployment)["containers"]:
        context = container.get("securityContext", {})
        name = f"{spec.app}/{container['name']}"
        assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, name
        assert context.get("readOnlyRootFilesystem") is True, name
        assert context.get("allowPrivilegeEscalation") is False, name
        assert "ALL" in context.get("capabilities", {}).get("drop", []), name


@per_service
def test_resource_requests_and_limits(spec: Spec) -> None:
    for container in _pod(_deployment(spec))["containers"]:
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(kind, {})), (
                f"{spec.app}/{container['name']}: {kind} must set cpu and memory"
            )


@per_service
def test_termination_grace_outlasts_drain_and_grace(spec: Spec) -> None:
    deployment = _deployment(spec)
    period = _pod(deployment).get("terminationGracePeriodSeconds")
    assert isinstance(period, int), f"{spec.app}: terminationGracePeriodSeconds is not set"
    env = _env(_server_container(deployment))
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}

    def seconds(setting: str) -> float:
        entry = env.get(f"{spec.env_prefix}{setting.upper()}")
        return float(entry["value"]) if entry else float(defaults[setting])

    assert period > seconds("drain_seconds") + seconds("grace_seconds")


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
def test_settings_match_the_service(spec: Spec) -> None:
    env = _env(_server_container(_deployment(spec)))
    for name in env:
        assert name == "SERVICE_MODULE" or name.startswith(spec.env_prefix), (
            f"{spec.app}: {name} is not one of its settings ({spec.env_prefix}*)"
        )
    assert env[f"{spec.env_prefix}HOST"]["value"] == "0.0.0.0"
    for setting, port in (("PORT", spec.grpc_port), ("METRICS_PORT", spec.metrics_port)):
        if f"{spec.env_prefix}{setting}" in env:
            assert int(env[f"{spec.env_prefix}{setting}"]["value"]) == port


@per_service
def test_settings_exist_in_the_config_class(spec: Spec) -> None:
    """load_config ignores unknown variables, so a misspelt setting would pass unnoticed."""
    config_module = importlib.import_module(f"{spec.module}.config")
    (config_cls,) = [
        c
        for c in vars(config_module).values()
        if isinstance(c, type)
        and issubclass(c, ServerConfig)
        and c.__module__ == config_module.__name__
    ]
    known = {f"{spec.env_prefix}{f.name.upper()}" for f in dataclasses.fields(config_cls)}
    known |= {"SERVICE_MODULE", f"{spec.env_prefix}CONFIG"}
    unknown = set(_env(_server_container(_deployment(spec)))) - known
    assert not unknown, f"{spec.app}: {config_cls.__name__} has no setting for {sorted(unknown)}"


@per_service
def test_targets_name_the_services_they_depend_on(spec: Spec) -> None:
    env = _env(_server_container(_deployment(spec)))
    targets = {n for n in env if n.endswith("_TARGET")}
    assert targets == {f"{spec.env_prefix}{s.upper()}" for s in spec.targets}
    for setting, app in spec.targets.items():
        value = env[f"{spec.env_prefix}{setting.upper()}"]["value"]
        host, _, port = value.rpartition(":")
        assert host == app, f"{spec.app}: {setting} should dial the {app} Service, got {value}"
        service_ports = {p["name"]: p["port"] for p in SERVICES[app]["spec"]["ports"]}
        expected = service_ports.get("grpc", service_ports.get("relay"))
        assert int(port) == expected, f"{spec.app}: {setting} port {port}"


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
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"].get("strategy", {}).get("type") == "Recreate"
    container = _server_container(deployment)
    assert _env(container)["SYSTEM_STORAGE_DATABASE_URL"]["value"] == "sqlite:////data/storage.db"
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    assert "/data" in mounts and not mounts["/data"].get("readOnly", False)
    volumes = {v["name"]: v for v in _pod(deployment).get("volumes", [])}
    data = volumes[mounts["/data"]["name"]]
    assert "emptyDir" in data or "persistentVolumeClaim" in data


# --- secrets -----------------------------------------------------------------------------------


def test_secrets_come_only_from_secret_refs() -> None:
    checked = 0
    for path, doc in _every_document():
        for entry in _env_entries(doc):
            name = entry["name"]
            literal = entry.get("value")
            ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
            where = f"{path.relative_to(ROOT)}: env {name}"
            if SECRET_ENV.search(name):
                assert literal is None and ref, f"{where} must come from a secretKeyRef"
            elif name.endswith("DATABASE_URL") and literal is not None:
                assert str(literal).startswith("sqlite:"), f"{where}: a database URL is a secret"
            else:
                continue
            if ref:
                assert ref["name"] == SECRET_NAME, f"{where}: secrets live in {SECRET_NAME}"
            checked += 1
    assert checked >= 3, "expected the tokens, API key and database URL to be checked"


def test_base_holds_no_secret_values() -> None:
    assert not _base_objects("Secret"), "base must not define Secrets; they hold real values"
    kustomization = _base_kustomization()
    assert "secretGenerator" not in kustomization


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
    for deployment in DEPLOYMENTS.values():
        assert _pod(deployment)["securityContext"].get("runAsUser", IMAGE_UID) == IMAGE_UID


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


# --- rendered ----------------------------------------------------------------------------------


def _render(folder: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomizations_render(tmp_path: Path) -> None:
    assert {d["kind"] for d in _render(BASE)} == {"Deployment", "Service"}

    dev = _render(KUBE / "overlays" / "dev")
    (secret,) = [d for d in dev if d["kind"] == "Secret"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for d in dev
        for e in _env_entries(d)
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {secret["metadata"]["name"]}, "references follow the generated name"

    overlay = tmp_path / "postgres"
    overlay.mkdir()
    # kustomize refuses absolute paths to bases and components.
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(BASE, overlay)],
                "components": [os.path.relpath(KUBE / "components" / "postgres-external", overlay)],
            }
        )
    )
    (storage,) = [
        d
        for d in _render(overlay)
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "storage"
    ]
    url = _env(_server_container(storage))["SYSTEM_STORAGE_DATABASE_URL"]
    assert "value" not in url and url["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME
