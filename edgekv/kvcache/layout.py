"""Parse and rebuild llama.cpp's per-sequence state blob (``llama_state_seq_get_data``).

This is the portable path into the KV cache: any stock libllama can hand us a
sequence's cells as bytes and take a rewritten blob back. The layout is the one
written by ``llama_kv_cache::state_write`` in the llama.cpp vendored by
llama-cpp-python 0.3.36 (see docs/design.md section 3)::

    u32 magic  i32 seq_id                                   (llama_context)
    per cache (1 for plain models, 2 for iSWA: base then SWA):
      u32 n_stream
      per stream: u32 cell_count (0: nothing else for the stream)
        cell_count x {i32 pos, u32 n_seq_id, [cell ext], n_seq_id x i32 seq_id}
        u32 v_trans, u32 n_layer
        n_layer x {i32 k_type, u64 k_row_size, cell_count rows}
        v_trans == 0: n_layer x {i32 v_type, u64 v_row_size, cell_count rows}
        v_trans == 1: n_layer x {i32 v_type, u32 v_elem_size, u32 n_embd_v_gqa,
                                 n_embd_v_gqa x cell_count elements}

Everything here is parsed strictly: a field that disagrees with the model
(layer count, row size, trailing bytes) raises ``StateLayoutError`` instead of
being guessed around, because a misread cache decodes into fluent nonsense.
Raw rows are kept as views into the blob so that a compaction that only gathers
rows copies bytes and never re-quantises them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from ..errors import StateLayoutError
from .quant import dequantize, quantize

STATE_SEQ_MAGIC = 0xAF143CD8


@dataclass
class LayerData:
    """Raw K and V of one layer for the cells of one stream.

    ``k`` is ``[n_cells, k_row_bytes]``. ``v`` is ``[n_cells, v_row_bytes]``
    when ``v_trans`` is false, else ``[n_embd_v, n_cells, v_elem_size]``
    (llama.cpp stores V transposed when flash attention is off).
    """

    k_type: int
    k_row_bytes: int
    k: np.ndarray
    v_type: int
    v_row_bytes: int  # bytes per cell row (v_trans: n_embd_v * elem size)
    v_elem_size: int  # only meaningful for v_trans
    n_embd_v: int  # only known from the blob for v_trans; else filled by caller
    v: np.ndarray


@dataclass
class CacheSection:
    """One ``llama_kv_cache`` worth of a sequence (one stream with cells)."""

    n_stream: int
    stream: int  # index of the stream holding the cells
    pos: np.ndarray  # int32 [n_cells], in blob (cell index) order
    cell_ext: bytes | None  # raw ext records when the cache has them (unsupported)
    v_trans: bool
    layers: list[LayerData] = field(default_factory=list)

    @property
    def n_cells(self) -> int:
        return int(self.pos.shape[0])


@dataclass
class SeqState:
    seq_id: int
    sections: list[CacheSection]


class _Reader:
    def __init__(self, blob: bytes | bytearray | memoryview) -> None:
        self.buf = np.frombuffer(blob, dtype=np.uint8)
        self.off = 0

    def take(self, n: int, what: str) -> np.ndarray:
        if n < 0 or self.off + n > self.buf.shape[0]:
            raise StateLayoutError(
                f"KV state blob truncated while reading {what} "
                f"(need {n} bytes at offset {self.off}, blob has {self.buf.shape[0]})"
            )
        out = self.buf[self.off : self.off + n]
        self.off += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what).tobytes())[0]

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what).tobytes())[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what).tobytes())[0]

    @property
    def remaining(self) -> int:
        return self.buf.shape[0] - self.off


def parse_seq_state(
    blob: bytes | bytearray | memoryview,
    *,
    n_caches: int,
    n_layers: list[int] | None,
    k_row_bytes: list[list[int]] | None = None,
) -> SeqState:
    """Parse a per-sequence state blob.

    ``n_caches`` and ``n_layers`` (per cache) come from the model, so that a
    blob from another model or another llama.cpp version is rejected rather
    than misread. ``k_row_bytes`` optionally pins every layer's K row size.
    """
    r = _Reader(blob)
    magic = r.u32("magic")
    if magic != STATE_SEQ_MAGIC:
        raise StateLayoutError(
            f"not a llama.cpp sequence state (magic {magic:#010x}, expected {STATE_SEQ_MAGIC:#010x})"
        )
    seq_id = r.i32("seq_id")
    sections: list[CacheSection] = []
    for ci in range(n_caches):
        expected = n_layers[ci] if n_layers else None
        sections.append(_parse_cache(r, ci, expected, k_row_bytes[ci] if k_row_bytes else None))
    if r.remaining:
        raise StateLayoutError(
            f"KV state blob has {r.remaining} unexpected trailing bytes after {n_caches} cache(s); "
            "this model's memory layout (hybrid/recurrent or another llama.cpp version) is not supported"
        )
    return SeqState(seq_id=seq_id, sections=sections)


def _parse_cache(r: _Reader, ci: int, n_layer_expected: int | None, k_rows: list[int] | None) -> CacheSection:
    n_stream = r.u32("n_stream")
    if not 1 <= n_stream <= 256:
        raise StateLayoutError(f"implausible n_stream={n_stream} in cache {ci}")
    found: CacheSection | None = None
    for s in range(n_stream):
        cell_count = r.u32("cell_count")
        if cell_count == 0:
            continue
        if found is not None:
            raise StateLayoutError("sequence spans several KV streams; not supported")
        found = _parse_stream(r, ci, n_stream, s, cell_count, n_layer_expected, k_rows)
    if found is None:
        found = CacheSection(
            n_stream=n_stream, stream=0, pos=np.zeros(0, np.int32), cell_ext=None, v_trans=False
        )
    return found


def _parse_stream(
    r: _Reader,
    ci: int,
    n_stream: int,
    stream: int,
    n: int,
    n_layer_expected: int | None,
    k_rows: list[int] | None,
) -> CacheSection:
    # Cell metadata: a fixed 12-byte record {pos, n_seq_id=1, seq_id} per cell
    # for a single-sequence read of a cache without cell ext.
    meta = r.take(12 * n, "cell metadata").view("<i4").reshape(n, 3)
    if not np.all(meta[:, 1] == 1):
        raise StateLayoutError(
            "cell metadata not understood (cells with n_seq_id != 1, or per-cell ext records "
            "as used by M-RoPE models); this model is not supported by the state engine"
        )
    pos = meta[:, 0].astype(np.int32)
    v_trans = r.u32("v_trans")
    n_layer = r.u32("n_layer")
    if v_trans not in (0, 1) or not 1 <= n_layer <= 4096 or (
        n_layer_expected is not None and n_layer != n_layer_expected
    ):
        raise StateLayoutError(
            f"cache {ci}: unexpected header v_trans={v_trans} n_layer={n_layer} "
            f"(model has {n_layer_expected} layers in this cache)"
        )
    ks: list[tuple[int, int, np.ndarray]] = []
    for il in range(n_layer):
        k_type = r.i32("k_type")
        k_row = r.u64("k_row_size")
        if k_rows is not None and k_row != k_rows[il]:
            raise StateLayoutError(
                f"cache {ci} layer {il}: K row is {k_row} bytes, model expects {k_rows[il]}"
            )
        ks.append((k_type, k_row, r.take(n * k_row, "K rows").reshape(n, k_row)))
    layers: list[LayerData] = []
    for il in range(n_layer):
        v_type = r.i32("v_type")
        k_type, k_row, k = ks[il]
        if not v_trans:
            v_row = r.u64("v_row_size")
            v = r.take(n * v_row, "V rows").reshape(n, v_row)
            layers.append(LayerData(k_type, k_row, k, v_type, v_row, 0, 0, v))
        else:
            el = r.u32("v_elem_size")
            n_embd_v = r.u32("n_embd_v_gqa")
            if el not in (2, 4):
                raise StateLayoutError(f"transposed V with element size {el} is not supported")
            v = r.take(n_embd_v * n * el, "V elements").reshape(n_embd_v, n, el)
            layers.append(LayerData(k_type, k_row, k, v_type, n_embd_v * el, el, n_embd_v, v))
    return CacheSection(
        n_stream=n_stream, stream=stream, pos=pos, cell_ext=None, v_trans=bool(v_trans), layers=layers
    )


def write_seq_state(state: SeqState) -> bytearray:
    """Serialise a ``SeqState`` back into the exact layout ``parse_seq_state`` reads.

    Row arrays are joined as buffers, so the cache bytes are copied once."""
    parts: list[bytes | memoryview] = [struct.pack("<Ii", STATE_SEQ_MAGIC, state.seq_id)]
    for sec in state.sections:
        parts.append(struct.pack("<I", sec.n_stream))
        for s in range(sec.n_stream):
            n = sec.n_cells if s == sec.stream else 0
            parts.append(struct.pack("<I", n))
            if n == 0:
                continue
            meta = np.empty((n, 3), dtype="<i4")
            meta[:, 0] = sec.pos
            meta[:, 1] = 1
            meta[:, 2] = state.seq_id
            parts.append(meta.tobytes())
            parts.append(struct.pack("<II", int(sec.v_trans), len(sec.layers)))
            for ld in sec.layers:
                parts.append(struct.pack("<iQ", ld.k_type, ld.k_row_bytes))
                parts.append(memoryview(np.ascontiguousarray(ld.k)).cast("B"))
            for ld in sec.layers:
                if not sec.v_trans:
                    parts.append(struct.pack("<iQ", ld.v_type, ld.v_row_bytes))
                else:
                    parts.append(struct.pack("<iII", ld.v_type, ld.v_elem_size, ld.n_embd_v))
                parts.append(memoryview(np.ascontiguousarray(ld.v)).cast("B"))
    return bytearray().join(parts)


def gather_section(sec: CacheSection, order: np.ndarray, keep: np.ndarray, pos: np.ndarray,
                   n_kv_head: int) -> CacheSection:
    """Build a compacted section from raw rows, per (layer, KV head).

    ``order`` maps position-sorted cell index -> blob cell index. ``keep`` is
    ``[n_layer, n_kv_head, B]`` indices into the position-sorted cells. Rows
    are moved as bytes (each head's slice of a row is whole quantisation
    blocks), so kept data is bit-identical: nothing is re-quantised.
    """
    n_layer, n_head, b = keep.shape
    if n_layer != len(sec.layers) or n_head != n_kv_head:
        raise StateLayoutError(
            f"keep indices shaped {keep.shape} do not match the cache ({len(sec.layers)} layers, "
            f"{n_kv_head} KV heads)"
        )
    src = order[keep]  # [L, H, B] blob cell indices
    layers: list[LayerData] = []
    for il, ld in enumerate(sec.layers):
        if ld.k_row_bytes % n_kv_head:
            raise StateLayoutError(f"K row of {ld.k_row_bytes} bytes does not split into {n_kv_head} heads")
        hk = ld.k_row_bytes // n_kv_head
        k3 = ld.k.reshape(sec.n_cells, n_kv_head, hk)
        k_new = np.empty((b, n_kv_head, hk), dtype=np.uint8)
        for h in range(n_kv_head):
            k_new[:, h, :] = k3[src[il, h], h, :]
        if not sec.v_trans:
            hv = ld.v_row_bytes // n_kv_head
            v3 = ld.v.reshape(sec.n_cells, n_kv_head, hv)
            v_new = np.empty((b, n_kv_head, hv), dtype=np.uint8)
            for h in range(n_kv_head):
                v_new[:, h, :] = v3[src[il, h], h, :]
            v_out = v_new.reshape(b, n_kv_head * hv)
        else:
            dv = ld.n_embd_v // n_kv_head
            v4 = ld.v.reshape(n_kv_head, dv, sec.n_cells, ld.v_elem_size)
            v_new = np.empty((n_kv_head, dv, b, ld.v_elem_size), dtype=np.uint8)
            for h in range(n_kv_head):
                v_new[h] = v4[h][:, src[il, h], :]
            v_out = v_new.reshape(ld.n_embd_v, b, ld.v_elem_size)
        layers.append(
            LayerData(ld.k_type, ld.k_row_bytes, k_new.reshape(b, ld.k_row_bytes), ld.v_type,
                      ld.v_row_bytes, ld.v_elem_size, ld.n_embd_v, v_out)
        )
    return CacheSection(
        n_stream=sec.n_stream, stream=sec.stream, pos=pos.astype(np.int32), cell_ext=None,
        v_trans=sec.v_trans, layers=layers,
    )


def _head_views(sec: CacheSection, layer: int, head: int, n_kv_head: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte views of one KV head's K rows [n_cells, bytes] and V rows ([n_cells, bytes],
    or [dv, n_cells, elem] when V is transposed)."""
    ld = sec.layers[layer]
    if ld.k_row_bytes % n_kv_head or (not sec.v_trans and ld.v_row_bytes % n_kv_head):
        raise StateLayoutError(f"rows of layer {layer} do not split into {n_kv_head} heads")
    k = ld.k.reshape(sec.n_cells, n_kv_head, ld.k_row_bytes // n_kv_head)[:, head]
    if sec.v_trans:
        v = ld.v.reshape(n_kv_head, ld.n_embd_v // n_kv_head, sec.n_cells, ld.v_elem_size)[head]
    else:
        v = ld.v.reshape(sec.n_cells, n_kv_head, ld.v_row_bytes // n_kv_head)[:, head]
    return k, v


def head_rows(sec: CacheSection, layer: int, head: int, cells: np.ndarray, n_kv_head: int,
              head_dim_k: int, head_dim_v: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 K [m, head_dim_k] and V [m, head_dim_v] of one KV head at blob cells ``cells``,
    dequantised but as stored (still Hadamard-rotated where llama.cpp rotates)."""
    ld = sec.layers[layer]
    k, v = _head_views(sec, layer, head, n_kv_head)
    kf = dequantize(k[cells], ld.k_type, head_dim_k)
    if sec.v_trans:
        vb = np.ascontiguousarray(v[:, cells].transpose(1, 0, 2)).reshape(len(cells), -1)
    else:
        vb = v[cells]
    return kf, dequantize(vb, ld.v_type, head_dim_v)


def set_head_rows(sec: CacheSection, layer: int, head: int, cells: np.ndarray, k: np.ndarray, v: np.ndarray,
                  n_kv_head: int) -> None:
    """Write float rows (as stored: rotated where llama.cpp rotates) into one KV head at blob
    cells ``cells``, quantised to the cache's types. The section's arrays must be writable
    (``gather_section`` builds such a section)."""
    ld = sec.layers[layer]
    kv, vv = _head_views(sec, layer, head, n_kv_head)
    kv[cells] = quantize(k, ld.k_type)
    vb = quantize(v, ld.v_type)
    if sec.v_trans:
        vv[:, cells] = vb.reshape(len(cells), -1, ld.v_elem_size).transpose(1, 0, 2)
    else:
        vv[cells] = vb
