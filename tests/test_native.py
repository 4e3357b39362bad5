"""Native engine (edgekv's ggml patch set) on the real default model: the same
cache contents as the state engine after the same compaction, merge with the
log-count bias in both attention paths, device-side scores and reads against
host references, and refusal of bad arguments without touching the cache."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from _attention import captured_attention, reference_attention
from _helpers import prefill, run_cli
from _helpers import random_keep as _keep

from edgekv.config import BudgetRule
from edgekv.errors import EdgekvError
from edgekv.kvcache import CacheState, StateEngine, layout, native_available
from edgekv.kvcache import native as native_mod
from edgekv.kvcache.native import READ_BYTES, NativeEngine, NativeUnsupported, ReadBuffers, load
from edgekv.kvcache.snapshot import unrotate
from edgekv.llama import Context, cpu_flag
from edgekv.methods import get_method, lagkv
from edgekv.session import Session

pytestmark = pytest.mark.kernels  # cache bytes, merges and scores computed by ggml's kernels

CONFIGS = [("f16", "f16", "off"), ("f16", "f16", "on"), ("q8_0", "q8_0", "on"), ("q8_0", "f16", "off")]
IDS = [f"{k}-{v}-fa_{fa}" for k, v, fa in CONFIGS]
TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. ") * 10


def test_native_bindings_are_built_for_a_patched_libllama() -> None:
    # setup.sh builds the bindings whenever libllama carries the patch set; a
    # patched libllama without them would silently fall back to the state engine.
    assert native_available()
    assert load() is not None


def _ctx(model, ck: str, cv: str, fa: str, n_ctx: int = 512) -> Context:
    return Context(model, n_ctx=n_ctx, cache_type_k=ck, cache_type_v=cv, flash_attn=fa, n_threads=2)


def _prefilled(model, toks: list[int], ck: str, cv: str, fa: str) -> tuple[Context, NativeEngine]:
    """A context and its native engine holding ``toks``."""
    ctx = _ctx(model, ck, cv, fa)
    eng = NativeEngine(ctx)
    prefill(eng, toks)
    return ctx, eng


@pytest.fixture(scope="module")
def toks(smollm2) -> list[int]:
    return smollm2.tokenize(TEXT)


@pytest.fixture(params=["host", "graph"])
def op_path(request, monkeypatch) -> str:
    """The native compaction's two paths: plain byte moves where the cache is in host
    memory (the CPU default), the ggml graph GPUs run (forced on the CPU)."""
    if request.param == "graph":
        monkeypatch.setenv("EDGEKV_GRAPH_OPS", "1")
    else:
        monkeypatch.delenv("EDGEKV_GRAPH_OPS", raising=False)
    return request.param


@pytest.mark.parametrize(("ck", "cv", "fa"), CONFIGS, ids=IDS)
def test_native_and_state_compaction_leave_identical_caches(smollm2, toks, ck, cv, fa, op_path) -> None:
    ctx = _ctx(smollm2, ck, cv, fa)
    state, native = StateEngine(ctx), NativeEngine(ctx)
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    for rounds in (1, 2):
        blobs, logits = [], []
        for eng in (state, native):
            prefill(eng, toks)
            for r in range(rounds):  # a second compaction works on an already per-head cache
                keep = _keep(np.random.default_rng(11 + r), L, H, eng.n_cells, eng.n_cells // 2)
                eng.compact(keep)
            blobs.append(ctx.state_get())
            eng.decode([toks[5]], ctx.pos_max() + 1)
            logits.append(ctx.logits())
        assert blobs[0] == blobs[1]
        assert np.array_equal(logits[0], logits[1])
    ctx.close()


def _on_both_paths(model, toks, ck, cv, fa, monkeypatch, op, bias: bool = False) -> None:
    """``op(engine, rng)`` after the same prefill, on the host path and on the graph a GPU
    runs: the same cache bytes (and log-count bias) after each, and not the bytes before it."""
    ctx = _ctx(model, ck, cv, fa)
    eng = NativeEngine(ctx)
    out = []
    for path in ("host", "graph"):
        monkeypatch.setenv("EDGEKV_GRAPH_OPS", "1" if path == "graph" else "0")
        eng.reset()
        prefill(eng, toks)
        before = ctx.state_get()
        op(eng, np.random.default_rng(5))
        out.append((ctx.state_get(), eng.bias_get(cell_order=True) if bias else None))
        assert out[-1][0] != before
    assert out[0][0] == out[1][0]
    assert not bias or np.array_equal(out[0][1], out[1][1])
    ctx.close()


@pytest.mark.parametrize(("ck", "cv", "fa"), CONFIGS, ids=IDS)
def test_compaction_in_any_order_is_the_same_on_both_paths(smollm2, toks, ck, cv, fa, monkeypatch) -> None:
    # edgekv passes increasing cells (the host path then moves them in place); the C op
    # takes any order, which the host path gathers through a copy: same bytes as the graph
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv

    def compact(eng: NativeEngine, rng: np.random.Generator) -> None:
        n, b = eng.n_cells, eng.n_cells // 2
        keep = np.stack([rng.permutation(n)[:b] for _ in range(L * H)]).astype(np.int32)
        pos = np.arange(b, dtype=np.int32)
        assert eng.lib.llama_edgekv_seq_compact(eng._c, 0, b, eng.ffi.from_buffer("int32_t[]", keep),
                                                eng.ffi.from_buffer("int32_t[]", pos)) == 0

    _on_both_paths(smollm2, toks, ck, cv, fa, monkeypatch, compact)


MERGE_CONFIGS = [("f16", "f16", "off"), ("f16", "f16", "on"), ("f32", "f32", "off"), ("f16", "f32", "off"),
                 ("q8_0", "q8_0", "on"), ("q4_0", "q4_0", "on"), ("q8_0", "f16", "off"), ("bf16", "bf16", "on")]


@pytest.mark.parametrize(("ck", "cv", "fa"), MERGE_CONFIGS, ids=[f"{k}-{v}-fa_{fa}" for k, v, fa in MERGE_CONFIGS])
def test_merge_is_the_same_on_both_paths(smollm2, toks, ck, cv, fa, monkeypatch) -> None:
    # a cache in host memory merges without a graph: the same bytes and bias as the graph
    # (quantised types through the CPU backend's own quantiser), for groups with unused slots, a repeated
    # member, and a group reading a cell another group's merge writes; a token decoded
    # before and one after (its K/V in later layers) show the next decode attends with the
    # bias the merge turned on, not through the graph of the decode before it
    L, H, G, M = smollm2.arch.n_layer, smollm2.arch.n_head_kv, 6, 4

    def merge(eng: NativeEngine, rng: np.random.Generator) -> None:
        eng.decode([toks[1]], eng.ctx.pos_max() + 1)
        # distinct cells (two groups with one target would race in the graph's set_rows)
        members = np.stack([rng.choice(eng.n_cells, G * M, replace=False) for _ in range(L * H)]).reshape(L, H, G, M)
        members[..., 2:][rng.random((L, H, G, M - 2)) < 0.3] = -1
        members[:, :, 1, 1] = members[:, :, 0, 0]  # group 0's target, read by group 1
        members[:, :, 2, 2] = members[:, :, 2, 1]  # a member twice
        eng._merge_groups(members, (rng.random((L, H, G, M)) + 0.1).astype(np.float32))
        eng.decode([toks[2]], eng.ctx.pos_max() + 1)

    _on_both_paths(smollm2, toks, ck, cv, fa, monkeypatch, merge, bias=True)


READ_CONFIGS = CONFIGS + [("f16", "bf16", "off"), ("f16", "f32", "off")]  # every type a transposed V can have


@pytest.mark.parametrize(("ck", "cv", "fa"), READ_CONFIGS, ids=[f"{k}-{v}-fa_{fa}" for k, v, fa in READ_CONFIGS])
def test_native_read_matches_state_snapshot(smollm2, toks, ck, cv, fa) -> None:
    ctx = _ctx(smollm2, ck, cv, fa)
    state, native = StateEngine(ctx), NativeEngine(ctx)
    prefill(native, toks)
    state.tokens = native.tokens  # one sequence, two engines reading it
    keep = _keep(np.random.default_rng(5), smollm2.arch.n_layer, smollm2.arch.n_head_kv, native.n_cells, 100)
    native.compact(keep)
    a, b = state.snapshot(), native.snapshot()
    assert np.array_equal(a.pos, b.pos)
    for layer in (0, smollm2.arch.n_layer // 2, smollm2.arch.n_layer - 1):
        if layer:  # keys, then values alone
            np.testing.assert_allclose(b.keys(layer), a.keys(layer), rtol=0, atol=1e-5)
        np.testing.assert_allclose(b.values(layer), a.values(layer), rtol=0, atol=1e-5)
        np.testing.assert_allclose(b.keys(layer), a.keys(layer), rtol=0, atol=1e-5)  # layer 0: read with V
    ctx.close()


def test_layers_prefetched_then_converted_by_many_threads_equal_one_threads(smollm2, toks) -> None:
    # a snapshot reads on one thread (prefetch) and the scoring threads put each layer in
    # order and undo llama.cpp's rotation: the same floats as reading and converting in
    # turn, one array per layer however many threads ask, K and V each with its own block
    from concurrent.futures import ThreadPoolExecutor

    ctx = _ctx(smollm2, "q8_0", "q8_0", "on")
    state, native = StateEngine(ctx), NativeEngine(ctx)
    prefill(native, toks)
    state.tokens = native.tokens
    assert ctx.k_rot and ctx.v_rot  # a quantised cache llama.cpp rotates
    native.compact(_keep(np.random.default_rng(4), smollm2.arch.n_layer, smollm2.arch.n_head_kv, native.n_cells, 120))
    L = smollm2.arch.n_layer
    one = native.snapshot()
    want = [(one.keys(il).copy(), one.values(il).copy()) for il in range(L)]
    snap = native.snapshot()
    for il in range(L):
        snap.prefetch(il, values=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda il: (il, snap.values(il), snap.keys(il)), [il for il in range(L) for _ in range(3)]))
    for il, v, k in got:
        assert k is snap.keys(il) and v is snap.values(il)
        assert np.array_equal(k, want[il][0]) and np.array_equal(v, want[il][1]), il
    ref = state.snapshot()
    for il in (0, L - 1):
        np.testing.assert_allclose(snap.keys(il), ref.keys(il), rtol=0, atol=1e-5)
        np.testing.assert_allclose(snap.values(il), ref.values(il), rtol=0, atol=1e-5)
    ctx.close()


@pytest.mark.parametrize(("ck", "cv", "fa"), [("f16", "f16", "off"), ("q8_0", "q8_0", "on"), ("f16", "bf16", "off")],
                         ids=["f16-fa_off", "q8_0-fa_on", "f16-bf16-fa_off"])
def test_a_read_of_many_layers_equals_reads_of_one(smollm2, toks, ck, cv, fa, monkeypatch) -> None:
    # a read of a run of layers brings back the same floats as reads of one layer, and the
    # host path (a cache in host memory) the same floats as the ggml graph
    ctx, eng = _prefilled(smollm2, toks, ck, cv, fa)
    L = smollm2.arch.n_layer
    eng.compact(_keep(np.random.default_rng(3), L, smollm2.arch.n_head_kv, eng.n_cells, 90))
    k, v = eng.read(range(L))
    for layer in range(L):
        k1, v1 = eng.read(range(layer, layer + 1))
        assert np.array_equal(k[layer], k1[0]) and np.array_equal(v[layer], v1[0])
    kv, vv = eng.read(range(2, 5), keys=False)
    assert kv is None and np.array_equal(vv, v[2:5])
    monkeypatch.setenv("EDGEKV_GRAPH_OPS", "1")  # the graph GPUs run, against the host path
    kg, vg = eng.read(range(L))
    assert np.array_equal(kg, k) and np.array_equal(vg, v)
    monkeypatch.delenv("EDGEKV_GRAPH_OPS")
    whole = eng.snapshot()
    monkeypatch.setattr(native_mod, "READ_BYTES", 1)  # the snapshot then reads one layer per call
    one = eng.snapshot()
    for layer in range(L):
        assert np.array_equal(whole.values(layer), one.values(layer))
        assert np.array_equal(whole.keys(layer), one.keys(layer))
    with pytest.raises(EdgekvError, match="consecutive"):
        eng.read(range(0, L, 2))
    ctx.close()


@pytest.mark.parametrize(("ck", "cv", "fa"), [("f16", "f16", "off"), ("f16", "f32", "off"), ("q8_0", "q8_0", "on")],
                         ids=["f16-fa_off", "f16-f32-fa_off", "q8_0-fa_on"])
def test_host_read_of_cells_with_holes_equals_the_graph(smollm2, toks, ck, cv, fa, monkeypatch) -> None:
    # cells freed in the middle of the sequence: the host path gathers a transposed V cell by
    # cell there instead of converting runs, and must still match the graph bit for bit; read
    # unrotated (q8_0), both paths give the rows as stored unrotated by the snapshot's recipe,
    # with the AVX-512 butterflies and with the AVX2 ones (EDGEKV_CPU=avx2)
    ctx, eng = _prefilled(smollm2, toks, ck, cv, fa)
    n0 = eng.n_cells
    assert ctx.seq_rm(0, 40, 97) and ctx.seq_rm(0, 130, 131)  # holes, cells still ascending
    n = n0 - 58
    L, H, d = smollm2.arch.n_layer, smollm2.arch.n_head_kv, eng.head_dim_v
    out = {}
    for path, unrot, cpu in itertools.product(("0", "1"), (False, True), ("", "avx2")):
        monkeypatch.setenv("EDGEKV_GRAPH_OPS", path)
        monkeypatch.setenv("EDGEKV_CPU", cpu)
        k = np.full(L * H * n * d, np.nan, np.float32)
        v = np.full(L * H * n * d, np.nan, np.float32)
        assert eng.lib.llama_edgekv_seq_read(eng._c, 0, 0, L, eng.ffi.from_buffer("float[]", k),
                                             eng.ffi.from_buffer("float[]", v), n, unrot) == 0
        out[path, unrot, cpu] = k, v
    stored, unrotated = out["0", False, ""], out["0", True, ""]
    assert np.isfinite(stored[1]).all() and np.isfinite(stored[0]).all()
    for (_, unrot, _), (k, v) in out.items():
        assert np.array_equal(k, out["0", unrot, ""][0]) and np.array_equal(v, out["0", unrot, ""][1])
    assert bool(ctx.k_rot) == (ck == "q8_0") and bool(ctx.v_rot) == (cv == "q8_0")
    assert np.array_equal(unrotated[0], unrotate(stored[0].reshape(-1, d), ctx.k_rot).ravel())
    assert np.array_equal(unrotated[1], unrotate(stored[1].reshape(-1, d), ctx.v_rot).ravel())
    assert np.array_equal(unrotated[0], stored[0]) == (not ctx.k_rot)
    ctx.close()


def test_read_buffers_are_reused_only_once_released(smollm2, toks) -> None:
    # reads land in pooled buffers (fresh pages cost more than the read): an array a
    # snapshot handed out must never change under its holder, even after the cache does
    ctx, eng = _prefilled(smollm2, toks, "f16", "f16", "off")
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    held = eng.snapshot()
    k0, v0 = held.keys(L - 1), held.values(L - 1)
    copies = k0.copy(), v0.copy()
    eng.compact(_keep(np.random.default_rng(2), L, H, eng.n_cells, 80))
    other = eng.snapshot()
    assert other.values(L - 1).shape[0] == 80 and not np.shares_memory(other.values(L - 1), v0)
    assert np.array_equal(k0, copies[0]) and np.array_equal(v0, copies[1])
    def spans() -> list[tuple[int, int]]:  # the pooled buffers' memory, without holding them
        return [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in eng._buffers._pool]

    def pooled(a: np.ndarray) -> bool:
        return any(lo <= a.ctypes.data < hi for lo, hi in before)

    before = spans()
    del held, k0, v0, other
    again = eng.snapshot()
    assert again.values(L - 1).shape[0] == 80  # a read the released buffers can hold: one is handed out again
    assert pooled(again.values(L - 1)) and spans() == before
    assert sum(b.nbytes for b in eng._buffers._pool) <= eng._buffers.cap
    small = ReadBuffers(1 << 20)
    small.take((1000,))
    kept = [(b.ctypes.data, b.nbytes) for b in small._pool]
    big = small.take((1 << 19,))  # more than the pool may keep: handed out, the pool left as it was
    assert big.size == 1 << 19 and [(b.ctypes.data, b.nbytes) for b in small._pool] == kept
    # the engine keeps two full reads' buffers, headroom included: one scored, one read ahead
    full = (READ_BYTES // 4,)
    eng._buffers._pool = []
    scored, ahead = eng._buffers.take(full), eng._buffers.take(full)
    assert len(eng._buffers._pool) == 2 and not np.shares_memory(scored, ahead)
    ctx.close()


@pytest.mark.parametrize(("ck", "cv", "fa"), CONFIGS, ids=IDS)
def test_device_key_norms_equal_host_sums(smollm2, toks, ck, cv, fa) -> None:
    # knorm ranks by these norms, and near-ties (repetitive text) flip on a last bit:
    # the device sums must be the state engine's floats exactly, not just close
    ctx = _ctx(smollm2, ck, cv, fa)
    state, native = StateEngine(ctx), NativeEngine(ctx)
    prefill(native, toks)
    state.tokens = native.tokens
    keep = _keep(np.random.default_rng(7), smollm2.arch.n_layer, smollm2.arch.n_head_kv, native.n_cells, 100)
    native.compact(keep)  # cells no longer in the order of their positions' heads
    a, b = state.snapshot(), native.snapshot()
    for layer in range(smollm2.arch.n_layer):
        assert np.array_equal(b.key_norms(layer), a.key_norms(layer)), layer
        ref = np.linalg.norm(a.keys(layer).astype(np.float64), axis=2).T  # the definition, on unrotated keys
        np.testing.assert_allclose(a.key_norms(layer), ref, rtol=1e-5)
    assert b.scored_layers == [] and not b._k  # no key was read back
    ctx.close()


def _duplicated(ctx: Context, eng: NativeEngine, toks: list[int], runs: dict[int, int]) -> tuple[bytes, np.ndarray]:
    """A cache where cell c is repeated runs[c] times (same K, V and position): the
    unmerged reference a merge of each run must reproduce."""
    prefill(eng, toks)
    blob = ctx.state_get()
    st = layout.parse_seq_state(blob, n_caches=1, n_layers=None)
    sec = st.sections[0]
    order = np.argsort(sec.pos, kind="stable")
    n = sec.n_cells
    idx = np.concatenate([[c] * runs.get(c, 1) for c in range(n)])
    L = len(sec.layers)
    keep = np.broadcast_to(idx, (L, eng.n_kv_head, idx.size)).copy()
    st.sections[0] = layout.gather_section(sec, order, keep, sec.pos[order][idx].astype(np.int32), eng.n_kv_head)
    return layout.write_seq_state(st), idx


@pytest.mark.parametrize("fa", ["off", "on"])
def test_merge_with_log_count_bias_equals_attention_over_unmerged_runs(smollm2, toks, fa) -> None:
    ctx = _ctx(smollm2, "f16", "f16", fa)
    eng = NativeEngine(ctx)
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    body = toks[:200]
    runs = {3: 8, 40: 16, 41: 2, 120: 16, 150: 4}
    blob, idx = _duplicated(ctx, eng, body, runs)
    probe = toks[200:203]
    tp = np.broadcast_to(idx.astype(np.int32), (L, H, idx.size)).copy()

    def unmerged() -> None:
        eng.reset()
        eng.restore(CacheState(blob=blob, token_pos=tp, engine="native"))

    # the truth: the unmerged cache's K/V, where each run really is k identical tokens
    unmerged()
    snap = eng.snapshot()
    truth = [(snap.keys(il).copy(), snap.values(il).copy()) for il in range(L)]
    truth_pos = snap.pos.copy()
    scale = 1.0 / np.sqrt(smollm2.arch.head_dim_k)
    ctx.capture.want("Qcur")
    ctx.capture.want("kqv_out")

    def decode_probe(setup) -> tuple[np.ndarray, np.ndarray]:
        """Logits of each probe token, and per (probe, layer) the mean and max distance of
        the attention llama.cpp computed from the attention over the unmerged runs (same
        queries, the probe's own new cells included), and that attention's scale."""
        setup()
        logits, errs = [], []
        for i, t in enumerate(probe):
            ctx.capture.clear()
            eng.decode([t], len(body) + i)
            logits.append(ctx.logits())
            now = eng.snapshot()
            pos = np.concatenate([truth_pos, now.pos[-(i + 1):]])
            row = []
            for il in range(L):
                q, out = captured_attention(ctx, il)
                k = np.concatenate([truth[il][0], now.keys(il)[-(i + 1):]])
                v = np.concatenate([truth[il][1], now.values(il)[-(i + 1):]])
                ref = reference_attention(q, k, v, None, np.array([len(body) + i]), pos, scale)
                d = np.abs(out - ref)
                row.append((d.mean(), d.max(), np.abs(ref).max()))
            errs.append(row)
        return np.stack(logits), np.array(errs)

    _, err_ref = decode_probe(unmerged)

    # merge each run into its first cell (the engine's merge verb drops the rest)
    first = np.ones(idx.size, bool)
    first[1:] = idx[1:] != idx[:-1]
    survivors = np.flatnonzero(first)
    dup = np.flatnonzero(~first)
    src = np.broadcast_to(dup, (L, H, dup.size)).copy()
    dst = np.broadcast_to(survivors[np.searchsorted(survivors, dup) - 1], (L, H, dup.size)).copy()

    def merged() -> None:
        unmerged()
        eng.merge(src, dst, bias=True)
        b = eng.bias_get()
        counts = np.array([runs.get(int(c), 1) for c in idx[survivors]])
        np.testing.assert_allclose(b, np.broadcast_to(np.log(counts), b.shape), atol=1e-6)

    got, err_got = decode_probe(merged)
    assert eng.n_cells == survivors.size + len(probe)

    # without the bias the merged cache attends measurably differently
    def merged_unbiased() -> None:
        merged()
        eng.bias_set(np.zeros((L, H, eng.n_cells), np.float32))

    _, err_plain = decode_probe(merged_unbiased)
    # Checked at every layer's attention, not at the logits: two computations that
    # differ only in rounding (f16 probabilities, flash attention's f16 V accumulator)
    # move the logits of this 30-layer quantised model by 0.1-0.7 through its q8
    # activation rounding, CPU-dependently, which drowned the bias's effect there.
    # The attention over merged cells with the bias must match the attention over the
    # unmerged runs to within f16 rounding (as the unmerged cache's own kernel does),
    # and far better than the same merge without the bias.
    # measured here: merged/unbiased 0.004 (fa off) and 0.014 (fa on); merged/unmerged
    # kernel 1.04 and 0.71 (the f16 V accumulator rounds 16 identical rows more than one)
    assert np.all(err_got[..., 1] < 0.06 * err_got[..., 2])
    assert err_got[..., 0].mean() < 0.1 * err_plain[..., 0].mean()
    assert err_got[..., 0].mean() < 2.0 * err_ref[..., 0].mean()

    # At the attention level the match is exact up to float32 rounding: the
    # device-side attention weights of the merged cell equal the sum over its run.
    rng = np.random.default_rng(4)
    q = rng.standard_normal((L, smollm2.arch.n_head, 4, smollm2.arch.head_dim_k)).astype(np.float32)
    q_pos = np.full(4, len(body) + 10, dtype=np.int32)
    unmerged()
    s_ref = eng.score(q, q_pos)
    merged()
    s_got = eng.score(q, q_pos)
    summed = np.add.reduceat(s_ref, survivors, axis=2)
    np.testing.assert_allclose(s_got, summed, rtol=1e-4, atol=1e-6)

    # the bias survives a save and restore (also of the session file format's state)
    merged()
    saved = eng.save()
    assert saved.bias and saved.counts.max() == max(runs.values())
    eng.reset()

    def restored() -> None:
        eng.reset()
        eng.restore(saved)

    np.testing.assert_array_equal(decode_probe(restored)[0], got)
    ctx.close()


SCORE_PATHS = {"host": "0", "graph": "1"}  # EDGEKV_GRAPH_OPS


@pytest.mark.parametrize("path", list(SCORE_PATHS))
@pytest.mark.parametrize(("ck", "cv", "fa"), [("f16", "f16", "off"), ("q8_0", "q8_0", "on")], ids=["f16", "q8_0"])
def test_device_scores_equal_host_reference(smollm2, toks, ck, cv, fa, path, monkeypatch) -> None:
    # window scores on each path: the host kernel in the cache's memory (x86-64 with AVX2;
    # elsewhere the graph again) and the ggml graph a GPU runs, against float64 softmaxes,
    # with a bias and masked cells
    monkeypatch.setenv("EDGEKV_GRAPH_OPS", SCORE_PATHS[path])
    ctx = _ctx(smollm2, ck, cv, fa)
    eng = NativeEngine(ctx)
    arch = smollm2.arch
    L, H, d = arch.n_layer, arch.n_head_kv, arch.head_dim_k
    n_head = arch.n_head
    prefill(eng, toks[:300])
    eng.compact(_keep(np.random.default_rng(2), L, H, eng.n_cells, 160))
    rng = np.random.default_rng(9)
    bias = rng.uniform(0, 2, (L, H, eng.n_cells)).astype(np.float32)
    eng.bias_set(bias)
    snap = eng.snapshot()
    w = 8
    q = rng.standard_normal((L, n_head, w, d)).astype(np.float32)
    q_pos = np.array(snap.pos[-w:] - 3, dtype=np.int32)  # the last queries do not see every cell
    scale = 1.0 / np.sqrt(d)
    got = eng.score(q, q_pos, scale)

    group = n_head // H
    ref = np.zeros((L, H, eng.n_cells))
    for layer in range(L):
        k = snap.keys(layer).astype(np.float64)  # [n, H, d], unrotated
        for qh in range(n_head):
            h = qh // group
            logits = scale * (q[layer, qh].astype(np.float64) @ k[:, h].T) + bias[layer, h]
            logits[snap.pos[None, :] > q_pos[:, None]] = -np.inf
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            ref[layer, h] += (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-4)
    masked = snap.pos > q_pos.max()
    assert masked.sum() == 3 and np.all(got[..., masked] == 0)  # cells after every query: exactly nothing
    ctx.close()


@pytest.mark.skipif(not cpu_flag("avx512f"), reason="one score kernel on a CPU without AVX-512: nothing to compare")
def test_host_scores_are_the_same_bits_with_avx512_and_avx2(smollm2, toks, monkeypatch) -> None:
    # the host kernel's AVX-512 and AVX2 logits are the same chains of multiply-adds, so the
    # scores agree to the last bit: an AVX2-only CPU keeps the cells an AVX-512 one keeps.
    # 1061 cells: past one 1024-cell chunk, and an odd number of 16-cell blocks; 13 queries:
    # a short last pass for both kernels (8 and 6 queries a pass)
    monkeypatch.delenv("EDGEKV_GRAPH_OPS", raising=False)
    ctx = _ctx(smollm2, "f16", "f16", "off", n_ctx=1280)
    eng = NativeEngine(ctx)
    arch = smollm2.arch
    L, H, d = arch.n_layer, arch.n_head_kv, arch.head_dim_k
    prefill(eng, (toks * (1200 // len(toks) + 1))[:1200])
    eng.compact(_keep(np.random.default_rng(4), L, H, eng.n_cells, 1061))
    rng = np.random.default_rng(5)
    eng.bias_set(rng.uniform(0, 2, (L, H, eng.n_cells)).astype(np.float32))
    pos = eng.snapshot().pos
    q = rng.standard_normal((L, arch.n_head, 13, d)).astype(np.float32)
    q_pos = np.asarray(pos[-13:] - 40, np.int32)  # the last 40 cells are masked for some queries
    monkeypatch.delenv("EDGEKV_CPU", raising=False)
    wide = eng.score(q, q_pos)
    monkeypatch.setenv("EDGEKV_CPU", "avx2")
    narrow = eng.score(q, q_pos)
    np.testing.assert_array_equal(wide, narrow)
    assert np.all(wide[..., pos > q_pos.max()] == 0) and np.all(wide[..., :1000] > 0)
    ctx.close()


@pytest.mark.parametrize("method", ["snapkv", "protokv"])
def test_window_scores_keep_the_same_cells_on_every_path(smollm2, toks, method, monkeypatch) -> None:
    # the host kernel and the graph round differently, yet a compression keeps the same cells
    kept = {}
    for path, graph in SCORE_PATHS.items():
        monkeypatch.setenv("EDGEKV_GRAPH_OPS", graph)
        ctx = _ctx(smollm2, "f16", "f16", "off")
        eng = NativeEngine(ctx)
        eng.observe(16)
        prefill(eng, toks)
        n = eng.n_cells
        get_method(method).compress(eng, n // 2)
        assert eng.n_cells == n // 2
        kept[path] = ctx.state_get()  # the cache's bytes: the cells each head kept, in order
        ctx.close()
    assert kept["host"] == kept["graph"]


def _groups(rng: np.random.Generator, L: int, H: int, n: int, g: int, w: int) -> np.ndarray:
    """[L, H, g, w] ascending ordinals per group, each of a random size (some empty), -1 padded."""
    members = -np.ones((L, H, g, w), np.int64)
    for il, h, i in np.ndindex(L, H, g):
        size = int(rng.integers(0, w + 1)) if i % 3 else w
        members[il, h, i, :size] = np.sort(rng.choice(n, size, replace=False))
    return members


@pytest.mark.parametrize(("ck", "cv", "fa"), [("f16", "f16", "off"), ("f16", "bf16", "off"), ("f16", "f32", "off"),
                                              ("f16", "f16", "on"), ("q8_0", "q8_0", "on"), ("q8_0", "f16", "off")],
                         ids=["f16", "bf16-vt", "f32-vt", "f16-fa", "q8_0-fa", "q8_0-vt"])
def test_device_lag_scores_are_the_kernels_doubles(smollm2, toks, ck, cv, fa, monkeypatch) -> None:
    # LagKV's scores computed in the cache's memory equal, to the last bit, the compiled
    # kernel's on the K/V read out and unrotated where llama.cpp rotates them (the kernel
    # undoes the rotation with the same float64 butterflies as the snapshot's unrotate),
    # for groups of cells that differ per head after a compaction, with empty and padded groups
    ctx, eng = _prefilled(smollm2, toks, ck, cv, fa)
    assert bool(ctx.k_rot) == (ck == "q8_0") and bool(ctx.v_rot) == (cv == "q8_0")  # both paths are run
    L, H = smollm2.arch.n_layer, smollm2.arch.n_head_kv
    rng = np.random.default_rng(11)
    eng.compact(_keep(rng, L, H, eng.n_cells, 150))
    members = _groups(rng, L, H, eng.n_cells, 5, 24)  # cell order
    got = eng.lag_scores(members)
    k, v = eng.read(range(L), cell_order=True)
    k, v = unrotate(k, ctx.k_rot), unrotate(v, ctx.v_rot)  # [L, H, n, d]: a block lies in a head
    for il in range(L):
        want = lagkv.group_scores(k[il].transpose(1, 0, 2), v[il].transpose(1, 0, 2), members[il])
        assert np.array_equal(got[il], want), il
    assert np.isneginf(got).any() and (got[np.isfinite(got)] >= 0).all()  # padding; softmax sums
    # the snapshot serves them, for a rotated cache too
    snap = eng.snapshot()
    assert np.array_equal(snap.lag_scores(members), got)
    monkeypatch.setenv("EDGEKV_GRAPH_OPS", "1")  # the path of a cache outside host memory
    with pytest.raises(NativeUnsupported):
        eng.lag_scores(members)
    assert eng.snapshot().lag_scores(members) is None
    ctx.close()


@pytest.mark.parametrize(("ck", "cv", "fa"), [("f16", "f16", "off"), ("f16", "bf16", "off"), ("f16", "f32", "off"),
                                              ("f16", "f16", "on"), ("q8_0", "q8_0", "on")],
                         ids=["f16-vt", "bf16-vt", "f32-vt", "f16-fa", "q8_0-fa"])
def test_value_norms_in_the_cache_are_numpys_floats(smollm2, toks, ck, cv, fa, monkeypatch) -> None:
    # every value's norm computed in the cache's memory equals, to the last bit, numpy's norm
    # of the float64 copy of the V the read hands out (unrotated where llama.cpp rotates it),
    # over cells in runs and, after holes are freed, cells gathered one by one
    ctx, eng = _prefilled(smollm2, toks, ck, cv, fa)
    assert bool(ctx.v_rot) == (cv == "q8_0")  # the unrotation is run
    L = smollm2.arch.n_layer
    got = eng.value_norms(cell_order=True)
    _, v = eng.read(range(L), cell_order=True, keys=False, unrotated=True)  # [L, H, n, d]
    assert got.tobytes() == np.linalg.norm(v.astype(np.float64), axis=3).tobytes()
    # the snapshot hands a layer's norms out in position order, [n, H], as ``values`` would be normed
    snap = eng.snapshot()
    for il in (0, L - 1):
        assert np.array_equal(snap.value_norms(il), np.linalg.norm(snap.values(il).astype(np.float64), axis=2))
    monkeypatch.setenv("EDGEKV_GRAPH_OPS", "1")  # the path of a cache outside host memory
    with pytest.raises(NativeUnsupported):
        eng.value_norms()
    assert eng.snapshot().value_norms(0) is None
    monkeypatch.setenv("EDGEKV_GRAPH_OPS", "0")
    # holes freed in the middle: cells still ascend but are no longer one run (through the C
    # API, as the engine's own count does not follow a removal behind its back)
    assert ctx.seq_rm(0, 40, 97) and ctx.seq_rm(0, 130, 131)
    n, H, d = eng.n_cells - 58, smollm2.arch.n_head_kv, eng.head_dim_v
    v = np.full(L * H * n * d, np.nan, np.float32)
    norms = np.full(L * H * n, np.nan)
    assert eng.lib.llama_edgekv_seq_read(eng._c, 0, 0, L, eng.ffi.NULL, eng.ffi.from_buffer("float[]", v), n, True) == 0
    assert eng.lib.llama_edgekv_seq_value_norms(eng._c, 0, eng.ffi.from_buffer("double[]", norms), n) == 0
    assert norms.tobytes() == np.linalg.norm(v.reshape(-1, d).astype(np.float64), axis=1).tobytes()
    ctx.close()


@pytest.mark.parametrize(("budget", "compacted", "ct"), [(None, False, "f16"), (300, False, "f16"),
                                                         (None, True, "f16"), (300, True, "f16"),
                                                         (None, False, "q8_0"), (300, True, "q8_0")])
def test_lagkv_keeps_the_same_cells_on_both_engines(smollm2, toks, budget, compacted, ct) -> None:
    # the native engine scores in the cache's memory, the state engine from K/V it reads:
    # the same ranks, so the same selection, through LagKV's step (an intact cache: its
    # partitions are consecutive cells) and its shrink (after a per-head compaction);
    # on q8_0 both undo llama.cpp's rotation, the kernel and the state engine's snapshot
    ctx = _ctx(smollm2, ct, ct, "off" if ct == "f16" else "on")
    state, native = StateEngine(ctx), NativeEngine(ctx)
    prefill(native, (toks * 3)[:480])
    state.tokens = native.tokens
    method = get_method("lagkv", L=32, sinks=4)
    method.bind(BudgetRule(budget=budget, ratio=None if budget else 0.5))
    if compacted:
        rng = np.random.default_rng(3)
        native.compact(_keep(rng, smollm2.arch.n_layer, smollm2.arch.n_head_kv, native.n_cells, 400))
    a, b = state.snapshot(), native.snapshot()
    tp = b.token_pos.astype(np.int64)
    T = int(tp[..., -1].max()) + 1
    assert (method._step(b, tp, T)[1] > method._frontier(tp, T)) == (not compacted)  # the step scores partitions
    assert b.lag_scores(-np.ones((smollm2.arch.n_layer, smollm2.arch.n_head_kv, 2, 1), np.int64)) is not None
    target = budget or 200
    keep_state, keep_native = method.select(a, target, why="budget"), method.select(b, target, why="budget")
    assert keep_native.shape[2] <= target  # budget mode leaves room for the next L tokens
    assert np.array_equal(keep_state, keep_native)
    ctx.close()


def test_bad_arguments_are_refused_and_cache_kept(smollm2, toks) -> None:
    ctx = _ctx(smollm2, "f16", "f16", "on")
    eng = NativeEngine(ctx)
    prefill(eng, toks[:100])
    before = ctx.state_get()
    L, H, n = smollm2.arch.n_layer, smollm2.arch.n_head_kv, eng.n_cells
    c = eng._c
    lib, ffi = eng.lib, eng.ffi
    keep = np.zeros(L * H * 10, np.int32)
    keep[3] = n  # out of range
    pos = np.arange(10, dtype=np.int32)
    assert lib.llama_edgekv_seq_compact(c, 0, 10, ffi.from_buffer("int32_t[]", keep), ffi.from_buffer("int32_t[]", pos)) == -2
    keep[3] = 0
    pos[4] = pos[3]  # not increasing
    assert lib.llama_edgekv_seq_compact(c, 0, 10, ffi.from_buffer("int32_t[]", keep), ffi.from_buffer("int32_t[]", pos)) == -2
    assert lib.llama_edgekv_seq_compact(c, 0, n + 1, ffi.from_buffer("int32_t[]", keep), ffi.from_buffer("int32_t[]", pos)) == -2
    assert lib.llama_edgekv_seq_read(c, 0, L, 1, ffi.NULL, ffi.NULL, n, False) == -2
    assert lib.llama_edgekv_seq_read(c, 0, 1, L, ffi.NULL, ffi.NULL, n, False) == -2  # past the last layer
    assert lib.llama_edgekv_seq_read(c, 0, 0, 0, ffi.NULL, ffi.NULL, n, False) == -2
    out = np.zeros(L * H * (n + 1), np.float32)
    assert lib.llama_edgekv_seq_key_sqnorms(c, 0, ffi.from_buffer("float[]", out), n + 1) == -2
    assert lib.llama_edgekv_seq_key_sqnorms(c, 0, ffi.NULL, n) == -2
    norms = np.zeros(L * H * (n + 1))
    assert lib.llama_edgekv_seq_value_norms(c, 0, ffi.from_buffer("double[]", norms), n + 1) == -2
    assert lib.llama_edgekv_seq_value_norms(c, 0, ffi.NULL, n) == -2
    members = np.zeros(L * H * 2 * 4, np.int32)
    scores = np.zeros(L * H * 4)
    m_buf, s_buf = ffi.from_buffer("int32_t[]", members), ffi.from_buffer("double[]", scores)
    assert lib.llama_edgekv_seq_lag_scores(c, 0, 1, 4, m_buf, s_buf, n) == 0
    members[5] = n  # out of range
    assert lib.llama_edgekv_seq_lag_scores(c, 0, 1, 4, m_buf, s_buf, n) == -2
    members[5] = -2
    assert lib.llama_edgekv_seq_lag_scores(c, 0, 1, 4, m_buf, s_buf, n) == -2
    members[5] = 0
    assert lib.llama_edgekv_seq_lag_scores(c, 0, 0, 4, m_buf, s_buf, n) == -2  # no group to score
    assert lib.llama_edgekv_seq_lag_scores(c, 0, 1, 4, m_buf, s_buf, n + 1) == -2
    with pytest.raises(EdgekvError, match="members must be"):
        eng.lag_scores(np.zeros((L, H, 1, 4), np.int64))
    with pytest.raises(EdgekvError):
        eng._merge_groups(-np.ones((L, H, 1, 2), np.int64), np.ones((L, H, 1, 2), np.float32))
    with pytest.raises(EdgekvError, match="newest"):
        eng.merge(np.full((L, H, 1), n - 1), np.zeros((L, H, 1), np.int64), bias=True)
    with pytest.raises(EdgekvError):
        eng.bias_set(np.zeros((L, H, n + 1), np.float32))
    assert ctx.state_get() == before
    ctx.close()


def test_session_picks_native_and_matches_state_engine_output(smollm2_path) -> None:
    prompt = ("Notes from the harbour. " * 60) + "The secret word is lantern. " + ("More notes. " * 40)
    outs = {}
    for engine in ("native", "state"):
        s = Session(smollm2_path, method="knorm", budget=192, n_ctx=256, engine=engine, n_threads=2)
        assert s.engine.name == engine
        s.feed_text(prompt + " What is the secret word? The secret word is")
        outs[engine] = ("".join(s.generate(12)), s.stats.compressions)
        s.close()
    assert outs["native"] == outs["state"]
    assert outs["native"][1] >= 1
    s = Session(smollm2_path, n_ctx=256, n_threads=2)
    assert s.engine.name == "native"
    s.close()


def test_cli_reports_native_engine_and_refuses_unknown_engines(smollm2_path, tmp_path) -> None:
    r = run_cli("info", smollm2_path)
    assert r.returncode == 0, r.stderr
    assert "engine: native" in r.stdout
    r = run_cli("generate", smollm2_path, "--prompt", "Hello", "--engine", "gpu", "--max-tokens", "2")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["edgekv: error: unknown engine 'gpu'; use auto, state or native"]
    r = run_cli("generate", smollm2_path, "--prompt", "Hello there, " * 40, "--engine", "native", "--method",
                "knorm", "--budget", "48", "--n-ctx", "96", "--max-tokens", "4", "--stats-json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["compressions"] >= 1 and stats["peak_cells"] <= 96


def test_native_snapshot_refuses_to_read_a_changed_cache(smollm2, toks) -> None:
    # a native snapshot reads K/V lazily from the live cache; after the cache
    # changes it must refuse rather than return another cache's rows
    ctx = _ctx(smollm2, "f16", "f16", "on")
    eng = NativeEngine(ctx)
    prefill(eng, toks[:100])
    snap = eng.snapshot()
    eng.decode([toks[100]], 100)
    with pytest.raises(EdgekvError, match="changed since this snapshot"):
        snap.keys(0)
    assert eng.snapshot().keys(0).shape[0] == 101
    snap = eng.snapshot()
    ctx.close()
    # a closed context is refused, never touched
    with pytest.raises(EdgekvError, match="context is closed"):
        snap.keys(1)
    with pytest.raises(EdgekvError, match="context is closed"):
        eng.snapshot()
