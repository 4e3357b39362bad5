"""Build edgekv's cffi bindings: the native ops of the patched libllama, and
the tensor capture (``native/capture.c``) that any libggml can run.

API mode: the C compiler checks every declaration below against the real
``llama-edgekv.h`` that the patched llama-cpp-python installs into
``site-packages/include``, and links ``libllama`` from ``site-packages/llama_cpp/lib``
(with an rpath to it, so the module and llama-cpp-python share one library).
The module lands in ``edgekv/_edgekv_native*.so``. On a stock libllama (no
header, no symbols) that build fails, and edgekv uses the portable state engine.

``edgekv/_edgekv_kernels*.so`` wraps ``native/kernels.c``, host kernels over numpy
arrays that any engine's methods use (ProtoKV's assignment); it links nothing.

``edgekv/_edgekv_capture*.so`` wraps ``native/capture.c``, an eval callback
(``cb_eval``) that copies named graph tensors (``Qcur-<il>``, ``kqv_out-<il>``)
to the host during ``llama_decode``. It uses only ggml's public API and links
``libggml-base``, so it builds against stock and patched libllama alike.

Run by ``scripts/setup.sh``; by hand: ``.venv/bin/python native/build_native.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent

CDEF = """
struct llama_context;
typedef int32_t llama_seq_id;
typedef int32_t llama_pos;

int32_t llama_edgekv_api_version(void);
int32_t llama_edgekv_cache_info(struct llama_context * ctx, int32_t * n_layer, int32_t * n_head_kv,
                             int32_t * n_embd_head_k, int32_t * n_embd_head_v, int32_t * kv_size);
int32_t llama_edgekv_seq_cells(struct llama_context * ctx, llama_seq_id seq_id, llama_pos * pos, int32_t cap);
int32_t llama_edgekv_seq_compact(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_keep,
                                const int32_t * keep, const llama_pos * pos);
int32_t llama_edgekv_seq_merge(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_group, int32_t n_member,
                              const int32_t * members, const float * weights, bool reference);
int32_t llama_edgekv_bias_enable(struct llama_context * ctx);
bool    llama_edgekv_bias_enabled(struct llama_context * ctx);
int32_t llama_edgekv_seq_bias_get(struct llama_context * ctx, llama_seq_id seq_id, float * bias, int32_t n);
int32_t llama_edgekv_seq_bias_set(struct llama_context * ctx, llama_seq_id seq_id, const float * bias, int32_t n);
int32_t llama_edgekv_seq_read(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t n_layers, float * k, float * v, int32_t n, bool unrotate);
int32_t llama_edgekv_seq_score(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_head, int32_t n_q,
                              const float * q, const llama_pos * q_pos, float kq_scale,
                              const int32_t * layers, int32_t n_layers, float * out, int32_t n);
int32_t llama_edgekv_seq_key_sqnorms(struct llama_context * ctx, llama_seq_id seq_id, float * out, int32_t n);
int32_t llama_edgekv_seq_value_norms(struct llama_context * ctx, llama_seq_id seq_id, double * out, int32_t n);
int32_t llama_edgekv_seq_lag_scores(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_group, int32_t width,
                                    const int32_t * members, double * out, int32_t n);
int32_t llama_edgekv_shift_apply(struct llama_context * ctx);
"""


def site_packages() -> Path:
    """The site holding llama_cpp: this Python's own, or the folder ``build_llama.py --target``
    installed it into (on ``PYTHONPATH``), whose ``include/`` and ``llama_cpp/lib`` sit beside it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin:
        return Path(spec.origin).resolve().parent.parent
    return Path(sysconfig.get_paths()["purelib"])


CAPTURE_CDEF = """
struct edgekv_capture_slot { float * data; size_t cap; int64_t ne[4]; int32_t n_seen; };
struct edgekv_capture;
struct edgekv_capture * edgekv_capture_new(int32_t n_layer);
void    edgekv_capture_free(struct edgekv_capture * c);
int32_t edgekv_capture_want(struct edgekv_capture * c, const char * name, int32_t layer, bool on);
int32_t edgekv_capture_want_sums(struct edgekv_capture * c, const char * name, int32_t layer, bool on);
bool    edgekv_capture_eval(struct ggml_tensor * t, bool ask, void * user_data);
const struct edgekv_capture_slot * edgekv_capture_get(const struct edgekv_capture * c, const char * name,
                                                      int32_t layer);
void    edgekv_capture_clear(struct edgekv_capture * c);
int32_t edgekv_capture_status(const struct edgekv_capture * c);
"""


def kernels_cdef() -> str:
    """``native/kernels.h`` as cffi reads it: the header without its preprocessor lines (one
    home for the kernels' declarations)."""
    header = (ROOT / "native" / "kernels.h").read_text()
    return "\n".join(line for line in header.splitlines() if not line.startswith("#"))


def _compile(module: str, cdef: str, source: str, libraries: list[str], sources: list[str] = (),
             flags: list[str] = ()) -> Path:
    site = site_packages()
    include = site / "include"
    libdir = site / "llama_cpp" / "lib"
    ffi = FFI()
    ffi.cdef(cdef)
    ffi.set_source(
        f"edgekv.{module}",
        source,
        sources=[str(s) for s in sources],
        include_dirs=[str(include), str(ROOT / "native")],
        library_dirs=[str(libdir)],
        libraries=libraries,
        extra_compile_args=list(flags),
        extra_link_args=[f"-Wl,-rpath,{libdir}"],
    )
    so = Path(ffi.compile(tmpdir=str(ROOT / "build" / "native"), verbose=False))
    dest = ROOT / "edgekv" / so.name
    # a new file renamed over the old one: writing into the old file would change the code
    # under a process that has it loaded (a running sweep), which then crashes
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(so.read_bytes())
    os.replace(part, dest)
    return dest


def build_capture() -> Path:
    if not (site_packages() / "include" / "ggml-backend.h").is_file():
        raise SystemExit("[edgekv native] ggml's headers are not installed next to libllama")
    return _compile("_edgekv_capture", "struct ggml_tensor;\n" + CAPTURE_CDEF, '#include "capture.h"\n',
                    ["ggml-base"], [ROOT / "native" / "capture.c"])


def build_kernels() -> Path:
    """``native/kernels.c``: host kernels over numpy arrays; no llama.cpp, any engine."""
    # no FMA contraction: the kernels that reproduce numpy's floats round each product
    return _compile("_edgekv_kernels", kernels_cdef(), '#include "kernels.h"\n', [], [ROOT / "native" / "kernels.c"],
                    ["-ffp-contract=off"])


def build() -> Path:
    include = site_packages() / "include"
    if not (include / "llama-edgekv.h").is_file():
        raise SystemExit(f"[edgekv native] {include}/llama-edgekv.h is missing: libllama lacks edgekv's patches")
    return _compile(
        "_edgekv_native", CDEF,
        '#include "llama-edgekv.h"\n'
        "#if LLAMA_EDGEKV_API_VERSION < 11\n#error edgekv needs patch set v11 or later\n#endif\n",
        ["llama"],
    )


if __name__ == "__main__":
    failed = False
    for what, fn, fallback in (("host kernels", build_kernels, "ProtoKV runs its numpy and numba paths"),
                               ("tensor capture", build_capture, "attention-level capture is unavailable"),
                               ("native ops", build, "edgekv will use the portable state engine")):
        try:
            print(f"[edgekv native] built {what}: {fn().relative_to(ROOT)}")
        except (SystemExit, Exception) as e:  # a missing header, a compiler or linker error
            print(f"[edgekv native] {what} not built ({e}); {fallback}", file=sys.stderr)
            failed = True
    sys.exit(1 if failed else 0)
