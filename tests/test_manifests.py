"""The Kubernetes manifests (deploy/k8s) and the Grafana dashboard (deploy/grafana), rendered and checked.

``kubectl kustomize`` renders the base and the production overlay. Every rendered object is validated:
custom resources against the JSON Schemas vendored in deploy/k8s/schemas (jsonschema), everything else
against the Kubernetes API's schemas for KUBERNETES_VERSION (kubernetes-validate, strict: unknown fields
fail). Then the manifests are checked against the code: the settings they set exist, the probes ask
the health port, the grace period outlasts the drain, KEDA watches the run queue, and the dashboard
queries metrics the worker exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from runbrake.worker import metrics
from tests.deploy_helpers import REPO, dockerfile_instructions, dockerfile_stages, settings_variables

KUBERNETES_VERSION = "1.31.0"
"""The oldest Kubernetes the manifests are for (unhealthyPodEvictionPolicy is GA from 1.31)."""
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "production": K8S / "overlays" / "production"}
SCHEMAS = K8S / "schemas"
DASHBOARD = REPO / "deploy" / "grafana" / "runbrake.json"
RUNBRAKE_CONTAINERS = {"worker", "api"}
"""Containers of the runbrake image (the others are Redis and RabbitMQ)."""
# Labels Prometheus and the Prometheus Operator put on every scraped sample, beside the metric's own.
TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "endpoint", "container", "le"}

Object = dict[str, Any]


@cache
def render(name: str) -> tuple[Object, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        message = "kubectl is not installed, so the manifests cannot be rendered (kubectl kustomize); install kubectl"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    rendered = subprocess.run([kubectl, "kustomize", str(KUSTOMIZATIONS[name])],
                              capture_output=True, text=True, timeout=120, check=False)
    assert rendered.returncode == 0, f"kubectl kustomize {KUSTOMIZATIONS[name]} failed:\n{rendered.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(rendered.stdout) if doc)


@pytest.fixture(params=sorted(KUSTOMIZATIONS))
def objects(request: pytest.FixtureRequest) -> tuple[Object, ...]:
    return render(request.param)


@cache
def crd_schemas() -> dict[tuple[str, str], Object]:
    """(apiVersion, kind) → the vendored JSON Schema."""
    schemas = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        schemas[(schema["properties"]["apiVersion"]["const"], schema["properties"]["kind"]["const"])] = schema
    return schemas


def validation_errors(obj: Object) -> list[str]:
    """Why ``obj`` is not a valid object of its kind ([] when it is)."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    schema = crd_schemas().get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if schema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{name}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{name}: {'.'.join(map(str, error.path))}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{name}: no schema: {error.message} (vendor one in deploy/k8s/schemas)"]
    return []


def find(objects: tuple[Object, ...], kind: str, name: str | None = None) -> list[Object]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: tuple[Object, ...], kind: str, name: str) -> Object:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def generated(objects: tuple[Object, ...], kind: str, name: str) -> Object:
    """A generated ConfigMap or Secret by its generator name (kustomize appends a content hash)."""
    pattern = re.compile(rf"{name}(-[a-z0-9]{{10}})?")
    found = [o for o in objects if o["kind"] == kind and pattern.fullmatch(o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(workload: Object) -> Object:
    spec: Object = workload["spec"]["template"]["spec"]
    return spec


def containers(objects: tuple[Object, ...]) -> list[tuple[Object, Object]]:
    """(workload, container) for every container of every Deployment and StatefulSet."""
    return [(w, c) for w in objects if w["kind"] in {"Deployment", "StatefulSet"} for c in pod_spec(w)["containers"]]


def container(objects: tuple[Object, ...], name: str) -> Object:
    found = [c for _, c in containers(objects) if c["name"] == name]
    assert len(found) == 1, f"expected one container {name}"
    return found[0]


def effective_env(objects: tuple[Object, ...], item: Object) -> dict[str, str | None]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env. A value from a
    Secret is None (the manifests do not hold it)."""
    env: dict[str, str | None] = {}
    for source in item.get("envFrom", []):
        if "configMapRef" in source:
            env.update(one(objects, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for entry in item.get("env", []):
        env[entry["name"]] = entry.get("value")
    return env


def port_number(item: Object, port: int | str) -> int:
    """A probe's or Service's port, a number or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in item.get("ports", []) if p.get("name") == port]
    assert numbers, f"container {item['name']} has no port named {port}"
    return int(numbers[0])


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# -- rendering and schemas ------------------------------------------------------------------------


def test_every_rendered_object_is_valid_for_its_kind(objects: tuple[Object, ...]) -> None:
    errors = [error for obj in objects for error in validation_errors(obj)]

    assert errors == []
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "ScaledObject",
            "TriggerAuthentication", "ServiceMonitor", "RabbitmqCluster"} <= kinds


def test_the_vendored_schemas_are_json_schemas_that_refuse_unknown_and_misspelt_fields() -> None:
    base = render("base")
    for schema in crd_schemas().values():
        jsonschema.Draft202012Validator.check_schema(schema)
    scaled = one(base, "ScaledObject", "runbrake-worker")
    monitor = one(base, "ServiceMonitor", "runbrake-worker")
    trigger = scaled["spec"]["triggers"][0]

    def with_metadata(**changes: str) -> Object:
        return {**scaled, "spec": {**scaled["spec"], "triggers": [
            {**trigger, "metadata": {**trigger["metadata"], **changes}}]}}

    misspelt = [
        {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}},
        with_metadata(queuename="x"),
        with_metadata(mode="Length"),
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "metrics", "intervall": "15s"}]}},
        {**one(base, "RabbitmqCluster", "runbrake-rabbitmq"), "spec": {"replica": 3}},
        {**one(base, "TriggerAuthentication", "runbrake-rabbitmq"), "spec": {"secretTargetRef": [{"name": "x"}]}},
    ]

    assert [bool(validation_errors(obj)) for obj in misspelt] == [True] * len(misspelt)


def test_kubernetes_validate_refuses_a_misspelt_field_too() -> None:
    worker = one(render("base"), "Deployment", "runbrake-worker")
    broken = json.loads(json.dumps(worker))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45

    assert validation_errors(broken)


def test_the_production_overlay_pins_the_image_puts_everything_in_its_namespace_and_uses_quorum_queues() -> None:
    production = render("production")

    namespaced = [o for o in production if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"runbrake"}
    images = {c["image"] for _, c in containers(production) if c["name"] in RUNBRAKE_CONTAINERS}
    assert len(images) == 1
    assert re.fullmatch(r"[\w.\-/]+:\d+\.\d+\.\d+", images.pop())
    assert generated(production, "ConfigMap", "runbrake-config")["data"]["RUNBRAKE_QUEUE_TYPE"] == "quorum"
    assert one(production, "RabbitmqCluster", "runbrake-rabbitmq")["spec"]["replicas"] >= 3
    assert one(production, "Deployment", "runbrake-api")["spec"]["replicas"] >= 2


# -- the manifests against the code ---------------------------------------------------------------


def test_every_runbrake_variable_the_manifests_set_is_a_setting(objects: tuple[Object, ...]) -> None:
    names = {name for _, item in containers(objects) for name in effective_env(objects, item)}
    names |= {key for cm in find(objects, "ConfigMap") for key in cm.get("data", {})}

    unknown = sorted(n for n in names if n.startswith("RUNBRAKE_") and n not in settings_variables())
    assert unknown == [], f"not read by Settings.from_env (shared/settings.py): {unknown}"


def test_credentials_come_from_secrets_and_no_secret_is_in_the_manifests(objects: tuple[Object, ...]) -> None:
    assert find(objects, "Secret") == []
    literal = []
    for _, item in containers(objects):
        for entry in item.get("env", []):
            value = entry.get("value")
            if value is None:
                continue
            if entry["name"] in {"RUNBRAKE_RABBITMQ_URL", "RUNBRAKE_REDIS_URL"} or re.search(
                    r"PASSWORD|API_KEY|SECRET|AUTH", entry["name"]) or re.search(r"://[^/\s]*@", value):
                literal.append(f"{item['name']}: {entry['name']}")
    assert literal == []
    for name in RUNBRAKE_CONTAINERS:
        env = {e["name"]: e for e in container(objects, name)["env"]}
        for url in ("RUNBRAKE_RABBITMQ_URL", "RUNBRAKE_REDIS_URL"):
            assert env[url]["valueFrom"]["secretKeyRef"] == {"name": "runbrake-secrets", "key": url}


def test_the_example_secrets_are_valid_hold_placeholders_and_are_in_no_kustomization() -> None:
    example = K8S / "secrets.example.yaml"
    secrets = [doc for doc in yaml.safe_load_all(example.read_text()) if doc]

    assert [validation_errors(s) for s in secrets] == [[]] * len(secrets)
    assert all("REPLACE-ME" in value for s in secrets for value in s["stringData"].values())
    for kustomization in K8S.rglob("kustomization.yaml"):
        listed = yaml.safe_load(kustomization.read_text()).get("resources", [])
        assert not [r for r in listed if "secret" in r.lower()], kustomization
    referenced = {
        (ref["name"], ref["key"])
        for obj in (*render("base"), *render("production"))
        for ref in _secret_key_refs(obj)
    }
    provided = {(s["metadata"]["name"], key) for s in secrets for key in s["stringData"]}
    assert referenced <= provided, f"referenced but not in the example: {sorted(referenced - provided)}"


def _secret_key_refs(node: Any) -> list[Object]:
    """Every secretKeyRef, and KEDA's secretTargetRef entries, anywhere in ``node``."""
    found: list[Object] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "secretKeyRef":
                found.append(value)
            elif key == "secretTargetRef":
                found += [{"name": ref["name"], "key": ref["key"]} for ref in value]
            else:
                found += _secret_key_refs(value)
    elif isinstance(node, list):
        for value in node:
            found += _secret_key_refs(value)
    return found


def test_the_worker_probes_ask_its_health_port_and_the_api_probes_its_serving_port(objects: tuple[Object, ...]) -> None:
    worker = container(objects, "worker")
    health_port = int(effective_env(objects, worker)["RUNBRAKE_HEALTH_PORT"] or 0)

    assert health_port > 0
    # The kubelet probes (and the ServiceMonitor scrapes) the pod's address; the worker's default is loopback.
    assert effective_env(objects, worker)["RUNBRAKE_HEALTH_HOST"] == "0.0.0.0"
    assert (worker["livenessProbe"]["httpGet"]["path"], worker["readinessProbe"]["httpGet"]["path"]) == (
        "/healthz", "/readyz")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert port_number(worker, worker[probe]["httpGet"]["port"]) == health_port, probe
    assert worker["livenessProbe"]["timeoutSeconds"] > 2, "longer than /healthz's own 2 s bound on the loop"
    api = container(objects, "api")
    api_port = int(option(api["command"], "--port"))
    assert option(api["command"], "--host") == "0.0.0.0"
    paths = (api["livenessProbe"]["httpGet"]["path"], api["readinessProbe"]["httpGet"]["path"])
    assert paths == ("/healthz", "/readyz")
    for probe in ("livenessProbe", "readinessProbe"):
        assert port_number(api, api[probe]["httpGet"]["port"]) == api_port, probe


def test_every_worker_container_sets_its_process_count(objects: tuple[Object, ...]) -> None:
    """Without --processes a worker starts one process per CPU it may use, and a container sees the node's
    CPUs, not its own limit (worker/supervisor.py, default_processes): the manifests say how many."""
    worker = container(objects, "worker")

    assert int(option(worker["command"], "--processes")) == 1  # one loop per pod, which the probes cover


def test_the_worker_gets_longer_to_stop_than_its_drain(objects: tuple[Object, ...]) -> None:
    deployment = one(objects, "Deployment", "runbrake-worker")
    drain_s = int(effective_env(objects, container(objects, "worker"))["RUNBRAKE_DRAIN_S"] or 0)

    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > drain_s


def test_every_runbrake_process_declares_the_same_queues(objects: tuple[Object, ...]) -> None:
    """The worker and the API both declare the run queue: RabbitMQ refuses a redeclaration with other
    arguments (docs/messages.md, "Run queue: declaration"), so they agree on what shapes them."""
    shaping = ("RUNBRAKE_NAMESPACE", "RUNBRAKE_QUEUE_TYPE", "RUNBRAKE_RUN_TIME_LIMIT_S")
    seen = {
        name: tuple(effective_env(objects, container(objects, name)).get(key) for key in shaping)
        for name in RUNBRAKE_CONTAINERS
    }

    assert len(set(seen.values())) == 1, seen
    assert None not in next(iter(seen.values()))


def test_keda_scales_the_worker_deployment_on_the_run_queue_and_the_runs_in_flight(
    objects: tuple[Object, ...],
) -> None:
    scaled = one(objects, "ScaledObject", "runbrake-worker")
    worker = container(objects, "worker")
    namespace = effective_env(objects, worker)["RUNBRAKE_NAMESPACE"]
    trigger, in_flight, saturation = scaled["spec"]["triggers"]

    assert scaled["spec"]["scaleTargetRef"]["name"] == "runbrake-worker"
    assert find(objects, "Deployment", "runbrake-worker")
    assert "replicas" not in one(objects, "Deployment", "runbrake-worker")["spec"], "KEDA owns the count"
    assert trigger["type"] == "rabbitmq"
    assert trigger["metadata"]["queueName"] == f"{namespace}.runs"
    assert trigger["metadata"]["mode"] == "QueueLength"
    assert (trigger["metadata"]["protocol"], trigger["metadata"]["excludeUnacknowledged"]) == ("http", "false")
    assert trigger["metadata"]["value"] == option(worker["command"], "--concurrency")
    # The queue alone does not see runs in flight (acked at claim): the second trigger counts them.
    assert in_flight["type"] == "prometheus"
    assert in_flight["metadata"]["threshold"] == option(worker["command"], "--concurrency")
    queried = set(re.findall(r"runbrake_[a-z_]+", in_flight["metadata"]["query"]))
    assert queried == {"runbrake_runs_in_flight", "runbrake_queue_depth"}
    assert queried | {"runbrake_worker_saturation"} <= _exported().keys()
    # Admission by health (worker/saturation.py): saturated workers leave runs queued, so scale on it too.
    assert saturation["type"] == "prometheus"
    assert set(re.findall(r"runbrake_[a-z_]+", saturation["metadata"]["query"])) == {"runbrake_worker_saturation"}
    assert float(saturation["metadata"]["threshold"]) < 1.0
    assert 'service="runbrake-worker-metrics"' in saturation["metadata"]["query"]
    metrics_service = one(objects, "ServiceMonitor", "runbrake-worker")
    assert 'service="runbrake-worker-metrics"' in in_flight["metadata"]["query"]
    assert metrics_service["spec"]["selector"]["matchLabels"].items() <= one(
        objects, "Service", "runbrake-worker-metrics")["metadata"]["labels"].items()
    auth = one(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert [ref["parameter"] for ref in auth["spec"]["secretTargetRef"]] == ["host"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_service_monitor_scrapes_the_worker_metrics_port(objects: tuple[Object, ...]) -> None:
    monitor = one(objects, "ServiceMonitor", "runbrake-worker")
    worker_deployment = one(objects, "Deployment", "runbrake-worker")
    worker = container(objects, "worker")
    selected = [s for s in find(objects, "Service")
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()]

    assert [s["metadata"]["name"] for s in selected] == ["runbrake-worker-metrics"]
    (service,) = selected
    assert service["spec"]["selector"].items() <= worker_deployment["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    metrics_port = int(effective_env(objects, worker)["RUNBRAKE_METRICS_PORT"] or 0)
    assert port_number(worker, service_port["targetPort"]) == metrics_port
    assert endpoint["path"] == "/metrics"


def test_the_catalog_is_mounted_where_runbrake_catalog_points(objects: tuple[Object, ...]) -> None:
    for _name in RUNBRAKE_CONTAINERS:
        workload, item = next((w, c) for w, c in containers(objects) if c["name"] == _name)
        path = Path(effective_env(objects, item)["RUNBRAKE_CATALOG"] or "")
        (mount,) = [m for m in item["volumeMounts"] if path.parent == Path(m["mountPath"])]
        (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
        config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
        assert path.name in config_map["data"]
        assert mount["readOnly"] is True


def test_the_api_reads_its_tokens_from_a_mounted_secret(objects: tuple[Object, ...]) -> None:
    workload = one(objects, "Deployment", "runbrake-api")
    api = container(objects, "api")
    path = Path(effective_env(objects, api)["RUNBRAKE_API_TOKENS"] or "")
    (mount,) = [m for m in api["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]

    assert volume["secret"]["secretName"] == "runbrake-api-tokens"
    assert [item["path"] for item in volume["secret"]["items"]] == [path.name]


def test_every_pod_runs_as_non_root_read_only_with_bounded_resources(objects: tuple[Object, ...]) -> None:
    runtime = dockerfile_stages(dockerfile_instructions())[-1]
    image_uid = int(next(i for i in reversed(runtime) if i.keyword == "USER").args.split(":")[0])
    for workload, item in containers(objects):
        spec = pod_spec(workload)
        where = f"{workload['metadata']['name']}/{item['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert item["securityContext"]["readOnlyRootFilesystem"] is True, where
        assert item["securityContext"]["allowPrivilegeEscalation"] is False, where
        assert item["securityContext"]["capabilities"]["drop"] == ["ALL"], where
        assert {"cpu", "memory"} <= item["resources"]["requests"].keys(), where
        assert {"cpu", "memory"} <= item["resources"]["limits"].keys(), where
        if item["name"] in RUNBRAKE_CONTAINERS:
            assert spec["securityContext"]["runAsUser"] == image_uid, where
            (tmp,) = [m for m in item["volumeMounts"] if m["mountPath"] == "/tmp"]  # noqa: S108 - the pod's emptyDir
            assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == tmp["name"]), where
            assert spec["enableServiceLinks"] is False, where


def test_every_deployment_has_a_disruption_budget_selecting_its_pods(objects: tuple[Object, ...]) -> None:
    budgets = find(objects, "PodDisruptionBudget")
    for deployment in find(objects, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, deployment["metadata"]["name"]


def test_redis_keeps_an_append_only_file_fsynced_every_second_on_a_persistent_volume(
    objects: tuple[Object, ...],
) -> None:
    redis = one(objects, "StatefulSet", "runbrake-redis")
    (item,) = pod_spec(redis)["containers"]
    command = " ".join(item["command"])

    assert "--appendonly yes" in command
    assert "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    data_dir = option(item["command"], "--dir")
    (mount,) = [m for m in item["volumeMounts"] if m["mountPath"] == data_dir]
    assert [t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]] == [mount["name"]]
    assert one(objects, "Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


# -- the dashboard --------------------------------------------------------------------------------


def _expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in _expressions(value)]
    return []


def _exported() -> dict[str, set[str]]:
    """Sample name → label names, for every sample the worker's metrics can expose."""
    exported: dict[str, set[str]] = {}
    described = set()
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        labels = set(collector._labelnames)  # the label names a metric was declared with
        for family in collector.describe():
            described.add(family.name)
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}[family.type]
            for suffix in suffixes:
                exported[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    registered = {family.name for family in metrics.REGISTRY.collect()}
    assert registered <= described, f"collectors not declared in worker/metrics.py: {registered - described}"
    return exported


def test_every_metric_the_dashboard_queries_is_exported_by_the_worker() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = _expressions(dashboard["panels"])
    exported = _exported()

    assert expressions
    queried = {name for expr in expressions for name in re.findall(r"\brunbrake_[a-z0-9_]+", expr)}
    assert sorted(queried - exported.keys()) == []
    for expr in expressions:
        names = re.findall(r"\brunbrake_[a-z0-9_]+", expr)
        allowed = set().union(*(exported[name] for name in names)) | TARGET_LABELS
        for clause in re.findall(r"\bby \(([^)]*)\)", expr):
            grouped = {label.strip() for label in clause.split(",")}
            assert grouped <= allowed, f"{expr}: grouped by labels the metric does not have: {grouped - allowed}"


def test_the_dashboard_shows_what_an_operator_needs() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = " ".join(_expressions(dashboard["panels"]))

    for needed in ("runbrake_runs_finished_total", "runbrake_tool_calls_total",
                   "runbrake_cancel_latency_seconds_bucket", "runbrake_runs_in_flight", "runbrake_queue_depth"):
        assert needed in expressions
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert dashboard["uid"] == "runbrake"
