"""deploy/: the compose file and the Kubernetes manifests, validated offline and in step.

No cluster here: the kustomize overlays are rendered (`kubectl kustomize`) and checked
against the Kubernetes API schemas (`kubernetes-validate --strict`), the compose file
against the Compose Specification's schema (`check-jsonschema`), and both are compared:
the same services, commands, ports, images and wiring.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
BIN = Path(sys.executable).parent

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl (for `kubectl kustomize`) is not installed: run `bash deploy/install.sh`",
)


def _render(overlay: str) -> list[dict]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _check_compose(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema against the Compose Specification's schema it ships."""
    return subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _validate(path: Path) -> subprocess.CompletedProcess:
    """kubernetes-validate, strict: unknown fields are errors."""
    return subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_compose_file_follows_the_compose_specification() -> None:
    result = _check_compose(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_compose_file_is_caught(tmp_path) -> None:
    """The check above can fail: a service with an unknown key does not pass."""
    broken = _compose()
    broken["services"]["buffer"]["restart_policy"] = "always"  # not a service key
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_compose(path)
    assert result.returncode != 0


@needs_kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_kubernetes_overlays_render_and_validate_strictly(overlay, tmp_path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    documents = _render(overlay)
    rendered.write_text(yaml.safe_dump_all(documents))
    result = _validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = sorted(
        f"{d['kind']}/{d['metadata']['name']}" for d in documents if d["kind"] != "ConfigMap"
    )
    configs = sorted(
        d["metadata"]["name"].rsplit("-", 1)[0] for d in documents if d["kind"] == "ConfigMap"
    )
    assert configs == ["rollwire-env", "rollwire-run"]
    assert kinds == sorted(
        [
            "Deployment/env-server",
            "Deployment/reward-server",
            "Deployment/rollout-server",
            "HorizontalPodAutoscaler/env-server",
            "HorizontalPodAutoscaler/reward-server",
            "HorizontalPodAutoscaler/rollout-server",
            "Job/orchestrator",
            "Job/prepare",
            "Job/trainer",
            "PersistentVolumeClaim/rollwire-models",
            "PersistentVolumeClaim/rollwire-run",
            "Service/buffer",
            "Service/env-server",
            "Service/reward-server",
            "Service/rollout-server",
            "Service/trainer",
            "StatefulSet/buffer",
        ]
    )
    assert all(doc["metadata"].get("namespace") == "rollwire" for doc in documents)


@needs_kubectl
def test_the_kubernetes_manifests_fail_strict_validation_when_broken(tmp_path) -> None:
    """The validation can fail: an unknown field in a container is rejected."""
    documents = _render("cpu")
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    rendered = tmp_path / "broken.yaml"
    rendered.write_text(yaml.safe_dump_all(documents))
    result = _validate(rendered)
    assert result.returncode != 0


def _workloads(documents: list[dict]) -> dict[str, dict]:
    """Pod templates by their container's name (the service)."""
    found = {}
    for doc in documents:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            spec = doc["spec"]["template"]["spec"]
            for container in spec["containers"]:
                found[container["name"]] = {"container": container, "pod": spec}
    return found


@needs_kubectl
def test_the_kubernetes_manifests_are_in_step_with_the_compose_file() -> None:
    compose = _compose()
    documents = _render("cpu")
    workloads = _workloads(documents)
    # The Node example (profile `node`) is compose's only: on a cluster another language's
    # env server is one more Deployment like env-server's.
    services = {
        name: service
        for name, service in compose["services"].items()
        if "node" not in service.get("profiles", [])
    }
    assert set(workloads) == set(services)
    env_config = next(
        d
        for d in documents
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rollwire-env-")
    )
    # Compose's `${VARIABLE:-default}` as compose reads it with the variable unset.
    wiring = {
        key: re.sub(r"\$\{[A-Z_]+:-(.*)\}", r"\1", value)
        for key, value in compose["x-config"].items()
        if key.startswith("ROLLWIRE__")
    }
    assert env_config["data"] == wiring
    for name, service in services.items():
        container = workloads[name]["container"]
        # The same command line (the mounted run YAML at the same path).
        assert container["args"] == service["command"], name
        # The same image: light for the light services, full for the others.
        compose_image = service.get("image", compose["x-service"]["image"])
        light = "LIGHT" in compose_image
        assert container["image"] == ("rollwire:light" if light else "rollwire:full"), name
        # The same per-service settings.
        extra = {
            key: value
            for key, value in (service.get("environment") or {}).items()
            if key.startswith("ROLLWIRE__") and key not in wiring
        }
        assert {
            e["name"]: e["value"] for e in container.get("env", []) if e["name"] in extra
        } == extra, name
    # Every server's probes are its gRPC health (the buffer: its ZeroMQ ports).
    for name in ("reward-server", "env-server", "rollout-server"):
        container = workloads[name]["container"]
        port = int(services[name]["command"][services[name]["command"].index("--port") + 1])
        assert container["readinessProbe"]["grpc"]["port"] == port
        assert container["livenessProbe"]["grpc"]["port"] == port
    env_service = next(
        d for d in documents if d["kind"] == "Service" and d["metadata"]["name"] == "env-server"
    )
    assert env_service["spec"]["clusterIP"] == "None", "dns:/// must see every env-server pod"
    # Every service asks for the stack's token; only the buffer and the trainer hold the
    # trainer's, in both.
    assert all(
        name in (service.get("secrets") or compose["x-service"]["secrets"])
        for service in services.values()
        for name in ["rollwire-token"]
    )
    for name, entry in workloads.items():
        mounted = {m["mountPath"] for m in entry["container"]["volumeMounts"]}
        assert "/run/secrets/rollwire-token" in mounted, name
        trainer_token = "/run/secrets/rollwire-trainer-token" in mounted
        compose_secrets = services[name].get("secrets") or compose["x-service"]["secrets"]
        assert trainer_token == (name in ("buffer", "trainer")), name
        assert ("rollwire-trainer-token" in compose_secrets) == trainer_token, name
    for entry in workloads.values():
        assert entry["pod"]["securityContext"]["runAsNonRoot"] is True
        assert entry["container"]["securityContext"]["allowPrivilegeEscalation"] is False
        assert "requests" in entry["container"]["resources"]


# Where each scaled service registers its gauges.
GAUGE_SOURCES = {
    "env-server": REPO / "envs" / "server.py",
    "reward-server": REPO / "reward" / "server.py",
    "rollout-server": REPO / "rollout" / "server" / "servicer.py",
}


@needs_kubectl
def test_every_autoscaler_reads_a_queue_gauge_its_service_serves() -> None:
    """Each server's HPA scales on a gauge that server registers, served on the metrics
    port its pods expose and announce, and that the Prometheus adapter's rules publish."""
    documents = _render("cpu")
    workloads = _workloads(documents)
    env_config = next(
        d
        for d in documents
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rollwire-env-")
    )
    adapter = yaml.safe_load(
        (DEPLOY / "k8s" / "autoscaling" / "prometheus-adapter-values.yaml").read_text()
    )
    published = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert all(
        rule["seriesQuery"].startswith(rule["name"]["as"] + "{")
        for rule in adapter["rules"]["custom"]
    )
    scaled = {}
    for hpa in (d for d in documents if d["kind"] == "HorizontalPodAutoscaler"):
        name = hpa["spec"]["scaleTargetRef"]["name"]
        queue = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert len(queue) == 1, name
        scaled[name] = queue[0]
    assert set(scaled) == set(GAUGE_SOURCES)
    for name, metric in scaled.items():
        gauge = metric.removeprefix("rollwire_")
        assert f'"{gauge}"' in GAUGE_SOURCES[name].read_text(), (name, gauge)
        assert metric in published, metric
        section = name.replace("-", "_").upper()
        port = env_config["data"][f"ROLLWIRE__{section}__SERVER__METRICS_PORT"]
        container = workloads[name]["container"]
        assert {"name": "metrics", "containerPort": int(port)} in container["ports"], name
        template = next(
            d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == name
        )["spec"]["template"]
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": port,
        }, name


@needs_kubectl
def test_the_gpu_overlay_asks_for_gpus_and_trains_on_two_ranks() -> None:
    workloads = _workloads(_render("gpu"))
    rollout = workloads["rollout-server"]["container"]
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert rollout["image"] == "rollwire:cuda"
    trainer = workloads["trainer"]["container"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["WORLD_SIZE"] == env["ROLLWIRE__TRAINER__WORLD_SIZE"] == "2"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "1"
    job = next(
        d for d in _render("gpu") if d["kind"] == "Job" and d["metadata"]["name"] == "trainer"
    )
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["completionMode"] == "Indexed"
