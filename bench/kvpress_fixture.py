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
writes tests/data/kvpress_fixture.npz.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from kvpress import ChunkKVPress, SnapKVPress
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


def main() -> None:
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
                        meta=np.array([N, WINDOW, KERNEL, CHUNK]),
                        versions=np.array([f"kvpress {version('kvpress')}", f"torch {version('torch')}",
                                           f"transformers {version('transformers')}"]), **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
