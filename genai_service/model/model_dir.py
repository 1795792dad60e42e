"""Model directory: what the engine needs to know about a model before running it.

A model directory (docs/design.md, "Model directory") holds ``model.onnx`` (+ external data),
``tokenizer.json`` and optionally ``genai_config.json`` (onnxruntime-genai),
``inference_metadata.yaml`` (onnx-genai), ``generation_config.json``,
``tokenizer_config.json`` and ``chat_template.jinja``.

``load_model_spec`` reads the graph's declarations only (never its weights),
checks that the engine can drive it, and merges what the config files add
(read by ``model_config``).
Precedence for every value: the graph (when it states it), then
genai_config.json, then inference_metadata.yaml, then generation_config.json /
tokenizer_config.json, then the tokenizer itself.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genai_common.errors import ModelLoadError

# Public config names stay importable from here (``X as X``: re-exported on purpose).
from .model_config import CHAT_TEMPLATE_FILE as CHAT_TEMPLATE_FILE
from .model_config import EOS_TOKEN_CANDIDATES as EOS_TOKEN_CANDIDATES
from .model_config import (
    GENAI_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INFERENCE_METADATA_FILE,
    TOKENIZER_CONFIG_FILE,
    _as_ids,
    _eos_ids,
    _first,
    _get,
    _LazyTokenizer,
    _opt_int,
    _read_yaml,
    _sampling_defaults,
    find_chat_template,
    read_json,
    special_token_text,
)
from .model_config import SAMPLING_KEYS as SAMPLING_KEYS
from .rope import RopeSource, find_rope_sources

if TYPE_CHECKING:
    import onnx

MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"

# Canonical tensor names (docs/design.md, "Model directory");
# genai_config.json may rename the KV ones.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
# Optional (an initializer, default 1): logits of the last N positions.
NUM_LOGITS_TO_KEEP = "num_logits_to_keep"
PAST_KEY = "past_key_values.%d.key"
PAST_VALUE = "past_key_values.%d.value"
PRESENT_KEY = "present.%d.key"
PRESENT_VALUE = "present.%d.value"

_FINGERPRINT_VERSION = b"genai-model-fingerprint/v1"

# onnx.TensorProto's element types, by number: the package is imported only
# where a graph is parsed, so a process that is handed a ModelSpec (the
# constraint checker) never loads it (~17 MB and ~0.9 s of import).
_KV_DTYPES: dict[int, str] = {
    1: "float32",  # TensorProto.FLOAT
    10: "float16",  # TensorProto.FLOAT16
}
_INT64 = 7  # TensorProto.INT64

Dim = int | str | None  # static size, symbolic name, or unknown


@dataclass(frozen=True)
class KvLayout:
    """Per-layer KV tensors are ``[batch, num_kv_heads, seq, head_dim]`` of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16"


@dataclass(frozen=True)
class StaticCacheIO:
    """onnx-genai's static-cache ABI (Mobius ``--static-cache`` exports): each
    layer's K and V are one ``[batch, capacity, num_kv_heads * head_dim]``
    buffer (``ModelSpec.past_names`` in, ``present_names`` out, the same
    buffer bound to both), written at ``write_indices [batch]`` (the tokens of
    valid KV before the step); ``kv_lengths [batch]`` (``nonpad_kv_seqlen``)
    is the valid length after the write. ``capacity``: the buffer's sequence
    size when the graph fixes it, else None (any)."""

    write_indices: str
    kv_lengths: str
    capacity: int | None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine knows about a model directory, without its weights."""

    path: Path
    onnx_path: Path
    model_id: str
    kv: KvLayout
    vocab_size: int
    input_names: tuple[str, ...]
    has_attention_mask: bool
    has_position_ids: bool
    past_names: tuple[tuple[str, str], ...]  # per layer: (past key input, past value input)
    present_names: tuple[tuple[str, str], ...]  # per layer: (present key, present value output)
    uses_gqa: bool  # com.microsoft GroupQueryAttention in the graph
    logits_last_only: bool  # logits hold only the last position: [batch, 1, vocab]
    # Optional input widening last-only logits to the last N positions (speculative
    # decoding's verification); None when the graph has none.
    num_logits_input: str | None
    context_length: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    sampling_defaults: dict[str, float | int] = field(hash=False)
    chat_template: str | None
    fingerprint: str  # hex; see _fingerprint
    # Each layer's rotary tables in the graph, where every layer's
    # GroupQueryAttention applies RoPE from initializers (model/rope.py); None otherwise.
    rope_sources: tuple[RopeSource, ...] | None = field(default=None, hash=False)
    # Per layer: the sliding attention window in tokens (GroupQueryAttention's
    # local_window_size), 0 where the layer sees the whole context.
    attention_windows: tuple[int, ...] = ()
    # onnx-genai's static-cache I/O (then KV is [batch, capacity, kv_hidden]); None: past/present.
    static_cache: StaticCacheIO | None = None


@dataclass(frozen=True)
class _Tensor:
    name: str
    elem_type: int  # onnx.TensorProto.DataType; 0 when the graph does not say
    shape: tuple[Dim, ...] | None  # None when the graph declares no shape


def load_model_spec(path: str | Path) -> ModelSpec:
    """Introspect a model directory; raise ``ModelLoadError`` naming the file or tensor at fault.

    The model id is the directory name unless ``model.name`` in genai_config.json
    or inference_metadata.yaml says otherwise.
    """
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist")
    genai = read_json(root / GENAI_CONFIG_FILE)
    meta = _read_yaml(root / INFERENCE_METADATA_FILE)
    gen_cfg = read_json(root / GENERATION_CONFIG_FILE)
    tok_cfg = read_json(root / TOKENIZER_CONFIG_FILE)

    filename = _get(genai, "model", "decoder", "filename") or MODEL_FILE
    onnx_path = root / str(filename)
    if not onnx_path.is_file():
        raise ModelLoadError(f"{onnx_path}: model file not found")
    tokenizer_path = root / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise ModelLoadError(f"{tokenizer_path}: tokenizer file not found")

    import onnx

    graph_bytes = onnx_path.read_bytes()
    try:
        # Parsing the bytes we hash is onnx.load(path, load_external_data=False) without a
        # second read: external weights stay on disk.
        model = onnx.load_model_from_string(graph_bytes)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise ModelLoadError(f"{onnx_path.name}: not a valid ONNX model ({e})") from e

    names = _tensor_name_patterns(genai)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = {vi.name: _tensor(vi) for vi in graph.input if vi.name not in initializers}
    optional_inputs = {vi.name for vi in graph.input if vi.name in initializers}
    outputs = {vi.name: _tensor(vi) for vi in graph.output}

    if INPUT_IDS not in inputs:
        raise ModelLoadError(f"{onnx_path.name}: graph has no input '{INPUT_IDS}'")
    if LOGITS not in outputs:
        raise ModelLoadError(f"{onnx_path.name}: graph has no output '{LOGITS}'")
    for name in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS):
        if name in inputs and inputs[name].elem_type != _INT64:
            got = _dtype_name(inputs[name].elem_type)
            raise ModelLoadError(f"{name}: must be int64, got {got}")

    static = _static_cache_names(onnx_path.name, meta, inputs)
    if static is not None:
        past_names, present_names, static_io = _pair_static_cache(
            onnx_path.name, inputs, outputs, static
        )
        past_tensors = [inputs[n] for pair in past_names for n in pair]
        dtype = _kv_dtype(
            past_tensors + [outputs[n] for pair in present_names for n in pair], rank=3
        )
        kv_heads, head_dim = _static_cache_heads(model, past_tensors, genai, meta)
    else:
        static_io = None
        past_names, present_names = _pair_kv(onnx_path.name, inputs, outputs, names)
        past_tensors = [inputs[n] for pair in past_names for n in pair]
        dtype = _kv_dtype(past_tensors + [outputs[n] for pair in present_names for n in pair])
        kv_heads = _kv_dim(
            past_tensors, 1, "kv_heads",
            _get(genai, "model", "decoder", "num_key_value_heads"),
            _get(meta, "model", "attention", "num_kv_heads"),
            "num_key_value_heads",
        )  # fmt: skip
        head_dim = _kv_dim(
            past_tensors, 3, "head_dim",
            _get(genai, "model", "decoder", "head_size"),
            _get(meta, "model", "attention", "head_dim"),
            "head_size",
        )  # fmt: skip
    kv = KvLayout(len(past_names), kv_heads, head_dim, dtype)

    tokenizer = _LazyTokenizer(tokenizer_path)
    logits = outputs[LOGITS]
    vocab_size, logits_seq = _check_logits(logits)
    if vocab_size is None:
        vocab_size = _opt_int(
            _first(_get(genai, "model", "vocab_size"), _get(meta, "model", "vocab_size")),
            "vocab_size",
        )
    if vocab_size is None:
        vocab_size = tokenizer.get().get_vocab_size(with_added_tokens=True)
    metadata_props = {p.key: p.value for p in model.metadata_props}
    logits_last_only = logits_seq == 1 or metadata_props.get("genai.logits") == "last"

    def config_id(key: str, tok_cfg_key: str) -> int | None:
        value = _first(
            _get(genai, "model", key),
            _get(meta, "tokens", key),
            _get(meta, "model", key),
            _get(gen_cfg, key),
        )
        if value is not None:
            ids = _as_ids(value, key)
            return ids[0] if ids else None
        return tokenizer.token_id(special_token_text(_get(tok_cfg, tok_cfg_key)))

    model_name = _first(_get(genai, "model", "name"), _get(meta, "model", "name"))
    return ModelSpec(
        path=root,
        onnx_path=onnx_path,
        model_id=str(model_name) if model_name else root.name,
        kv=kv,
        vocab_size=vocab_size,
        input_names=tuple(inputs),
        has_attention_mask=ATTENTION_MASK in inputs,
        has_position_ids=POSITION_IDS in inputs,
        past_names=past_names,
        present_names=present_names,
        uses_gqa=any(
            n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
            for n in _all_nodes(model)
        ),
        logits_last_only=logits_last_only,
        num_logits_input=NUM_LOGITS_TO_KEEP if NUM_LOGITS_TO_KEEP in optional_inputs else None,
        context_length=_opt_int(
            _first(
                _get(genai, "model", "context_length"),
                _get(meta, "model", "max_sequence_length"),
            ),
            "context_length",
        ),
        eos_token_ids=_eos_ids(genai, meta, gen_cfg, tok_cfg, tokenizer),
        bos_token_id=config_id("bos_token_id", "bos_token"),
        pad_token_id=config_id("pad_token_id", "pad_token"),
        sampling_defaults=_sampling_defaults(genai, meta),
        chat_template=find_chat_template(root, tok_cfg),
        fingerprint=_fingerprint(graph_bytes, _external_data_sizes(model, onnx_path)),
        rope_sources=find_rope_sources(model, [k for k, _ in past_names]),
        attention_windows=_attention_windows(model, [k for k, _ in past_names]),
        static_cache=static_io,
    )


# --- graph introspection ---------------------------------------------------------------


def _tensor(vi: onnx.ValueInfoProto) -> _Tensor:
    if not vi.type.HasField("tensor_type"):
        return _Tensor(vi.name, 0, None)
    tt = vi.type.tensor_type
    shape: tuple[Dim, ...] | None = None
    if tt.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
    return _Tensor(vi.name, tt.elem_type, shape)


def _dtype_name(elem_type: int) -> str:
    if elem_type == 0:
        return "an undeclared type"
    if elem_type in _KV_DTYPES:
        return _KV_DTYPES[elem_type]
    import onnx

    return onnx.TensorProto.DataType.Name(elem_type).lower()


def _tensor_name_patterns(genai: Mapping[str, Any]) -> dict[str, str]:
    """KV name patterns (``%d`` = layer); genai_config.json may rename them, nothing else."""
    io = {
        **(_get(genai, "model", "decoder", "inputs") or {}),
        **(_get(genai, "model", "decoder", "outputs") or {}),
    }
    for key, fixed in (
        ("input_ids", INPUT_IDS),
        ("attention_mask", ATTENTION_MASK),
        ("position_ids", POSITION_IDS),
        ("logits", LOGITS),
    ):
        if io.get(key, fixed) != fixed:
            raise ModelLoadError(
                f"{GENAI_CONFIG_FILE}: tensor '{key}' renamed to {io[key]!r} is not supported "
                f"(the engine uses '{fixed}')"
            )
    patterns = {}
    for key, default in (
        ("past_key_names", PAST_KEY),
        ("past_value_names", PAST_VALUE),
        ("present_key_names", PRESENT_KEY),
        ("present_value_names", PRESENT_VALUE),
    ):
        pattern = io.get(key, default)
        if not isinstance(pattern, str) or pattern.count("%d") != 1:
            raise ModelLoadError(
                f"{GENAI_CONFIG_FILE}: {key} must contain '%d' once, got {pattern!r}"
            )
        patterns[key] = pattern
    return patterns


def _match_layers(pattern: str, names: Iterator[str] | list[str]) -> dict[int, str]:
    regex = re.compile(re.escape(pattern).replace("%d", r"(0|[1-9][0-9]*)"))
    found = {}
    for name in names:
        m = regex.fullmatch(name)
        if m:
            found[int(m.group(1))] = name
    return found


def _pair_kv(
    model_file: str,
    inputs: Mapping[str, _Tensor],
    outputs: Mapping[str, _Tensor],
    names: Mapping[str, str],
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    pk_pat, pv_pat = names["past_key_names"], names["past_value_names"]
    prk_pat, prv_pat = names["present_key_names"], names["present_value_names"]
    past_k = _match_layers(pk_pat, list(inputs))
    past_v = _match_layers(pv_pat, list(inputs))
    present_k = _match_layers(prk_pat, list(outputs))
    present_v = _match_layers(prv_pat, list(outputs))

    known = {INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_k.values(), *past_v.values()}
    for name in inputs:
        if name not in known:
            raise ModelLoadError(
                f"{model_file}: unsupported graph input '{name}' (the engine feeds "
                f"{INPUT_IDS}, {ATTENTION_MASK}, {POSITION_IDS}, {pk_pat}, {pv_pat})"
            )

    layers = sorted(set(past_k) | set(past_v) | set(present_k) | set(present_v))
    if not layers:
        raise ModelLoadError(
            f"{model_file}: graph has no KV-cache inputs ('{pk_pat % 0}'); "
            "the engine needs a decoder with past/present KV"
        )
    for i in layers:
        for a, a_pat, b, b_pat in (
            (past_k, pk_pat, present_k, prk_pat),
            (present_k, prk_pat, past_k, pk_pat),
            (past_v, pv_pat, present_v, prv_pat),
            (present_v, prv_pat, past_v, pv_pat),
            (past_k, pk_pat, past_v, pv_pat),
            (past_v, pv_pat, past_k, pk_pat),
        ):
            if i in a and i not in b:
                raise ModelLoadError(f"unpaired KV: {a_pat % i} has no {b_pat % i}")
    if layers != list(range(len(layers))):
        missing = next(i for i in range(len(layers)) if i not in past_k)
        raise ModelLoadError(
            f"KV layer indices are not contiguous from 0: "
            f"have {', '.join(map(str, layers))}; {pk_pat % missing} is missing"
        )
    return (
        tuple((past_k[i], past_v[i]) for i in layers),
        tuple((present_k[i], present_v[i]) for i in layers),
    )


def _kv_dtype(tensors: list[_Tensor], rank: int = 4) -> str:
    first: _Tensor | None = None
    layout = "[batch, kv_heads, seq, head_dim]" if rank == 4 else "[batch, seq, kv_hidden]"
    for t in tensors:
        if t.shape is not None and len(t.shape) != rank:
            raise ModelLoadError(f"{t.name}: KV rank {len(t.shape)}, expected {rank} {layout}")
        if t.elem_type == 0:
            continue  # an output with no declared type; ORT will tell us at run time
        if t.elem_type not in _KV_DTYPES:
            raise ModelLoadError(
                f"{t.name}: KV dtype {_dtype_name(t.elem_type)} is not supported "
                "(float32 or float16)"
            )
        if first is None:
            first = t
        elif t.elem_type != first.elem_type:
            raise ModelLoadError(
                f"KV dtype mismatch: {first.name} is {_dtype_name(first.elem_type)} "
                f"but {t.name} is {_dtype_name(t.elem_type)}"
            )
    if first is None:
        raise ModelLoadError(f"{tensors[0].name}: KV tensor declares no element type")
    return _KV_DTYPES[first.elem_type]


# onnx-genai's static-cache names (inference_metadata.yaml model.io.static_cache
# may name others): what Mobius --static-cache exports.
_STATIC_CACHE_DEFAULTS = {
    "write_indices_input": "write_indices",
    "kv_sequence_length_input": "nonpad_kv_seqlen",
    "key_cache_inputs": "key_cache.%d",
    "value_cache_inputs": "value_cache.%d",
    "key_cache_outputs": "updated_key_cache.%d",
    "value_cache_outputs": "updated_value_cache.%d",
}


def _static_cache_names(
    model_file: str, meta: Mapping[str, Any], inputs: Mapping[str, _Tensor]
) -> dict[str, Any] | None:
    """The static-cache tensor names: ``model.io.static_cache`` of
    inference_metadata.yaml, or the canonical ones when the graph has a
    ``write_indices`` input; None for a past/present graph."""
    declared = _get(meta, "model", "io", "static_cache")
    if declared is None:
        if _STATIC_CACHE_DEFAULTS["write_indices_input"] not in inputs:
            return None
        return dict(_STATIC_CACHE_DEFAULTS)
    if not isinstance(declared, Mapping):
        raise ModelLoadError(
            f"{INFERENCE_METADATA_FILE}: model.io.static_cache must be a mapping, got "
            f"{type(declared).__name__}"
        )
    names = dict(_STATIC_CACHE_DEFAULTS)
    for key, value in declared.items():
        if key not in names:
            continue  # fields of the ABI the engine does not need
        if key.endswith(("_inputs", "_outputs")):
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ModelLoadError(
                f"{INFERENCE_METADATA_FILE}: model.io.static_cache.{key} has the wrong type "
                f"({value!r})"
            )
        names[key] = value
    return names


def _pair_static_cache(
    model_file: str,
    inputs: Mapping[str, _Tensor],
    outputs: Mapping[str, _Tensor],
    names: Mapping[str, Any],
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...], StaticCacheIO]:
    """Per layer (key, value) cache inputs and outputs of a static-cache graph."""
    per_layer: dict[str, list[str]] = {}  # key -> the names, in layer order
    for key in (
        "key_cache_inputs",
        "value_cache_inputs",
        "key_cache_outputs",
        "value_cache_outputs",
    ):
        value = names[key]  # the declared list, or a %d pattern to match
        if isinstance(value, list):
            per_layer[key] = value
        else:
            found = _match_layers(value, list(inputs if key.endswith("inputs") else outputs))
            per_layer[key] = [found[i] for i in sorted(found)]
    counts = {key: len(v) for key, v in per_layer.items()}
    if not counts["key_cache_inputs"] or len(set(counts.values())) != 1:
        raise ModelLoadError(
            f"{model_file}: static-cache KV names do not pair up per layer ({counts})"
        )
    for key, layer_names in per_layer.items():
        tensors, where = (inputs, "input") if key.endswith("inputs") else (outputs, "output")
        for name in layer_names:
            if name not in tensors:
                raise ModelLoadError(f"{model_file}: graph has no {where} '{name}' ({key})")
    write, lengths = names["write_indices_input"], names["kv_sequence_length_input"]
    known = {INPUT_IDS, write, lengths, *per_layer["key_cache_inputs"]}
    known |= set(per_layer["value_cache_inputs"])
    for name in (write, lengths):
        if name not in inputs:
            raise ModelLoadError(f"{model_file}: static-cache graph has no input '{name}'")
        if inputs[name].elem_type != _INT64:
            raise ModelLoadError(
                f"{name}: must be int64, got {_dtype_name(inputs[name].elem_type)}"
            )
    for name in inputs:
        if name not in known:
            raise ModelLoadError(
                f"{model_file}: unsupported graph input '{name}' in a static-cache graph "
                f"(the engine feeds {INPUT_IDS}, {write}, {lengths} and the KV caches)"
            )
    capacities: set[int] = set()
    for n in per_layer["key_cache_inputs"] + per_layer["value_cache_inputs"]:
        shape = inputs[n].shape
        if shape is not None and len(shape) == 3 and isinstance(shape[1], int):
            capacities.add(shape[1])
    if len(capacities) > 1:
        raise ModelLoadError(f"{model_file}: KV caches of different lengths {sorted(capacities)}")
    past = tuple(zip(per_layer["key_cache_inputs"], per_layer["value_cache_inputs"], strict=True))
    present = tuple(
        zip(per_layer["key_cache_outputs"], per_layer["value_cache_outputs"], strict=True)
    )
    io = StaticCacheIO(write, lengths, capacities.pop() if capacities else None)
    return past, present, io


def _static_cache_heads(
    model: onnx.ModelProto,
    caches: list[_Tensor],
    genai: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a static-cache graph: its caches hold
    ``kv_hidden`` per position, split by the Attention ops' ``kv_num_heads``
    or the config's KV heads and head size."""
    hidden = {t.shape[2] for t in caches if t.shape is not None and isinstance(t.shape[2], int)}
    attrs = {
        a.i
        for n in _all_nodes(model)
        if n.op_type == "Attention" and n.domain in ("", "ai.onnx")
        for a in n.attribute
        if a.name == "kv_num_heads"
    }
    heads = _opt_int(
        _first(
            _get(genai, "model", "decoder", "num_key_value_heads"),
            _get(meta, "model", "attention", "num_kv_heads"),
            next(iter(attrs)) if len(attrs) == 1 else None,
        ),
        "num_kv_heads",
    )
    head_dim = _opt_int(
        _first(
            _get(genai, "model", "decoder", "head_size"),
            _get(meta, "model", "attention", "head_dim"),
        ),
        "head_dim",
    )
    kv_hidden = hidden.pop() if len(hidden) == 1 else None
    if heads is None:
        raise ModelLoadError(
            f"{caches[0].name}: the static cache's KV heads are unknown (no Attention "
            "kv_num_heads, no model.attention.num_kv_heads)"
        )
    if head_dim is None:
        if kv_hidden is None:
            raise ModelLoadError(
                f"{caches[0].name}: the static cache's head size is unknown (no static "
                "kv_hidden, no model.attention.head_dim)"
            )
        head_dim = kv_hidden // heads
    if kv_hidden is not None and kv_hidden != heads * head_dim:
        raise ModelLoadError(
            f"{caches[0].name}: kv_hidden {kv_hidden} is not {heads} KV heads x head_dim {head_dim}"
        )
    return heads, head_dim


def _kv_dim(
    past: list[_Tensor],
    axis: int,
    what: str,
    genai_value: Any,
    meta_value: Any,
    config_key: str,
) -> int:
    """A KV dimension from the static dims of the past inputs, else from a config."""
    static: tuple[str, int] | None = None  # (tensor name, size)
    for t in past:
        dim = t.shape[axis] if t.shape is not None else None
        if not isinstance(dim, int) or dim <= 0:
            continue
        if static is None:
            static = (t.name, dim)
        elif dim != static[1]:
            raise ModelLoadError(
                f"KV shape mismatch: {static[0]} has {what} {static[1]} but {t.name} has {dim}"
            )
    if static is not None:
        return static[1]
    value = _opt_int(_first(genai_value, meta_value), config_key)
    if value is None or value <= 0:
        raise ModelLoadError(
            f"{past[0].name}: dim {axis} ({what}) is not static and no config gives {config_key}"
        )
    return value


def _check_logits(logits: _Tensor) -> tuple[int | None, Dim]:
    """Return (static vocab size or None, seq dim) of ``logits`` ``[batch, seq, vocab]``."""
    if logits.elem_type not in (0, *_KV_DTYPES):
        raise ModelLoadError(
            f"{LOGITS}: must be float32 or float16, got {_dtype_name(logits.elem_type)}"
        )
    if logits.shape is None:
        return None, None
    if len(logits.shape) != 3:
        raise ModelLoadError(f"{LOGITS}: rank {len(logits.shape)}, expected 3 [batch, seq, vocab]")
    vocab = logits.shape[2]
    return (vocab if isinstance(vocab, int) and vocab > 0 else None), logits.shape[1]


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    import onnx

    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _attention_windows(model: onnx.ModelProto, past_key_names: list[str]) -> tuple[int, ...]:
    """Each layer's sliding window (layer order of ``past_key_names``): the
    ``local_window_size`` of the GroupQueryAttention node reading its past key;
    0 for a global layer, a layer without that op, or the attribute's -1."""
    import onnx

    by_past = {}
    for node in _all_nodes(model):
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if len(node.input) > 3:
                by_past[node.input[3]] = max(0, int(attrs.get("local_window_size", -1)))
    return tuple(by_past.get(name, 0) for name in past_key_names)


def _all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    for graph in _graphs(model.graph):
        yield from graph.node
    for function in model.functions:
        yield from function.node


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    import onnx

    for graph in _graphs(model.graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def _external_data_sizes(model: onnx.ModelProto, onnx_path: Path) -> dict[str, int]:
    """(location → size in bytes) of every external-data file the graph names."""
    import onnx

    locations = set()
    for tensor in _all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
    sizes = {}
    for location in sorted(locations):
        file = onnx_path.parent / location
        if not file.is_file():
            raise ModelLoadError(
                f"{location}: external data file named by {onnx_path.name} is missing"
            )
        sizes[location] = file.stat().st_size
    return sizes


def _fingerprint(graph_bytes: bytes, external_sizes: Mapping[str, int]) -> str:
    """blake2b over the graph bytes and each external file's (name, size).

    See docs/design.md, "Model directory".

    Weights are not hashed (they can be gigabytes); a re-export changes the graph
    bytes or the data sizes. Every field is length-prefixed so no two inputs collide.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(_FINGERPRINT_VERSION)
    h.update(len(graph_bytes).to_bytes(8, "little"))
    h.update(graph_bytes)
    for location, size in sorted(external_sizes.items()):
        name = location.encode("utf-8")
        h.update(len(name).to_bytes(8, "little"))
        h.update(name)
        h.update(size.to_bytes(8, "little"))
    return h.hexdigest()
