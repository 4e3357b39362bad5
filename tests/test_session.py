"""Session on the real default model: equivalence with plain llama.cpp,
bounded memory under compression, save/restore, and the AMX guard."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgekv.errors import BudgetError, EdgekvError
from edgekv.kvcache import layout
from edgekv.llama import cpu_features, use_extra_bufts
from edgekv.session import Session

PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
          "told stories to the children every evening. One night he began a new story about")


def _plain_llama_greedy(path, tokens: list[int], n: int, flash_attn: bool) -> list[int]:
    """Greedy continuation by llama-cpp-python's own high-level loop (independent of edgekv)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2, verbose=False,
                          flash_attn=flash_attn)
    out = []
    for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if llm.token_eos() == tok or len(out) >= n:
            break
        out.append(tok)
    llm.close()
    return out


@pytest.mark.parametrize(("ct", "want", "v_trans"), [("f16", "off", True), ("q8_0", "on", False)])
def test_auto_flash_attention_is_what_the_cpu_cache_needs(smollm2, ct: str, want: str, v_trans: bool) -> None:
    """edgekv's ``auto`` turns flash attention off for an unquantised V cache on the
    CPU (llama.cpp's own auto turns it on, and decodes 2-3x slower there) and on for
    a quantised V, which needs it; the cache llama.cpp built must agree (V transposed
    exactly when flash attention is off)."""
    with Session(smollm2, n_ctx=64, cache_type_k=ct, cache_type_v=ct, n_threads=2) as s:
        assert (s.ctx.flash_attn, s.ctx.flash_attn_requested) == (want, "auto")
        s.feed(smollm2.tokenize(PROMPT)[:8])
        sec = layout.parse_seq_state(s.ctx.state_get(), n_caches=1, n_layers=[smollm2.arch.n_layer]).sections[0]
        assert sec.v_trans is v_trans and sec.n_cells == 8


@pytest.mark.slow
@pytest.mark.parametrize("fa", ["on", "off"])
def test_full_and_large_budget_match_plain_llama_cpp_greedy(smollm2, smollm2_path, fa: str) -> None:
    toks = smollm2.tokenize(PROMPT)
    ref = _plain_llama_greedy(smollm2_path, toks, 40, flash_attn=fa == "on")
    assert len(ref) >= 20
    for method, kw in (("full", {}), ("knorm", {"budget": 400}), ("streaming_llm", {"budget": 400})):
        with Session(smollm2, method=method, n_ctx=512, chunk=256, n_threads=2, flash_attn=fa, **kw) as s:
            s.feed(toks)
            got = list(s.generate_tokens(len(ref)))
            assert s.stats.compressions == 0
        assert got == ref, f"{method} diverged from llama.cpp greedy"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["streaming_llm", "knorm", "random", "chelsea", "chelsea_nobias", "protokv"])
def test_prompt_four_times_n_ctx_stays_bounded(smollm2, method: str) -> None:
    n_ctx, budget = 256, 128
    text = " ".join(f"Record {i}: the ship {i % 7} carried {i * 3} barrels of oil." for i in range(120))
    toks = smollm2.tokenize(text)
    assert len(toks) >= 4 * n_ctx
    with Session(smollm2, method=method, budget=budget, n_ctx=n_ctx, chunk=64, n_threads=2) as s:
        seen_cells = []
        s.feed(toks, progress=lambda done, total: seen_cells.append(s.engine.n_cells))
        assert s.stats.tokens_seen == len(toks)
        assert s.stats.peak_cells <= n_ctx and max(seen_cells) <= n_ctx
        assert s.stats.compressions >= (len(toks) - n_ctx) // (n_ctx - budget)
        # llama.cpp's own count agrees with the engine's accounting.
        sec = layout.parse_seq_state(s.ctx.state_get(), n_caches=1, n_layers=None).sections[0]
        assert sec.n_cells == s.engine.n_cells == s.stats.cells
        assert s.ctx.pos_max() == len(toks) - 1
        out = "".join(s.generate(16))
        assert out.strip()
        assert s.ctx.pos_max() <= len(toks) - 1 + 16


def test_impossible_budgets_are_one_line_errors(smollm2) -> None:
    cases = [
        dict(method="knorm", budget=512, n_ctx=512),
        dict(method="knorm", budget=20, n_ctx=512),
        dict(method="knorm", ratio=1.5),
        dict(method="knorm", ratio=0.5, budget=100),
        dict(method="knorm", budget=0),
    ]
    for kw in cases:
        with pytest.raises(BudgetError) as e:
            Session(smollm2, n_threads=2, **kw)
        assert "\n" not in str(e.value)


def test_full_method_reports_a_full_context(smollm2) -> None:
    with Session(smollm2, method="full", n_ctx=64, chunk=32, n_threads=2) as s:
        with pytest.raises(EdgekvError, match="context full"):
            s.feed(smollm2.tokenize(PROMPT * 4))


def test_save_restore_reuses_a_prefill(smollm2) -> None:
    toks = smollm2.tokenize(PROMPT * 3)
    with Session(smollm2, method="knorm", budget=48, n_ctx=256, n_threads=2) as s:
        s.feed(toks)
        saved = s.save()
        first = list(s.generate_tokens(8))
        s.restore(saved)
        # After a restore the last logits are gone; re-decoding is the caller's job.
        with pytest.raises(EdgekvError, match="feed a prompt first"):
            list(s.generate_tokens(1))
        s.compress(48)
        assert s.engine.n_cells == 48
        s.restore(saved)
        assert s.engine.n_cells == len(toks)
        assert first  # generation from the original prefill worked


def test_session_file_roundtrip_and_wrong_files(smollm2, tmp_path) -> None:
    toks = smollm2.tokenize(PROMPT * 3)
    with Session(smollm2, method="knorm", budget=48, n_ctx=256, n_threads=2) as s:
        s.feed(toks)
        s.compress()
        ref = s.engine.snapshot()
        ref_keys = ref.keys(5)
        f = tmp_path / "chat.ekv"
        s.save_file(f)
    if s.engine.name == "native":
        # a native snapshot reads the live cache lazily (from layer 5 on, a block of layers was
        # read above; layer 0 was not): once the session is closed it refuses
        with pytest.raises(EdgekvError, match="context is closed"):
            ref.keys(0)
    with Session(smollm2, method="knorm", budget=48, n_ctx=256, n_threads=2) as s2:
        s2.load_file(f)
        got = s2.engine.snapshot()
        assert s2.engine.n_cells == 48 and s2.n_past == len(toks)
        np.testing.assert_array_equal(got.keys(5), ref_keys)
        np.testing.assert_array_equal(got.token_pos, ref.token_pos)
        tok = smollm2.tokenize(" the", add_special=False)
        s2.feed(tok)  # continues where the saved session stopped
        assert s2.ctx.pos_max() == len(toks)
    bad = tmp_path / "bad.ekv"
    bad.write_bytes(b"not a session")
    data = f.read_bytes()
    trunc = tmp_path / "trunc.ekv"
    trunc.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flipped.ekv"  # one bit inside the K/V payload: caught by the checksum
    flipped.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 4]) + data[len(data) // 2 + 1 :])
    # headers that parse as JSON but are not a session header
    odd = []
    for i, header in enumerate((b"[1, 2]", b'{"version": 2, "arrays": []}', b'{"version": 2, "arrays": [7]}')):
        p = tmp_path / f"odd{i}.ekv"
        p.write_bytes(data[:8] + len(header).to_bytes(4, "little") + header)
        odd.append((p, "corrupt"))
    with Session(smollm2, method="knorm", budget=48, n_ctx=256, cache_type_k="q8_0",
                 cache_type_v="q8_0", flash_attn="on", n_threads=2) as s3:
        s3.feed(toks[:10])
        for path, msg in ((bad, "not an edgekv session"), (trunc, "corrupted"), (flipped, "checksum"),
                          (f, "cache type"), (tmp_path / "missing.ekv", "does not exist"), *odd):
            with pytest.raises(EdgekvError, match=msg) as e:
                s3.load_file(path)
            assert "\n" not in str(e.value)
            assert s3.engine.n_cells == 10  # nothing lost


@pytest.mark.kernels
def test_the_build_runs_the_kernel_set_it_was_built_for() -> None:
    """``EDGEKV_CPU=avx2`` (scripts/test_kernels.sh) must really run the AVX2 kernels, or a
    second run of the kernel tests proves nothing; and no build runs AVX-512 kernels on a
    CPU without AVX-512 (a build made with ``EDGEKV_CPU=avx2`` may of course lack them)."""
    feats = set(cpu_features())
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 kernel sets only")
    assert {"AVX", "AVX2", "F16C", "FMA"} <= feats
    if os.environ.get("EDGEKV_CPU") == "avx2":
        assert not {f for f in feats if f.startswith(("AVX512", "AMX"))}
    if "AVX512" in feats:
        with open("/proc/cpuinfo") as f:
            assert re.search(r"\bavx512f\b", f.read())


def test_extra_buffer_types_off_only_for_amx_builds_on_amx_cpus() -> None:
    assert use_extra_bufts(cpu_amx=True, lib_amx=True) is False
    assert use_extra_bufts(cpu_amx=True, lib_amx=False) is True
    assert use_extra_bufts(cpu_amx=False, lib_amx=True) is True


@pytest.mark.slow
def test_long_batches_do_not_crash_on_this_cpu(smollm2_path) -> None:
    """The 21+-token batch that segfaulted in ggml_backend_amx_mul_mat (docs/design.md section 5),
    through the product's loading path, in a child process so a crash is a failure, not a dead run."""
    code = textwrap.dedent(f"""
        from edgekv.session import Session
        s = Session({str(smollm2_path)!r}, method="full", n_ctx=512, chunk=256, n_threads=2)
        toks = s.model.tokenize("The harbour was quiet that morning, " * 30)
        s.feed(toks)
        print("ok", len(toks), "".join(s.generate(4)) is not None)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-500:]}"
    assert r.stdout.startswith("ok ")


def test_logits_survive_a_compression(smollm2) -> None:
    """Compressing between prefill and sampling keeps the already computed logits."""
    toks = smollm2.tokenize(PROMPT * 3)
    with Session(smollm2, method="knorm", budget=48, n_ctx=256, n_threads=2) as s:
        s.feed(toks)
        before = s.logits()
        s.compress()
        assert s.engine.n_cells == 48
        assert np.array_equal(s.logits(), before)
        assert len(list(s.generate_tokens(4))) >= 1


@pytest.mark.parametrize("method", ["snapkv", "chelsea", "knorm"])
def test_making_room_ahead_is_the_compression_the_next_turn_would_run(smollm2, method: str) -> None:
    """``make_room(n)`` between turns runs the compression that feeding the next ``n`` tokens
    would have started with: the turn then compresses no more, and the cache (cells,
    positions, merge counts) and the reply's logits are the same bytes as without it."""
    toks = smollm2.tokenize(PROMPT * 8)
    turn = smollm2.tokenize(" And then the storm came over the hill.", add_special=False)[:12]
    n_ctx = 256
    with Session(smollm2, method="full", n_ctx=n_ctx, chunk=64, n_threads=2, observe=32) as s:
        s.feed(toks[: n_ctx - len(turn) + 3])  # the turn does not fit
        s.use(method, budget=96, scheduled=False)  # compress when full, not on the method's schedule
        full = s.save()
        assert not s.make_room(3)  # three cells are still free: nothing to do
        assert s.stats.compressions == 0

        s.feed(turn)  # compresses before the turn
        assert s.stats.compressions == 1
        plain, plain_logits = s.save()[0], s.logits().copy()

        s.restore(full)
        assert s.make_room(len(turn))
        assert s.stats.compressions == 2 and s.engine.n_cells + len(turn) <= n_ctx
        s.feed(turn)  # fits now
        assert s.stats.compressions == 2
        ahead = s.save()[0]
        assert ahead.blob == plain.blob
        assert np.array_equal(ahead.token_pos, plain.token_pos)
        assert (ahead.counts is None) == (plain.counts is None)
        if plain.counts is not None:  # chelsea merges: the same counts
            assert np.array_equal(ahead.counts, plain.counts)
        assert np.array_equal(s.logits(), plain_logits)
        with pytest.raises(EdgekvError, match="at least 1"):
            s.make_room(0)


def test_making_room_is_nothing_for_a_method_that_never_compresses(smollm2) -> None:
    toks = smollm2.tokenize(PROMPT * 3)
    with Session(smollm2, method="full", n_ctx=64, n_threads=2) as s:
        s.feed(toks[:60])
        assert not s.make_room(16)  # the next feed refuses, with its one-line error
        assert s.engine.n_cells == 60
        with pytest.raises(EdgekvError, match="context full"):
            s.feed(toks[60:76])


def test_a_compression_pauses_the_cyclic_gc_and_restores_it(smollm2, monkeypatch) -> None:
    """The collector is off while the method compresses and as it was afterwards, also
    when the method fails."""
    import gc

    toks = smollm2.tokenize(PROMPT * 3)
    with Session(smollm2, method="knorm", budget=48, n_ctx=256, n_threads=2) as s:
        s.feed(toks)
        seen = []
        inner = s.method.compress

        def spy(*args, **kwargs):
            seen.append(gc.isenabled())
            return inner(*args, **kwargs)

        monkeypatch.setattr(s.method, "compress", spy)
        assert gc.isenabled()
        s.compress(64)
        assert seen == [False] and gc.isenabled()
        gc.disable()
        try:
            s.compress(56)
            assert seen == [False, False] and not gc.isenabled()
        finally:
            gc.enable()

        def fail(*args, **kwargs):
            raise EdgekvError("no")

        monkeypatch.setattr(s.method, "compress", fail)
        with pytest.raises(EdgekvError):
            s.compress(48)
        assert gc.isenabled()


@pytest.mark.slow
def test_context_shift_matches_llama_cpp_semantics(smollm2) -> None:
    """llama.cpp's context shift: positions are shifted down, n_keep cells stay,
    the older half of the rest goes, and decoding goes on below n_ctx."""
    text = " ".join(f"Entry {i}: the tide rose {i % 5} feet." for i in range(60))
    toks = smollm2.tokenize(text)
    with Session(smollm2, method="context_shift", n_ctx=128, n_threads=2) as s:
        s.feed(toks)
        assert s.stats.compressions >= 1 and s.stats.peak_cells <= 128
        snap = s.engine.snapshot()
        # Positions are contiguous again after the shift (not the original ones) ...
        assert s.ctx.pos_max() == s.n_past - 1 < len(toks) - 1
        assert np.all(np.diff(snap.pos[1:]) == 1)
        # ... while the engine still knows which original tokens survive.
        assert snap.token_pos[0, 0, 0] == 0
        assert snap.token_pos[0, 0, -1] == len(toks) - 1
        assert "".join(s.generate(8)).strip()


def test_native_context_shift_reads_positions_not_the_cache(smollm2, monkeypatch) -> None:
    """The native engine's context shift takes the cells' positions from its cells op, not
    from a parse of the state blob (every layer's keys and values: 0.1 to 0.5 s at 8k), and
    leaves what the state engine's shift leaves."""
    from edgekv.llama import Context, SamplerConfig

    toks = smollm2.tokenize(" ".join(f"Entry {i}: the tide rose {i % 5} feet." for i in range(30)))
    assert len(toks) > 200
    after = {}
    for engine in ("native", "state"):
        with Session(smollm2, method="full", n_ctx=256, engine=engine, n_threads=2) as s:
            s.feed(toks[:200])
            s.use("context_shift")
            if engine == "native":
                monkeypatch.setattr(Context, "state_get", lambda *a, **k: pytest.fail("read the state blob"))
            s.compress()
            monkeypatch.undo()
            reply = [s.step(SamplerConfig(temperature=0)) for _ in range(4)]
            snap = s.engine.snapshot()
            after[engine] = (snap.pos, snap.token_pos, reply, np.frombuffer(s.save()[0].blob, np.uint8))
    assert after["native"][0].shape[0] == 200 - 199 // 2 + 4
    for a, b in zip(after["native"], after["state"], strict=True):
        assert np.array_equal(a, b)


def test_native_context_shift_rotates_the_keys_before_the_turn(smollm2) -> None:
    """The native engine applies llama.cpp's K-shift inside the compression (llama.cpp's own
    update, which the next decode would otherwise run), so a compression made ahead of a
    turn (``make_room``) leaves the turn nothing to do: the native ops serve at once, the
    cache can be saved before any decode, and the turn's logits are the state engine's,
    whose decode applies the same shift."""
    from edgekv.kvcache.native import NativeSnapshot

    toks = smollm2.tokenize(" ".join(f"Entry {i}: the tide rose {i % 5} feet." for i in range(30)))[:250]
    turn = smollm2.tokenize(" The keeper", add_special=False)
    logits = {}
    for engine in ("native", "state"):
        with Session(smollm2, method="context_shift", n_ctx=256, engine=engine, n_threads=2) as s:
            s.feed(toks)
            assert s.make_room(len(turn) + 8)
            if engine == "native":
                assert isinstance(s.engine.snapshot(), NativeSnapshot)  # no shift left pending
                assert s.engine.lib.llama_edgekv_shift_apply(s.engine._c) == 0  # nothing to apply
                blob = s.save()[0].blob  # refused while a shift is pending
            before = s.stats.compressions
            s.feed(turn)
            assert s.stats.compressions == before
            logits[engine] = s.ctx.logits(-1).copy()
    assert blob
    np.testing.assert_array_equal(logits["native"], logits["state"])


def test_use_switches_methods_and_refuses_what_the_session_cannot_do(smollm2) -> None:
    from dataclasses import dataclass

    from edgekv.methods import Method

    toks = smollm2.tokenize(PROMPT * 12)
    assert len(toks) > 400
    with Session(smollm2, method="full", n_ctx=256, chunk=128, engine="state", n_threads=2) as s:
        s.feed(toks[:100])
        assert s.chunk == 128
        s.use("knorm", budget=64)
        assert s.method.name == "knorm" and s.budget == 64 and s.chunk == 128  # min(128, 256 - 64)
        s.use("streaming_llm", budget=200)
        assert s.chunk == 56  # a compression must leave room for the next chunk
        for kw in (dict(budget=256), dict(budget=8), dict(ratio=0.5, budget=64)):
            with pytest.raises(BudgetError) as e:
                s.use("knorm", **kw)
            assert "\n" not in str(e.value)
        assert s.method.name == "streaming_llm" and s.budget == 200  # a refused use changes nothing

        @dataclass
        class NeedsBias(Method):
            name = "needs_bias"
            needs = frozenset({"bias"})

        with pytest.raises(EdgekvError, match="needs bias, which the state engine lacks"):
            s.use(NeedsBias())
        s.feed(toks[100:])  # 200 + the rest: compresses to the budget on the way
        assert s.stats.compressions >= 1 and s.engine.n_cells <= 256


def test_stats_have_one_serialisation_that_reads_back() -> None:
    """``--stats-json`` and the server's saved index write the same dict; it reads back whole."""
    from edgekv.session import Event, Stats

    s = Stats(capacity=300, kv_bytes_per_cell=23040, cells=120, peak_cells=300, compressions=2, tokens_seen=900,
              tokens_evicted=780, compress_seconds=0.25, events=[Event(300, 300, 120), Event(600, 300, 120)])
    d = s.as_dict()
    assert d["kv_bytes"] == 120 * 23040 and d["events"] == [[300, 300, 120], [600, 300, 120]]
    import json

    back = Stats.from_dict(json.loads(json.dumps(d)))
    assert back == s and isinstance(back.events[0], Event)


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_a_turn_rendered_over_its_last_exchange_is_the_whole_transcripts_tail(system) -> None:
    # Chat renders a new turn over the system message and the last exchange only, so its
    # cost stays flat over a long chat: for every format llama.cpp knows, that text must be
    # what rendering the whole transcript adds after the text the cache holds
    from functools import partial

    from edgekv.llama import chat_template_names, render_chat
    from edgekv.session import common_prefix, turn_text

    names = chat_template_names()
    assert len(names) > 40
    for name in [*names, None]:  # None: no template, the plain transcript
        render = partial(render_chat, name.encode() if name else None)
        msgs = [{"role": "system", "content": system}] if system else []
        for t in range(6):
            msgs.append({"role": "user", "content": f"Question {t}: what is {t} + {t}?"})
            if t:
                before = render(msgs[:-2], add_assistant=True) + msgs[-2]["content"]
                whole = render(msgs, add_assistant=True)
                assert turn_text(render, msgs, held=True) == whole[common_prefix(before, whole):], (name, t)
            else:
                assert turn_text(render, msgs, held=False) == render(msgs, add_assistant=True)
            msgs.append({"role": "assistant", "content": f"  {2 * t}, since {t} twice is {2 * t}.\n"})


def test_common_prefix_across_blocks() -> None:
    from edgekv.session import common_prefix

    a = "x" * 10000
    for i in (0, 1, 4095, 4096, 4097, 9999):
        assert common_prefix(a, a[:i] + "y" + a[i + 1:]) == i
    assert common_prefix(a, a) == 10000 and common_prefix(a, a[:5000]) == 5000 and common_prefix("", a) == 0
