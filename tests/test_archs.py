"""The architecture matrix: a tiny random-weight model of each family the vendored
llama.cpp loads (``edgekv/tinymodels.py``), run through what a user does with edgekv.

Per family: it loads with the verdict ``edgekv info`` prints; a chat turn decodes;
every method compresses it at ratio 0.5 on every engine it can use, and where both
engines apply they leave byte-identical caches and predict the same next token;
a session file saved and loaded continues identically; ``+rerotate`` runs where the
keys carry RoPE and is refused with one line where they do not.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.archs import TESTED, verdict
from edgekv.errors import EdgekvError, ModelError
from edgekv.gguf_info import read_model_info
from edgekv.kvcache import native_available
from edgekv.kvcache.rope import Rope
from edgekv.llama import Model, SamplerConfig
from edgekv.methods import METHODS
from edgekv.profiles import HeadProfile, save_profile
from edgekv.session import Chat, Session
from edgekv.tinymodels import SPECS, make_tiny

TEXT = ("The lighthouse keeper wrote in her log every evening: the wind, the ships, the colour of "
        "the sea and the names of the birds that rested on the rail. ") * 6


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny(tiny_dir, smollm2_path):
    models: dict[str, Model] = {}

    def get(arch: str) -> Model:
        if arch not in models:
            models[arch] = Model(make_tiny(arch, tiny_dir, vocab_from=smollm2_path))
        return models[arch]

    yield get
    for m in models.values():
        m.close()


def test_the_matrix_covers_every_tested_family() -> None:
    assert set(TESTED) <= set(SPECS)
    assert {"llama", "mistral3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "granite",
            "starcoder2", "gpt2"} <= set(TESTED)


def test_the_generator_names_what_the_vendored_gguf_py_names(tiny_dir, smollm2_path) -> None:
    """Every tensor a tiny model holds is one llama.cpp's loader asked for: an unknown
    name would load (llama.cpp ignores nothing silently; it fails on extra tensors),
    so the file's tensor count is the spec's."""
    import gguf

    for arch in ("gpt2", "olmo2"):
        path = make_tiny(arch, tiny_dir, vocab_from=smollm2_path)
        info = read_model_info(path)
        assert info.arch == arch and info.n_tensors == len(SPECS[arch].tensors(SPECS[arch].shape))
        assert path.stat().st_size < 16 << 20
        r = gguf.GGUFReader(path)
        assert r.fields["general.architecture"].contents() == arch
    with pytest.raises(EdgekvError, match="no tiny model for 'nope'"):
        make_tiny("nope", tiny_dir, vocab_from=smollm2_path)


@pytest.mark.parametrize("arch", TESTED)
def test_each_family_loads_with_its_verdict_and_chats(tiny, arch: str) -> None:
    model = tiny(arch)
    v = verdict(model.info)
    assert v.status == "supported", v.line()
    spec = SPECS[arch]
    assert (model.arch.n_layer, model.arch.n_head_kv) == (spec.shape.n_layer, spec.shape.n_head_kv)
    assert model.info.positions == {"gpt2": "learned", "bloom": "alibi"}.get(arch, "rope")
    assert model.info.is_swa_model == (arch in ("gemma2", "gemma3", "gpt-oss", "llama4"))
    with Session(model, method="knorm", budget=96, n_ctx=160, n_threads=2) as s:
        chat = Chat(s, system="You keep a lighthouse.")
        reply = "".join(chat.send(TEXT + "What did you see today?", max_tokens=8,
                                  sampler=SamplerConfig(temperature=0)))
        assert isinstance(reply, str)
        assert s.stats.tokens_seen > 200 and s.stats.compressions >= 1  # it outgrew 160 cells
        assert s.engine.n_cells <= 160


def _engines(model: Model) -> list[str]:
    if model.info.is_swa_model or not native_available():
        return ["state"]
    return ["state", "native"]


def _profile(model: Model, path) -> str:
    """A CompressKV head profile for a tiny model (seeded scores: calibrating random
    weights would find no retrieval heads to rank)."""
    info = model.info
    layers = list(info.global_layers) if info.is_swa_model else list(range(info.n_layer))
    rng = np.random.default_rng(0)
    scores = rng.random((len(layers), info.n_head)).round(4).tolist()
    return str(save_profile(HeadProfile(info.name, "", layers, scores, 1, 1), path))


def _run_methods(model: Model, engine: str, profile: str) -> dict[str, object]:
    """Per method: (state blob, token map, next token) after one compression at ratio 0.5
    from the same prefill, or the one-line error that refused it."""
    params: dict[str, dict[str, object]] = {"compresskv": {"profile": profile}}
    more = model.tokenize(" And then the fog came in.", add_special=False)
    out: dict[str, object] = {}
    info = model.info  # under soft-capping, sinks or ALiBi the engines refuse to record attention
    record = not (info.attn_logit_softcap or info.attn_sinks or info.positions == "alibi")
    # Expected Attention rotates queries back: RoPE edgekv reproduces, or none at all
    moments = record and (Rope.unsupported(model) is None or model.arch.rope_type < 0)
    with Session(model, method="full", n_ctx=512, engine=engine, n_threads=2, observe=64 * record,
                 tally=record, moments=moments) as s:
        assert s.engine.name == engine
        s.feed_text(TEXT)
        before = s.engine.n_cells
        saved = s.save()
        for name in METHODS:
            if name in ("full", "context_shift"):
                continue
            s.restore(saved)
            try:
                s.use(name, ratio=0.5, **params.get(name, {}))
                s.compress()
            except EdgekvError as e:
                out[name] = str(e)
                continue
            assert s.engine.n_cells <= before // 2 + 1, name
            state = s.engine.save()
            s.feed(more)  # decoding goes on over the compressed cache
            out[name] = (state.blob, state.token_pos.copy(), int(np.argmax(s.logits())))
    return out


@pytest.mark.parametrize("arch", TESTED)
def test_every_method_on_every_engine_leaves_the_same_cache(tiny, arch: str, tmp_path) -> None:
    model = tiny(arch)
    profile = _profile(model, tmp_path / "profile.json")
    runs = {engine: _run_methods(model, engine, profile) for engine in _engines(model)}
    state = runs["state"]
    ran = [m for m, r in state.items() if isinstance(r, tuple)]
    refused = {m: r for m, r in state.items() if isinstance(r, str)}
    everywhere = {"streaming_llm"} if model.info.positions == "alibi" else \
        {"streaming_llm", "knorm", "random", "lagkv", "chelsea_nobias"}
    assert everywhere <= set(ran), refused
    for m, why in refused.items():  # every refusal on the state engine has its reason
        assert "\n" not in why
        if model.info.attn_logit_softcap or model.info.attn_sinks or model.info.positions == "alibi":
            assert any(w in why for w in ("soft-capping", "sinks", "ALiBi", "needs")), (m, why)
        else:  # only the native engine's bias and merge ops, or a RoPE edgekv does not reproduce
            assert "needs" in why or (m == "expected_attention" and "RoPE" in why), (m, why)
    if "native" in runs:
        native = runs["native"]
        for m, r in native.items():  # the native engine refuses only what no engine scores right
            assert isinstance(r, tuple) or any(w in r for w in ("soft-capping", "sinks", "ALiBi", "RoPE")), (m, r)
        if model.info.positions == "alibi":  # per-head methods: the native engine's bias keeps them exact
            assert {"knorm", "random", "lagkv", "chelsea"} <= {m for m, r in native.items() if isinstance(r, tuple)}
        for m in ran:
            blob_s, tp_s, next_s = state[m]
            blob_n, tp_n, next_n = native[m]
            assert np.array_equal(tp_s, tp_n), m
            assert blob_s == blob_n, f"{arch} {m}: the engines left different caches"
            assert next_s == next_n, m


@pytest.mark.parametrize("arch", TESTED)
def test_session_files_and_rerotation(tiny, arch: str, tmp_path) -> None:
    model = tiny(arch)
    path = tmp_path / f"{arch}.ekv"
    more = model.tokenize(" And then the fog came in.", add_special=False)
    logits = []
    for load in (False, True):
        with Session(model, method="knorm", ratio=0.5, n_ctx=512, n_threads=2) as s:
            if load:
                s.load_file(path)
            else:
                s.feed_text(TEXT)
                s.compress()
                s.save_file(path)
            s.feed(more)  # the same tokens after the saved cache, or after the same cache loaded
            logits.append(s.logits().copy())
    assert np.array_equal(logits[0], logits[1]), "a loaded session file continued differently"
    rope = model.info.positions == "rope" and not model.info.is_swa_model
    with Session(model, method="full", n_ctx=512, n_threads=2) as s:
        s.feed_text(TEXT)
        if rope:
            s.use("streaming_llm+rerotate", ratio=0.5)
            s.compress()
            assert s.n_past == s.engine.n_cells  # renumbered: positions are consecutive again
            s.feed(more)
            assert np.isfinite(s.logits()).all()
        else:
            with pytest.raises(EdgekvError) as e:
                s.use("streaming_llm+rerotate", ratio=0.5)
            assert "\n" not in str(e.value)


def test_edgekv_info_prints_each_familys_verdict(tiny_dir, smollm2_path) -> None:
    from typer.testing import CliRunner

    from edgekv.cli import app

    for arch in SPECS:
        path = make_tiny(arch, tiny_dir, vocab_from=smollm2_path)
        res = CliRunner().invoke(app, ["info", str(path)])
        assert res.exit_code == 0, res.output
        line = next(x for x in res.output.splitlines() if x.startswith("edgekv "))
        want = verdict(read_model_info(path))
        assert line == f"edgekv      {want.line()}"
        refused = arch in ("mamba", "deepseek2", "qwen2vl", "lfm2")
        assert want.status == ("supported" if arch in TESTED else "refused" if refused else "unverified"), \
            (arch, line)
    assert "ALiBi" in verdict(read_model_info(make_tiny("bloom", tiny_dir, vocab_from=smollm2_path))).line()


def _compacted_attention(model: Model, per_head: bool, engine: str = "auto",
                         zero_bias: bool = False) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per compressed layer: (llama.cpp's attention output, the float64 reference over the
    kept rows at their tokens' true positions, the same reference with V's rows permuted),
    for 4 queries decoded after a compaction to 60 of 120 cells (the same cells in every
    head, or different cells per head)."""
    from _attention import alibi_slopes, captured_attention, reference_attention
    from _helpers import prefill

    from edgekv.kvcache import make_engine
    from edgekv.llama import Context

    info = model.info
    ctx = Context(model, n_ctx=256, n_batch=64, flash_attn="off", n_threads=2)
    eng = make_engine(ctx, engine)
    toks = model.tokenize(TEXT, add_special=False)[:124]
    prefill(eng, toks[:120], batch=64)
    rows = len(info.global_layers) if info.is_swa_model else info.n_layer
    rng = np.random.default_rng(5)
    pick = [np.sort(np.r_[rng.choice(119, 59, replace=False), 119]) for _ in range(rows * info.n_head_kv)]
    keep = np.array(pick).reshape(rows, info.n_head_kv, 60)
    if not per_head:
        keep[:] = keep[0, 0]
    eng.compact(keep)
    if zero_bias:  # what llama.cpp attends without edgekv's per-cell bias
        eng.bias_set(np.zeros((rows, info.n_head_kv, eng.n_cells), np.float32))
    layers = list(info.global_layers) if info.is_swa_model else list(range(info.n_layer))
    ctx.capture.want("Qcur", layers)
    ctx.capture.want("kqv_out", layers)
    ctx.capture.clear()
    eng.decode(toks[120:124], 120)
    snap = eng.snapshot()
    q_pos = np.arange(120, 124)
    alibi = alibi_slopes(info.n_head, 8.0) if info.positions == "alibi" else None
    sinks = None
    if info.attn_sinks:
        import gguf

        tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(model.path).tensors}
    perm = rng.permutation(snap.n_cells)
    out = []
    for row, il in enumerate(layers):
        q, got = captured_attention(ctx, il)
        k, v, kpos = snap.keys(row), snap.values(row), snap.token_pos[row]
        if info.attn_sinks:
            sinks = tensors[f"blk.{il}.attn_sinks.weight"].astype(np.float64)
        ref = reference_attention(q, k, v, None, q_pos, kpos, info.kq_scale, softcap=info.attn_logit_softcap,
                                  alibi=alibi, sinks=sinks)
        other = reference_attention(q, k, v[perm], None, q_pos, kpos, info.kq_scale,
                                    softcap=info.attn_logit_softcap, alibi=alibi, sinks=sinks)
        out.append((got, ref, other))
    ctx.close()
    return out


def _exact(got: np.ndarray, ref: np.ndarray, other: np.ndarray) -> bool:
    """Within the kernels' rounding (f16 K and V, f16 probabilities: about 1 % of the output's
    scale, tests/test_attention.py), and far closer than attention over the wrong rows."""
    err = np.abs(got - ref)
    return bool(err.max() < 0.02 * np.abs(ref).max() and err.mean() < 0.1 * np.abs(other - ref).mean())


@pytest.mark.kernels
@pytest.mark.parametrize("arch", TESTED)
def test_attention_after_a_per_head_compaction_is_exact(tiny, arch: str) -> None:
    """llama.cpp's own attention over a per-head compacted cache equals float64 attention over
    the kept rows at their tokens' true positions, with the family's scale, soft-capping and
    windows (the sliding-window layers keep their own cache; the compressed layers are full)."""
    for il, (got, ref, other) in enumerate(_compacted_attention(tiny(arch), per_head=True)):
        assert _exact(got, ref, other), (arch, il, float(np.abs(got - ref).max()), float(np.abs(ref).max()))


@pytest.mark.kernels
def test_alibi_is_exact_after_a_per_head_compaction_only_with_the_bias(tiny) -> None:
    """ALiBi biases each key by its cell's one position. A compaction that keeps the same
    tokens in every head is exact on both engines; a per-head one is exact on the native
    engine, whose per-cell bias carries the distance it took from each head's tokens, and
    is not without that bias, which is why the state engine refuses it."""
    model = tiny("bloom")
    for engine in ("state", "native"):
        assert all(_exact(*r) for r in _compacted_attention(model, per_head=False, engine=engine))
    assert all(_exact(*r) for r in _compacted_attention(model, per_head=True, engine="native"))
    assert not any(_exact(*r) for r in _compacted_attention(model, per_head=True, engine="native", zero_bias=True))
    with pytest.raises(EdgekvError, match="ALiBi") as e:
        _compacted_attention(model, per_head=True, engine="state")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("arch", "why"), [("mamba", "recurrent state"), ("lfm2", "recurrent state"),
                                         ("qwen2vl", "M-RoPE")])
def test_recurrent_hybrid_and_mrope_models_are_refused_in_one_line(tiny_dir, smollm2_path, arch: str,
                                                                   why: str) -> None:
    """Mamba keeps a recurrent state, not a per-token cache, and LFM2 keeps one beside its
    attention layers; Qwen2-VL's cells carry sectioned positions. edgekv refuses each at load
    and says why, and ``edgekv info`` says so from the header without loading it."""
    path = make_tiny(arch, tiny_dir, vocab_from=smollm2_path)
    v = verdict(read_model_info(path))
    assert v.status == "refused" and why in v.line()
    with pytest.raises(ModelError) as e:
        Model(path)
    assert why in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("engine", ["state", "native"])
def test_rerotation_leaves_the_layers_without_rope_alone(tiny, engine: str) -> None:
    """SmolLM3 builds every 4th layer without RoPE: renumbering must move the keys of the
    other layers by their distance and leave those layers' keys exactly as they were."""
    from _helpers import prefill

    from edgekv.kvcache import make_engine
    from edgekv.llama import Context

    model = tiny("smollm3")
    assert model.info.nope_layers == (3,)
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=2)
    eng = make_engine(ctx, engine)
    prefill(eng, model.tokenize(TEXT, add_special=False)[:160], batch=64)
    kept = np.r_[0:4, 100:160]  # StreamingLLM's sinks and recent window: a gap of 96 positions
    eng.compact(np.broadcast_to(kept, (model.info.n_layer, model.info.n_head_kv, kept.size)).copy())
    before = eng.snapshot()
    k_before = [before.keys(il).copy() for il in range(model.info.n_layer)]
    assert eng.renumber() == -96
    after = eng.snapshot()
    for il in range(model.info.n_layer):
        same = np.array_equal(after.keys(il), k_before[il])
        assert same == (il == 3), il  # only the NoPE layer is untouched
        assert np.array_equal(after.keys(il)[:4], k_before[il][:4])  # the sinks did not move
    ctx.close()


def test_mla_models_are_refused_in_one_line_and_why(tiny_dir, smollm2_path) -> None:
    """DeepSeek-V2's MLA cache: loading it past the refusal shows why it is refused. llama.cpp
    keeps one latent per layer and no V (V is a view of K), so the state engine cannot parse
    the sequence's state, which the first compression of a session would hit."""
    from edgekv.errors import StateLayoutError
    from edgekv.kvcache import StateEngine
    from edgekv.llama import Context, lib

    path = make_tiny("deepseek2", tiny_dir, vocab_from=smollm2_path)
    info = read_model_info(path)
    assert info.mla and verdict(info).status == "refused"
    with pytest.raises(ModelError) as e:
        Model(path)
    assert "multi-head latent attention" in str(e.value) and "\n" not in str(e.value)

    class Unchecked(Model):  # the model as libllama loads it, without edgekv's refusals
        def _setup(self) -> None:
            self.vocab = lib().llama_model_get_vocab(self.ptr)
            self.arch = self._read_arch()

    model = Unchecked(path)
    assert (model.arch.n_head_kv, model.arch.head_dim_k, model.arch.head_dim_v) == (1, 48, 32)
    ctx = Context(model, n_ctx=256, n_batch=64, n_threads=2)
    eng = StateEngine(ctx)
    eng.decode(model.tokenize(TEXT, add_special=False)[:64], 0)
    with pytest.raises(StateLayoutError, match="v_type"):
        eng.snapshot()
    ctx.close()
    model.close()
