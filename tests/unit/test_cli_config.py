"""The entry points' flags: named after the config fields they set, defaults from the dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from genai_service import __main__ as server_main
from genai_service.config import (
    CacheConfig,
    EngineConfig,
    KvStoreConfig,
    LimitsConfig,
    RunnerConfig,
    SchedulerConfig,
    ServerConfig,
    SessionConfig,
    SpeculationConfig,
)
from kvstore import __main__ as kvstore_main
from kvstore.redis_tier import RedisConfig
from kvstore.server import KvStoreConfig as KvStoreServerConfig

# Flags that set no single field (files read into one, the model, the target).
SERVER_NON_FIELD_FLAGS = {
    "model",
    "auth_token_file",
    "kvstore",
    "kvstore_auth_token_file",
    "kv_integrity_key_file",
}
# Names kept from the public contract (docs/design.md, "Public API names").
SERVER_RENAMED = {
    "kv_chunk_size": (CacheConfig, "chunk_size"),
    "speculate": (SpeculationConfig, "num_tokens"),
    "speculate_max_batch": (SpeculationConfig, "max_batch"),
}
SERVER_CONFIGS = (
    ServerConfig,
    EngineConfig,
    RunnerConfig,
    SchedulerConfig,
    CacheConfig,
    SessionConfig,
    LimitsConfig,
)


def _field_default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    assert f.default is not dataclasses.MISSING, f"{cls.__name__}.{name} has no plain default"
    return f.default


def _plain_fields(cls: type) -> set[str]:
    """Fields that are values, not nested configs (those have a default_factory)."""
    return {f.name for f in dataclasses.fields(cls) if f.default_factory is dataclasses.MISSING}


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _server_field(dest: str) -> tuple[type, str]:
    if dest in SERVER_RENAMED:
        return SERVER_RENAMED[dest]
    if dest.startswith("kvstore_"):
        return KvStoreConfig, dest.removeprefix("kvstore_")
    owners = [cls for cls in SERVER_CONFIGS if dest in _plain_fields(cls)]
    assert len(owners) == 1, f"--{dest.replace('_', '-')} names no single config field: {owners}"
    return owners[0], dest


def test_every_server_flag_is_named_after_its_field_and_defaults_to_it() -> None:
    for action in _flags(server_main.build_parser()):
        if action.dest in SERVER_NON_FIELD_FLAGS:
            continue
        cls, name = _server_field(action.dest)
        assert action.default == _field_default(cls, name), (action.dest, cls.__name__)
        if action.dest not in SERVER_RENAMED:
            assert "--" + action.dest.replace("_", "-") == action.option_strings[0]


def test_server_defaults_build_the_default_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENAI_AUTH_TOKEN", raising=False)
    parser = server_main.build_parser()
    config = server_main.config_from_args(parser.parse_args(["--model", "m"]))
    assert config == ServerConfig(engine=EngineConfig(model_dir="m"))
    args = parser.parse_args(["--model", "m", "--kvstore", "h:1", "--kvstore-insecure"])
    kv = server_main.config_from_args(args).engine.kvstore
    assert kv is not None
    assert kv == KvStoreConfig("h:1", insecure=True, integrity_key=kv.integrity_key)


@pytest.mark.parametrize(
    ("old", "dest"),
    [
        ("--session-kv-bytes", "max_parked_kv_bytes"),
        ("--session-ttl", "idle_ttl_s"),
        ("--session-metadata-entries", "max_metadata_entries"),
        ("--session-max-record-fetches", "max_record_fetches"),
        ("--threads", "intra_op_threads"),
        ("--max-batched-tokens", "max_num_batched_tokens"),
        ("--grace-period", "grace_period_s"),
        ("--kvstore-timeout", "kvstore_timeout_s"),
        ("--tls-cert", "tls_cert_file"),
        ("--kvstore-tls-ca", "kvstore_tls_ca_file"),
    ],
)
def test_older_server_flag_names_still_work(old: str, dest: str) -> None:
    args = server_main.build_parser().parse_args(["--model", "m", old, "7"])
    assert str(getattr(args, dest)) in ("7", "7.0")


def test_every_kvstore_flag_is_named_after_its_field_and_defaults_to_it() -> None:
    parser = kvstore_main.build_parser()
    fields = {f.name for f in dataclasses.fields(KvStoreServerConfig)}
    for action in _flags(parser):
        if action.dest in ("auth_token_file", "log_format", "log_level", "redis_password_file"):
            continue
        if action.dest == "redis":  # the url of the RedisConfig in KvStoreConfig.redis
            continue
        if action.dest.startswith("redis_"):  # --redis-X sets RedisConfig.X
            name = action.dest.removeprefix("redis_")
            assert name in {f.name for f in dataclasses.fields(RedisConfig)}, action.dest
            assert "--" + action.dest.replace("_", "-") == action.option_strings[0]
            assert action.default == _field_default(RedisConfig, name)
            continue
        assert action.dest in fields, action.dest
        assert "--" + action.dest.replace("_", "-") == action.option_strings[0]
        if action.dest not in ("auth_token", "insecure"):
            assert action.default == _field_default(KvStoreServerConfig, action.dest)
    config = kvstore_main.config_from_args(parser.parse_args(["--insecure"]), {})
    assert config == KvStoreServerConfig(insecure=True)
    assert parser.parse_args(["--tls-cert", "c"]).tls_cert_file == "c"
