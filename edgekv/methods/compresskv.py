"""CompressKV ("CompressKV: Semantic Retrieval Heads Know What Tokens are Not
Important Before Generation", arXiv:2508.02401; notes in docs/methods.md).

SnapKV's vote, cast only by the heads that retrieve. Offline, once per model,
``edgekv calibrate`` finds each layer's semantic retrieval heads: the query
heads that put the most attention on a needle's answer span while the model
copies it out (``edgekv/calibrate.py``). Online, per layer, each of the
``heads`` best of them scores the cells before the window by the attention
its ``window`` newest queries pay them (summed), smoothed by an average pool
of ``kernel``; the heads' vectors are averaged and the layer keeps its top
cells plus the window, the same cells in every KV head (the paper's GQA-safe
choice). Defaults: the paper's window 8, kernel 5 (average), 4 heads.

The paper also gives each layer its own budget from an offline error profile.
Every layer of a llama.cpp cache holds the same number of cells, so a smaller
budget in one layer frees no memory unless all layers shrink; edgekv keeps one
budget for all layers and documents the allocation rather than faking it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import EdgekvError
from ..gguf_info import ModelInfo
from ..kvcache.snapshot import KVSnapshot
from ..profiles import HeadProfile, load_profile
from .base import ScorerMethod
from .snapkv import avg_pool, check_window


@dataclass
class CompressKV(ScorerMethod):
    """Keep what the model's retrieval heads attend to, one set per layer."""

    name = "compresskv"
    summary = "keep what calibrated semantic retrieval heads attend to, per layer (Lin et al. 2025)"
    needs = frozenset({"queries"})

    sinks: int = 0
    window: int = 8
    kernel: int = 5
    heads: int = 4
    profile: str = ""  # a profile file; default: the one `edgekv calibrate` wrote for this model
    _profile: HeadProfile | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, self.kernel)
        if self.heads < 1:
            raise ValueError(f"heads must be at least 1, got {self.heads}")

    @property
    def queries_needed(self) -> int:
        return self.window

    def params(self) -> dict[str, object]:
        return {k: v for k, v in super().params().items() if not k.startswith("_")}

    def attach(self, info: ModelInfo) -> None:
        p = load_profile(info.path, self.profile or None)
        layers = list(info.global_layers) if info.is_swa_model else list(range(info.n_layer))
        if list(p.layers) != layers or len(p.scores) != len(layers):
            raise EdgekvError(f"the CompressKV profile has {len(p.layers)} layers, {info.name} compresses "
                              f"{len(layers)} ({p.model} is not this model?)")
        if any(len(row) != info.n_head for row in p.scores):
            raise EdgekvError(f"the CompressKV profile was made for {len(p.scores[0])} query heads, "
                              f"{info.name} has {info.n_head}")
        self._profile = p

    def score(self, snap: KVSnapshot, layer: int) -> np.ndarray:
        if self._profile is None:
            raise EdgekvError("compresskv has no retrieval-head profile (a Session attaches it)")
        n = snap.n_cells
        w = min(self.window, n)
        heads = self._profile.top_heads(layer, self.heads)
        a = snap.head_attention(layer, self.window, heads)[:, : n - w]
        s = avg_pool(a, self.kernel).mean(axis=0)
        s = np.concatenate([s, np.full(w, np.inf)])
        return np.broadcast_to(s, (snap.n_kv_head, n))
