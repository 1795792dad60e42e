"""The routing overlays: session affinity under Istio and the Gateway API
Inference Extension's pool (docs/kubernetes.md), checked against the code they
route to. Rendering and schema validation are tests/service/test_k8s.py's."""

from __future__ import annotations

import copy
import json
import subprocess

import jsonschema
import pytest
import yaml

from genai_common.metadata import SESSION_ID_HEADER
from genai_service.server.metrics import VLLM_NAMES
from tests.conftest import require_tool
from tests.k8s_crds import validate_custom
from tests.service.test_k8s import (
    K8S,
    container,
    deployment,
    kvstore_args,
    named_port,
    one,
    pod_labels,
    pod_spec,
    rendered,
    selects,
    server,
    server_args,
)


def test_session_affinity_hashes_on_the_header_the_clients_send() -> None:
    objects = rendered("session-affinity")
    rule = one(objects, "DestinationRule", "genai-grpc")
    service = one(objects, "Service", "genai-grpc")
    assert rule["spec"]["host"] == service["metadata"]["name"]
    consistent = rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]
    assert consistent["httpHeaderName"] == SESSION_ID_HEADER
    assert "maglev" in consistent
    # Istio balances per request only on ports it knows to be gRPC.
    (port,) = service["spec"]["ports"]
    assert port["appProtocol"] == "grpc" and port["name"].startswith("grpc")
    # The overlay adds the rule and changes nothing of the base.
    base = rendered("base")
    assert [o for o in objects if o["kind"] != "DestinationRule"] == base


def test_crd_validation_is_strict() -> None:
    rule = one(rendered("session-affinity"), "DestinationRule", "genai-grpc")
    typo = copy.deepcopy(rule)
    hashing = typo["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]
    hashing["httpHeaderNam"] = hashing.pop("httpHeaderName")
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(typo)
    pool = one(rendered("inference-pool"), "InferencePool", "genai-grpc")
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(bad)


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def test_inference_pool_selects_the_servers_http_port() -> None:
    objects = rendered("inference-pool")
    pool = one(objects, "InferencePool", "genai-grpc")
    dep = deployment(objects)
    epp = one(objects, "Deployment", "genai-grpc-epp")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(dep))
    assert not selects(selector, pod_labels(epp))
    c = server(objects)
    http_port = server_args(c).http_port
    (target,) = pool["spec"]["targetPorts"]
    assert target["number"] == http_port == named_port(c, "http")
    # gRPC stays where the base has it.
    assert server_args(c).port == named_port(c, "grpc")


def test_endpoint_picker_reads_this_servers_metrics() -> None:
    objects = rendered("inference-pool")
    pool = one(objects, "InferencePool", "genai-grpc")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", ref["name"])
    epp = one(objects, "Deployment", "genai-grpc-epp")
    assert selects(service["spec"]["selector"], pod_labels(epp))
    (port,) = service["spec"]["ports"]
    assert port["port"] == ref["port"]["number"]
    c = container(pod_spec(epp), "epp")
    assert named_port(c, port["targetPort"]) == port["port"]
    flags = _flags(c["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert int(flags["grpc-port"]) == port["port"]
    # The scorers read the gauges genai-server exports (docs/design.md, "Routing signals").
    metrics = {
        flags["total-queued-requests-metric"],
        flags["total-running-requests-metric"],
        flags["kv-cache-usage-percentage-metric"],
    }
    assert metrics == {
        "genai_num_requests_waiting",
        "genai_num_requests_running",
        "genai_kv_cache_usage_perc",
    }
    assert metrics <= set(VLLM_NAMES)
    # Its configuration file is the ConfigMap's, and every scorer it uses is declared.
    config_map = one(objects, "ConfigMap", "genai-grpc-epp")
    mount = next(m for m in c["volumeMounts"] if flags["config-file"].startswith(m["mountPath"]))
    volume = next(v for v in pod_spec(epp)["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    key = flags["config-file"][len(mount["mountPath"]) :].lstrip("/")
    config = yaml.safe_load(config_map["data"][key])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} <= declared
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= declared
    # It may watch the pool and the pods, in its namespace only, and nothing more.
    role = one(objects, "Role", "genai-grpc-epp")
    binding = one(objects, "RoleBinding", "genai-grpc-epp")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject["name"] == pod_spec(epp)["serviceAccountName"]
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"pods", "inferencepools"} <= resources


def test_redis_tier_overlay_gives_the_sidecar_its_shared_tier() -> None:
    from kvstore.__main__ import config_from_args
    from kvstore.redis_tier import REDIS_PASSWORD_ENV, REDIS_URL_ENV

    objects = rendered("redis-tier")
    kv = container(pod_spec(deployment(objects)), "genai-kvstore")
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in kv["env"] if "valueFrom" in e}
    assert env[REDIS_URL_ENV]["name"] == "genai-grpc-redis" and not env[REDIS_URL_ENV].get(
        "optional"
    )
    assert env[REDIS_PASSWORD_ENV]["optional"] is True
    args = kvstore_args(kv)
    environ = {"GENAI_KVSTORE_AUTH_TOKEN": "t", REDIS_URL_ENV: "redis+cluster://redis:6379"}
    config = config_from_args(args, environ)
    assert config.redis is not None and config.redis.url.startswith("redis+cluster://")
    # Nothing else in the pod differs from the base.
    base = rendered("base")
    base_kv = container(pod_spec(deployment(base)), "genai-kvstore")
    assert [e for e in kv["env"] if e["name"] not in env or "REDIS" not in e["name"]] == (
        base_kv["env"]
    )
    assert [o for o in objects if o["kind"] != "Deployment"] == [
        o for o in base if o["kind"] != "Deployment"
    ]


VALIDATE = K8S / "validate"


def _validate_with_crd_schemas(objects: list[dict]) -> subprocess.CompletedProcess[str]:
    """k8s/validate/validate.mjs: the schemas @kubernetes-models generates from
    Istio's own CRDs (types, enums, one-of rules; not strict about unknown
    fields, which tests/k8s_crds.py is)."""
    require_tool("node")
    require_tool("npm")
    if not (VALIDATE / "node_modules").is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--silent"],
            cwd=VALIDATE,
            check=True,
            timeout=300,
        )
    return subprocess.run(
        ["node", "validate.mjs"],
        cwd=VALIDATE,
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_destination_rule_validates_against_istios_crd_schema() -> None:
    rule = one(rendered("session-affinity"), "DestinationRule", "genai-grpc")
    result = _validate_with_crd_schemas([rule])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok DestinationRule/genai-grpc"
    bad = copy.deepcopy(rule)
    bad["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["useSourceIp"] = True
    result = _validate_with_crd_schemas([bad])  # two hash keys: the CRD's one-of rule
    assert result.returncode == 1 and "invalid DestinationRule" in result.stdout
