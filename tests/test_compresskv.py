"""CompressKV on the real model: the calibration's attention is llama.cpp's, a profile
drives the method, and a missing profile is a clear error.

Calibration credits heads with llama.cpp's own softmax (``kq_soft_max-<il>``,
flash attention off), read column by column as token positions. That reading
is checked here against a float64 softmax of the captured query over the
cached keys. The CLI runs a one-needle calibration end to end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _helpers import prefill, run_cli

from edgekv import Session
from edgekv.calibrate import NEEDLES, _span, recall
from edgekv.errors import EdgekvError
from edgekv.kvcache import make_engine
from edgekv.llama import Context
from edgekv.profiles import HeadProfile, file_sha256, save_profile

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. ") * 20


def test_captured_softmax_columns_are_positions(smollm2) -> None:
    arch = smollm2.arch
    ctx = Context(smollm2, n_ctx=512, n_batch=128, flash_attn="off", n_threads=2)
    eng = make_engine(ctx, "state")
    toks = smollm2.tokenize(TEXT, add_special=True)[:201]
    prefill(eng, toks[:200])
    ctx.capture.want("kq_soft_max", [0, 17])
    ctx.capture.want("Qcur", [0, 17])
    eng.decode([toks[200]], 200)
    snap = eng.snapshot()
    g = arch.n_head // arch.n_head_kv
    for il in (0, 17):
        p = ctx.capture.get("kq_soft_max", il)[0, :, 0]  # [n_head, n_kv (padded)]
        q = ctx.capture.get("Qcur", il)[0, 0]  # [n_head, d]
        k = snap.keys(il).astype(np.float64)
        assert np.allclose(p[:, 201:], 0.0)  # padding and empty cells get nothing
        for h in range(arch.n_head):
            logit = (k[:, h // g] @ q[h].astype(np.float64)) / np.sqrt(arch.head_dim_k)
            ref = np.exp(logit - logit.max())
            assert np.abs(p[h, :201] - ref / ref.sum()).max() < 2e-3, (il, h)
    ctx.close()


def test_answer_span_and_recall(smollm2) -> None:
    sentence, _, answer = NEEDLES[0]
    toks = smollm2.tokenize("Some prose here. " + sentence + " More prose.", add_special=True)
    a0, a1 = _span(smollm2, toks, answer)
    text = b"".join(smollm2.piece(t) for t in toks[a0:a1]).decode()
    assert "smoked paprika" in text and "cardamom" in text
    assert recall(answer, "It is a spoonful of smoked paprika and a pinch of cardamom.") == 1.0
    assert recall(answer, "Cinnamon.") == 0.0


def _profile(model, path, heads_first: list[int]) -> HeadProfile:
    info = model.info
    scores = np.zeros((info.n_layer, info.n_head))
    scores[:, heads_first] = np.arange(len(heads_first), 0, -1)
    prof = HeadProfile(info.path.name, file_sha256(info.path), list(range(info.n_layer)), scores.tolist(), 1, 1)
    save_profile(prof, path)
    return prof


@pytest.mark.parametrize("engine", ["state", "native"])
def test_compresskv_session_with_a_profile(smollm2, tmp_path, engine) -> None:
    path = tmp_path / "p.json"
    _profile(smollm2, path, [4, 0, 8, 1])
    toks = smollm2.tokenize(TEXT, add_special=True)[:300]
    with Session(smollm2, method="compresskv", budget=128, n_ctx=256, engine=engine,
                 method_params={"profile": str(path)}) as s:
        s.feed(toks)
        assert s.stats.compressions >= 1 and s.engine.n_cells <= 256
        snap = s.engine.snapshot()
        tp = snap.token_pos
        assert np.all(tp == tp[:, :1])  # one set per layer, shared by its KV heads
        assert "".join(s.generate(4))


def test_missing_or_mismatched_profile_is_a_clear_error(smollm2, tmp_path) -> None:
    with pytest.raises(EdgekvError, match="no CompressKV profile"):
        Session(smollm2, method="compresskv", budget=128, n_ctx=256,
                method_params={"profile": str(tmp_path / "none.json")})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x", "sha256": "0", "layers": [0], "scores": [[1.0] * 9], "runs": 1,
                               "successful": 1}))
    with pytest.raises(EdgekvError, match="profile has 1 layers"):
        Session(smollm2, method="compresskv", budget=128, n_ctx=256, method_params={"profile": str(bad)})


@pytest.mark.slow
def test_calibrate_cli_writes_a_profile(smollm2_path, tmp_path) -> None:
    out = tmp_path / "prof.json"
    r = run_cli("calibrate", smollm2_path, "--lengths", "384", "--depths", "0.5", "--needles", "2",
                "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "[2/2] needle 2" in r.stderr
    prof = json.loads(out.read_text())
    assert prof["runs"] == 2 and prof["successful"] >= 1  # SmolLM2 finds a needle in 384 tokens
    scores = np.array(prof["scores"])
    assert scores.shape == (30, 9) and np.all(scores >= 0) and scores.max() > 0
    assert prof["sha256"] == file_sha256(smollm2_path)
    assert "top heads per layer" in r.stdout


def test_every_registry_model_ships_its_profile(smollm2_path, tmp_path, monkeypatch) -> None:
    # compresskv runs on a fresh machine: each registry model's profile ships, keyed by the
    # model's sha256, and is found when the user has calibrated nothing
    from edgekv.models import list_models
    from edgekv.profiles import load_profile, shipped_profile_path

    for spec in list_models():
        p = shipped_profile_path(spec.sha256)
        assert p is not None, f"no shipped CompressKV profile for {spec.name}"
        prof = HeadProfile(**json.loads(p.read_text()))
        assert prof.sha256 == spec.sha256 and prof.successful > 0
        assert len(prof.scores) == len(prof.layers) and all(np.isfinite(prof.scores[0]))
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path))
    prof = load_profile(smollm2_path)
    assert prof.sha256 == file_sha256(smollm2_path)
    # a calibration of one's own takes precedence
    mine = HeadProfile(**{**prof.__dict__, "runs": prof.runs + 1})
    save_profile(mine)
    assert load_profile(smollm2_path).runs == prof.runs + 1
