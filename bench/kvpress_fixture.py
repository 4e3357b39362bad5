#!/usr/bin/env python3
"""Write the kvpress cross-check fixture: kvpress's own kept sets on known K/V and queries.

kvpress (NVIDIA's PyTorch reference for SnapKV and ChunkKV) runs here on
three random Llama attention layers (GQA: 6 query heads on 2 KV heads, head
size 16, 200 tokens): its ``SnapKVPress`` (window 64, kernel 5) and
``ChunkKVPress`` over it (chunk 20) compress each layer at two ratios. The
values carry each token's position in channel 0, so the positions that
survive kvpress's gather are its kept set. The fixture stores the post-RoPE
queries of the window exactly as kvpress computes them (``q_proj`` then
RoPE), the keys, the values and the kept sets, so ``tests/test_kvpress.py``
can check edgekv's ``snapkv`` and ``chunkkv per_layer=true`` against kvpress
without torch.

Needs the optional dependencies (``pip install -e .[compare]``: torch,
transformers, kvpress); run once, commit the result:

    python bench/kvpress_fixture.py
writes tests/data/kvpress_fixture.npz and tests/data/kvpress_frontier.npz.

The second file holds the query-agnostic frontier's scoring steps, for
``tests/test_frontier_parity.py``: ``ExpectedAttentionPress.score`` (with its
defaults, and with neither covariance nor value norm) on the pre-RoPE queries
of a whole prefill, and ``KVzipPress.score_kvzip`` on the post-RoPE queries of
a repeat pass over two chunks of the context (one from the start, one past the
sinks), both on the same random layers as above.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from kvpress import ChunkKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    rotate_half,
)

N, WINDOW, KERNEL, CHUNK = 200, 64, 5, 20
LAYERS = 3
RATIOS = (0.5, 0.6)  # ChunkKVPress keeps int(10 chunks * (1 - ratio)) chunks: 5 and 4, so its window (64) stays
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "kvpress_fixture.npz"
FRONTIER = OUT.with_name("kvpress_frontier.npz")
CTX, REPEAT = 120, 72  # KVzip: context cells, repeat-pass tokens
CHUNKS = ((0, 60), (40, 100))  # the context chunk each repeat pass reconstructs


def main() -> None:
    snapkv_chunkkv()
    frontier()


def versions() -> np.ndarray:
    return np.array([f"kvpress {version('kvpress')}", f"torch {version('torch')}",
                     f"transformers {version('transformers')}"])


def snapkv_chunkkv() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, num_hidden_layers=LAYERS, max_position_embeddings=1024)
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(N)[None]
    out: dict[str, np.ndarray] = {}
    qs, ks, vs = [], [], []
    for layer in range(LAYERS):
        attn = LlamaAttention(cfg, layer_idx=layer).eval()
        hidden = torch.randn(1, N, cfg.hidden_size)
        cos, sin = rope(hidden, pos)
        with torch.no_grad():
            q = attn.q_proj(hidden).view(1, N, 6, 16).transpose(1, 2)
            k = attn.k_proj(hidden).view(1, N, 2, 16).transpose(1, 2)
            q = q * cos[:, None] + rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            v = torch.randn(1, 2, N, 16)
            v[..., 0] = torch.arange(N, dtype=v.dtype)  # each token's position rides along the gather
            for ratio in RATIOS:
                presses = {"snapkv": SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)}
                presses["chunkkv"] = ChunkKVPress(press=SnapKVPress(compression_ratio=ratio, window_size=WINDOW,
                                                                    kernel_size=KERNEL), chunk_length=CHUNK)
                for name, press in presses.items():
                    _, kept_v = press.compress(attn, hidden, k, v, None, {"position_embeddings": (cos, sin)})
                    kept = kept_v[0, :, :, 0].round().long().sort(dim=-1).values.numpy()  # [H, n_kept]
                    out[f"{name}_{ratio}_layer{layer}"] = kept.astype(np.int32)
        qs.append(q[0, :, N - WINDOW :].numpy())  # [n_head, window, d], post-RoPE
        ks.append(k[0].transpose(0, 1).numpy())  # [N, H, d]
        vs.append(v[0].transpose(0, 1).numpy())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, q=np.stack(qs).astype(np.float32), k=np.stack(ks).astype(np.float32),
                        v=np.stack(vs).astype(np.float32), ratios=np.array(RATIOS),
                        meta=np.array([N, WINDOW, KERNEL, CHUNK]), versions=versions(), **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


def frontier() -> None:
    """Expected Attention's and KVzip's scores, as kvpress computes them, on random layers."""
    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, num_hidden_layers=LAYERS, max_position_embeddings=1024)
    rope = LlamaRotaryEmbedding(cfg)
    out: dict[str, np.ndarray] = {}
    for layer in range(LAYERS):
        attn = LlamaAttention(cfg, layer_idx=layer).eval()
        attn.rotary_emb = rope  # kvpress's pipeline hands the model's rotary embedding to each layer
        with torch.no_grad():
            # Expected Attention: a prefill of N tokens, scored with the queries' statistics
            hidden = torch.randn(1, N, cfg.hidden_size) * 2.0
            cos, sin = rope(hidden, torch.arange(N)[None])
            q = attn.q_proj(hidden).view(1, N, 6, 16).transpose(1, 2)  # before RoPE
            k = attn.k_proj(hidden).view(1, N, 2, 16).transpose(1, 2)
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            v = torch.randn(1, 2, N, 16) * torch.rand(1, 2, N, 1) * 3  # value norms that differ
            for tag, kw in (("default", {}), ("plain", {"use_covariance": False, "use_vnorm": False})):
                press = ExpectedAttentionPress(**kw)
                out[f"ea_{tag}_layer{layer}"] = press.score(attn, hidden, k, v, None, {})[0].numpy()
            out[f"ea_q_layer{layer}"] = q[0].numpy()  # [n_head, N, d], pre-RoPE
            out[f"ea_k_layer{layer}"] = k[0].transpose(0, 1).numpy()  # [N, H, d], post-RoPE
            out[f"ea_v_layer{layer}"] = v[0].transpose(0, 1).numpy()

            # KVzip: a context of CTX cells, then a repeat pass of REPEAT tokens after it
            ctx_hidden = torch.randn(1, CTX, cfg.hidden_size)
            rep_hidden = torch.randn(1, REPEAT, cfg.hidden_size)
            allpos = torch.arange(CTX + REPEAT)[None]
            cos, sin = rope(ctx_hidden, allpos)
            keys = attn.k_proj(torch.cat([ctx_hidden, rep_hidden], dim=1)).view(1, -1, 2, 16).transpose(1, 2)
            keys = keys * cos[:, None] + rotate_half(keys) * sin[:, None]
            values = torch.randn(1, 2, CTX + REPEAT, 16)
            rcos, rsin = cos[:, CTX:], sin[:, CTX:]
            rq = attn.q_proj(rep_hidden).view(1, REPEAT, 6, 16).transpose(1, 2)
            rq = rq * rcos[:, None] + rotate_half(rq) * rsin[:, None]
            for lo, hi in CHUNKS:
                press = KVzipPress()
                press.context_length, press.start_idx, press.end_idx = CTX, lo, hi
                press.score_val = torch.zeros(LAYERS, 1, 2, CTX)
                press.score_kvzip(attn, rep_hidden, keys, values, None, {"position_embeddings": (rcos, rsin)})
                out[f"kvzip_{lo}_{hi}_layer{layer}"] = press.score_val[layer, 0].numpy()
            out[f"kvzip_q_layer{layer}"] = rq[0].numpy()  # [n_head, REPEAT, d], post-RoPE
            out[f"kvzip_k_layer{layer}"] = keys[0].transpose(0, 1).numpy()  # [CTX + REPEAT, H, d]
    np.savez_compressed(FRONTIER, meta=np.array([N, CTX, REPEAT]), chunks=np.array(CHUNKS),
                        rope_theta=np.array(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters")
                                            else cfg.rope_theta), versions=versions(),
                        **{k: np.asarray(a, np.float32) for k, a in out.items()})
    print(f"wrote {FRONTIER} ({FRONTIER.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
