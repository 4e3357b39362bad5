"""The float64 attention that llama.cpp's kernels are checked against (test helper)."""

from __future__ import annotations

import numpy as np


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None,
                        q_pos: np.ndarray, k_pos: np.ndarray, scale: float, *, softcap: float = 0.0,
                        alibi: np.ndarray | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """float64 attention per query head: q [n_q, n_head, d], k/v [n, H, d], bias [H, n] or None.

    Query head h reads KV head h // (n_head / H) (GQA); a query sees the cells
    at or before its position. ``k_pos`` is [n], or [H, n] where each KV head's
    cells hold tokens of their own positions (a per-head compaction). ``softcap``:
    logits become softcap * tanh(logits / softcap) (Gemma 2); ``alibi``: one slope
    per query head, adding slope * (k_pos - q_pos); ``sinks``: one learned logit per query
    head that joins every softmax's denominator (gpt-oss). Returns [n_q, n_head, d_v]."""
    n_q, n_head, _ = q.shape
    H = k.shape[1]
    group = n_head // H
    k_pos = np.broadcast_to(k_pos, (H, k.shape[0]))
    out = np.zeros((n_q, n_head, v.shape[2]))
    for qh in range(n_head):
        h = qh // group
        visible = k_pos[h][None, :] <= q_pos[:, None]
        logits = scale * (q[:, qh].astype(np.float64) @ k[:, h].astype(np.float64).T)
        if softcap:
            logits = softcap * np.tanh(logits / softcap)
        if alibi is not None:
            logits = logits + alibi[qh] * (k_pos[h][None, :] - q_pos[:, None])
        if bias is not None:
            logits = logits + bias[h][None, :]
        logits[~visible] = -np.inf
        top = logits.max(axis=1, keepdims=True)
        if sinks is not None:
            top = np.maximum(top, sinks[qh])
        p = np.exp(logits - top)
        p /= p.sum(axis=1, keepdims=True) + (np.exp(sinks[qh] - top) if sinks is not None else 0.0)
        out[:, qh] = p @ v[:, h].astype(np.float64)
    return out


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi's slope per query head, as ggml's soft_max computes them."""
    n_log2 = 1 << int(np.floor(np.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


def captured_attention(ctx, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(q [n_q, n_head, d_k], attention output [n_q, n_head, d_v]) of the last decode,
    from the context's capture (``Qcur`` and ``kqv_out`` wanted), V rotation undone."""
    from edgekv.kvcache.snapshot import hadamard

    arch = ctx.model.arch
    q = ctx.capture.get("Qcur", layer)
    out = ctx.capture.get("kqv_out", layer)
    assert q is not None and out is not None, f"layer {layer} not captured"
    assert q.shape[0] == 1 and out.shape[:2] == (1, 1)  # ggml's ne reversed: [1, n_q, n_head, d]
    q, out = q[0], out[0, 0]
    if ctx.v_rot:  # llama.cpp attends in the Hadamard-rotated V space and rotates back after kqv_out
        out = (out.reshape(-1, ctx.v_rot) @ hadamard(ctx.v_rot)).reshape(out.shape)
    return q, out.reshape(q.shape[0], arch.n_head, arch.head_dim_v)
