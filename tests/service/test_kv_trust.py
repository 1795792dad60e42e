"""Trust boundaries of reused KV: forged chunks and session records, integrity
secrets shared (or not) between replicas, prefix-sharing scope and cache_salt."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from genai_common.errors import NotFound, PermissionDenied
from genai_service.config import CacheConfig, EngineConfig, KvStoreConfig, ServerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_codec import pack_kv
from genai_service.engine.kv.kv_integrity import TAG_BYTES, KvIntegrity
from genai_service.engine.kv.prefix_cache import chunk_keys
from genai_service.engine.sessions.sessions import Session, session_record
from kvstore.client import KvStoreClient
from tests.kvstore_harness import DATA_PLANE_TOKEN, KvStoreProcess
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import encode_words, reference_greedy

pytestmark = pytest.mark.e2e

CHUNK = 4
PROMPT = encode_words(
    "the cat sat on the mat and the dog sat in the box under a tree with a red hat ?"
)


def reusable(n: int) -> int:
    """Prompt tokens of n that reuse can cover: complete chunks, never the last token."""
    return min(n // CHUNK * CHUNK, n - 1)


REUSABLE = reusable(len(PROMPT))
SECRET_A = b"replica-group-a-integrity-secret-0123456789"
SECRET_B = b"replica-group-b-integrity-secret-0123456789"


@pytest.fixture(scope="module")
def kvstore() -> Iterator[KvStoreProcess]:
    kv = KvStoreProcess("--log-format", "console").start()
    yield kv
    kv.stop()


def engine(
    model_dir: Path, target: str | None = None, secret: bytes = SECRET_A, scope: str = "global"
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            cache=CacheConfig(chunk_size=CHUNK, prefix_cache_scope=scope),
            kvstore=(
                KvStoreConfig(target, auth_token=DATA_PLANE_TOKEN, integrity_key=secret)
                if target
                else None
            ),
        )
    )


def greedy(rid: str, ids: list[int], n: int = 6, **kw) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True), **kw
    )


def public_chunk_keys(eng: LLMEngine, ids: list[int]) -> list[bytes]:
    """The keys an outsider computes from the public model alone (the recipe of
    key format v1: fingerprint, dtype, layout, chunk size; no secret)."""
    kv = eng.spec.kv
    layout = f"L{kv.num_layers}.H{kv.num_kv_heads}.D{kv.head_dim}.hnd"
    fields = ("genai-kv", eng.spec.fingerprint, kv.dtype, layout, str(CHUNK), "v1")
    return chunk_keys("|".join(fields).encode(), ids, CHUNK)


def forged_chunk(eng: LLMEngine, seed: int) -> bytes:
    """A well-formed KV chunk of random values: its own checksum is valid."""
    kv = eng.spec.kv
    rng = np.random.default_rng(seed)
    shape = (kv.num_kv_heads, CHUNK, kv.head_dim)
    layers = [
        (rng.standard_normal(shape) * 5, rng.standard_normal(shape) * 5)
        for _ in range(kv.num_layers)
    ]
    return pack_kv(layers, kv.dtype)


def test_forged_chunks_are_never_reused(tiny_model_dir: Path, kvstore: KvStoreProcess) -> None:
    """The poisoning reproduction: a writer without the integrity key stores
    valid-looking blobs under the victim's chunk keys, both the ones computable
    from the public model and the real ones (as if it had learnt them); the
    victim's first request on a fresh server reuses none of it."""
    cold = reference_greedy(tiny_model_dir, PROMPT, 6)
    victim = engine(tiny_model_dir, kvstore.target, secret=b"victim-" + SECRET_A)
    real = chunk_keys(victim.namespace, PROMPT, CHUNK)
    forger = KvIntegrity.generate()  # a MAC under the wrong secret looks like a sealed blob
    # A writer holding the data-plane token (an insider, or a leaked token) but
    # not the integrity secret, using the public data-plane client.
    with KvStoreClient(kvstore.target, auth_token=DATA_PLANE_TOKEN) as raw:
        for i, key in enumerate(public_chunk_keys(victim, PROMPT)):
            raw.put(key, forged_chunk(victim, i), replace=True)
        for i, key in enumerate(real):
            blob = forged_chunk(victim, 100 + i)
            raw.put(key, forger.seal(key, blob) if i % 2 else blob, replace=True)
    result = victim.generate(greedy("victim", PROMPT))
    assert list(result.token_ids) == cold
    assert result.usage.cached_tokens == 0
    assert victim.stats()["kvstore_mac_failures"] >= 1  # the real keys' forgeries, refused
    victim.close()  # its pushes have gone out


def test_a_forged_chunk_is_replaced_by_the_next_push(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    """A forgery under a real key costs one recompute, not a miss forever: the
    chunk that failed its check is pushed again with replace (a plain push
    skips a key the store already holds)."""
    secret = b"healing-" + SECRET_A
    cold = reference_greedy(tiny_model_dir, PROMPT, 6)
    first = engine(tiny_model_dir, kvstore.target, secret=secret)
    (key, *_) = chunk_keys(first.namespace, PROMPT, CHUNK)
    with KvStoreClient(kvstore.target, auth_token=DATA_PLANE_TOKEN) as raw:
        raw.put(key, KvIntegrity.generate().seal(key, forged_chunk(first, 7)), replace=True)
    r1 = first.generate(greedy("first", PROMPT))
    assert list(r1.token_ids) == cold and r1.usage.cached_tokens == 0
    assert first.stats()["kvstore_mac_failures"] == 1
    first.close()

    second = engine(tiny_model_dir, kvstore.target, secret=secret)  # empty memory
    r2 = second.generate(greedy("second", PROMPT))
    assert list(r2.token_ids) == cold
    assert r2.usage.cached_tokens == REUSABLE  # the genuine chunks, from the store
    assert second.stats()["kvstore_mac_failures"] == 0
    second.close()


def test_a_forged_chain_heals_in_one_recompute(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    """Every chunk of a prompt forged under its real key (issue 31: each later
    process used to replace only the first chunk that failed, so N forged
    chunks cost N recomputes in N processes): the first engine's pushes replace
    the whole run, and the next engine reuses all of it."""
    secret = b"chain-heal-" + SECRET_A
    prompt = PROMPT * 4  # 20 chunks of 4 tokens
    cold = reference_greedy(tiny_model_dir, prompt, 6)
    first = engine(tiny_model_dir, kvstore.target, secret=secret)
    keys = chunk_keys(first.namespace, prompt, CHUNK)
    assert len(keys) >= 16  # the 16 forged chunks, and more
    forger = KvIntegrity.generate()
    with KvStoreClient(kvstore.target, auth_token=DATA_PLANE_TOKEN) as raw:
        for i, key in enumerate(keys):
            raw.put(key, forger.seal(key, forged_chunk(first, 50 + i)), replace=True)
    r1 = first.generate(greedy("first", prompt))
    assert list(r1.token_ids) == cold and r1.usage.cached_tokens == 0
    assert first.stats()["kvstore_mac_failures"] == 1  # the chain stops at its first
    first.close()  # its pushes have gone out

    second = engine(tiny_model_dir, kvstore.target, secret=secret)
    r2 = second.generate(greedy("second", prompt))
    assert list(r2.token_ids) == cold
    assert r2.usage.cached_tokens == reusable(len(prompt))
    assert second.stats()["kvstore_mac_failures"] == 0
    second.close()


def test_a_rewritten_session_record_is_not_a_takeover(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    """bob rewrites the owner of alice's session record (re-sealed under another
    secret, Put with replace) at its public key and at its real one; after a
    restart the session is NOT_FOUND for him, never his."""
    a = engine(tiny_model_dir, kvstore.target)
    sid = a.wait(a.create_session(owner="alice")).session_id
    a.generate(
        greedy("t1", encode_words("hello , who are you ?"), session_id=sid, principal="alice")
    )
    assert a.remote is not None and a.remote.flush(10)
    with pytest.raises(PermissionDenied):
        a.get_session(sid, "bob")
    real = a.session_calls.record_key(sid)
    forger = KvIntegrity.generate()
    with KvStoreClient(kvstore.target, auth_token=DATA_PLANE_TOKEN) as raw:
        public = b"session:" + sid.encode()
        raw.put(public, session_record(Session(sid, 0.0, 0.0, 900.0, "bob")), replace=True)
        sealed = raw.get(real)
        assert sealed is not None
        record = json.loads(sealed[:-TAG_BYTES])
        assert record["owner"] == "alice"
        record["owner"] = "bob"
        raw.put(real, forger.seal(real, json.dumps(record).encode()), replace=True)
    a.close()

    restarted = engine(tiny_model_dir, kvstore.target)  # same secret, empty memory
    with pytest.raises((NotFound, PermissionDenied)):
        restarted.wait(restarted.get_session(sid, "bob"))
    # A turn for a session not in memory waits for its record off the engine
    # loop; its only output is then the refusal.
    restarted.add_request(greedy("hijack", [1, 2, 3], session_id=sid, principal="bob"))
    outs: list = []
    for _ in range(10_000):
        outs += [o for o in restarted.step() if o.request_id == "hijack"]
        if outs:
            break
        time.sleep(0.001)
    assert len(outs) == 1 and outs[0].finished
    assert isinstance(outs[0].error, (NotFound, PermissionDenied))
    assert restarted.stats()["kvstore_mac_failures"] >= 1
    restarted.close()


def test_replicas_share_kv_and_sessions_only_under_one_secret(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    prompt = encode_words("a red hat on the big dog in the old house by the small tree .")
    cold = reference_greedy(tiny_model_dir, prompt, 6)
    a = engine(tiny_model_dir, kvstore.target, SECRET_A)
    assert list(a.generate(greedy("a", prompt)).token_ids) == cold
    sid = a.wait(a.create_session()).session_id
    t1 = a.generate(greedy("a1", encode_words("hello , who are you ?"), session_id=sid))
    assert a.remote is not None and a.remote.flush(10)

    # Another secret: neither A's chunks nor its session; its own writes leave A's alone.
    b = engine(tiny_model_dir, kvstore.target, SECRET_B)
    rb = b.generate(greedy("b", prompt))
    assert list(rb.token_ids) == cold and rb.usage.cached_tokens == 0
    with pytest.raises(NotFound):
        b.wait(b.get_session(sid))
    assert b.remote is not None and b.remote.flush(10)
    assert b.stats()["kvstore_mac_failures"] == 0  # its keys are its own: nothing to refuse
    b.close()

    # The same secret: a fresh replica reuses A's chunks and continues A's session.
    c = engine(tiny_model_dir, kvstore.target, SECRET_A)
    rc = c.generate(greedy("c", prompt))
    assert list(rc.token_ids) == cold and rc.usage.cached_tokens == reusable(len(prompt))
    t2 = c.generate(greedy("c2", encode_words("what is my name ?"), session_id=sid))
    assert t2.session_tokens == t1.session_tokens + len(encode_words("what is my name ?")) + 6
    assert t2.usage.cached_tokens > 0
    a.close()
    c.close()


def test_cache_salt_scopes_reuse(tiny_model_dir: Path) -> None:
    cold = reference_greedy(tiny_model_dir, PROMPT, 6)
    eng = engine(tiny_model_dir)
    runs = [
        ("first", "team-a", 0),
        ("other salt", "team-b", 0),
        ("no salt", None, 0),
        ("same salt", "team-a", REUSABLE),
        ("no salt again", None, REUSABLE),
    ]
    for rid, salt, cached in runs:
        result = eng.generate(greedy(rid, PROMPT, cache_salt=salt))
        assert list(result.token_ids) == cold, rid
        assert result.usage.cached_tokens == cached, rid


@pytest.mark.parametrize(("scope", "bob_cached"), [("principal", 0), ("global", REUSABLE)])
def test_prefix_cache_scope(tiny_model_dir: Path, scope: str, bob_cached: int) -> None:
    cold = reference_greedy(tiny_model_dir, PROMPT, 6)
    eng = engine(tiny_model_dir, scope=scope)
    for rid, principal, cached in (
        ("alice", "alice", 0),
        ("bob", "bob", bob_cached),
        ("alice again", "alice", REUSABLE),
    ):
        result = eng.generate(greedy(rid, PROMPT, principal=principal))
        assert list(result.token_ids) == cold, rid
        assert result.usage.cached_tokens == cached, rid


def test_a_session_turn_uses_its_owners_scope(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir, scope="principal")
    sid = eng.wait(eng.create_session(owner="alice")).session_id
    t1 = eng.generate(greedy("t1", PROMPT, session_id=sid, principal="alice"))
    history = PROMPT + list(t1.token_ids)
    later = encode_words("and then ?")
    mine = eng.generate(greedy("alice", history + later, principal="alice"))
    theirs = eng.generate(greedy("bob", history + later, principal="bob"))
    assert mine.usage.cached_tokens == len(history) // CHUNK * CHUNK
    assert theirs.usage.cached_tokens == 0


# -- through the server ----------------------------------------------------------


def test_cache_salt_and_principal_scope_over_rpc(tiny_model_dir: Path) -> None:
    from genai_client import Client, InvalidArgumentError

    config = ServerConfig(
        engine=EngineConfig(
            model_dir=str(tiny_model_dir),
            cache=CacheConfig(chunk_size=CHUNK, prefix_cache_scope="principal"),
        ),
        port=free_port(),
        auth_tokens=(("alice-token", "alice"), ("bob-token", "bob")),
    )
    srv = ServerThread(config).start()
    try:
        with (
            Client(srv.target, token="alice-token") as alice,
            Client(srv.target, token="bob-token") as bob,
        ):

            def cached(client: Client, **kw: object) -> int:
                r = client.generate(token_ids=PROMPT, max_new_tokens=3, ignore_eos=True, **kw)
                return r.usage.cached_tokens

            assert cached(alice, cache_salt="s1") == 0
            assert cached(alice, cache_salt="s2") == 0
            assert cached(alice, cache_salt="s1") == REUSABLE
            assert cached(bob, cache_salt="s1") == 0  # another principal, same salt
            assert cached(alice) == 0 and cached(alice) == REUSABLE
            with pytest.raises(InvalidArgumentError, match="cache_salt: 257 characters"):
                cached(alice, cache_salt="x" * 257)
            with pytest.raises(InvalidArgumentError, match="cache_salt: 0 characters"):
                cached(alice, cache_salt="")
    finally:
        srv.stop()


# -- genai-server flags ------------------------------------------------------------


def _config(tmp_path: Path, *flags: str) -> ServerConfig:
    from genai_service.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--model", str(tmp_path), *flags])
    return config_from_args(args)


def test_integrity_key_file(tmp_path: Path) -> None:
    key = tmp_path / "kv.key"
    key.write_text("\n  " + "k" * 40 + "  \n")
    config = _config(
        tmp_path,
        "--kvstore",
        "127.0.0.1:1",
        "--kvstore-insecure",
        "--kv-integrity-key-file",
        str(key),
    )
    assert config.engine.kvstore is not None
    assert config.engine.kvstore.integrity_key == b"k" * 40
    assert "k" * 40 not in repr(config)
    # Without the flag: a random key per process (per configuration).
    first, second = (
        _config(tmp_path, "--kvstore", "127.0.0.1:1", "--kvstore-insecure") for _ in range(2)
    )
    assert first.engine.kvstore is not None and second.engine.kvstore is not None
    assert first.engine.kvstore.integrity_key != second.engine.kvstore.integrity_key
    assert dataclasses.replace(first.engine.kvstore).integrity_key == (
        first.engine.kvstore.integrity_key
    )

    key.write_text("too-short-a-secret\n")
    with pytest.raises(ValueError, match="at least 32"):
        _config(
            tmp_path,
            "--kvstore",
            "127.0.0.1:1",
            "--kvstore-insecure",
            "--kv-integrity-key-file",
            str(key),
        )
    # genai-server itself (a child process: it configures logging for good).
    flags = ["--kvstore", "127.0.0.1:1", "--kvstore-insecure", "--kv-integrity-key-file", str(key)]
    run = subprocess.run(
        [sys.executable, "-m", "genai_service", "--model", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "--kv-integrity-key-file" in run.stderr
    assert "has 18 characters; at least 32" in run.stderr


def test_prefix_cache_scope_defaults_to_principal_with_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GENAI_AUTH_TOKEN", raising=False)
    assert _config(tmp_path).engine.cache.prefix_cache_scope == "global"
    monkeypatch.setenv("GENAI_AUTH_TOKEN", "control-token")
    assert _config(tmp_path).engine.cache.prefix_cache_scope == "principal"
    flags = ("--prefix-cache-scope", "global")
    assert _config(tmp_path, *flags).engine.cache.prefix_cache_scope == "global"
    with pytest.raises(ValueError, match="prefix_cache_scope must be one of global, principal"):
        CacheConfig(prefix_cache_scope="tenant")
    # The same default for a ServerConfig built in code: auth means per-principal.
    engine = EngineConfig(model_dir=str(tmp_path))
    authed = ServerConfig(engine=engine, auth_tokens=(("t", "alice"),))
    assert authed.engine.cache.prefix_cache_scope == "principal"
    assert ServerConfig(engine=engine).engine.cache.prefix_cache_scope == "global"


def test_genai_stack_writes_a_private_key_the_server_accepts(tmp_path: Path) -> None:
    from genai_service.__main__ import read_integrity_key
    from genai_service.launcher import write_integrity_key

    path = Path(write_integrity_key(str(tmp_path)))
    assert path.stat().st_mode & 0o777 == 0o600
    key = read_integrity_key(str(path))
    other = tmp_path / "other"
    other.mkdir()
    assert len(key) >= 32 and key != read_integrity_key(write_integrity_key(str(other)))
