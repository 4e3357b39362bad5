"""Rotary position embedding of cached keys, by a distance per (layer, KV head, cell).

llama.cpp caches keys after RoPE. Moving a key to another position is one more
rotation by the distance moved (rotations compose): that is how llama.cpp's
K-shift works, one distance per cell for every head. A per-head compacted cell
holds a different token in each head, so giving the cells new positions
exactly needs a distance per (layer, head, cell), which this module applies on
the host, computing the angles as ggml's CPU rope does (float32 ``theta``
multiplied up from ``freq_base ** (-2 / n_rot)``, no YaRN).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..errors import EdgekvError

if TYPE_CHECKING:
    from ..llama import Model

ROPE_NORM = 0  # llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1)
ROPE_NEOX = 2  # LLAMA_ROPE_TYPE_NEOX: pairs (i, i + n_rot / 2)


@dataclass(frozen=True)
class Rope:
    """The RoPE a model applies to its keys: what re-rotating them needs."""

    mode: int
    n_rot: int
    freq_base: float
    freq_scale: float

    @classmethod
    def of(cls, model: Model, use: str = "re-rotating keys",
           instead: str = "run without position re-indexing") -> Rope:
        """The model's RoPE (read once per model), or a one-line error for the variants this
        module does not reproduce, saying which ``use`` needed it and what to do ``instead``."""
        cached = model.__dict__.get("_edgekv_rope")
        if cached is None:
            read = cls._read(model)
            if isinstance(read, str):
                raise EdgekvError(f"{use} is not supported for {model.arch.name} ({read}); {instead}")
            cached = model.__dict__["_edgekv_rope"] = read
        return cached

    @classmethod
    def unsupported(cls, model: Model) -> str | None:
        """Why this module does not reproduce the model's RoPE, or None when it does."""
        read = cls._read(model)
        return read if isinstance(read, str) else None

    @classmethod
    def _read(cls, model: Model) -> Rope | str:
        """The model's RoPE, or why this module does not reproduce it."""
        from ..gguf_info import read_gguf_header
        from ..llama import lib

        arch = model.arch
        why = None
        if arch.rope_type not in (ROPE_NORM, ROPE_NEOX):
            why = "no RoPE" if arch.rope_type < 0 else f"RoPE type {arch.rope_type}"
        elif arch.n_swa > 0:
            why = "sliding-window layers (two caches, two RoPE bases)"
        elif (model.meta(f"{arch.name}.rope.scaling.type") or "none") not in ("none", "linear"):
            why = f"{model.meta(f'{arch.name}.rope.scaling.type')} RoPE scaling"
        elif any(t.name.startswith(("rope_freqs", "rope_factors")) for t in read_gguf_header(model.path).tensors):
            why = "per-dimension RoPE frequency factors (Llama 3.1 style or LongRoPE)"
        elif float(model.meta(f"{arch.name}.rope.scaling.attn_factor") or 1.0) != 1.0:
            why = "a RoPE attention factor"
        if why:
            return why
        n_rot = int(model.meta(f"{arch.name}.rope.dimension_count") or arch.head_dim_k)
        base = float(model.meta(f"{arch.name}.rope.freq_base") or 10000.0)
        scale = float(lib().llama_model_rope_freq_scale_train(model.ptr))
        return cls(arch.rope_type, n_rot, base, scale)

    def angles(self, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) float32 [..., n_rot / 2] of the rotation by ``delta`` positions, pair by
        pair, computed as ggml's CPU rope does."""
        half = self.n_rot // 2
        theta_scale = np.float32(self.freq_base) ** np.float32(-2.0 / self.n_rot)
        theta = np.asarray(delta, np.float32)[..., None].repeat(half, axis=-1)
        for i in range(1, half):  # ggml: theta *= theta_scale, pair by pair, in float32
            theta[..., i] = theta[..., i - 1] * theta_scale
        theta *= np.float32(self.freq_scale)
        # cos/sin in float64, rounded once: what libm's cosf/sinf give ggml, whatever SIMD
        # kernels numpy's float32 cos/sin dispatch to on this CPU
        t = theta.astype(np.float64)
        return np.cos(t).astype(np.float32), np.sin(t).astype(np.float32)

    def pairs(self) -> tuple[slice, slice]:
        """The channels each rotation pair takes its first and second member from."""
        if self.mode == ROPE_NORM:
            return slice(0, self.n_rot, 2), slice(1, self.n_rot, 2)
        return slice(0, self.n_rot // 2), slice(self.n_rot // 2, self.n_rot)

    def rotate(self, k: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """Keys ``k`` float32 [..., n, head_dim] moved by ``delta`` int [..., n] positions."""
        k = np.array(k, np.float32)
        cos, sin = self.angles(delta)
        a, b = self.pairs()
        x0, x1 = k[..., a].copy(), k[..., b].copy()
        k[..., a] = x0 * cos - x1 * sin
        k[..., b] = x0 * sin + x1 * cos
        return k

    def mean_rotation(self, first: int, n: int, head_dim: int) -> np.ndarray:
        """float64 [head_dim, head_dim]: the rotation R(p) (column vectors, R q = the rotated
        q) averaged over the positions first..first+n-1; channels past ``n_rot`` stay put.
        Read-only: cached, as every layer of a compression asks for the same one."""
        return _mean_rotation(self, first, n, head_dim)


@lru_cache(maxsize=8)
def _mean_rotation(rope: Rope, first: int, n: int, head_dim: int) -> np.ndarray:
    cos, sin = rope.angles(np.arange(first, first + n))
    c, s = cos.astype(np.float64).mean(axis=0), sin.astype(np.float64).mean(axis=0)
    a, b = rope.pairs()
    idx = np.arange(head_dim)
    ia, ib = idx[a], idx[b]
    r = np.eye(head_dim)
    r[ia, ia], r[ib, ib] = c, c
    r[ia, ib], r[ib, ia] = -s, s
    r.flags.writeable = False
    return r
