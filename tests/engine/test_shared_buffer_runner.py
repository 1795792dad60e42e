"""The shared-buffer runner: in-place KV, slot compaction, sessions and prefix reuse on GQA."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from genai_service.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.runner.model_runner import StepItem
from genai_service.engine.runner.shared_buffer_runner import SharedBufferRunner
from genai_service.model.model_dir import load_model_spec
from tests.tiny_model import encode_words, reference_greedy, reference_logits


def greedy(rid: str, ids: list[int], n: int, **kw) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True), **kw
    )


def test_kv_buffers_are_allocated_once_and_written_in_place(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["gqa"]
    runner = SharedBufferRunner(load_model_spec(model_dir), RunnerConfig(), max_slots=2, max_len=64)
    pointers = [b.ctypes.data for b in runner.k_buffers + runner.v_buffers]
    ids = encode_words("the cat sat on the mat")
    logits = runner.run([StepItem(7, ids, 0)])
    np.testing.assert_allclose(logits[0], reference_logits(model_dir, ids), atol=1e-4)
    tokens = list(ids)
    for _ in range(5):
        tok = int(np.argmax(logits[0]))
        logits = runner.run([StepItem(7, [tok], len(tokens))])
        tokens.append(tok)
        np.testing.assert_allclose(logits[0], reference_logits(model_dir, tokens), atol=1e-4)
        assert [b.ctypes.data for b in runner.k_buffers + runner.v_buffers] == pointers
    # the KV of every position was written into the buffers themselves
    slot = runner.slot_of(7)
    assert slot == 0
    n = len(tokens)
    assert np.abs(runner.k_buffers[0][slot, :, n - 1]).sum() > 0
    assert np.abs(runner.k_buffers[0][slot, :, n:]).sum() == 0
    assert np.abs(runner.k_buffers[0][1]).sum() == 0  # the other slot is untouched


def test_release_compacts_slots_and_keeps_kv(tiny_models: dict[str, Path]) -> None:
    runner = SharedBufferRunner(
        load_model_spec(tiny_models["gqa"]), RunnerConfig(), max_slots=3, max_len=32
    )
    for seq, text in ((1, "the cat"), (2, "the dog sat"), (3, "a bird saw it")):
        runner.run([StepItem(seq, encode_words(text), 0)])
    kv3 = runner.read_kv(3, 0, 4)
    runner.release(1)
    assert runner.slot_of(3) == 0 and runner.slot_of(2) == 1 and runner.moves == 1
    for (k, v), (k2, v2) in zip(kv3, runner.read_kv(3, 0, 4), strict=True):
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)


def test_batched_decode_rows_follow_the_items_in_any_slot_order(
    tiny_models: dict[str, Path],
) -> None:
    """In slot order the ORT output is returned as is; any other order (or a
    slot left out) maps each row back to its item."""
    model_dir = tiny_models["gqa"]
    runner = SharedBufferRunner(load_model_spec(model_dir), RunnerConfig(), max_slots=3, max_len=32)
    prompts = {
        1: encode_words("the cat"),
        2: encode_words("the dog sat"),
        3: encode_words("a bird"),
    }
    for seq, ids in prompts.items():
        runner.run([StepItem(seq, ids, 0)])
    for order in ([1, 2, 3], [3, 1, 2], [2, 3]):
        logits = runner.run([StepItem(seq, [5], len(prompts[seq])) for seq in order])
        for row, seq in enumerate(order):
            prompts[seq] = prompts[seq] + [5]
            want = reference_logits(model_dir, prompts[seq])
            np.testing.assert_allclose(logits[row], want, atol=1e-4)


def engine(model_dir: Path, **cache) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            runner=RunnerConfig(runner="shared_buffer"),
            scheduler=SchedulerConfig(max_num_seqs=4),
            cache=CacheConfig(chunk_size=4, **cache),
        )
    )


def test_sessions_on_the_shared_buffer_runner(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["gqa"]
    eng = engine(model_dir, prefix_cache_bytes=0)
    sid = eng.create_session().session_id
    other = eng.create_session().session_id
    t1 = encode_words("hello , who are you ?")
    r1 = eng.generate(dataclasses.replace(greedy("t1", t1, 6), session_id=sid))
    # another session's turn in between takes the slot; ours is parked and restored
    eng.generate(dataclasses.replace(greedy("o1", encode_words("the dog"), 9), session_id=other))
    t2 = encode_words("what is the time ?")
    r2 = eng.generate(dataclasses.replace(greedy("t2", t2, 6), session_id=sid))
    history = t1 + list(r1.token_ids)
    assert r2.usage.cached_tokens == len(history)
    assert list(r2.token_ids) == reference_greedy(model_dir, history + t2, 6)


def test_prefix_reuse_on_the_shared_buffer_runner(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["gqa"]
    prefix = encode_words("the cat sat on the mat and the dog sat in the box")
    b = prefix + encode_words("with a hat ?")
    eng = engine(model_dir)
    eng.generate(greedy("a", prefix + encode_words(". who is it ?"), 8))
    r = eng.generate(greedy("b", b, 8))
    assert r.usage.cached_tokens == 12
    assert list(r.token_ids) == reference_greedy(model_dir, b, 8)


def test_the_layout_widens_and_narrows_with_the_sequences_held_and_keeps_their_kv(
    tiny_models: dict[str, Path], monkeypatch
) -> None:
    """The position axis follows the longest sequence (doubling from
    MIN_CAPACITY, in place within the memory reserved for max_len) and falls back
    when it leaves; every step's logits stay those of a recompute, the KV read back
    is the same bytes across each move, and decode steps with a dummy row at the
    capacity's edge widen first."""
    from genai_service.engine.runner import shared_buffer_runner

    monkeypatch.setattr(shared_buffer_runner, "MIN_CAPACITY", 8)
    model_dir = tiny_models["gqa"]
    runner = SharedBufferRunner(load_model_spec(model_dir), RunnerConfig(), max_slots=3, max_len=96)
    assert runner.capacity == 8 and runner.k_buffers[0].shape[2] == 8
    pointers = [b.ctypes.data for b in runner.k_buffers + runner.v_buffers]
    seqs = {
        1: encode_words("the cat sat"),
        2: encode_words("a bird saw the dog on the mat"),
        3: encode_words("the dog"),
    }
    for seq, ids in seqs.items():
        runner.run([StepItem(seq, ids, 0)])
    assert runner.capacity == 8 and runner.relayouts == 0
    before = runner.read_kv(3, 0, len(seqs[3]))

    def decode(order: list[int]) -> None:
        logits = runner.run([StepItem(seq, [7], len(seqs[seq])) for seq in order])
        for row, seq in enumerate(order):
            seqs[seq] = seqs[seq] + [7]
            np.testing.assert_allclose(
                logits[row], reference_logits(model_dir, seqs[seq]), atol=1e-4
            )

    # Sequence 2 (8 tokens) fills the layout: its next token widens it to 16,
    # and at 16 to 32 (sequence 1 rides along at its own length).
    for _ in range(10):
        decode([2, 3])
    assert runner.capacity == 32 and runner.relayouts == 2
    for (k, v), (k2, v2) in zip(before, runner.read_kv(3, 0, 2), strict=True):
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)
    # A dummy row at the edge: sequence 2 at 18 tokens decodes nothing while 1
    # and 3 do; nothing it holds is overwritten.
    kv2 = runner.read_kv(2, 0, len(seqs[2]))
    for _ in range(3):
        decode([1, 3])
    for (k, v), (k2, v2) in zip(kv2, runner.read_kv(2, 0, len(seqs[2])), strict=True):
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)
    # A prefill past the capacity widens before it runs.
    long = encode_words("the cat sat on the mat and the dog saw a bird on the mat " * 3)
    assert len(long) > 32
    runner.release(3)
    runner.run([StepItem(4, long, 0)])
    seqs[4] = long
    assert runner.capacity == 64
    decode([1, 2, 4])
    # The longest leaves: the others fit in a quarter, so the layout narrows.
    runner.release(4)
    assert runner.capacity == 64  # 2's 19 tokens do not fit in a quarter (16)
    runner.release(2)
    assert runner.capacity == 16  # 1's 7 tokens: twice that, rounded up from 8
    decode([1])
    runner.release(1)
    assert runner.capacity == 8
    assert [b.ctypes.data for b in runner.k_buffers + runner.v_buffers] == pointers


def test_the_layout_is_never_narrower_than_the_widest_sliding_window(
    tiny_models: dict[str, Path], monkeypatch
) -> None:
    """ORT's GroupQueryAttention refuses a present buffer shorter than a layer's
    local_window_size on some graphs (onnxruntime-genai's Gemma 3 export): the
    narrowest layout holds the widest window, and narrowing stops there."""
    from genai_service.engine.runner import shared_buffer_runner

    monkeypatch.setattr(shared_buffer_runner, "MIN_CAPACITY", 8)
    model_dir = tiny_models["gqa"]
    spec = dataclasses.replace(load_model_spec(model_dir), attention_windows=(0, 24))
    runner = SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=96)
    assert runner.capacity == 32  # 8 doubled past the 24-token window
    ids = encode_words("the cat sat on the mat and the dog saw a bird on the mat " * 3)
    runner.run([StepItem(1, ids, 0)])
    assert runner.capacity == 64
    runner.run([StepItem(2, ids[:3], 0)])
    runner.release(1)
    assert runner.capacity == 32  # 2's 3 tokens would fit 8: the window's floor holds


def twin_matches_one_call_per_item(
    model_dir: Path, atol: float = 1e-4, grow_to: int = 0, lengths: tuple[int, int, int] = (6, 2, 9)
) -> str | None:
    """Several sequences' guesses checked on the graph's twin
    (``prepare_verify_batch``) against one GroupQueryAttention call per
    sequence: the same logits up to float rounding, the same KV afterwards (the
    items' own tokens written back, a row between them untouched), and the same
    next step from it; with ``grow_to``, again after one sequence has grown to
    that many tokens (a wider buffer layout than the first check's). None, or
    why the graph has no twin."""
    spec = load_model_spec(model_dir)
    max_len = max(64, 2 * grow_to)
    per_item = SharedBufferRunner(spec, RunnerConfig(), max_slots=3, max_len=max_len)
    twin = SharedBufferRunner(spec, RunnerConfig(), max_slots=3, max_len=max_len)
    why = twin.prepare_verify_batch()
    if why is not None:
        return why
    a, b, c = lengths
    ids = np.random.default_rng(0).integers(1, min(spec.vocab_size, 1000), a + b + c + 13 + grow_to)
    ids = ids.tolist()
    prompts = {1: ids[:a], 2: ids[a : a + b], 3: ids[a + b : a + b + c]}
    guesses = ids[a + b + c : a + b + c + 4]
    more = ids[a + b + c + 13 :]
    for runner in (per_item, twin):
        for seq, prompt in prompts.items():
            runner.run([StepItem(seq, prompt, 0)])
    rounds = [guesses] + ([more] if grow_to else [])
    for grown in rounds:
        # Sequences 1 and 3 check guesses of different lengths; 2, between them, rides along.
        items = [
            StepItem(1, guesses[:3], per_item.kv_len(1)),
            StepItem(3, guesses[3:], per_item.kv_len(3)),
        ]
        want = [per_item.verify(item) for item in items]
        got = twin.verify_batch(items)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, atol=atol)
            assert (g.argmax(axis=-1) == w.argmax(axis=-1)).all()
        for seq in prompts:
            held = per_item.kv_len(seq)
            assert twin.kv_len(seq) == held
            for (k, v), (k2, v2) in zip(
                per_item.read_kv(seq, 0, held), twin.read_kv(seq, 0, held), strict=True
            ):
                np.testing.assert_allclose(k2, k, atol=atol)
                np.testing.assert_allclose(v2, v, atol=atol)
        # The next step reads the KV the twin wrote back (and sequence 2 grows).
        step = [StepItem(seq, [5] if seq != 2 else grown, per_item.kv_len(seq)) for seq in prompts]
        np.testing.assert_allclose(twin.run(step), per_item.run(step), atol=atol)
    if grow_to:
        assert twin.relayouts > 0  # the second check ran on a wider layout
    return None


def test_several_sequences_are_checked_in_one_call_on_the_graphs_twin(
    tiny_models: dict[str, Path],
) -> None:
    assert twin_matches_one_call_per_item(tiny_models["gqa"]) is None  # rotary in the node
    assert twin_matches_one_call_per_item(tiny_models["gqa-learned"]) is None  # position_ids


def test_the_twin_follows_the_buffer_layout_as_it_widens(bytes_models: dict[str, Path]) -> None:
    assert twin_matches_one_call_per_item(bytes_models["gqa"], grow_to=300) is None


def test_a_twin_that_fails_leaves_one_call_per_sequence(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A twin failing at run time (it writes nothing) hands the same items to
    one call each and is dropped; one failing to build is reported, not raised."""
    from genai_service.engine.runner import shared_buffer_runner

    spec = load_model_spec(tiny_models["gqa"])
    runner = SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=32)
    assert runner.prepare_verify_batch() is None
    for seq in (1, 2):
        runner.run([StepItem(seq, encode_words("the cat sat"), 0)])
    reference = SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=32)
    for seq in (1, 2):
        reference.run([StepItem(seq, encode_words("the cat sat"), 0)])
    items = [StepItem(1, encode_words("on the"), 3), StepItem(2, encode_words("mat"), 3)]

    tries = []

    def broken(*args: object) -> None:
        tries.append(args)
        raise RuntimeError("ORT said no")

    monkeypatch.setattr(runner, "_run_twin", broken)
    got = runner.verify_batch(items)
    for g, w in zip(got, [reference.verify(item) for item in items], strict=True):
        np.testing.assert_array_equal(g, w)
    assert runner.kv_len(1) == 5 and runner.kv_len(2) == 4
    for seq in (1, 2):
        runner.truncate(seq, 3)
    runner.verify_batch(items)
    assert len(tries) == 1  # dropped after its failure

    def failing(*args: object) -> None:
        raise RuntimeError("a kernel is missing")

    monkeypatch.setattr(shared_buffer_runner, "build_verify_graph", failing)
    fresh = SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=32)
    assert fresh.prepare_verify_batch() == "the graph's twin failed to build: a kernel is missing"


def test_a_runner_without_a_twin_checks_one_sequence_per_call(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from genai_service.engine.runner import shared_buffer_runner

    spec = load_model_spec(tiny_models["gqa"])
    runner = SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=32)
    calls = []
    monkeypatch.setattr(runner, "verify", lambda item: calls.append(item) or np.zeros((1, 1)))
    runner.verify_batch([StepItem(1, [1, 2], 0), StepItem(2, [3], 0)])
    assert len(calls) == 2  # no prepare_verify_batch yet

    def refuse(*args: object) -> None:
        raise shared_buffer_runner.Unsupported("soft-capped scores (softcap)")

    monkeypatch.setattr(shared_buffer_runner, "build_verify_graph", refuse)
    assert runner.prepare_verify_batch() == "soft-capped scores (softcap)"


def test_the_twin_refuses_what_it_does_not_reproduce(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attribute it does not know (onnxruntime-genai's sliding_window_cache:
    other buffer coordinates), and sliding windows on an onnxruntime whose
    window it does not reproduce, keep one call per sequence."""
    import onnx

    from genai_service.engine.runner import verify_graph

    spec = load_model_spec(tiny_models["gqa"])

    def twin_of(**attrs: int) -> onnx.ModelProto:
        model = onnx.load(str(spec.onnx_path))
        for node in model.graph.node:
            if node.op_type == "GroupQueryAttention":
                node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in attrs.items())
        return verify_graph.build_verify_graph(
            model, spec.past_names, np.dtype(np.float32), spec.kv.head_dim
        )

    twin_of(local_window_size=4)  # a window: fine on this onnxruntime
    with pytest.raises(verify_graph.Unsupported, match="sliding_window_cache"):
        twin_of(sliding_window_cache=1)
    monkeypatch.setattr(verify_graph, "WINDOWS_FROM", (99, 0))
    with pytest.raises(verify_graph.Unsupported, match="onnxruntime >= 1.32"):
        twin_of(local_window_size=4)
    twin_of()  # no window: any onnxruntime
