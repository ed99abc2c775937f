"""docker/Dockerfile linted, the Kubernetes manifests validated against the API's schemas, and
the promises the deployment docs make checked in the files themselves (no Docker needed).

hadolint, kubernetes-validate (schemas bundled, --strict: unknown fields are errors) and
kubectl (for `kubectl kustomize`, which runs offline) come from the test extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from trace_proxy.config import parse_size

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"
BIN = Path(sys.executable).parent  # the test extra's console scripts
MIN_KUBERNETES = "1.29.0"  # native sidecars (init containers with restartPolicy: Always)


def tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / name), *args], capture_output=True, text=True, check=False, timeout=120
    )


def manifests() -> list[Path]:
    return sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def kustomized() -> list[dict[str, Any]]:
    built = tool("kubectl", "kustomize", str(KUBERNETES))
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = (doc for doc in docs if doc["kind"] == kind)
    return found


def test_dockerfile_passes_hadolint() -> None:
    linted = tool("hadolint", str(REPO / "docker" / "Dockerfile"))
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.parametrize("version", [MIN_KUBERNETES, None], ids=["1.29", "newest"])
def test_manifests_validate_strictly(version: str | None, tmp_path: Path) -> None:
    rendered = tmp_path / "kustomized.yaml"
    rendered.write_text(yaml.safe_dump_all(kustomized()))
    versions = ["--kubernetes-version", version] if version else []
    files = [str(p) for p in [*manifests(), rendered]]
    validated = tool("kubernetes-validate", "--strict", *versions, *files)
    assert validated.returncode == 0, validated.stdout + validated.stderr


def test_strict_validation_catches_a_misspelled_field(tmp_path: Path) -> None:
    """The check above can fail: a typo in a probe's name is an error, not ignored."""
    broken = tmp_path / "deployment.yaml"
    text = (KUBERNETES / "deployment.yaml").read_text()
    broken.write_text(text.replace("readinessProbe:", "readinesProbe:", 1))
    validated = tool("kubernetes-validate", "--strict", str(broken))
    assert validated.returncode != 0
    assert "readinesProbe" in validated.stdout + validated.stderr


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in manifests()]


def test_the_pod_runs_trace_proxy_as_a_native_sidecar_in_front_of_the_server() -> None:
    docs = kustomized()
    options = by_kind(docs, "ConfigMap")["data"]
    pod = by_kind(docs, "Deployment")["spec"]["template"]
    spec = pod["spec"]
    (sidecar,) = spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: up before, down after
    assert sidecar["envFrom"] == [{"configMapRef": {"name": "trace-proxy"}}]
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"proxy": int(options["TRACE_PROXY_PORT"]),
                     "admin": int(options["TRACE_PROXY_ADMIN_PORT"])}  # fmt: skip
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                        ("readinessProbe", "/ready")):  # fmt: skip
        assert sidecar[probe]["httpGet"] == {"path": path, "port": "admin"}
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
    assert security["runAsUser"] == 10001  # docker/Dockerfile's USER
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == {"/data", "/tmp"}
    assert options["TRACE_PROXY_OUTPUT"].startswith("/data/")  # the spool is under it
    assert sidecar["resources"]["requests"] and sidecar["resources"]["limits"]["memory"]

    # Stopping: the server first, then the proxy drains and flushes, each within the grace.
    grace = float(options["TRACE_PROXY_SHUTDOWN_GRACE"])
    assert spec["terminationGracePeriodSeconds"] >= 2 * grace + 30

    # The spool's budget and the capture overflow's, both in the spool's directory, fit its
    # volume.
    (data,) = (v for v in spec["volumes"] if v["name"] == sidecar["volumeMounts"][0]["name"])
    assert parse_size(options["TRACE_PROXY_SPOOL_MAX_BYTES"]) + parse_size(
        options["TRACE_PROXY_CAPTURE_OVERFLOW_BYTES"]
    ) < parse_size(data["emptyDir"]["sizeLimit"].replace("Gi", "GiB"))

    # Clients reach the server only through the proxy.
    (server,) = spec["containers"]
    assert "--host=127.0.0.1" in server["args"]
    assert options["TRACE_PROXY_UPSTREAM"] == "http://127.0.0.1:8000"
    service = by_kind(docs, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [ports["proxy"]]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["admin"])
    assert annotations["prometheus.io/path"] == "/metrics"


def test_compose_puts_trace_proxy_in_the_servers_network_with_a_named_volume() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    proxy = services["trace-proxy"]
    assert proxy["network_mode"] == "service:vllm"
    assert proxy["build"]["dockerfile"] == "docker/Dockerfile"
    assert (COMPOSE.parent / proxy["build"]["context"] / "docker" / "Dockerfile").is_file()
    env = proxy["environment"]
    assert env["TRACE_PROXY_UPSTREAM"] == "http://127.0.0.1:8000"
    assert "--host" in services["vllm"]["command"]  # the server on loopback only
    assert services["vllm"]["command"][services["vllm"]["command"].index("--host") + 1] == (
        "127.0.0.1"
    )
    assert f"8000:{env['TRACE_PROXY_PORT']}" in services["vllm"]["ports"]

    volume, _, target = proxy["volumes"][0].partition(":")
    assert target == "/data" and volume in compose["volumes"]  # a named volume

    assert "mlflow" in env["TRACE_PROXY_BACKEND"].split(",")
    assert env["TRACE_PROXY_MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert proxy["build"]["args"]["EXTRAS"] == "mlflow"
    assert proxy["depends_on"]["mlflow"]["condition"] == "service_healthy"
    stop_grace = int(proxy["stop_grace_period"].rstrip("s"))
    assert stop_grace >= 2 * float(env["TRACE_PROXY_SHUTDOWN_GRACE"])
