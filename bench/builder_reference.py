"""Independent references from onnxruntime-genai's model builder, recorded once.

    python -m bench.builder_reference --builder-python VENV/bin/python [--gemma3]

The builder (``onnxruntime_genai.models.builder``) exports Llama, Qwen2/3 and
Gemma 3 from Hugging Face-layout weights with its own graph code, and
onnxruntime-genai runs the result: neither shares arithmetic with our
converter. For each synthetic file of tests/synthetic_gguf.py (and, with
``--gemma3``, for Gemma 3 270M), this

1. dequantizes the GGUF with the ``gguf`` package into Hugging Face layout
   (config.json, model.safetensors; llama.cpp's Q/K row permutation undone for
   Llama, Gemma's stored ``1 + weight`` norms back to ``weight``);
2. runs the builder at fp32 on CPU, and onnxruntime-genai's greedy search on
   fixed prompts (token ids; 32 new tokens, stopping at EOS), keeping the
   prefill's top logits;
3. loads the builder's directory in our engine too (it must load and give the
   same tokens), and records everything as golden test data:
   tests/engine/data/builder_reference.json and
   tests/e2e/data/gemma3_builder.json, which tests/engine/test_architectures.py
   and tests/e2e/test_gemma3.py compare our own fp32 conversion against.
   With ``--keep-gemma3 DIR`` the builder's Gemma 3 directory is kept there
   for ``make bench ARGS="--gemma3-builder DIR"`` (bench/gemma3_bench.py).

Steps 1–2 run in ``--builder-python``, an environment with torch,
transformers, onnxruntime-genai, onnx-ir, gguf and safetensors (``pip install
torch transformers onnxruntime-genai onnx-ir gguf safetensors``; never this
project's venv, never CI):
this file re-runs itself there as ``python bench/builder_reference.py child``,
so its top level imports nothing of ours.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC_OUT = ROOT / "tests" / "engine" / "data" / "builder_reference.json"
GEMMA3_OUT = ROOT / "tests" / "e2e" / "data" / "gemma3_builder.json"
NEW_TOKENS = 32
TOP = 16  # logits kept per prompt: the prefill's highest


# -- child: Hugging Face layout, the builder, onnxruntime-genai (builder venv) ----------------


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF rotate-half → adjacent pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_layout(gguf_path: Path, tokenizer_dir: Path, out: Path, rope_scaling: dict | None) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = meta["general.architecture"]

    def m(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(m("embedding_length")), int(m("attention.head_count"))
    kv_heads = int(m("attention.head_count_kv", heads))
    head_dim = int(m("attention.key_length", hidden // heads))
    layers = int(m("block_count"))
    vocab = len(meta["tokenizer.ggml.tokens"])
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "ffn_norm": "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm",
    }
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name == "rope_freqs.weight":
            continue  # the builder computes it from rope_scaling
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stored Gemma's (1 + weight)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            _, layer, kind, leaf = t.name.split(".")
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                w = _unpermute(w, heads if kind == "attn_q" else kv_heads)
            name = f"model.layers.{layer}.{names[kind]}.{leaf}"
        tensors[name] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(m("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(m("context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config |= {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if rope_scaling:
            config["rope_scaling"] = rope_scaling
    elif arch in ("qwen2", "qwen3"):
        config |= {
            "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"],
            "model_type": arch,
            "hidden_act": "silu",
            "use_sliding_window": False,
            "attention_bias": arch == "qwen2",
        }
    elif arch == "gemma3":
        window = int(m("attention.sliding_window"))
        config |= {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim,
            "sliding_window": window,
            "layer_types": [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
            ],
            "rope_local_base_freq": float(m("rope.freq_base_swa", 10000.0)),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "rope_scaling": None,
        }
    else:
        raise ValueError(f"no Hugging Face layout for {arch}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    tokens = meta["tokenizer.ggml.tokens"]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokens[config["bos_token_id"]],
                "eos_token": tokens[config["eos_token_id"]],
            }
        )
        + "\n"
    )


def og_greedy(model_dir: Path, prompts: list[list[int]]) -> list[dict[str, Any]]:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    config = json.loads((model_dir / "genai_config.json").read_text())
    # a sliding-window cache must hold the window, whatever the prompt
    window = int(config["model"]["decoder"].get("sliding_window", {}).get("window_size", 0))
    results = []
    for ids in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=max(len(ids) + NEW_TOKENS, window))
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        logits = np.asarray(gen.get_logits(), dtype=np.float32).reshape(-1)
        top = np.argsort(-logits)[:TOP]
        tokens: list[int] = []
        while not gen.is_done() and len(tokens) < NEW_TOKENS:
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        results.append(
            {
                "tokens": tokens,
                "top_ids": [int(i) for i in top],
                "top_logits": [float(logits[i]) for i in top],
            }
        )
    return results


def run_builder(hf: Path, out: Path, cache: Path) -> None:
    """``python -m onnxruntime_genai.models.builder -i hf -o out -p fp32 -e cpu``, in process.

    transformers 5 reads Gemma 3's two RoPE bases into per-layer-type
    ``rope_parameters``, where builder 0.18 still looks for ``rope_theta``,
    ``rope_local_base_freq`` and a top-level ``rope_type``; the config is
    given those names back (the same values), nothing else is touched."""
    import runpy

    from transformers import AutoConfig

    loader = AutoConfig.from_pretrained.__func__  # type: ignore[attr-defined]

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        config = loader(cls, *args, **kwargs)
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and "full_attention" in rope and "sliding_attention" in rope:
            config.rope_theta = rope["full_attention"]["rope_theta"]
            config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
            rope.setdefault("rope_type", rope["full_attention"]["rope_type"])
        return config

    AutoConfig.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign]
    argv = sys.argv
    sys.argv = ["builder", "-i", str(hf), "-o", str(out), "-p", "fp32", "-e", "cpu"]
    sys.argv += ["-c", str(cache)]
    try:
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
    finally:
        sys.argv = argv


def child(argv: list[str]) -> None:
    gguf, tok_dir, work, prompts_json, result_json = map(Path, argv[:5])
    rope_scaling = json.loads(argv[5]) if len(argv) > 5 and argv[5] else None
    hf, built = work / "hf", work / "builder"
    hf_layout(gguf, tok_dir, hf, rope_scaling)
    run_builder(hf, built, work / "cache")
    prompts = json.loads(prompts_json.read_text())
    result_json.write_text(json.dumps(og_greedy(built, prompts)))


# -- parent: our conversion and engine (this project's venv) ---------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _our_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from genai_service.config import EngineConfig, RunnerConfig
    from genai_service.contract.request import GenerationRequest, StoppingCriteria
    from genai_service.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model_dir=str(model_dir), runner=RunnerConfig(intra_op_threads=2)))
    stop = StoppingCriteria(max_new_tokens=NEW_TOKENS)
    return [
        list(eng.generate(GenerationRequest(f"p{i}", tuple(ids), stopping=stop)).token_ids)
        for i, ids in enumerate(prompts)
    ]


def reference(
    gguf: Path, prompts: list[list[int]], builder_python: str, work: Path, rope_scaling: Any
) -> dict[str, Any]:
    from genai_service.convert.convert import ConvertOptions, convert

    ours = convert(gguf, work / "ours", ConvertOptions(weights="fp32"), progress=False)
    (work / "prompts.json").write_text(json.dumps(prompts))
    subprocess.run(
        [
            builder_python,
            str(Path(__file__).resolve()),
            "child",
            str(gguf),
            str(ours),
            str(work),
            str(work / "prompts.json"),
            str(work / "og.json"),
            json.dumps(rope_scaling) if rope_scaling else "",
        ],
        check=True,
    )
    og = json.loads((work / "og.json").read_text())
    on_builder_dir = _our_greedy(work / "builder", prompts)  # the builder's dir loads in ours
    mine = _our_greedy(ours, prompts)
    for i, (o, b, m) in enumerate(zip(og, on_builder_dir, mine, strict=True)):
        print(
            f"  prompt {i}: og == ours on builder dir: {o['tokens'] == b}, og == our fp32: "
            f"{o['tokens'] == m} ({len(o['tokens'])} tokens)"
        )
    return {
        "gguf_sha256": _sha256(gguf),
        "prompts": [
            {"ids": ids, **o, "ours_on_builder_dir": b}
            for ids, o, b in zip(prompts, og, on_builder_dir, strict=True)
        ],
    }


def _made_by(builder_python: str) -> str:
    versions = subprocess.run(
        [
            builder_python,
            "-c",
            "import onnxruntime_genai as og, onnxruntime as ort, transformers, torch;"
            "print(f'onnxruntime-genai {og.__version__} builder, onnxruntime {ort.__version__}, "
            "transformers {transformers.__version__}, torch {torch.__version__}')",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"bench/builder_reference.py with {versions}, fp32, CPU"


def synthetic_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in (5, 12, 24, 40, 60, 80)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        child(argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builder-python", required=True, help="python of a venv with the builder")
    ap.add_argument("--gemma3", action="store_true", help="also Gemma 3 270M (several minutes)")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument(
        "--keep-gemma3",
        type=Path,
        default=None,
        metavar="DIR",
        help="also keep the builder's Gemma 3 directory there (bench.gemma3_bench --builder-dir)",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.synthetic_gguf import ARCHS, LLAMA3_ROPE, tiny_vocab, write_synthetic_gguf

    if args.keep_gemma3 is not None and not args.gemma3:
        ap.error("--keep-gemma3 needs --gemma3")
    made_by = _made_by(args.builder_python)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_synthetic:
            data: dict[str, Any] = {"made_by": made_by, "new_tokens": NEW_TOKENS, "models": {}}
            prompts = synthetic_prompts(len(tiny_vocab()[0]))
            for arch in ARCHS:
                print(arch, flush=True)
                work = Path(tmp) / arch
                work.mkdir()
                gguf = write_synthetic_gguf(work / f"{arch}.gguf", arch)
                scaling = LLAMA3_ROPE if arch == "llama3" else None
                data["models"][arch] = reference(gguf, prompts, args.builder_python, work, scaling)
            SYNTHETIC_OUT.parent.mkdir(parents=True, exist_ok=True)
            SYNTHETIC_OUT.write_text(json.dumps(data, indent=1) + "\n")
            print("wrote", SYNTHETIC_OUT)
        if args.gemma3:
            from genai_service.convert.default_model import gemma3_gguf

            print("gemma3-270m", flush=True)
            golden = json.loads((ROOT / "tests/e2e/data/gemma3_golden.json").read_text())
            prompts = [p["ids"] for p in golden["prompts"]]
            long = [2]
            for line in golden["corpus"]:
                long += line["ids"]
            prompts.append(long[:1500])  # beyond the 512-token window of the local layers
            work = Path(tmp) / "gemma3-270m"
            work.mkdir()
            data = {"made_by": made_by, "new_tokens": NEW_TOKENS}
            data |= reference(gemma3_gguf().path, prompts, args.builder_python, work, None)
            GEMMA3_OUT.write_text(json.dumps(data, indent=1) + "\n")
            print("wrote", GEMMA3_OUT)
            if args.keep_gemma3 is not None:
                shutil.rmtree(args.keep_gemma3, ignore_errors=True)
                shutil.copytree(work / "builder", args.keep_gemma3)
                (args.keep_gemma3 / "made_by.txt").write_text(made_by + "\n")
                print("kept", args.keep_gemma3)


if __name__ == "__main__":
    main()
