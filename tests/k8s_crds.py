"""Schemas of the custom resources that k8s/overlays use, for tests/service/test_k8s.py.

kubernetes-validate knows only the built-in kinds, so the OpenAPI schemas of
these CRDs are restated here as JSON Schema from the published CRDs (field
names, types, enums, bounds, required fields): the Istio
``networking.istio.io/v1`` DestinationRule (1.22+) and the Gateway API
Inference Extension's ``inference.networking.k8s.io/v1`` InferencePool (v1.0).
Every object level restated is closed (``additionalProperties: false``, as the
API server prunes or, with field validation Strict, rejects unknown fields): a
typo in a field name fails. Sub-trees the overlays do not use are accepted by
name only. The DestinationRule is also validated against the schema that
``@kubernetes-models/istio`` (npm) generates from Istio's own CRDs
(k8s/validate/, tests/service/test_k8s_routing.py), which checks types and
one-of rules but not unknown fields; no registry CI reaches ships the
InferencePool's.
"""

from __future__ import annotations

from typing import Any

import jsonschema

Schema = dict[str, Any]

ANY: Schema = {}  # a field of the CRD the overlays do not use: accepted by name
DURATION: Schema = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms|us|ns))+$"}
UINT32: Schema = {"type": "integer", "minimum": 0, "maximum": 4294967295}
INT32: Schema = {"type": "integer", "minimum": -2147483648, "maximum": 2147483647}
PORT_NUMBER: Schema = {"type": "integer", "minimum": 1, "maximum": 65535}
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE: Schema = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}


def closed(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": closed(
                {
                    "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
                    "namespace": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": LABEL_VALUE},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                },
                required=("name",),
            ),
            "spec": spec,
        },
        required=("apiVersion", "kind", "metadata", "spec"),
    )


# --- Istio DestinationRule (networking.istio.io/v1) ------------------------------

_CONSISTENT_HASH = closed(
    {
        "httpHeaderName": {"type": "string"},
        "httpCookie": closed(
            {"name": {"type": "string"}, "path": {"type": "string"}, "ttl": DURATION},
            required=("name",),
        ),
        "useSourceIp": {"type": "boolean"},
        "httpQueryParameterName": {"type": "string"},
        "ringHash": closed({"minimumRingSize": {"type": "integer", "minimum": 0}}),
        "maglev": closed({"tableSize": {"type": "integer", "minimum": 0}}),
        "minimumRingSize": {"type": "integer", "minimum": 0},
    }
)
# Exactly one hash key and at most one of ringHash/maglev (the CRD's oneOf rules).
_CONSISTENT_HASH["allOf"] = [
    {
        "oneOf": [
            {"required": [key]}
            for key in ("httpHeaderName", "httpCookie", "useSourceIp", "httpQueryParameterName")
        ]
    },
    {"not": {"required": ["ringHash", "maglev"]}},
]

_LOAD_BALANCER = closed(
    {
        "simple": {
            "enum": [
                "UNSPECIFIED",
                "RANDOM",
                "PASSTHROUGH",
                "ROUND_ROBIN",
                "LEAST_REQUEST",
                "LEAST_CONN",
            ]
        },
        "consistentHash": _CONSISTENT_HASH,
        "localityLbSetting": ANY,
        "warmupDurationSecs": DURATION,
        "warmup": ANY,
    }
)
_LOAD_BALANCER["not"] = {"required": ["simple", "consistentHash"]}

_CONNECTION_POOL = closed(
    {
        "tcp": ANY,
        "http": closed(
            {
                "http1MaxPendingRequests": INT32,
                "http2MaxRequests": INT32,
                "maxRequestsPerConnection": INT32,
                "maxRetries": INT32,
                "idleTimeout": DURATION,
                "h2UpgradePolicy": {"enum": ["DEFAULT", "DO_NOT_UPGRADE", "UPGRADE"]},
                "useClientProtocol": {"type": "boolean"},
                "maxConcurrentStreams": INT32,
            }
        ),
    }
)

_OUTLIER_DETECTION = closed(
    {
        "splitExternalLocalOriginErrors": {"type": "boolean"},
        "consecutiveLocalOriginFailures": UINT32,
        "consecutiveGatewayErrors": UINT32,
        "consecutive5xxErrors": UINT32,
        "interval": DURATION,
        "baseEjectionTime": DURATION,
        "maxEjectionPercent": INT32,
        "minHealthPercent": INT32,
        "consecutiveErrors": INT32,
    }
)

_TRAFFIC_POLICY = closed(
    {
        "loadBalancer": _LOAD_BALANCER,
        "connectionPool": _CONNECTION_POOL,
        "outlierDetection": _OUTLIER_DETECTION,
        "tls": ANY,
        "portLevelSettings": ANY,
        "tunnel": ANY,
        "proxyProtocol": ANY,
    }
)

DESTINATION_RULE = resource(
    "networking.istio.io/v1",
    "DestinationRule",
    closed(
        {
            "host": {"type": "string", "minLength": 1},
            "trafficPolicy": _TRAFFIC_POLICY,
            "subsets": ANY,
            "exportTo": {"type": "array", "items": {"type": "string"}},
            "workloadSelector": ANY,
        },
        required=("host",),
    ),
)

# --- Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1)

INFERENCE_POOL = resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    closed(
        {
            "selector": closed(
                {
                    "matchLabels": {
                        "type": "object",
                        "additionalProperties": LABEL_VALUE,
                        "minProperties": 1,
                        "maxProperties": 64,
                    }
                },
                required=("matchLabels",),
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": closed({"number": PORT_NUMBER}, required=("number",)),
            },
            "endpointPickerRef": closed(
                {
                    "group": {
                        "type": "string",
                        "maxLength": 253,
                        "pattern": r"^$|" + DNS_SUBDOMAIN[1:],
                    },
                    "kind": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": 63,
                        "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                    },
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": closed({"number": PORT_NUMBER}, required=("number",)),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                required=("name",),
            ),
        },
        required=("selector", "targetPorts", "endpointPickerRef"),
    ),
)

SCHEMAS = {
    ("networking.istio.io/v1", "DestinationRule"): DESTINATION_RULE,
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
}


def is_custom(obj: dict[str, Any]) -> bool:
    return (obj["apiVersion"], obj["kind"]) in SCHEMAS


def validate_custom(obj: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``obj`` is valid for its CRD."""
    jsonschema.validate(obj, SCHEMAS[(obj["apiVersion"], obj["kind"])])
