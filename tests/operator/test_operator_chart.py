"""The Helm chart, rendered and linted by Helm's own library (helm-python-sdk), output validated."""

from __future__ import annotations

import json
import re

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kube_emulator import ROOT

CHART = ROOT / "charts" / "disagg"
KUBE_VERSION = "1.35"
NAMESPACED = {"watchNamespace": "team-a", "grafanaDashboard": {"enabled": True}}


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name="disagg", namespace="ops", is_install=True)
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.mark.parametrize(
    "values", [{}, NAMESPACED, {"clusterWide": True}], ids=["default", "namespaced", "cluster-wide"]
)
def test_lint_is_clean(values):
    report = helm.lint(str(CHART), values, strict=True, namespace="ops", kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [] and report["errors"] == []


@pytest.mark.parametrize(
    "values", [{}, NAMESPACED, {"clusterWide": True}], ids=["default", "namespaced", "cluster-wide"]
)
def test_rendered_objects_validate_strictly(values):
    docs = render(values)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    (deploy,) = by_kind(docs)["Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"]
    assert container["args"][0] == "operator" and "--standalone" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # The autoscaler's own metrics: a named port, the env that serves it there, matching annotations.
    (port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert {"name": "DISAGG_AUTOSCALER_METRICS_PORT", "value": str(port["containerPort"])} in container["env"]
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"]) == "9090"
    assert annotations["prometheus.io/scrape"] == "true"
    assert "ServiceMonitor" not in by_kind(docs)  # off by default


def test_the_default_install_is_namespaced_to_the_release_namespace():
    docs = by_kind(render({}))
    (role,) = docs["Role"]
    (binding,) = docs["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ops"
    args = docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ops" in args and "--all-namespaces" not in args
    assert "--operator-namespace=ops" in args
    assert not any(a.startswith("--allow-host-path") for a in args)  # hostPath off by default


def test_cluster_wide_install_is_opt_in_with_a_cluster_role():
    docs = by_kind(render({"clusterWide": True}))
    assert "Role" not in docs and "RoleBinding" not in docs
    (binding,) = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"][0]["metadata"]["name"]
    assert "--all-namespaces" in docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_namespaced_install_grants_workload_rights_only_in_the_watched_namespace():
    docs = by_kind(render(NAMESPACED))
    (role,) = docs["Role"]
    (binding,) = docs["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert binding["subjects"][0]["namespace"] == "ops"
    cluster_wide = {
        (g, r)
        for rule in docs["ClusterRole"][0]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert cluster_wide == {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
    args = docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args


def test_host_path_prefixes_become_operator_flags():
    docs = by_kind(render({"hostPathPrefixes": ["/mnt/models", "/data"]}))
    args = docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--allow-host-path")] == [
        "--allow-host-path=/mnt/models",
        "--allow-host-path=/data",
    ]


def test_autoscaler_pace_reaches_the_operator_and_defaults_to_the_codes():
    from disagg.operator.autoscaling.handlers import Settings

    def env(values: dict) -> dict:
        docs = by_kind(render(values))
        return {
            e["name"]: e["value"]
            for e in docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
        }

    code = Settings.from_env({})
    default = Settings.from_env(env({}))
    assert (default.interval_seconds, default.tuning.window_seconds) == (
        code.interval_seconds,
        code.tuning.window_seconds,
    )
    fast = Settings.from_env(env({"autoscaler": {"intervalSeconds": 2, "windowSeconds": 5}}))
    assert (fast.interval_seconds, fast.tuning.window_seconds) == (2.0, 5.0)


def test_service_monitor_scrapes_the_operators_metrics_port():
    values = {
        "metrics": {
            "port": 9191,
            "podAnnotations": False,
            "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
        }
    }
    docs = by_kind(render(values))
    (monitor,) = docs["ServiceMonitor"]
    (service,) = [s for s in docs["Service"] if s["metadata"]["name"].endswith("-metrics")]
    kubernetes_validate.validate(service, KUBE_VERSION, strict=True)
    (deploy,) = docs["Deployment"]
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9191, "protocol": "TCP"} in container["ports"]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9191, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert "annotations" not in pod["metadata"]  # annotations off: the ServiceMonitor is the one scraper


def test_grafana_dashboard_has_ttft_and_itl_panels():
    docs = by_kind(render(NAMESPACED))
    (cm,) = [d for d in docs["ConfigMap"] if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["disagg.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "disagg_time_to_first_token_seconds_bucket",
        "disagg_inter_token_latency_seconds_bucket",
        "disagg_e2e_request_latency_seconds_bucket",
        "disagg_engine_step_seconds_sum",
        "disagg_engine_step_rows_total",
        "disagg_router_migrations_total",
        "disagg_router_migration_gap_seconds_bucket",
        "disagg_kv_tier_hits_total",
        "disagg_kv_tier_blocks",
        "disagg_kv_tier_read_seconds_bucket",
    ):
        assert metric in exprs
    # every series a panel reads is one the workers and router export
    from prometheus_client import CollectorRegistry

    from disagg.worker.serving.metrics import ServingMetrics

    exported = ServingMetrics("decode", "m", registry=CollectorRegistry()).exposition().decode()

    def family(name: str) -> str:
        return re.sub(r"_(bucket|sum|count|total|created)$", "", name)

    families = {family(n) for n in re.findall(r"^# TYPE (\S+)", exported, flags=re.M)}
    for name in set(re.findall(r"\bdisagg_[a-z0-9_]+", exprs)):
        assert family(name) in families, name
    assert "ConfigMap" not in by_kind(render({}))  # off by default


def test_crd_ships_in_the_chart_and_notes_say_what_to_do_next():
    with helm.Chart.load(CHART) as chart:
        (crd,) = chart.crds
        notes = chart.render(NAMESPACED, name="disagg", namespace="ops")["disagg/templates/NOTES.txt"]
    assert yaml.safe_load(crd["data"])["metadata"]["name"] == "inferencedeployments.disagg.dev"
    assert "kubectl apply -n team-a" in notes and "kubectl get idep" in notes


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"replicaCount": 2}, "replicaCount"),
        ({"logFormat": "yaml"}, "logFormat"),
        ({"watchNamespace": "Team_A"}, "watchNamespace"),
        ({"unknownKey": True}, "unknownKey"),
        ({"metrics": {"port": 0}}, "port"),
        ({"hostPathPrefixes": ["models"]}, "hostPathPrefixes"),
    ],
)
def test_values_schema_rejects_bad_values_naming_the_key(values, key):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert key in str(err.value)
