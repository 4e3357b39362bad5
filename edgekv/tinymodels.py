"""Tiny random-weight GGUF models of many architecture families, made on demand.

edgekv must compress every model a user brings, but real checkpoints of each
family are gigabytes. What matters to a KV cache is the attention's shape (GQA,
QK-norm, sliding windows, soft-capping, learned or ALiBi positions, biases,
post-norms), not trained weights, so this module writes a few-MB GGUF per family
with seeded random weights and the hyperparameters that matter, with the
tensor and key names of the gguf-py that ships inside the vendored llama.cpp
(``scripts/setup.sh`` installs that copy), so libllama loads them as the real
thing. The vocabulary (and chat template) is copied from a real GGUF, the
default model's, so prompts tokenise as usual.

    path = make_tiny("qwen3", out_dir, vocab_from=default_model_path)

Nothing made here is committed: tests and ``edgekv models tiny`` make them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from .errors import EdgekvError


@dataclass(frozen=True)
class Shape:
    """The geometry every tiny model shares, and each family may change."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2  # GQA: two query heads per KV head
    head_dim: int = 16
    n_ff: int = 128
    n_ctx_train: int = 2048


@dataclass(frozen=True)
class TinySpec:
    """One family: its llama.cpp architecture name, geometry, extra metadata and tensors."""

    arch: str
    what: str  # the attention features this family exercises, in a few words
    shape: Shape = Shape()
    keys: dict[str, object] = field(default_factory=dict)  # "{arch}.xxx" -> value (or list), beyond the common ones
    norm_eps: str = "rms"  # "rms": attention.layer_norm_rms_epsilon, "ln": attention.layer_norm_epsilon
    tensors: Callable[[Shape], list[tuple[str, tuple[int, ...]]]] = field(default=lambda s: [])


# -- tensor layouts ---------------------------------------------------------------
# Shapes are ggml's (ne0 first), as llama.cpp's load_arch_tensors writes them.

def _global(s: Shape, *, norm_bias: bool = False, output: bool = False,
            pos_embd: bool = False, embd_norm: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    out = [("token_embd.weight", (s.n_embd, -1)), ("output_norm.weight", (s.n_embd,))]
    if norm_bias:
        out.append(("output_norm.bias", (s.n_embd,)))
    if output:
        out.append(("output.weight", (s.n_embd, -1)))
    if pos_embd:
        out.append(("position_embd.weight", (s.n_embd, s.n_ctx_train)))
    if embd_norm:
        out += [("token_embd_norm.weight", (s.n_embd,)), ("token_embd_norm.bias", (s.n_embd,))]
    return out


def _layers(s: Shape, *, qkv: str = "split", qkv_bias: bool = False, out_bias: bool = False,
            pre_norm: bool = True, norm_bias: bool = False, qk_norm: str = "", post_norms: bool = False,
            ffn: str = "gated", ffn_bias: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Per-layer tensors. ``qkv``: "split" (attn_q/k/v) or "fused" (attn_qkv); ``qk_norm``:
    "" none, "head" (one weight per head dim, Qwen3/Gemma 3), "full" (over all heads, OLMo 2);
    ``ffn``: "gated" (gate/up/down), "plain" (up/down), "fused" (Phi-3's gate and up in one)."""
    e, q, kv, f = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_ff
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(s.n_layer):
        b = f"blk.{i}."
        if pre_norm:
            out.append((b + "attn_norm.weight", (e,)))
            if norm_bias:
                out.append((b + "attn_norm.bias", (e,)))
        if qkv == "fused":
            out.append((b + "attn_qkv.weight", (e, q + 2 * kv)))
            if qkv_bias:
                out.append((b + "attn_qkv.bias", (q + 2 * kv,)))
        else:
            out += [(b + "attn_q.weight", (e, q)), (b + "attn_k.weight", (e, kv)), (b + "attn_v.weight", (e, kv))]
            if qkv_bias:
                out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        out.append((b + "attn_output.weight", (q, e)))
        if out_bias:
            out.append((b + "attn_output.bias", (e,)))
        if qk_norm == "head":
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,))]
        elif qk_norm == "full":
            out += [(b + "attn_q_norm.weight", (q,)), (b + "attn_k_norm.weight", (kv,))]
        if post_norms:
            out.append((b + "post_attention_norm.weight", (e,)))
        if pre_norm:
            out.append((b + "ffn_norm.weight", (e,)))
            if norm_bias:
                out.append((b + "ffn_norm.bias", (e,)))
        if ffn == "gated":
            out.append((b + "ffn_gate.weight", (e, f)))
        out += [(b + "ffn_up.weight", (e, 2 * f if ffn == "fused" else f)), (b + "ffn_down.weight", (f, e))]
        if ffn_bias:
            out += [(b + "ffn_up.bias", (f,)), (b + "ffn_down.bias", (e,))]
        if post_norms:
            out.append((b + "post_ffw_norm.weight", (e,)))
    return out


def _mamba(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Mamba's blocks (src/models/mamba.cpp), with d_inner = 2 * n_embd, d_conv 4, d_state 16
    and dt_rank 8 as the spec's keys say."""
    e, di, dc, ds, dr = s.n_embd, 2 * s.n_embd, 4, 16, 8
    out = _global(s)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "ssm_in.weight", (e, 2 * di)),
                (b + "ssm_conv1d.weight", (dc, di)), (b + "ssm_conv1d.bias", (di,)),
                (b + "ssm_x.weight", (di, dr + 2 * ds)), (b + "ssm_dt.weight", (dr, di)),
                (b + "ssm_dt.bias", (di,)), (b + "ssm_a", (ds, di)), (b + "ssm_d", (di,)),
                (b + "ssm_out.weight", (di, e))]
    return out


def _gpt_oss(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """gpt-oss (src/models/openai-moe.cpp): learned attention sinks, biases, 4 experts
    of ``n_ff`` each."""
    e, q, kv, f, x = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_ff, 4
    out = _global(s, output=True)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "post_attention_norm.weight", (e,)),
                (b + "attn_q.weight", (e, q)), (b + "attn_k.weight", (e, kv)), (b + "attn_v.weight", (e, kv)),
                (b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,)),
                (b + "attn_output.weight", (q, e)), (b + "attn_output.bias", (e,)),
                (b + "attn_sinks.weight", (s.n_head,)),
                (b + "ffn_gate_inp.weight", (e, x)), (b + "ffn_gate_inp.bias", (x,)),
                (b + "ffn_gate_exps.weight", (e, f, x)), (b + "ffn_gate_exps.bias", (f, x)),
                (b + "ffn_up_exps.weight", (e, f, x)), (b + "ffn_up_exps.bias", (f, x)),
                (b + "ffn_down_exps.weight", (f, e, x)), (b + "ffn_down_exps.bias", (e, x))]
    return out


def _llama4(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Llama 4 (src/models/llama4.cpp): dense and mixture-of-experts layers interleaved
    (every 2nd, with a shared expert), 4 experts of ``n_ff`` each."""
    e, f, x = s.n_embd, s.n_ff, 4
    out = _global(s)
    for i, layer in enumerate(_chunks(_layers(s), s.n_layer)):
        if i % 2 == 1:  # interleave_moe_layer_step 2: layers 1, 3, ... route to experts
            b = f"blk.{i}."
            layer = [t for t in layer if not t[0].startswith((b + "ffn_gate.", b + "ffn_up.", b + "ffn_down."))]
            layer += [(b + "ffn_gate_inp.weight", (e, x)), (b + "ffn_gate_exps.weight", (e, f, x)),
                      (b + "ffn_up_exps.weight", (e, f, x)), (b + "ffn_down_exps.weight", (f, e, x)),
                      (b + "ffn_gate_shexp.weight", (e, f)), (b + "ffn_up_shexp.weight", (e, f)),
                      (b + "ffn_down_shexp.weight", (f, e))]
        out += layer
    return out


def _chunks(tensors: list[tuple[str, tuple[int, ...]]], n_layer: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Per-layer tensors grouped by layer."""
    return [[t for t in tensors if t[0].startswith(f"blk.{i}.")] for i in range(n_layer)]


def _deepseek2(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V2's multi-head latent attention (src/models/deepseek2.cpp): each layer caches
    one 32-wide latent plus 16 RoPE channels for all heads; dense feed-forward layers."""
    e, h, rank, nope, rope, v = s.n_embd, s.n_head, 32, 16, 16, 16
    out = _global(s)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_kv_a_norm.weight", (rank,)),
                (b + "attn_q.weight", (e, h * (nope + rope))), (b + "attn_kv_a_mqa.weight", (e, rank + rope)),
                (b + "attn_k_b.weight", (nope, rank, h)), (b + "attn_v_b.weight", (rank, v, h)),
                (b + "attn_output.weight", (h * v, e)), (b + "ffn_norm.weight", (e,)),
                (b + "ffn_gate.weight", (e, s.n_ff)), (b + "ffn_up.weight", (e, s.n_ff)),
                (b + "ffn_down.weight", (s.n_ff, e))]
    return out


def _lfm2(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """LFM2 (src/models/lfm2.cpp): short-convolution layers (0 KV heads) between attention
    layers with QK-norm; its final norm is named ``token_embd_norm``."""
    e, f, kv = s.n_embd, s.n_ff, s.n_head_kv * s.head_dim
    out = [("token_embd.weight", (e, -1)), ("token_embd_norm.weight", (e,))]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (e, f)),
                (b + "ffn_up.weight", (e, f)), (b + "ffn_down.weight", (f, e))]
        if i % 2:  # attention
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,)),
                    (b + "attn_q.weight", (e, e)), (b + "attn_k.weight", (e, kv)), (b + "attn_v.weight", (e, kv)),
                    (b + "attn_output.weight", (e, e))]
        else:  # short convolution: recurrent state
            out += [(b + "shortconv.conv.weight", (3, e)), (b + "shortconv.in_proj.weight", (e, 3 * e)),
                    (b + "shortconv.out_proj.weight", (e, e))]
    return out


def _llama_like(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    return _global(s) + _layers(s)


SPECS: dict[str, TinySpec] = {s.arch: s for s in [
    TinySpec("llama", "RoPE, GQA", tensors=_llama_like),
    TinySpec("mistral3", "RoPE, GQA (Mistral Small 3's text model)", tensors=_llama_like),
    TinySpec("qwen2", "RoPE, GQA, Q/K/V biases",
             tensors=lambda s: _global(s) + _layers(s, qkv_bias=True)),
    TinySpec("qwen3", "RoPE, GQA, QK-norm",
             tensors=lambda s: _global(s) + _layers(s, qk_norm="head")),
    TinySpec("phi3", "RoPE, fused QKV and gate-up",
             shape=Shape(n_head_kv=4),
             tensors=lambda s: _global(s) + _layers(s, qkv="fused", ffn="fused")),
    TinySpec("gemma2", "alternating sliding windows, attention and final logit soft-capping, post-norms",
             keys={"attention.sliding_window": 32, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0},
             tensors=lambda s: _global(s) + _layers(s, post_norms=True)),
    TinySpec("gemma3", "5 sliding-window layers to 1 global, QK-norm, post-norms",
             shape=Shape(n_layer=6),
             keys={"attention.sliding_window": 32},
             tensors=lambda s: _global(s) + _layers(s, qk_norm="head", post_norms=True)),
    TinySpec("olmo2", "RoPE, QK-norm over all heads, post-norms only",
             shape=Shape(n_head_kv=4),
             tensors=lambda s: _global(s, output=True) + _layers(s, pre_norm=False, qk_norm="full",
                                                                  post_norms=True)),
    TinySpec("smollm3", "RoPE on 3 of every 4 layers (NoPE on the 4th), GQA", tensors=_llama_like),
    TinySpec("granite", "RoPE, GQA, embedding/residual/attention/logit scales",
             keys={"logit_scale": 2.0, "embedding_scale": 1.5, "residual_scale": 0.5,
                   "attention.scale": 0.2},
             tensors=_llama_like),
    TinySpec("starcoder2", "RoPE, GQA, LayerNorm, biases everywhere, plain MLP",
             norm_eps="ln",
             tensors=lambda s: _global(s, norm_bias=True) + _layers(s, qkv_bias=True, out_bias=True,
                                                                    norm_bias=True, ffn="plain", ffn_bias=True)),
    TinySpec("gpt2", "learned absolute positions (no RoPE), fused QKV, LayerNorm",
             shape=Shape(n_head_kv=4), norm_eps="ln",
             tensors=lambda s: _global(s, norm_bias=True, pos_embd=True)
             + _layers(s, qkv="fused", qkv_bias=True, out_bias=True, norm_bias=True, ffn="plain", ffn_bias=True)),
    TinySpec("gpt-oss", "learned attention sinks, alternating sliding windows, mixture of experts",
             keys={"attention.sliding_window": 32, "expert_count": 4, "expert_used_count": 2,
                   "expert_feed_forward_length": 128},
             tensors=_gpt_oss),
    TinySpec("llama4", "chunked attention on 3 of every 4 layers, NoPE on the 4th, experts",
             keys={"expert_count": 4, "expert_used_count": 1, "interleave_moe_layer_step": 2,
                   "expert_feed_forward_length": 128},
             tensors=_llama4),
    TinySpec("deepseek2", "multi-head latent attention (MLA): one latent per layer for all heads",
             shape=Shape(n_head_kv=1),
             keys={"attention.key_length": 48, "attention.value_length": 32, "attention.q_lora_rank": 0,
                   "attention.kv_lora_rank": 32, "attention.key_length_mla": 32, "attention.value_length_mla": 16,
                   "rope.dimension_count": 16, "leading_dense_block_count": 4, "expert_feed_forward_length": 128,
                   "expert_shared_count": 0},
             tensors=_deepseek2),
    TinySpec("qwen2vl", "multimodal RoPE (M-RoPE): positions in sections, refused",
             keys={"rope.dimension_sections": [2, 3, 3, 0]},
             tensors=lambda s: _global(s) + _layers(s, qkv_bias=True)),
    TinySpec("lfm2", "short convolutions between attention layers (hybrid: recurrent state), refused",
             keys={"shortconv.l_cache": 3, "attention.head_count_kv": [0, 2, 0, 2]},
             tensors=_lfm2),
    TinySpec("mamba", "no attention: a selective state space (recurrent state), refused",
             shape=Shape(n_head=0, n_head_kv=0, n_ff=0),
             keys={"ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.time_step_rank": 8},
             tensors=_mamba),
    TinySpec("bloom", "ALiBi positions (no RoPE), fused QKV, LayerNorm",
             shape=Shape(n_head_kv=4), norm_eps="ln",
             tensors=lambda s: _global(s, norm_bias=True, embd_norm=True)
             + _layers(s, qkv="fused", qkv_bias=True, out_bias=True, norm_bias=True, ffn="plain", ffn_bias=True)),
]}


def _gguf():
    import gguf

    return gguf


@cache
def _vocab_fields(path: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, array subtype) of every ``tokenizer.*`` field of a GGUF (read once
    per process: gguf-py's reader takes seconds over a large vocabulary)."""
    gguf = _gguf()
    r = gguf.GGUFReader(path)
    out = []
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        out.append((name, f.contents(), vtype, sub))
    return out


def _n_vocab(fields: list[tuple[str, object, object, object]]) -> int:
    for name, value, _, _ in fields:
        if name == "tokenizer.ggml.tokens":
            return len(value)  # type: ignore[arg-type]
    raise EdgekvError("the vocabulary GGUF has no tokenizer.ggml.tokens")


def make_tiny(arch: str, out_dir: str | Path, *, vocab_from: str | Path, seed: int = 0) -> Path:
    """Write ``<out_dir>/tiny-<arch>.gguf`` (``tiny-<arch>-s<seed>.gguf`` for another seed;
    made again only when missing) and return its path."""
    spec = SPECS.get(arch)
    if spec is None:
        raise EdgekvError(f"no tiny model for {arch!r}; one of: {', '.join(SPECS)}")
    gguf = _gguf()
    out = Path(out_dir) / (f"tiny-{arch}.gguf" if seed == 0 else f"tiny-{arch}-s{seed}.gguf")
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    s = spec.shape
    vocab = _vocab_fields(Path(vocab_from))
    n_vocab = _n_vocab(vocab)
    known = {gguf.TENSOR_NAMES[t].format(bid="{bid}") for t in gguf.MODEL_TENSORS[_arch_enum(arch)]}
    w = gguf.GGUFWriter(str(out) + ".part", arch)
    # no architecture in the name: llama.cpp keys vocabulary fixes on it ("phi3" wants Phi's tokens)
    w.add_name("edgekv tiny model")
    keys: dict[str, object] = {"context_length": s.n_ctx_train, "embedding_length": s.n_embd,
                               "block_count": s.n_layer, "feed_forward_length": s.n_ff,
                               "attention.head_count": s.n_head, "attention.head_count_kv": s.n_head_kv}
    if s.n_head:
        keys |= {"attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
                 "rope.freq_base": 10000.0}
    if spec.norm_eps == "rms":
        keys["attention.layer_norm_rms_epsilon"] = 1e-6
    else:
        keys["attention.layer_norm_epsilon"] = 1e-5
    keys |= spec.keys  # the family's own, overriding the common ones
    for k, v in keys.items():
        if isinstance(v, list):
            w.add_array(f"{arch}.{k}", v)
        elif isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", int(v))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, value, vtype, sub in vocab:
        w.add_key_value(name, value, vtype, sub)
    rng = np.random.default_rng([seed, *arch.encode()])
    for name, ggml_shape in spec.tensors(s):
        template = re.sub(r"^blk\.\d+\.", "blk.{bid}.", re.sub(r"\.(weight|bias)$", "", name))
        if template not in known:
            raise EdgekvError(f"{arch}: gguf-py names no tensor {template!r} for this architecture "
                              "(is the vendored gguf-py installed? rerun scripts/setup.sh)")
        shape = tuple(n_vocab if d == -1 else d for d in reversed(ggml_shape))  # numpy order
        if name.endswith("attn_sinks.weight"):  # a sink logit per head, in the range of the real ones
            a = rng.normal(1.0, 1.0, shape).astype(np.float32)
        elif len(shape) == 1:  # norms at 1 (Gemma's too: its converter stores 1 + w), biases small
            a = np.ones(shape, np.float32) if name.endswith("norm.weight") else \
                rng.normal(0, 0.02, shape).astype(np.float32)
        else:
            a = rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(np.float32)
            if name == "token_embd.weight" or name == "output.weight":
                a = a.astype(np.float16)  # the vocabulary dominates the file: half the bytes
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(out) + ".part").replace(out)
    return out


def _arch_enum(arch: str):
    gguf = _gguf()
    for k, v in gguf.MODEL_ARCH_NAMES.items():
        if v == arch:
            return k
    raise EdgekvError(f"gguf-py knows no architecture {arch!r} (is the vendored gguf-py installed?)")
