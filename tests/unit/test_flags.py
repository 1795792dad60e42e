"""Every flag of genai-server and genai-kvstore against the config field it sets
(genai_common/flags.py): name, default, type and choices come from the field,
and a config field is either on the command line or listed here as one that
deliberately is not, so a new field cannot be forgotten."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from genai_common import flags
from genai_service import __main__ as server_main
from genai_service import config
from kvstore import __main__ as kvstore_main
from kvstore.redis_tier import RedisConfig
from kvstore.server import KvStoreConfig

# (config class, flag prefix) of each parser.
SERVER_PARTS = [
    (config.ServerConfig, ""),
    (config.EngineConfig, ""),
    (config.RunnerConfig, ""),
    (config.SchedulerConfig, ""),
    (config.CacheConfig, ""),
    (config.LimitsConfig, ""),
    (config.SpeculationConfig, ""),
    (config.SessionConfig, ""),
    (config.ContextConfig, ""),
    (config.KvStoreConfig, server_main.KVSTORE_PREFIX),
]
KVSTORE_PARTS = [(KvStoreConfig, ""), (RedisConfig, kvstore_main.REDIS_PREFIX)]

# Fields no flag sets, and why.
NOT_FLAGS = {
    # Nested configs, built from their own flags.
    "ServerConfig.engine",
    "EngineConfig.runner",
    "EngineConfig.scheduler",
    "EngineConfig.cache",
    "EngineConfig.sessions",
    "EngineConfig.limits",
    "EngineConfig.speculation",
    "EngineConfig.context",
    "EngineConfig.kvstore",
    "KvStoreConfig.redis",
    # Read from files or the environment by __main__ (--model, --auth-token-file,
    # --kvstore, --kvstore-auth-token-file, --kv-integrity-key-file, --auth-token,
    # --redis, --redis-password-file), or the logging group both servers share.
    "EngineConfig.model_dir",
    "ServerConfig.auth_tokens",
    "ServerConfig.served_model_names",  # --served-model-name, repeatable
    "ServerConfig.log_format",
    "KvStoreConfig.target",
    "KvStoreConfig.auth_token",
    "KvStoreConfig.integrity_key",
    "RedisConfig.url",
    "RedisConfig.password",
    # Tuning that tests and embedders set, not operators.
    "ServerConfig.max_message_bytes",
    "ServerConfig.max_input_chars",
    "ServerConfig.engine_start_timeout_s",
    "KvStoreConfig.record_wait_s",
    "RunnerConfig.shared_thread_pool",  # the engine process sets it beside a draft model
    "SpeculationConfig.ngram_max",
    "SpeculationConfig.ngram_min",
    "LimitsConfig.max_stop_sequences",
    "LimitsConfig.max_stop_sequence_chars",
    "LimitsConfig.max_stop_token_ids",
    "LimitsConfig.max_top_logprobs",
    "LimitsConfig.max_time_limit_ms",
    "LimitsConfig.max_cache_salt_chars",
    "LimitsConfig.max_bad_words",
    "RedisConfig.max_connections",
}
# Flags that set no single field (the NOT_FLAGS fields above they feed).
SERVER_OTHER = {
    "model",
    "served_model_name",
    "log_format",
    "auth_token_file",
    "kvstore",
    "kvstore_auth_token_file",
    "kv_integrity_key_file",
}
KVSTORE_OTHER = {"auth_token_file", "auth_token", "redis", "redis_password_file"} | {
    "log_format",
    "log_level",
}


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def check(parser: argparse.ArgumentParser, parts: list[tuple[type, str]], other: set[str]) -> None:
    by_dest = actions(parser)
    flagged = set()
    for cls, prefix in parts:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f"{cls.__name__}.{f.name}"
            spec = f.metadata.get("flag")
            if spec is None:
                assert name in NOT_FLAGS, f"{name} has no flag: declare one or list it in NOT_FLAGS"
                continue
            assert name not in NOT_FLAGS, name
            dest = flags.dest(f, spec, prefix)
            action = by_dest.get(dest)
            assert action is not None, f"{name}: no flag {flags.option(f, spec, prefix)}"
            flagged.add(dest)
            assert action.option_strings[0] == flags.option(f, spec, prefix), name
            assert action.default == flags.default_of(f), name
            kind = flags.value_type(hints[f.name])
            if kind is bool:
                assert isinstance(action, argparse._StoreTrueAction), name
            else:
                assert action.type is (spec.parse or kind), name
                assert action.choices == spec.choices, name
    assert set(by_dest) - flagged == other


def test_every_genai_server_flag_is_its_config_field() -> None:
    check(server_main.build_parser(), SERVER_PARTS, SERVER_OTHER)


def test_every_genai_kvstore_flag_is_its_config_field() -> None:
    check(kvstore_main.build_parser(), KVSTORE_PARTS, KVSTORE_OTHER)


def test_both_servers_declare_tls_and_logging_the_same_way() -> None:
    server, kvstore = actions(server_main.build_parser()), actions(kvstore_main.build_parser())
    for dest in (*flags.TLS_FIELDS, "log_format", "auth_token_file"):
        a, b = server[dest], kvstore[dest]
        assert (a.option_strings, a.metavar, a.choices) == (b.option_strings, b.metavar, b.choices)


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
def test_older_spellings_stay_aliases(old: str, dest: str) -> None:
    args = server_main.build_parser().parse_args(["--model", "m", old, "7"])
    assert str(getattr(args, dest)) in ("7", "7.0")


def test_the_defaults_build_the_default_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENAI_AUTH_TOKEN", raising=False)
    parser = server_main.build_parser()
    server = server_main.config_from_args(parser.parse_args(["--model", "m"]))
    assert server == config.ServerConfig(engine=config.EngineConfig(model_dir="m"))
    args = parser.parse_args(["--model", "m", "--kvstore", "h:1", "--kvstore-insecure"])
    kv = server_main.config_from_args(args).engine.kvstore
    assert kv is not None
    assert kv == config.KvStoreConfig("h:1", insecure=True, integrity_key=kv.integrity_key)
    store = kvstore_main.build_parser()
    assert kvstore_main.config_from_args(store.parse_args(["--insecure"]), {}) == KvStoreConfig(
        insecure=True
    )
    assert store.parse_args(["--tls-cert", "c"]).tls_cert_file == "c"


def test_served_model_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENAI_AUTH_TOKEN", raising=False)
    parser = server_main.build_parser()

    def names(*argv: str) -> tuple[str, ...]:
        return server_main.config_from_args(parser.parse_args(argv)).served_model_names

    assert names("--model", "m") == ()  # the gateway's default: "default" and the model id
    assert names("--model", "m", "--served-model-name", "a", "--served-model-name", "b") == (
        "a",
        "b",
    )
    cache = "/cache/genai-grpc/0123-int8-v3"
    monkeypatch.setattr(
        "genai_service.convert.default_model.resolve_model", lambda name: Path(cache)
    )
    assert names("--model", "gemma3-270m") == ("default", "gemma3-270m", "0123-int8-v3")
    assert names("--model", "default") == ()


def test_byte_counts_and_the_redis_prefix() -> None:
    args = kvstore_main.build_parser().parse_args(
        ["--memory-bytes", "512MiB", "--redis-split-bytes", "8KiB", "--redis-ttl-s", "7"]
    )
    values = flags.flag_values(args, RedisConfig, kvstore_main.REDIS_PREFIX)
    assert args.memory_bytes == 512 << 20
    assert values["split_bytes"] == 8192 and values["ttl_s"] == 7
    with pytest.raises(SystemExit):
        kvstore_main.build_parser().parse_args(["--memory-bytes", "lots"])
