"""The GPU path: the default model with its weights and KV cache on a CUDA device.

A cache outside host memory takes every native op's ggml graph, so on a GPU the
compaction, the merge with its log-count bias, the reads, the window scores and the
key norms all run there. ``EDGEKV_TEST_NGL=-1`` runs the native, attention and engine
suites with the shared models on the GPU (``bench/gpu.sh``). This module checks that
the cache really is on the device then, and runs the user's path, ``edgekv generate
-ngl -1`` through a compressing method, against the state engine on the same device.

It needs libllama built with CUDA (``EDGEKV_CUDA=1 bash scripts/setup.sh``) and a
GPU. Machines without one (CI's) skip it: ``bench/RESULTS.md`` records the runs.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from _helpers import prefill, run_cli
from _helpers import random_keep as _keep

from edgekv.kvcache import StateEngine
from edgekv.kvcache.native import NativeEngine
from edgekv.llama import Context, Model, buffer_sizes


def cuda_devices() -> list[str]:
    """The CUDA devices ggml sees (none without a CUDA build or a GPU)."""
    from edgekv.rpc import _ggml

    g = _ggml()
    reg = g.ggml_backend_reg_by_name(b"CUDA")
    return [g.ggml_backend_dev_name(g.ggml_backend_reg_dev_get(reg, i)).decode()
            for i in range(g.ggml_backend_reg_dev_count(reg))] if reg else []


pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cuda_devices(), reason="no CUDA GPU (libllama without CUDA, or no device)")]

TEXT = ("The lighthouse keeper wrote down every ship that passed, its flag, its cargo and the hour. "
        "On stormy nights the entries grew short. ") * 10


@pytest.fixture(scope="module")
def gpu_model(smollm2_path):
    m = Model(smollm2_path, n_gpu_layers=-1)
    yield m
    m.close()


def test_the_shared_models_are_where_edgekv_test_ngl_puts_them(smollm2) -> None:
    # bench/gpu.sh runs the suites with EDGEKV_TEST_NGL=-1: without this, a build that
    # quietly kept everything on the CPU would pass them there
    want = int(os.environ.get("EDGEKV_TEST_NGL", "0"))
    ctx = Context(smollm2, n_ctx=256, n_threads=2)
    kv = buffer_sizes(ctx.creation_log, "KV")
    ctx.close()
    assert kv, ctx.creation_log[-2000:]
    assert all(k.startswith("CUDA") for k in kv) == (want != 0), kv


@pytest.mark.parametrize(("ck", "cv", "fa"), [("f16", "f16", "off"), ("f16", "f16", "on"), ("q8_0", "q8_0", "on")])
def test_compaction_on_the_gpu_equals_the_state_engines(gpu_model, ck, cv, fa) -> None:
    # the native op's graph on CUDA against the portable engine's host round trip of the
    # same device cache: byte-identical caches, and the same logits decoding after them
    done = re.search(r"offloaded (\d+)/(\d+) layers", gpu_model.load_log)
    assert done and done.group(1) == done.group(2), gpu_model.load_log[-2000:]
    ctx = Context(gpu_model, n_ctx=512, cache_type_k=ck, cache_type_v=cv, flash_attn=fa, n_threads=2)
    assert all(k.startswith("CUDA") for k in buffer_sizes(ctx.creation_log, "KV"))
    toks = gpu_model.tokenize(TEXT)
    state, native = StateEngine(ctx), NativeEngine(ctx)
    L, H = gpu_model.arch.n_layer, gpu_model.arch.n_head_kv
    blobs, logits = [], []
    for eng in (state, native):
        prefill(eng, toks)
        for r in range(2):
            eng.compact(_keep(np.random.default_rng(11 + r), L, H, eng.n_cells, eng.n_cells // 2))
        blobs.append(ctx.state_get())
        eng.decode([toks[5]], ctx.pos_max() + 1)
        logits.append(ctx.logits())
    ctx.close()
    assert blobs[0] == blobs[1]
    assert np.array_equal(logits[0], logits[1])


@pytest.mark.parametrize("method", ["knorm", "lagkv", "snapkv"])
def test_generate_on_the_gpu_compresses_as_the_state_engine_does(smollm2_path, method: str) -> None:
    # the user's command with everything offloaded: the native engine (graphs on CUDA)
    # and the portable one (host round trips) on the same device write the same text
    args = ["generate", smollm2_path, "--prompt", TEXT * 2, "--method", method, "--budget", "128",
            "--max-tokens", "24", "-ngl", "-1", *(["--param", "L=32"] if method == "lagkv" else [])]
    native = run_cli(*args, "--engine", "native")
    state = run_cli(*args, "--engine", "state")
    assert native.returncode == 0, native.stderr
    assert state.returncode == 0, state.stderr
    assert native.stdout == state.stdout and native.stdout.strip()
    stats = re.search(r"\[cells .*compressions (\d+).*\]", native.stderr)
    assert stats and int(stats.group(1)) >= 1, native.stderr
