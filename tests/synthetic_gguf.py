"""Tiny synthetic GGUF files of every architecture the converter builds.

No Qwen or Llama 3.1 GGUF ships on PyPI, so the tests write small ones with
the ``gguf`` writer, with the tensor names, layouts and metadata keys that
llama.cpp's converter writes for each family:

- ``llama3``: Llama with Llama 3.1's RoPE scaling baked into
  ``rope_freqs.weight`` (Q/K rows permuted for llama.cpp's RoPE kernel);
- ``qwen2``: q/k/v projection biases;
- ``qwen3``: QK-norm and a head_dim that is not hidden / heads;
- ``gemma3``: six layers (five local with a 16-token window, one global, each
  kind with its RoPE base), QK-norm, four norms per layer stored as
  1 + weight, GELU-tanh, a scaled and tied embedding.

Weights are random and mixed in type (F32, F16, Q8_0, Q5_0, Q4_K, Q6_K: the
K-quant blocks are random bytes with small scales, as the ``gguf`` package
cannot quantize them), fixed by the seed, so a file written twice is
byte-identical and references recorded once (bench/builder_reference.py)
stay valid. Imports only numpy and gguf, so the recorder can load it in the
onnxruntime-genai builder's own environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import GGML_QUANT_SIZES
from gguf.quants import quantize as gguf_quantize

Q = GGMLQuantizationType
ARCHS = ("llama3", "qwen2", "qwen3", "gemma3")


def put_tensor(w: GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """Float32 ``data`` into ``w`` as ``qtype``: F32 and F16 as arrays, any
    other type quantized by the gguf package's own quantizer."""
    if qtype == Q.F32:
        w.add_tensor(name, data)
    elif qtype == Q.F16:
        w.add_tensor(name, data.astype(np.float16))
    else:
        w.add_tensor(name, gguf_quantize(data, qtype), raw_dtype=qtype)


def byte_chars() -> list[str]:
    """GPT-2's byte → printable character table (byte-level BPE alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_chars() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    context_length: int = 256
    window: int = 0  # gemma3: the local layers' sliding window
    rope_theta_local: float = 0.0


SHAPES = {
    "llama3": Shape(2, 256, 512, 4, 2, 64, 10000.0),
    "qwen2": Shape(2, 256, 512, 4, 2, 64, 1000000.0),
    "qwen3": Shape(2, 256, 512, 8, 2, 64, 1000000.0),
    "gemma3": Shape(6, 256, 512, 4, 1, 64, 1000000.0, window=16, rope_theta_local=10000.0),
}

# Llama 3.1's RoPE scaling, for the llama3 file (original context 64 tokens,
# so the tiny model's positions reach the scaled frequencies).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
EOS_ID = 2


def llama3_freq_factors(head_dim: int, theta: float, rope: dict = LLAMA3_ROPE) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from rope_scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def k_quant_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator):
    """Random K-quant super-blocks (256 weights) with scales that keep weights O(0.1)."""
    _, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = k // 256
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    # the float16 d (and Q4_K's dmin) of each super-block: Q4_K's codes are
    # 0..15 with a subtracted min, so dmin ~ 7.5 d centres its weights on 0
    fields = {"Q4_K": ((0, 1.0), (2, 7.5)), "Q6_K": ((nbytes - 2, 1.0),)}[qtype.name]
    scale = {"Q4_K": 4e-4, "Q6_K": 2e-4}[qtype.name]
    d = rng.uniform(0.5 * scale, scale, size=(rows, blocks))
    for start, times in fields:
        value = (d * times).astype(np.float16)
        raw[..., start : start + 2] = value[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * nbytes)


def write_synthetic_gguf(path: str | Path, arch: str, seed: int = 0) -> Path:
    """Write the tiny ``arch`` model (one of ``ARCHS``) to ``path``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown synthetic architecture {arch!r}; one of {ARCHS}")
    s = SHAPES[arch]
    family = "llama" if arch == "llama3" else arch
    rng = np.random.default_rng(seed)
    tokens, types = tiny_vocab()
    w = GGUFWriter(str(path), family)
    w.add_name(f"synthetic-{arch}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    if s.window:
        w.add_sliding_window(s.window)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if family.startswith("qwen") else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    def add(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float) -> None:
        if qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, k_quant_blocks(qtype, shape[0], shape[1], rng), raw_dtype=qtype)
            return
        put_tensor(w, name, (rng.standard_normal(shape) * std).astype(np.float32), qtype)

    def norm(name: str, size: int, center: float = 1.0) -> None:
        # llama.cpp stores Gemma's norm weights as 1 + weight; either way near 1
        w.add_tensor(name, (center * (1.0 + rng.standard_normal(size) * 0.1)).astype(np.float32))

    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    add("token_embd.weight", (len(tokens), s.hidden), Q.F16, 0.02)
    if arch == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(s.head_dim, s.rope_theta))
    for i in range(s.layers):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", s.hidden)
        add(f"{b}.attn_q.weight", (q_dim, s.hidden), Q.Q8_0, 0.08)
        add(f"{b}.attn_k.weight", (kv_dim, s.hidden), Q.Q5_0, 0.08)
        add(f"{b}.attn_v.weight", (kv_dim, s.hidden), Q.Q6_K, 0.08)
        add(f"{b}.attn_output.weight", (s.hidden, q_dim), Q.Q8_0, 0.05)
        if arch == "qwen2":
            for proj, size in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                add(f"{b}.attn_{proj}.bias", (size,), Q.F32, 0.1)
        if arch in ("qwen3", "gemma3"):
            norm(f"{b}.attn_q_norm.weight", s.head_dim)
            norm(f"{b}.attn_k_norm.weight", s.head_dim)
        if arch == "gemma3":
            norm(f"{b}.post_attention_norm.weight", s.hidden)
        norm(f"{b}.ffn_norm.weight", s.hidden)
        add(f"{b}.ffn_gate.weight", (s.ffn, s.hidden), Q.Q4_K, 0.08)
        add(f"{b}.ffn_up.weight", (s.ffn, s.hidden), Q.Q4_K, 0.08)
        add(f"{b}.ffn_down.weight", (s.hidden, s.ffn), Q.Q6_K, 0.05)
        if arch == "gemma3":
            norm(f"{b}.post_ffw_norm.weight", s.hidden)
    norm("output_norm.weight", s.hidden, 40.0 if arch == "gemma3" else 4.0)
    if arch in ("qwen2", "llama3"):  # untied; Qwen3 and Gemma 3 tie the LM head
        add("output.weight", (len(tokens), s.hidden), Q.Q8_0, 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
