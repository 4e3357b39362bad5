"""GGUF model-info tests on the real SmolLM2 file and on GGUFs written by gguf.GGUFWriter.

The written files are genuine GGUF (the reference writer), used to reach
layouts the default model does not have: sliding-window patterns, per-layer
KV head counts, separate SWA head sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgekv.errors import EdgekvError, ModelError
from edgekv.gguf_info import (
    KV_CACHE_TYPES,
    format_info,
    kv_bytes_per_token,
    kv_cache_bytes,
    read_gguf_header,
    read_model_info,
)
from edgekv.models import is_pulled, model_path

# ---------------------------------------------------------------- real SmolLM2


def test_smollm2_facts(smollm2_path: Path) -> None:
    info = read_model_info(smollm2_path)
    assert info.arch == "llama"
    assert (info.n_layer, info.n_head, info.n_head_kv) == (30, 9, 3)
    assert info.n_head_kv_layers == (3,) * 30
    assert info.n_embd == 576
    assert (info.head_dim_k, info.head_dim_v) == (64, 64)
    assert info.n_ctx_train == 8192
    assert info.sliding_window == 0 and not info.is_swa_model
    assert info.swa_layers == (False,) * 30
    assert info.file_type == "Q4_1"
    assert info.file_size == smollm2_path.stat().st_size == 98362432
    assert info.n_tensors == 272
    assert info.n_params == 134515008  # 135M with tied embeddings
    assert info.gguf_version == 3


def test_smollm2_kv_bytes(smollm2_path: Path) -> None:
    info = read_model_info(smollm2_path)
    assert kv_bytes_per_token(info, "f16", "f16") == 2 * 30 * 3 * 64 * 2
    row = 3 * 64  # elements per layer for K (and for V)
    assert kv_bytes_per_token(info, "q8_0", "q8_0") == 2 * 30 * (row // 32 * 34)
    assert kv_bytes_per_token(info, "q4_0", "q4_0") == 2 * 30 * (row // 32 * 18)
    assert kv_bytes_per_token(info, "q8_0", "f16") == 30 * (row // 32 * 34 + row * 2)
    assert kv_bytes_per_token(info, "F32", "bf16") == 30 * (row * 4 + row * 2)  # case-insensitive
    assert kv_cache_bytes(info, 4096) == 4096 * 23040
    assert kv_cache_bytes(info, 4096, swa_full=True) == 4096 * 23040


@pytest.mark.parametrize(
    ("ct", "block", "size"),
    [("f32", 1, 4), ("f16", 1, 2), ("bf16", 1, 2), ("q8_0", 32, 34), ("q4_0", 32, 18),
     ("q4_1", 32, 20), ("q5_0", 32, 22), ("q5_1", 32, 24), ("iq4_nl", 32, 18)],
)  # fmt: skip
def test_cache_type_block_sizes(smollm2_path: Path, ct: str, block: int, size: int) -> None:
    info = read_model_info(smollm2_path)
    assert set(KV_CACHE_TYPES) >= {ct}
    assert kv_bytes_per_token(info, ct, ct) == 2 * 30 * (3 * 64 // block * size)


def test_unknown_cache_type(smollm2_path: Path) -> None:
    info = read_model_info(smollm2_path)
    with pytest.raises(EdgekvError, match="unknown KV cache type 'q3_k'.*q8_0"):
        kv_bytes_per_token(info, "q3_k", "f16")


def test_format_info(smollm2_path: Path) -> None:
    text = format_info(read_model_info(smollm2_path))
    for needle in ("llama", "Q4_1", "30 (n_embd 576, 9 heads, 3 KV heads", "head_dim k/v 64/64",
                   "n_ctx_train 8192", "f16 23040 B", "q8_0 12240 B", "q4_0 6480 B",
                   "@8192", "f16 180.0", "full attention"):  # fmt: skip
        assert needle in text, needle


@pytest.mark.slow
def test_header_matches_gguf_reader(smollm2_path: Path) -> None:
    """The fast header parser agrees with gguf's own GGUFReader (slow: ~4 s)."""
    h = read_gguf_header(smollm2_path)
    r = gguf.GGUFReader(smollm2_path)
    assert h.data_offset == r.data_offset
    assert h.alignment == r.alignment
    assert len(h.tensors) == len(r.tensors)
    for mine, ref in zip(h.tensors, r.tensors, strict=True):
        assert mine.name == ref.name
        assert mine.shape == tuple(int(x) for x in ref.shape)
        assert mine.ggml_type == ref.tensor_type
        assert h.data_offset + mine.offset == ref.data_offset
        assert mine.n_bytes == ref.n_bytes
    scalars = 0
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        assert key in h.metadata
        if len(field.types) == 1:  # scalars and strings
            assert h.metadata[key] == pytest.approx(field.contents()), key
            scalars += 1
    assert scalars > 15
    assert h.data_end == smollm2_path.stat().st_size


# ---------------------------------------------------------------- written GGUFs


def _write(
    path: Path,
    arch: str,
    *,
    n_layer: int,
    n_head: int = 4,
    n_head_kv: int | Sequence[int] = 1,
    n_embd: int = 640,
    key_length: int | None = 256,
    sliding_window: int | None = None,
    pattern: int | Sequence[bool] | None = None,
    extra: dict[str, int] | None = None,
) -> Path:
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name(f"test {arch}")
    w.add_block_count(n_layer)
    w.add_context_length(32768)
    w.add_embedding_length(n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if key_length is not None:
        w.add_key_length(key_length)
        w.add_value_length(key_length)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    for k, v in (extra or {}).items():
        w.add_uint32(k.format(arch=arch), v)
    w.add_tensor("token_embd.weight", np.zeros((8, n_embd), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma3_default_swa_pattern(tmp_path: Path) -> None:
    """No pattern key: llama.cpp's gemma3 default, 5 local then 1 global layer."""
    info = read_model_info(_write(tmp_path / "g.gguf", "gemma3", n_layer=18, sliding_window=512))
    assert info.sliding_window == 512 and info.is_swa_model
    assert info.global_layers == (5, 11, 17)
    assert sum(info.swa_layers) == 15
    assert "default" in info.swa_pattern_source
    assert info.file_type == "Q4_K_M"
    assert info.n_params == 8 * 640 + 640
    # 1 KV head x 256 x f16 x (K+V) on each of 18 layers.
    assert kv_bytes_per_token(info, "f16", "f16") == 18 * 1 * 256 * 2 * 2
    per_layer = 1 * 256 * 2 * 2
    # iSWA: SWA layers keep pad256(min(n_ctx, 512 + n_ubatch)) cells.
    assert kv_cache_bytes(info, 32768) == (3 * 32768 + 15 * 1024) * per_layer
    assert kv_cache_bytes(info, 32768, swa_full=True) == 18 * 32768 * per_layer
    assert kv_cache_bytes(info, 600) == (3 * 600 + 15 * 768) * per_layer
    text = format_info(info)
    assert "sliding window 512 on 15 of 18 layers" in text and "global layers: 5, 11, 17" in text


def test_swa_pattern_period_key(tmp_path: Path) -> None:
    info = read_model_info(
        _write(tmp_path / "g.gguf", "gemma3", n_layer=8, sliding_window=256, pattern=4)
    )
    assert info.global_layers == (3, 7)
    assert info.swa_pattern_source == "gguf"


def test_swa_pattern_bool_array(tmp_path: Path) -> None:
    pattern = [True, False, True, True, False, True]
    info = read_model_info(
        _write(tmp_path / "g.gguf", "gemma3", n_layer=6, sliding_window=128, pattern=pattern)
    )
    assert info.swa_layers == tuple(pattern)
    assert info.global_layers == (1, 4)


def test_gemma3_without_window_is_full_attention(tmp_path: Path) -> None:
    info = read_model_info(_write(tmp_path / "g.gguf", "gemma3", n_layer=6))
    assert info.sliding_window == 0 and not info.is_swa_model
    assert info.global_layers == tuple(range(6))


def test_swa_head_sizes(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "g.gguf", "gemma3", n_layer=6, sliding_window=128,
        extra={"{arch}.attention.key_length_swa": 128, "{arch}.attention.value_length_swa": 64},
    )  # fmt: skip
    info = read_model_info(path)
    assert info.head_dims(0) == (128, 64) and info.head_dims(5) == (256, 256)
    assert kv_bytes_per_token(info, "f16", "f16") == 5 * (128 + 64) * 2 + 1 * (256 + 256) * 2
    assert "SWA layers 128/64" in format_info(info)


def test_per_layer_kv_heads(tmp_path: Path) -> None:
    """Per-layer head_count_kv (0 = no attention, e.g. recurrent layers)."""
    kv = [2, 0, 2, 4]
    info = read_model_info(
        _write(tmp_path / "m.gguf", "llama", n_layer=4, n_head=8, n_head_kv=kv, n_embd=512,
               key_length=None)
    )  # fmt: skip
    assert info.n_head_kv_layers == tuple(kv) and info.n_head_kv == 4
    assert info.head_dim_k == info.head_dim_v == 512 // 8
    assert kv_bytes_per_token(info, "f16", "f16") == sum(kv) * 64 * 2 * 2
    assert "0-4 KV heads (per layer)" in format_info(info)


def test_kv_heads_default_to_heads(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(2)
    w.add_embedding_length(256)
    w.add_head_count(4)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = read_model_info(path)
    assert info.n_head_kv_layers == (4, 4) and info.head_dim_k == 64
    assert info.file_type == "F32"  # no general.file_type: the dominant tensor type
    assert info.n_ctx_train == 0


def test_quantized_cache_needs_whole_blocks(tmp_path: Path) -> None:
    info = read_model_info(
        _write(tmp_path / "m.gguf", "llama", n_layer=2, n_head=4, n_head_kv=1, n_embd=80,
               key_length=20)
    )  # fmt: skip
    assert kv_bytes_per_token(info, "f16", "f16") == 2 * 20 * 2 * 2
    with pytest.raises(EdgekvError, match="multiples of 32"):
        kv_bytes_per_token(info, "q8_0", "q8_0")
    assert "q8_0 n/a" in format_info(info)


def test_missing_hparams_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, arch="llama")  # architecture only, no block_count
    w.add_tensor("x", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    read_gguf_header(path)  # a valid GGUF ...
    with pytest.raises(ModelError, match="lacks llama.block_count"):
        read_model_info(path)  # ... but not a usable model


def test_corrupt_tensor_type(tmp_path: Path, smollm2_path: Path) -> None:
    """A flipped byte in the tensor table is reported, not trusted."""
    data = bytearray(smollm2_path.read_bytes()[: 4 << 20])
    h = read_gguf_header(smollm2_path)
    # Locate the first tensor's type field: name, n_dims, dims, then type.
    name = h.tensors[0].name.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    at += 4 + 8 * len(h.tensors[0].shape)
    data[at : at + 4] = (999).to_bytes(4, "little")
    f = tmp_path / "bad.gguf"
    f.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="unknown ggml type 999"):
        read_gguf_header(f)


# ---------------------------------------------------------------- other registry models


@pytest.mark.parametrize(
    ("name", "facts"),
    [
        ("qwen2.5-coder-0.5b", dict(arch="qwen2", n_layer=24, n_head=14, n_head_kv=2,
                                    head_dim_k=64, n_ctx_train=32768, sliding_window=0)),
        ("gemma3-270m", dict(arch="gemma3", n_layer=18, n_head=4, n_head_kv=1,
                             head_dim_k=256, n_ctx_train=32768, sliding_window=512)),
    ],
)  # fmt: skip
def test_other_registry_models(name: str, facts: dict[str, object]) -> None:
    """Facts of the larger models, checked when they are already in the cache."""
    if not is_pulled(name):
        pytest.skip(f"{name} not pulled (edgekv models pull {name})")
    info = read_model_info(model_path(name))
    for k, v in facts.items():
        assert getattr(info, k) == v, k
    assert info.file_type == "Q4_K_M"
    if name == "gemma3-270m":
        assert info.global_layers == (5, 11, 17)
