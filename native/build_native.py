"""Build edgekv's cffi bindings to the native ops of the patched libllama.

API mode: the C compiler checks every declaration below against the real
``llama-edgekv.h`` that the patched llama-cpp-python installs into
``site-packages/include``, and links ``libllama`` from ``site-packages/llama_cpp/lib``
(with an rpath to it, so the module and llama-cpp-python share one library).
The module lands in ``edgekv/_edgekv_native*.so``. On a stock libllama (no
header, no symbols) the build fails, and edgekv uses the portable state engine.

Run by ``scripts/setup.sh``; by hand: ``.venv/bin/python native/build_native.py``.
"""

from __future__ import annotations

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
int32_t llama_edgekv_kv_info(struct llama_context * ctx, int32_t * n_layer, int32_t * n_head_kv,
                             int32_t * n_embd_head_k, int32_t * n_embd_head_v, int32_t * kv_size);
int32_t llama_edgekv_kv_cells(struct llama_context * ctx, llama_seq_id seq_id, llama_pos * pos, int32_t cap);
int32_t llama_edgekv_kv_compact(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_keep,
                                const int32_t * keep, const llama_pos * pos);
int32_t llama_edgekv_kv_merge(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_group, int32_t n_member,
                              const int32_t * members, const float * weights);
int32_t llama_edgekv_kv_bias_enable(struct llama_context * ctx);
bool    llama_edgekv_kv_bias_enabled(struct llama_context * ctx);
int32_t llama_edgekv_kv_bias_get(struct llama_context * ctx, llama_seq_id seq_id, float * bias, int32_t n);
int32_t llama_edgekv_kv_bias_set(struct llama_context * ctx, llama_seq_id seq_id, const float * bias, int32_t n);
int32_t llama_edgekv_kv_read(struct llama_context * ctx, llama_seq_id seq_id, int32_t il, float * k, float * v, int32_t n);
int32_t llama_edgekv_kv_score(struct llama_context * ctx, llama_seq_id seq_id, int32_t n_head, int32_t n_q,
                              const float * q, const llama_pos * q_pos, float kq_scale, float * out, int32_t n);
"""


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def build() -> Path:
    site = site_packages()
    include = site / "include"
    libdir = site / "llama_cpp" / "lib"
    if not (include / "llama-edgekv.h").is_file():
        raise SystemExit(f"[edgekv native] {include}/llama-edgekv.h is missing: libllama lacks edgekv's patches")
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "edgekv._edgekv_native",
        '#include "llama-edgekv.h"\n'
        "#if LLAMA_EDGEKV_API_VERSION < 2\n#error edgekv needs patch set v2 or later\n#endif\n",
        include_dirs=[str(include)],
        library_dirs=[str(libdir)],
        libraries=["llama"],
        extra_link_args=[f"-Wl,-rpath,{libdir}"],
    )
    out = ffi.compile(tmpdir=str(ROOT / "build" / "native"), verbose=False)
    so = Path(out)
    dest = ROOT / "edgekv" / so.name
    dest.write_bytes(so.read_bytes())
    return dest


if __name__ == "__main__":
    try:
        print(f"[edgekv native] built {build().relative_to(ROOT)}")
    except SystemExit:
        raise
    except Exception as e:  # a compiler or linker error: say so, the state engine still works
        print(f"[edgekv native] not built ({e}); edgekv will use the portable state engine", file=sys.stderr)
        sys.exit(1)
