"""Which model architectures edgekv compresses, read from a GGUF header.

A verdict per architecture family: ``supported`` where the architecture matrix
(``tests/test_archs.py``, on the tiny models of ``tinymodels.py``) checks it,
``refused`` where edgekv will not load it, and ``unverified`` for what loads
but the matrix does not yet check, with the reason it might not be exact.
``edgekv info`` prints it; docs/architectures.md is the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gguf_info import ModelInfo

# the families the architecture matrix runs (tests/test_archs.py): a tiny model of each
# passes every method on both engines, session files, +rerotate where RoPE allows it
TESTED = ("llama", "mistral3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "granite",
          "starcoder2", "gpt2", "smollm3", "gpt-oss", "llama4", "bloom")


MLA_REFUSAL = ("multi-head latent attention caches one latent per layer with V a view of K, and llama.cpp's "
               "state of that cache holds no V, which edgekv's engines cannot parse or compact yet")


@dataclass(frozen=True)
class Verdict:
    status: str  # "supported", "refused" or "unverified"
    attention: str  # full, or sliding windows beside full layers
    positions: str  # RoPE, learned, ALiBi
    kv_layout: str
    notes: tuple[str, ...]  # what applies (engines, methods), or why it is refused / unverified

    def line(self) -> str:
        return f"{self.status}: " + "; ".join(self.notes)


def verdict(info: ModelInfo) -> Verdict:
    """The verdict for the model ``info`` describes."""
    kind = "chunked attention (chunks of" if info.arch == "llama4" else "sliding window ("
    attention = (f"{kind} {info.sliding_window}) on {sum(info.swa_layers)} of {info.n_layer} layers"
                 if info.is_swa_model else "full")
    positions = {"rope": "RoPE", "learned": "learned (absolute embeddings)", "alibi": "ALiBi"}[info.positions]
    layout = (f"one {info.kv_lora_rank}-wide latent per layer for all heads, V a view of it (MLA)" if info.mla
              else f"K and V per KV head ({info.n_head_kv} KV heads of {info.n_head})")
    if info.recurrent:
        return Verdict("refused", attention, positions, "recurrent state" + (" beside attention" if info.n_head else ""),
                       ("keeps recurrent state, which cannot be pruned per token; edgekv compresses attention "
                        "KV caches only",))
    if info.mrope:
        return Verdict("refused", attention, "multimodal RoPE (M-RoPE)", layout,
                       ("M-RoPE cells carry positions in several sections, which edgekv's engines do not "
                        "track",))
    notes: list[str] = []
    if info.is_swa_model:
        notes.append("the sliding-window layers keep llama.cpp's own window; only the full-attention layers "
                     "are compressed, on the state engine (the native ops do not handle iSWA caches)")
        notes.append("+rerotate and expected_attention are refused: the two kinds of layer rotate with "
                     "two RoPE bases, which edgekv's host RoPE does not reproduce")
    if info.attn_logit_softcap:
        notes.append("attention-scored methods are refused: their scores would not model the logit "
                     "soft-capping")
    if info.attn_sinks:
        notes.append("attention-scored methods are refused: their scores would leave out the learned "
                     "attention sinks")
    if info.positions != "rope":
        notes.append("+rerotate is refused: keys carry no rotation to renumber")
    elif info.nope_layers:
        positions += f" (none on layers {', '.join(map(str, info.nope_layers))})"
        notes.append("+rerotate leaves the keys of the layers without RoPE as they are")
    if info.mla:
        return Verdict("refused", attention, positions, layout, (MLA_REFUSAL,))
    if info.positions == "alibi":
        if info.n_head != info.n_head_kv:
            return Verdict("unverified", attention, positions, layout,
                           ("ALiBi with grouped-query attention: one per-cell bias per KV head cannot carry "
                            "the slopes of its query heads; per-head compactions are refused", *notes))
        notes += ["per-head compactions are exact on the native engine, whose per-cell bias carries "
                  "ALiBi's distance; the state engine keeps whole tokens only (streaming_llm)",
                  "attention-scored methods are refused: their scores would leave out ALiBi's bias"]
    if info.arch not in TESTED:
        return Verdict("unverified", attention, positions, layout,
                       (f"{info.arch} is not in edgekv's architecture matrix; it is compressed as the "
                        "matrix's families are", *notes))
    return Verdict("supported", attention, positions, layout,
                   (*notes,) or ("every method on both engines",))
