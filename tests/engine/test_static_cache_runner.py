"""onnx-genai's static-cache graphs (issue 27, item 4): detection, the third
runner, and the engine's features on it, against the default tiny model's
recompute reference (the same weights behind past/present I/O)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from genai_service.config import (
    CacheConfig,
    EngineConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculationConfig,
)
from genai_service.contract.request import GenerationRequest, SamplingParams, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.runner.model_runner import StepItem
from genai_service.engine.runner.static_cache_runner import StaticCacheRunner
from genai_service.model.model_config import ModelLoadError
from genai_service.model.model_dir import StaticCacheIO, load_model_spec
from tests.tiny_model import (
    TinyModelSpec,
    build_tiny_model,
    encode_words,
    reference_greedy,
    reference_logits,
)

PROMPT = encode_words("the cat sat on the mat and the dog sat in the box")  # 13 tokens


def greedy(rid: str, ids: list[int], n: int, **kw) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True), **kw
    )


def engine(model_dir: Path, store: MemoryKvChunkStore | None = None, **kw) -> LLMEngine:
    config = EngineConfig(
        model_dir=str(model_dir),
        scheduler=kw.pop("scheduler", SchedulerConfig(max_num_seqs=4)),
        cache=kw.pop("cache", CacheConfig(chunk_size=4)),
        **kw,
    )
    return LLMEngine(config, chunk_store=store)


def test_the_graph_is_read_as_a_static_cache(static_cache_model_dir: Path) -> None:
    spec = load_model_spec(static_cache_model_dir)
    assert spec.static_cache == StaticCacheIO("write_indices", "nonpad_kv_seqlen", None)
    assert spec.past_names == (("key_cache.0", "value_cache.0"), ("key_cache.1", "value_cache.1"))
    assert spec.present_names[1] == ("updated_key_cache.1", "updated_value_cache.1")
    assert (spec.kv.num_layers, spec.kv.num_kv_heads, spec.kv.head_dim) == (2, 2, 8)
    assert spec.context_length == 128 and not spec.logits_last_only
    assert spec.rope_sources is None  # context slides recompute


def test_the_canonical_names_need_no_declaration(
    static_cache_model_dir: Path, tmp_path: Path
) -> None:
    """Without model.io.static_cache the graph's own input names say it."""
    copy = tmp_path / "undeclared"
    shutil.copytree(static_cache_model_dir, copy)
    meta = yaml.safe_load((copy / "inference_metadata.yaml").read_text())
    del meta["model"]["io"]
    del meta["model"]["attention"]  # heads from the Attention ops' kv_num_heads
    (copy / "inference_metadata.yaml").write_text(yaml.safe_dump(meta))
    spec = load_model_spec(copy)
    assert spec.static_cache is not None
    assert (spec.kv.num_kv_heads, spec.kv.head_dim) == (2, 8)


def test_a_declared_name_the_graph_lacks_is_named(
    static_cache_model_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "misnamed"
    shutil.copytree(static_cache_model_dir, copy)
    meta = yaml.safe_load((copy / "inference_metadata.yaml").read_text())
    meta["model"]["io"]["static_cache"]["key_cache_outputs"][1] = "present_key.1"
    (copy / "inference_metadata.yaml").write_text(yaml.safe_dump(meta))
    with pytest.raises(ModelLoadError, match="graph has no output 'present_key.1'"):
        load_model_spec(copy)


def test_runner_choice(static_cache_model_dir: Path, tiny_model_dir: Path) -> None:
    assert engine(static_cache_model_dir).runner.kind == "static_cache"
    with pytest.raises(ValueError, match="runner: shared_buffer cannot run this graph"):
        engine(static_cache_model_dir, runner=RunnerConfig(runner="shared_buffer"))
    with pytest.raises(ValueError, match="runner: static_cache cannot run this graph"):
        engine(tiny_model_dir, runner=RunnerConfig(runner="static_cache"))


def test_kv_is_written_in_place_and_read_in_the_chunk_layout(
    static_cache_model_dir: Path, tiny_model_dir: Path
) -> None:
    spec = load_model_spec(static_cache_model_dir)
    runner = StaticCacheRunner(spec, RunnerConfig(), max_slots=2, max_len=64)
    assert runner.k_buffers[0].shape == (2, 64, 16)  # [slots, positions, kv_hidden]
    pointers = [b.ctypes.data for b in runner.k_buffers + runner.v_buffers]
    logits = runner.run([StepItem(7, PROMPT, 0)])
    np.testing.assert_allclose(logits[0], reference_logits(tiny_model_dir, PROMPT), atol=1e-4)
    tokens = list(PROMPT)
    for _ in range(4):
        tok = int(np.argmax(logits[0]))
        logits = runner.run([StepItem(7, [tok], len(tokens))])
        tokens.append(tok)
        np.testing.assert_allclose(logits[0], reference_logits(tiny_model_dir, tokens), atol=1e-4)
    assert [b.ctypes.data for b in runner.k_buffers + runner.v_buffers] == pointers
    n = len(tokens)
    assert np.abs(runner.k_buffers[0][0, n - 1]).sum() > 0
    assert (
        np.abs(runner.k_buffers[0][0, n:]).sum() == 0 and np.abs(runner.k_buffers[0][1]).sum() == 0
    )
    # A read is [kv_heads, n, head_dim] per layer; written back to another slot it
    # continues exactly.
    layers = runner.read_kv(7, 0, n)
    assert layers[0][0].shape == (2, n, 8)
    # Always a copy, even where the layout would allow a view (one position; or
    # one KV head): a view would change under the next step or slot move.
    last = runner.read_kv(7, n - 1, n)
    assert not any(
        np.shares_memory(a, buf)
        for pair in last
        for a in pair
        for buf in runner.k_buffers + runner.v_buffers
    )
    runner.write_chunks(9, [layers])
    again = runner.run([StepItem(9, [5], n)])
    np.testing.assert_allclose(again[0], reference_logits(tiny_model_dir, tokens + [5]), atol=1e-4)


def test_an_open_length_is_tiered_with_the_sequences_held(
    static_cache_model_dir: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    """A graph that leaves the caches' length open is bound at a capacity that
    follows the longest sequence (ORT's Attention costs by the bound length):
    it widens in place as a sequence grows, every step's logits are the bits
    of the buffers bound whole (and the recompute's), the KV held reads back
    byte-identical across each move, and it narrows when the long sequence
    leaves."""
    from genai_service.engine.runner import shared_buffer_runner

    monkeypatch.setattr(shared_buffer_runner, "MIN_CAPACITY", 8)
    spec = load_model_spec(static_cache_model_dir)
    assert spec.static_cache is not None
    whole = StaticCacheRunner(
        dataclasses.replace(spec, static_cache=dataclasses.replace(spec.static_cache, capacity=64)),
        RunnerConfig(),
        max_slots=2,
        max_len=64,
    )
    runner = StaticCacheRunner(spec, RunnerConfig(), max_slots=2, max_len=64)
    assert runner.tiered and runner.capacity == 8
    assert runner.k_buffers[0].shape == (2, 8, 16)  # [slots, capacity, kv_hidden]
    pointers = [b.ctypes.data for b in runner.k_buffers + runner.v_buffers]
    short = encode_words("the dog")
    runner.run([StepItem(1, short, 0)])
    held = runner.read_kv(1, 0, len(short))
    whole.run([StepItem(1, short, 0)])
    logits = runner.run([StepItem(2, PROMPT, 0)])  # 13 tokens: widens to 16 first
    np.testing.assert_array_equal(logits, whole.run([StepItem(2, PROMPT, 0)]))
    assert runner.capacity == 16 and runner.relayouts == 1
    tokens = list(PROMPT)
    for _ in range(6):  # past 16: widens to 32 between decode steps
        tok = int(np.argmax(logits[0]))
        logits = runner.run([StepItem(2, [tok], len(tokens))]).copy()
        np.testing.assert_array_equal(logits, whole.run([StepItem(2, [tok], len(tokens))]))
        tokens.append(tok)
        np.testing.assert_allclose(logits[0], reference_logits(tiny_model_dir, tokens), atol=1e-4)
    assert runner.capacity == 32 and runner.relayouts == 2
    for (k, v), (k2, v2) in zip(held, runner.read_kv(1, 0, len(short)), strict=True):
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)
    runner.release(2)  # the short one fits a quarter: back to the narrowest
    assert runner.capacity == 8
    again = runner.run([StepItem(1, [5], len(short))])
    np.testing.assert_allclose(again[0], reference_logits(tiny_model_dir, short + [5]), atol=1e-4)
    assert [b.ctypes.data for b in runner.k_buffers + runner.v_buffers] == pointers


def test_a_fixed_length_is_bound_whole(static_cache_model_dir: Path) -> None:
    spec = load_model_spec(static_cache_model_dir)
    assert spec.static_cache is not None
    fixed = dataclasses.replace(
        spec, static_cache=dataclasses.replace(spec.static_cache, capacity=64)
    )
    runner = StaticCacheRunner(fixed, RunnerConfig(), max_slots=2, max_len=48)
    assert not runner.tiered and runner.k_buffers[0].shape == (2, 64, 16)
    runner.run([StepItem(1, PROMPT, 0)])
    assert runner.relayouts == 0


def test_batched_with_chunked_prefill_equals_the_reference(
    static_cache_model_dir: Path, tiny_model_dir: Path
) -> None:
    """Four requests of different lengths, one of them prefilled in chunks
    while the others decode, each with the recompute reference's tokens."""
    prompts = {
        "a": PROMPT,
        "b": encode_words("hello , who are you ?"),
        "c": PROMPT + encode_words("with a hat ? and a red box under the tree"),
        "d": encode_words("one two three"),
    }
    eng = engine(
        static_cache_model_dir,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
        cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0),
    )
    for rid, ids in prompts.items():
        eng.add_request(greedy(rid, ids, 12))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(500):
        for out in eng.step():
            got[out.request_id] += list(out.token_ids)
        if not eng.has_unfinished():
            break
    for rid, ids in prompts.items():
        assert got[rid] == reference_greedy(tiny_model_dir, ids, 12), rid


def test_sessions_and_prefix_reuse(static_cache_model_dir: Path, tiny_model_dir: Path) -> None:
    eng = engine(static_cache_model_dir)
    sid = eng.create_session().session_id
    t1 = encode_words("hello , who are you ?")
    r1 = eng.generate(dataclasses.replace(greedy("t1", t1, 6), session_id=sid))
    eng.generate(greedy("other", encode_words("the dog"), 9))  # takes a slot in between
    t2 = encode_words("what is the time ?")
    r2 = eng.generate(dataclasses.replace(greedy("t2", t2, 6), session_id=sid))
    history = t1 + list(r1.token_ids)
    assert r2.usage.cached_tokens == len(history)
    assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + t2, 6)

    b = PROMPT + encode_words("with a hat ?")
    eng.generate(greedy("a", PROMPT + encode_words(". who is it ?"), 8))
    r = eng.generate(greedy("b", b, 8))
    assert r.usage.cached_tokens == 12
    assert list(r.token_ids) == reference_greedy(tiny_model_dir, b, 8)


def test_kv_chunks_through_a_store_to_a_fresh_engine(
    static_cache_model_dir: Path, tiny_model_dir: Path
) -> None:
    """Chunks in the format of the other runners: pushed by one engine, reused
    by a fresh one with the same tokens as a recompute."""
    store = MemoryKvChunkStore(dtype="float32")
    first = engine(static_cache_model_dir, store)
    first.generate(greedy("a", PROMPT, 4))
    first.flush_finished()  # its chunks pushed (close would close the shared store)
    assert len(store.blobs) >= 3
    second = engine(static_cache_model_dir, store)
    r = second.generate(greedy("b", PROMPT, 8))
    assert r.usage.cached_tokens == 12
    assert list(r.token_ids) == reference_greedy(tiny_model_dir, PROMPT, 8)


def test_prompt_lookup_speculation_gives_the_same_tokens(
    static_cache_model_dir: Path, tiny_model_dir: Path
) -> None:
    ids = encode_words("the cat sat on the mat . the cat sat on the mat . the cat sat on")
    eng = engine(static_cache_model_dir, speculation=SpeculationConfig(num_tokens=4))
    r = eng.generate(greedy("s", ids, 16))
    assert list(r.token_ids) == reference_greedy(tiny_model_dir, ids, 16)
    assert eng.counters["spec_draft_tokens"] > 0  # verified on this runner


def test_verify_batch_checks_several_sequences_as_verify_does_each(
    static_cache_model_dir: Path, tiny_model_dir: Path
) -> None:
    runner = StaticCacheRunner(
        load_model_spec(static_cache_model_dir), RunnerConfig(), max_slots=3, max_len=64
    )
    prompts = [PROMPT, encode_words("a bird saw the dog"), encode_words("the mat and")]
    for sid, ids in enumerate(prompts):
        runner.run([StepItem(sid, ids[:-2], 0)])
    rows = runner.verify_batch(
        [StepItem(sid, ids[-2:], len(ids) - 2) for sid, ids in enumerate(prompts)]
    )
    for sid, ids in enumerate(prompts):
        assert rows[sid].shape[0] == 2 and runner.kv_len(sid) == len(ids)
        for j in range(2):
            want = reference_logits(tiny_model_dir, ids[: len(ids) - 1 + j])
            np.testing.assert_allclose(rows[sid][j], want, atol=1e-4)


def test_a_static_cache_graph_drafts_for_its_past_present_twin(
    static_cache_model_dir: Path, tiny_model_dir: Path
) -> None:
    """The same weights behind the other I/O: every greedy guess is right."""
    spec = SpeculationConfig(
        4, 4, draft_model=str(static_cache_model_dir), mode="draft", batch_rule="always"
    )
    eng = engine(tiny_model_dir, speculation=spec)
    r = eng.generate(greedy("d", PROMPT, 16))
    assert list(r.token_ids) == reference_greedy(tiny_model_dir, PROMPT, 16)
    c = eng.counters
    assert c["spec_accepted_tokens.draft"] == c["spec_draft_tokens.draft"] > 0


def test_a_speculating_steps_checks_of_different_lengths_and_riding_decodes(
    static_cache_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a poor draft at --speculate-max-batch 5, one check call holds
    guesses of different lengths (a row padded after its own tokens) and the
    one-token decodes of sequences not guessing that step (riding): every
    request's tokens are a plain decode's, greedy, seeded sampled and Mirostat."""
    poor = build_tiny_model(tmp_path / "one-layer", TinyModelSpec(num_layers=1))

    def requests() -> list[GenerationRequest]:
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
        return [
            greedy("greedy", PROMPT, 40),
            greedy("sampled", encode_words("a bird saw it and the"), 24, sampling=sampled),
            greedy("short", encode_words("the dog"), 6),
            greedy("seeded", encode_words("the mat and"), 20, sampling=sampled),
            # Mirostat gets no guesses: it decodes in the others' check calls.
            greedy(
                "mirostat",
                encode_words("the box"),
                16,
                sampling=SamplingParams(temperature=0.8, mirostat=2, seed=3),
            ),
        ]

    plain = engine(
        static_cache_model_dir, scheduler=SchedulerConfig(max_num_seqs=5)
    ).run_to_completion(requests())
    calls: list[list[int]] = []
    real = StaticCacheRunner.verify_batch

    def spy(self: StaticCacheRunner, items: list[StepItem]) -> list[np.ndarray]:
        calls.append([len(item.token_ids) for item in items])
        return real(self, items)

    monkeypatch.setattr(StaticCacheRunner, "verify_batch", spy)
    # Full-length guesses (no confidence stop, no shortening after a rejected
    # guess): the tiny draft doubts nearly every token and is always wrong, and
    # this checks rows of mixed lengths in one call.
    spec = SpeculationConfig(
        4, 5, draft_model=str(poor), mode="draft", batch_rule="always", min_confidence=0.0
    )
    eng = engine(
        static_cache_model_dir, speculation=spec, scheduler=SchedulerConfig(max_num_seqs=5)
    )
    assert eng.runner.checks_in_one_call

    class FullLength(dict):  # rejected guesses do not shorten the next ones here
        def __setitem__(self, key: int, value: int) -> None:
            pass

    eng.speculation.draft._span = FullLength()  # type: ignore[union-attr]
    got = eng.run_to_completion(requests())
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in plain.items()}
    several = [c for c in calls if len(c) > 1]
    assert any(len(set(c)) > 2 and 1 in c for c in several), calls  # mixed, with riders
    assert eng.counters["spec_draft_tokens.draft"] > eng.counters["spec_accepted_tokens.draft"]
