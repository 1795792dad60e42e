"""A GroupQueryAttention graph's twin that checks several sequences' guesses
in one call (docs/design.md, "Speculative decoding").

ONNX Runtime's CPU GroupQueryAttention refuses several rows of several tokens
over a past ("batch_size must be 1 when sequence_length > 1 and past context is
given", onnxruntime 1.32), so a step that checks B sequences' guesses would
cost B calls of the model. The twin is the same graph, built from it when the
runner loads (same weights, read from the same files), with each
GroupQueryAttention node replaced by the attention it computes, written in
plain and contrib ops that take any batch:

- the new tokens' queries and keys rotated at their positions (``RotaryEmbedding``,
  the node's own cos/sin tables and interleaving), when the node rotates;
- scores against the whole past buffer (``FusedMatMul`` with the keys
  transposed in place, no copy) and against the new keys, joined, plus
  ``verify.attention_bias`` ``[rows, 1, new, capacity + new]`` (0 where a
  row may attend: its valid past, and causally its new tokens; -inf
  elsewhere), or for a sliding-window layer its window's bias
  (``window_bias``: the same, less what lies ``local_window_size`` or more
  positions back), a softmax, and the two products with the values;
- the new tokens' keys (rotated) and values as outputs
  (``verify.new.{i}.key``/``.value``, ``[rows, kv_heads, new, head_dim]``),
  which the runner writes into its buffers after the call: the past buffers
  are inputs only.

Built only where that is the same attention: no soft-capping, rotary over
the whole head, none of the newer optional inputs (position ids, bias,
sinks); ``build_verify_graph`` says why not otherwise, and the runner checks
one sequence per call as before. The twin's logits differ from
GroupQueryAttention's by float rounding only (~3e-5 on the default model's
fp32 logits, ~1e-4 on Gemma 3's past its 512-token window), as a
several-token check already does from a one-token step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...model.model_dir import POSITION_IDS

MS_DOMAIN = "com.microsoft"
BIAS = "verify.attention_bias"
POSITIONS = POSITION_IDS  # a graph's own position_ids input, when it has one
NEW_POSITIONS = "verify.position_ids"  # else the twin's
# GroupQueryAttention's inputs the twin reads, by position.
PAST_KEY, PAST_VALUE, COS_CACHE, SIN_CACHE = 3, 4, 7, 8


# GroupQueryAttention attributes whose meaning the twin reproduces (others: refused).
KNOWN_ATTRIBUTES = frozenset(
    {
        "num_heads",
        "kv_num_heads",
        "scale",
        "local_window_size",
        "softcap",
        "do_rotary",
        "rotary_interleaved",
        "smooth_softmax",
    }
)
# The first onnxruntime whose CPU kernel's window is the one the twin's bias
# builds: a query at position q sees positions q - local_window_size + 1 .. q
# (1.32; releases around 1.20 also saw q - local_window_size).
WINDOWS_FROM = (1, 32)


def windows_supported() -> bool:
    """Whether this onnxruntime masks sliding windows as the twin does."""
    import onnxruntime

    parts = onnxruntime.__version__.split(".")[:2]
    return tuple(int("".join(ch for ch in x if ch.isdigit()) or 0) for x in parts) >= WINDOWS_FROM


WINDOW_BIAS = f"{BIAS}.window."


def window_bias(window: int) -> str:
    """The bias input of the layers that attend to the last ``window`` positions
    (GroupQueryAttention's ``local_window_size``): ``WINDOW_BIAS`` + the window."""
    return f"{WINDOW_BIAS}{window}"


def new_kv_names(layer: int) -> tuple[str, str]:
    """The twin's outputs of layer ``layer``: the new tokens' keys and values."""
    return f"verify.new.{layer}.key", f"verify.new.{layer}.value"


class Unsupported(ValueError):
    """The graph has no twin (the reason is the message)."""


def build_verify_graph(
    model: onnx.ModelProto,
    past_names: Sequence[tuple[str, str]],
    kv_dtype: np.dtype,
    head_dim: int,
) -> onnx.ModelProto:
    """The twin of ``model`` (a GroupQueryAttention decoder whose layers read
    ``past_names``, KV of ``kv_dtype`` with heads of ``head_dim``); raises
    ``Unsupported`` when some node computes an attention the twin does not, or
    the graph is built in a way the twin's surgery does not follow."""
    graph = model.graph
    _check_plain(model)
    layer_of = {k: i for i, (k, _) in enumerate(past_names)}
    inits = {t.name: t for t in graph.initializer}
    dtype = helper.np_dtype_to_tensor_dtype(np.dtype(kv_dtype))
    consts: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    # The new tokens' positions: the graph's own position_ids input, else one of ours.
    positions = POSITIONS if any(i.name == POSITIONS for i in graph.input) else NEW_POSITIONS
    read = {i for n in graph.node for i in n.input}

    def const(name: str, values: list[int]) -> str:
        consts.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
        return name

    def add(op: str, inputs: list[str], output: str, domain: str = "", **attrs: Any) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, domain=domain, **attrs))
        return output

    # The split of each layer's scores into past and new columns: [capacity, new].
    add("Shape", [next(iter(layer_of))], "verify/capacity", start=2, end=3)
    add("Shape", ["input_ids"], "verify/new_tokens", start=1, end=2)
    add("Concat", ["verify/capacity", "verify/new_tokens"], "verify/past_new", axis=0)
    replaced: set[int] = set()
    # (query heads per KV head, bias input) -> the bias tiled to its rows
    biases: dict[tuple[int, str], str] = {}
    for node in graph.node:
        if not (node.op_type == "GroupQueryAttention" and node.domain == MS_DOMAIN):
            nodes.append(node)
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        name = node.name or node.output[0]
        unknown = sorted(set(a) - KNOWN_ATTRIBUTES)
        if unknown:  # e.g. onnxruntime-genai's sliding_window_cache: other buffer coordinates
            raise Unsupported(f"{name}: attributes {unknown}")
        window = max(int(a.get("local_window_size", -1)), -1)  # -1: none (as any negative)
        if window == 0:
            raise Unsupported(f"{name}: a zero-length sliding window")
        if window > 0 and not windows_supported():
            raise Unsupported(f"{name}: sliding windows need onnxruntime >= 1.32's")
        if a.get("softcap", 0.0):
            raise Unsupported(f"{name}: soft-capped scores (softcap)")
        if a.get("smooth_softmax", 0) or any(node.input[9:]) or len(node.input) < 5:
            raise Unsupported(f"{name}: inputs or options past the past, lengths and rotary")
        if any(o in read for o in node.output[1:] if o):
            raise Unsupported(f"{name}: its present keys or values feed other nodes")
        layer = layer_of.get(node.input[PAST_KEY])
        if layer is None or layer in replaced or node.input[PAST_VALUE] != past_names[layer][1]:
            raise Unsupported(f"{name}: its past inputs are not one layer's own")
        replaced.add(layer)
        heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
        group = heads // kv_heads
        p = f"verify/{layer}"
        past_k, past_v = node.input[PAST_KEY], node.input[PAST_VALUE]
        if node.input[1]:  # separate query, key, value
            q, k, v = node.input[0], node.input[1], node.input[2]
        else:  # packed [q | k | v]
            q, k, v = f"{p}/q", f"{p}/k", f"{p}/v"
            sizes = const(f"{p}/qkv", [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            nodes.append(
                helper.make_node(
                    "Split", [node.input[0], sizes], [q, k, v], name=f"{p}/split", axis=-1
                )
            )
        if a.get("do_rotary", 0):
            if len(node.input) <= SIN_CACHE:
                raise Unsupported(f"{name}: rotary without its cos/sin tables")
            cos, sin = node.input[COS_CACHE], node.input[SIN_CACHE]
            table = inits.get(cos)
            if table is None or len(table.dims) != 2 or 2 * table.dims[1] != head_dim:
                raise Unsupported(f"{name}: rotary over part of the head (or no cos table)")
            interleaved = int(a.get("rotary_interleaved", 0))
            q, k = (
                add(
                    "RotaryEmbedding",
                    [x, positions, cos, sin],
                    f"{p}/{tag}_rot",
                    MS_DOMAIN,
                    interleaved=interleaved,
                    num_heads=n_heads,
                )
                for x, n_heads, tag in ((q, heads, "q"), (k, kv_heads, "k"))
            )
        scale = float(a.get("scale", 0.0)) or 1.0 / float(np.sqrt(head_dim))
        new_k, new_v = new_kv_names(layer)
        # q [B, S, H*d] -> [B, KV, G*S, d] (query head h reads kv head h // G)
        q = add("Reshape", [q, const(f"{p}/q5", [0, 0, kv_heads, group, head_dim])], f"{p}/q5r")
        q = add("Transpose", [q], f"{p}/qt", perm=[0, 2, 3, 1, 4])
        q = add("Reshape", [q, const(f"{p}/q4", [0, kv_heads, -1, head_dim])], f"{p}/q4r")
        kv_shape = const(f"{p}/kv4", [0, 0, kv_heads, head_dim])
        k = add("Reshape", [k, kv_shape], f"{p}/k4")
        add("Transpose", [k], new_k, perm=[0, 2, 1, 3])
        v = add("Reshape", [v, kv_shape], f"{p}/v4")
        add("Transpose", [v], new_v, perm=[0, 2, 1, 3])
        scores = add(
            "Concat",
            [
                add("FusedMatMul", [q, past_k], f"{p}/s_past", MS_DOMAIN, transB=1, alpha=scale),
                add("FusedMatMul", [q, new_k], f"{p}/s_new", MS_DOMAIN, transB=1, alpha=scale),
            ],
            f"{p}/scores",
            axis=-1,
        )  # [B, KV, G*S, T]
        layer_bias = window_bias(window) if window > 0 else BIAS
        if (group, layer_bias) not in biases:  # each query row's: rows are (group, token)
            reps = f"verify/bias_reps_{group}"
            if not any(g == group for g, _ in biases):  # its repeats, once per group
                const(reps, [1, 1, group, 1])
            biases[group, layer_bias] = add("Tile", [layer_bias, reps], f"{layer_bias}/x{group}")
        probs = add(
            "Softmax",
            [add("Add", [scores, biases[group, layer_bias]], f"{p}/biased")],
            f"{p}/probs",
            axis=-1,
        )
        p_past, p_new = f"{p}/p_past", f"{p}/p_new"
        nodes.append(
            helper.make_node(
                "Split", [probs, "verify/past_new"], [p_past, p_new], name=f"{p}/p_split", axis=-1
            )
        )
        out = add(
            "Add",
            [
                add("MatMul", [p_past, past_v], f"{p}/o_past"),
                add("MatMul", [p_new, new_v], f"{p}/o_new"),
            ],
            f"{p}/o4",
        )
        # [B, KV, G*S, d] -> [B, KV, G, S, d] -> [B, S, KV, G, d] -> [B, S, H*d]
        out = add(
            "Reshape", [out, const(f"{p}/o5", [0, kv_heads, group, -1, head_dim])], f"{p}/o5r"
        )
        out = add("Transpose", [out], f"{p}/ot", perm=[0, 3, 1, 2, 4])
        add("Reshape", [out, const(f"{p}/o3", [0, 0, heads * head_dim])], node.output[0])
        outputs += [helper.make_tensor_value_info(kv, dtype, None) for kv in (new_k, new_v)]
    if replaced != set(range(len(past_names))):
        raise Unsupported("not every layer's past is read by one GroupQueryAttention node")
    # Logits of several tokens per row: no declared [batch, 1, vocab] (ORT would
    # refuse the caller's array of [rows, new, vocab] bound to it).
    logits = next(o for o in graph.output if o.name == "logits")
    kept_outputs = [
        helper.make_tensor_value_info("logits", logits.type.tensor_type.elem_type, None),
        *outputs,
    ]
    nodes = _live(nodes, {o.name for o in kept_outputs})
    used = {i for n in nodes for i in n.input}
    inputs = [i for i in graph.input if i.name in used]
    known = {"input_ids", POSITIONS, *layer_of, *(v for _, v in past_names)}
    extra = [i.name for i in inputs if i.name not in known and i.name not in inits]
    if extra:
        raise Unsupported(f"the graph's other inputs {extra} feed more than the attention")
    if positions == NEW_POSITIONS and NEW_POSITIONS in used:
        inputs.append(
            helper.make_tensor_value_info(NEW_POSITIONS, TensorProto.INT64, ["batch_size", "new"])
        )
    for name in sorted({bias for _, bias in biases}):  # the global one, each window's
        inputs.append(helper.make_tensor_value_info(name, dtype, ["batch_size", 1, "new", "all"]))
    initializers = [t for t in graph.initializer if t.name in used] + consts
    twin = helper.make_graph(nodes, f"{graph.name}-verify", inputs, kept_outputs, initializers)
    out_model = helper.make_model(
        twin, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )
    if not any(o.domain == MS_DOMAIN for o in out_model.opset_import):
        out_model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out_model


def _check_plain(model: onnx.ModelProto) -> None:
    """What the surgery relies on: one flat graph (no subgraphs, whose outer
    names it would not follow; no model-local functions) at opset 15 or later
    (``Shape`` with start/end)."""
    if model.functions:
        raise Unsupported("model-local functions")
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for n in model.graph.node
        for a in n.attribute
    ):
        raise Unsupported("nodes with subgraphs")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 15:
        raise Unsupported(f"opset {opset} (the twin needs 15 or later)")


def _live(nodes: list[onnx.NodeProto], wanted: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` (in topological order) that some wanted output depends on."""
    need = set(wanted)
    kept = []
    for node in reversed(nodes):
        if any(o in need for o in node.output):
            kept.append(node)
            need.update(i for i in node.input if i)
    return kept[::-1]
