"""A static-cache model directory through genai-server (issue 27, item 4):
GetModelInfo names its runner, and concurrent streams and a session turn give
the recompute reference's tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from genai_client import Client
from genai_service.config import EngineConfig, ServerConfig
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import encode_words, reference_greedy


def test_served_static_cache_model(static_cache_model_dir: Path, tiny_model_dir: Path) -> None:
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(static_cache_model_dir)), port=free_port()
    )
    srv = ServerThread(config).start()
    try:
        with Client(srv.target) as client:
            info = client.model_info()
            assert info.runner_kind == "STATIC_CACHE"
            assert (info.kv_layout.num_layers, info.kv_layout.num_kv_heads) == (2, 2)
            prompts = [
                encode_words("the cat sat on the mat"),
                encode_words("hello , who are you ?"),
                encode_words("the dog sat in the box under a tree"),
            ]

            def run(ids: list[int]) -> list[int]:
                stream = client.stream(token_ids=ids, max_new_tokens=10, ignore_eos=True)
                return [t for delta in stream for t in delta.token_ids]

            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(run, prompts))
            assert got == [reference_greedy(tiny_model_dir, ids, 10) for ids in prompts]
            with client.session() as session:
                t1 = encode_words("hello , who are you ?")
                r1 = session.generate(token_ids=t1, max_new_tokens=5, ignore_eos=True)
                t2 = encode_words("what is the time ?")
                r2 = session.generate(token_ids=t2, max_new_tokens=5, ignore_eos=True)
                history = t1 + list(r1.token_ids)
                assert r2.usage.cached_tokens == len(history)
                assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + t2, 5)
    finally:
        srv.stop()
