// edgekv extensions to llama.cpp (see include/llama-edgekv.h).
//
// Every op is a ggml graph of existing ops (get_rows, set_rows, cpy, mul, sum_rows,
// mul_mat, soft_max_ext) over the cache tensors, run through the context's scheduler,
// so it runs on whichever backend holds the cache (CPU, CUDA, Metal, ...). Compaction
// also has a host path, plain byte moves, for a cache in host memory. Cell
// bookkeeping (positions, sequences) and the small per-cell bias stay on the host.

#include "llama-edgekv.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <system_error>
#include <thread>
#include <vector>

#if defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <xmmintrin.h>
#endif

// libllama is compiled for the baseline instruction set (ggml-cpu alone gets -march): the
// host paths' hot loops choose AVX2 and F16C at run time where the CPU has them
#if defined(__GNUC__) && defined(__linux__) && defined(__GLIBC__) && (defined(__x86_64__) || defined(__i386__))
#define EDGEKV_X86_DISPATCH 1
#include <immintrin.h>

static bool edgekv_has_avx2_fma() {
    static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return has;
}

// The AVX-512 kernels where the CPU has them, unless EDGEKV_CPU=avx2 (read per call, so a
// test can compare the two in one process)
static bool edgekv_use_avx512() {
    static const bool has = __builtin_cpu_supports("avx512f");
    const char * cpu = getenv("EDGEKV_CPU");
    return has && !(cpu && strcmp(cpu, "avx2") == 0);
}
#endif

int32_t llama_edgekv_api_version(void) {
    return LLAMA_EDGEKV_API_VERSION;
}

// a graph built in its own context and computed on the context's scheduler
struct llama_edgekv_graph {
    llama_context * lctx;
    ggml_context  * ctx = nullptr;
    ggml_cgraph   * gf  = nullptr;

    std::vector<std::pair<ggml_tensor *, std::vector<uint8_t>>> uploads;

    llama_edgekv_graph(llama_context * lctx, size_t n_nodes) : lctx(lctx) {
        ggml_init_params params = {
            /*.mem_size   =*/ n_nodes*ggml_tensor_overhead() + ggml_graph_overhead_custom(n_nodes, false),
            /*.mem_buffer =*/ NULL,
            /*.no_alloc   =*/ true,
        };
        ctx = ggml_init(params);
        gf  = ggml_new_graph_custom(ctx, n_nodes, false);
    }

    ~llama_edgekv_graph() {
        ggml_free(ctx);
    }

    ggml_tensor * input(ggml_type type, int64_t ne0, int64_t ne1, const void * data) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx, type, ne0, ne1);
        ggml_set_input(t);
        const uint8_t * p = (const uint8_t *) data;
        uploads.emplace_back(t, std::vector<uint8_t>(p, p + ggml_nbytes(t)));
        return t;
    }

    // the same bytes as t, seen as I32 rows of row_bytes, so rows move without conversion
    ggml_tensor * alias_i32(ggml_tensor * t, size_t row_bytes) {
        ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, row_bytes/4, ggml_nbytes(t)/row_bytes);
        if (ggml_backend_tensor_alloc(t->buffer, a, t->data) != GGML_STATUS_SUCCESS) {
            return nullptr;
        }
        return a;
    }

    // A write into a pre-allocated tensor (the cache) must run on a backend that can use
    // the tensor's buffer; if none of the scheduler's backends can run the op there, the
    // scheduler would abort the process. Ask them first (reads can move, writes cannot).
    int32_t check_writes(ggml_backend_sched_t sched) const {
        for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
            ggml_tensor * node = ggml_graph_node(gf, i);
            ggml_tensor * dst  = node->view_src;
            if (dst == nullptr || dst->buffer == nullptr) {
                continue;
            }
            ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(dst->buffer);
            bool ok = false;
            for (int b = 0; b < ggml_backend_sched_get_n_backends(sched) && !ok; ++b) {
                ggml_backend_t backend = ggml_backend_sched_get_backend(sched, b);
                ok = ggml_backend_supports_buft(backend, buft) && ggml_backend_supports_op(backend, node);
            }
            if (!ok) {
                LLAMA_LOG_ERROR("%s: no backend can run %s into a %s cache tensor in %s\n", __func__,
                        ggml_op_desc(node), ggml_type_name(dst->type), ggml_backend_buft_name(buft));
                return LLAMA_EDGEKV_ERR_BACKEND;
            }
        }
        return LLAMA_EDGEKV_OK;
    }

    // LLAMA_EDGEKV_OK, or why the graph did not run
    int32_t compute() {
        ggml_backend_sched_t sched = lctx->get_sched();
        if (const int32_t rc = check_writes(sched); rc != LLAMA_EDGEKV_OK) {
            return rc;
        }

        llama_synchronize(lctx);

        // the previous decode graph is no longer allocated once the scheduler runs ours
        lctx->edgekv_graph_reset();

        ggml_backend_sched_reset(sched);
        ggml_backend_sched_set_eval_callback(sched, nullptr, nullptr);

        if (!ggml_backend_sched_alloc_graph(sched, gf)) {
            LLAMA_LOG_ERROR("%s: failed to allocate the edgekv graph\n", __func__);
            return LLAMA_EDGEKV_ERR_COMPUTE;
        }
        for (auto & [t, data] : uploads) {
            ggml_backend_tensor_set(t, data.data(), 0, data.size());
        }
        if (lctx->graph_compute(gf, false) != GGML_STATUS_SUCCESS) {
            LLAMA_LOG_ERROR("%s: failed to compute the edgekv graph\n", __func__);
            return LLAMA_EDGEKV_ERR_COMPUTE;
        }
        ggml_backend_sched_synchronize(sched);

        return LLAMA_EDGEKV_OK;
    }
};

// access to the cache internals (friend of llama_kv_cache)
struct llama_edgekv_kv {
    llama_kv_cache * kv = nullptr;

    int32_t n_layer   = 0;
    int32_t n_head_kv = 0;
    int32_t hd_k      = 0;
    int32_t hd_v      = 0;

    std::vector<uint32_t> cells; // the sequence's cells in order

    // 0 or an error code: the cache is one the ops handle
    int32_t init(llama_context * lctx) {
        kv = dynamic_cast<llama_kv_cache *>(llama_get_memory(lctx));
        if (!kv || kv->other || kv->n_stream != 1 || kv->layers.empty()) {
            return LLAMA_EDGEKV_ERR_UNSUPPORTED;
        }
        n_layer = (int32_t) kv->layers.size();
        for (const auto & layer : kv->layers) {
            const int32_t nh = (int32_t) kv->hparams.n_head_kv(layer.il);
            const int32_t hk = (int32_t) kv->hparams.n_embd_head_k(layer.il);
            const int32_t hv = (int32_t) kv->hparams.n_embd_head_v(layer.il);
            if (n_head_kv == 0) {
                n_head_kv = nh; hd_k = hk; hd_v = hv;
            }
            if (nh != n_head_kv || hk != hd_k || hv != hd_v || !layer.k || !layer.v) {
                return LLAMA_EDGEKV_ERR_UNSUPPORTED;
            }
            // K rows and V rows must be exactly the heads, without [TAG_V_CACHE_VARIABLE] padding
            if (layer.k->ne[0] != (int64_t) nh*hk || layer.v->ne[0] != (int64_t) nh*hv) {
                return LLAMA_EDGEKV_ERR_UNSUPPORTED;
            }
        }
        return LLAMA_EDGEKV_OK;
    }

    // the Hadamard block llama.cpp rotates K rows by, 0 if it does not (a quantised K): the
    // largest power of two from 64 that divides the head, as llama_kv_cache::build_input_k_rot
    int32_t k_rot() const {
        if (!kv->attn_rot_k) {
            return 0;
        }
        int32_t r = 64;
        while (2*r <= hd_k && kv->n_embd_head_k_all % (2*r) == 0) {
            r *= 2;
        }
        return r;
    }

    // the same for V rows: always 64 (llama_kv_cache::build_input_v_rot)
    int32_t v_rot() const {
        return kv->attn_rot_v ? 64 : 0;
    }

    // 0 or an error code: init() plus the sequence owns every used cell and no shift is pending
    int32_t init_seq(llama_context * lctx, llama_seq_id seq_id) {
        const int32_t rc = init(lctx);
        if (rc != LLAMA_EDGEKV_OK) {
            return rc;
        }
        if (seq_id < 0 || seq_id >= (llama_seq_id) kv->seq_to_stream.size()) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
        const auto & c = kv->v_cells[0];
        if (c.get_has_shift()) {
            return LLAMA_EDGEKV_ERR_UNSUPPORTED;
        }
        cells.clear();
        for (uint32_t i = 0; i < c.size(); ++i) {
            if (c.is_empty(i)) {
                continue;
            }
            if (c.seq_count(i) != 1 || !c.seq_has(i, seq_id)) {
                return LLAMA_EDGEKV_ERR_UNSUPPORTED;
            }
            cells.push_back(i);
        }
        return LLAMA_EDGEKV_OK;
    }

    std::vector<llama_kv_cache::kv_layer> & layers() const { return kv->layers; }
    llama_kv_cells & cells0() const { return kv->v_cells[0]; }
    std::vector<uint32_t> & heads() const { return kv->v_heads; }
    std::vector<ggml_tensor *> & bias() const { return kv->edgekv_bias; }
    bool v_trans() const { return kv->v_trans; }

    uint32_t kv_size() const {
        return kv->get_size();
    }

    // rows of one head: [hd, n_head_kv*kv_size] view of a non-transposed K or V tensor
    ggml_tensor * head_rows(ggml_context * ctx, ggml_tensor * t, int32_t hd) const {
        return ggml_view_2d(ctx, t, hd, (int64_t) n_head_kv*kv_size(), ggml_row_size(t->type, hd), 0);
    }

    // a transposed V as [n_embd_v, kv_size], the layout of a non-transposed one (a copy)
    ggml_tensor * v_untransposed(ggml_context * ctx, ggml_tensor * v) const {
        ggml_tensor * vt = ggml_view_2d(ctx, v, kv_size(), v->ne[0], ggml_row_size(v->type, kv_size()), 0);
        return ggml_cont(ctx, ggml_transpose(ctx, vt));
    }

    // row ids cell*n_head_kv + h of the head rows, for ordinals idx[h*n + j] (head-major)
    std::vector<int32_t> head_ids(const int32_t * idx, int32_t n, bool cell_major) const {
        std::vector<int32_t> ids((size_t) n_head_kv*n);
        for (int32_t h = 0; h < n_head_kv; ++h) {
            for (int32_t j = 0; j < n; ++j) {
                const int32_t row = (int32_t) cells[idx[(size_t) h*n + j]]*n_head_kv + h;
                ids[cell_major ? (size_t) j*n_head_kv + h : (size_t) h*n + j] = row;
            }
        }
        return ids;
    }

    std::vector<float> bias_host(int32_t ikv) const {
        ggml_tensor * t = kv->edgekv_bias[ikv];
        std::vector<float> b(ggml_nelements(t));
        ggml_backend_tensor_get(t, b.data(), 0, ggml_nbytes(t));
        return b;
    }
};

int32_t llama_edgekv_cache_info(
        llama_context * ctx, int32_t * n_layer, int32_t * n_head_kv, int32_t * n_embd_head_k, int32_t * n_embd_head_v, int32_t * kv_size) {
    llama_edgekv_kv e;
    const int32_t rc = e.init(ctx);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    if (n_layer)       { *n_layer       = e.n_layer; }
    if (n_head_kv)     { *n_head_kv     = e.n_head_kv; }
    if (n_embd_head_k) { *n_embd_head_k = e.hd_k; }
    if (n_embd_head_v) { *n_embd_head_v = e.hd_v; }
    if (kv_size)       { *kv_size       = (int32_t) e.kv_size(); }
    return LLAMA_EDGEKV_OK;
}

int32_t llama_edgekv_seq_cells(llama_context * ctx, llama_seq_id seq_id, llama_pos * pos, int32_t cap) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const auto & c = e.cells0();
    for (size_t i = 0; pos && i < e.cells.size() && (int32_t) i < cap; ++i) {
        pos[i] = c.pos_get(e.cells[i]);
    }
    return (int32_t) e.cells.size();
}

// gather rows ids of head rows of t (hd per head) into rows 0..ids-1 of the same view
static bool edgekv_gather_rows(
        llama_edgekv_graph & g, const llama_edgekv_kv & e, ggml_tensor * t, int32_t hd, ggml_tensor * ids) {
    const size_t row = ggml_row_size(t->type, hd);
    const int64_t n  = ids->ne[0];

    if (row % 4 == 0) {
        ggml_tensor * a = g.alias_i32(t, row);
        if (!a) {
            return false;
        }
        ggml_tensor * rows = ggml_get_rows(g.ctx, a, ids);
        ggml_build_forward_expand(g.gf, ggml_cpy(g.ctx, rows, ggml_view_2d(g.ctx, a, a->ne[0], n, a->nb[1], 0)));
        return true;
    }
    if (t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16 || t->type == GGML_TYPE_F32) {
        // through F32, which holds every F16/BF16 value exactly
        ggml_tensor * src  = e.head_rows(g.ctx, t, hd);
        ggml_tensor * rows = ggml_get_rows(g.ctx, src, ids);
        ggml_build_forward_expand(g.gf, ggml_cpy(g.ctx, rows, ggml_view_2d(g.ctx, t, hd, n, src->nb[1], 0)));
        return true;
    }
    return false;
}

// Compaction where the cache is in host memory (the CPU backend): the same byte moves as
// the graph below, without its round trips. A transposed V is gathered inside each of its
// rows instead of being transposed twice through F32, which made it ten times slower.
// EDGEKV_GRAPH_OPS=1 forces the graph, so the CPU tests cover the path GPUs take.
static bool edgekv_host_cache(const llama_edgekv_kv & e) {
    const char * force = getenv("EDGEKV_GRAPH_OPS");
    if (force && force[0] == '1') {
        return false;
    }
    for (const auto & layer : e.layers()) {
        if (!ggml_backend_buffer_is_host(layer.k->buffer) || !ggml_backend_buffer_is_host(layer.v->buffer)) {
            return false;
        }
    }
    return true;
}

// In place and forward when keep is strictly increasing per (layer, head), as edgekv
// passes it: cells are in ascending cell order, so the source cells[keep[j]] >= j of every
// row or element is read before it is written. Any other order goes through a copy.

// a hint only: every cache line of [p, p + n) on its way in
static inline void edgekv_prefetch(const void * p, size_t n) {
    for (uintptr_t a = (uintptr_t) p & ~(uintptr_t) 63; a < (uintptr_t) p + n; a += 64) {
#if defined(__GNUC__) || defined(__clang__)
        __builtin_prefetch((const void *) a);
#elif defined(_M_X64) || defined(_M_IX86)
        _mm_prefetch((const char *) a, _MM_HINT_T0);
#endif
    }
}

// A scratch buffer that grows without zeroing what it hands out: std::vector<uint8_t>
// zeroes every byte it adds, and the score op asks a megabyte per thread per call, whose
// contents it writes before it reads them. Growing keeps nothing of the old contents.
struct edgekv_scratch {
    std::unique_ptr<uint8_t[]> buf;
    size_t cap = 0, n = 0;
    void resize(size_t m) {
        if (m > cap) {
            buf.reset(); // the old buffer goes before the new one is asked for
            cap = 0;
            buf.reset(new uint8_t[m]);
            cap = m;
        }
        n = m;
    }
    uint8_t * data() { return buf.get(); }
    size_t size() const { return n; }
};

// rows (cell*n_head_kv + h, row_bytes each) of head h's kept cells into rows j*n_head_kv + h.
// The reads are scattered, so the loop is bound by memory latency, not bandwidth: the
// source rows a few steps ahead are prefetched.
static void edgekv_host_gather_rows(
        uint8_t * data, size_t row_bytes, int32_t n_head_kv, const std::vector<uint32_t> & cells,
        const int32_t * kl, int32_t n_keep, bool in_place, edgekv_scratch & tmp) {
    constexpr int32_t ahead = 8;
    uint8_t * out = data;
    if (!in_place) {
        tmp.resize((size_t) n_keep*n_head_kv*row_bytes);
        out = tmp.data();
    }
    for (int32_t j = 0; j < n_keep; ++j) {
        for (int32_t h = 0; h < n_head_kv; ++h) {
            if (j + ahead < n_keep) {
                const uint8_t * next = data + ((size_t) cells[kl[(size_t) h*n_keep + j + ahead]]*n_head_kv + h)*row_bytes;
                edgekv_prefetch(next, row_bytes);
            }
            const size_t src = (size_t) cells[kl[(size_t) h*n_keep + j]]*n_head_kv + h;
            const size_t dst = (size_t) j*n_head_kv + h;
            if (out != data || src != dst) {
                memcpy(out + dst*row_bytes, data + src*row_bytes, row_bytes);
            }
        }
    }
    if (!in_place) {
        memcpy(data, tmp.data(), tmp.size());
    }
}

// a transposed V, [kv_size] elements per channel row: each row gathers its head's kept cells
static void edgekv_host_gather_vt(
        uint8_t * data, size_t el, int64_t kv_size, int64_t n_embd_v, int32_t hd_v,
        const std::vector<uint32_t> & cells, const int32_t * kl, int32_t n_keep, bool in_place,
        edgekv_scratch & tmp) {
    tmp.resize((size_t) n_keep*el);
    for (int64_t c = 0; c < n_embd_v; ++c) {
        uint8_t * row = data + (size_t) c*kv_size*el;
        uint8_t * out = in_place ? row : tmp.data();
        const int32_t * idx = kl + (size_t) (c/hd_v)*n_keep;
        if (el == 2) {
            const uint16_t * r = (const uint16_t *) row;
            uint16_t * o = (uint16_t *) out;
            for (int32_t j = 0; j < n_keep; ++j) {
                o[j] = r[cells[idx[j]]];
            }
        } else {
            for (int32_t j = 0; j < n_keep; ++j) {
                memmove(out + (size_t) j*el, row + (size_t) cells[idx[j]]*el, el);
            }
        }
        if (!in_place) {
            memcpy(row, out, (size_t) n_keep*el);
        }
    }
}

// work(item, tmp) for items 0..n_items-1, shared out over n_threads threads that take them
// one at a time from a common counter (items differ in cost: a transposed V costs more than
// its K); tmp is a scratch buffer per thread. If a thread cannot be started, the threads
// that did start and this one take all the items. False if a scratch buffer could not be
// allocated (no exception crosses the C API).
template <typename F>
static bool edgekv_host_parallel(int32_t n_items, int32_t n_threads, F && work) {
    std::atomic<int32_t> next{0};
    std::atomic<bool> ok{true};
    auto run = [&]() {
        try {
            edgekv_scratch tmp;
            for (int32_t item; (item = next.fetch_add(1)) < n_items; ) {
                work(item, tmp);
            }
        } catch (const std::bad_alloc &) {
            ok = false;
            next = n_items;
        }
    };
    std::vector<std::thread> pool;
    const int32_t n_extra = std::max(0, std::min(n_threads, n_items) - 1);
    try {
        pool.reserve(n_extra);
        for (int32_t t = 0; t < n_extra; ++t) {
            pool.emplace_back(run);
        }
    } catch (const std::exception &) { // std::system_error or std::bad_alloc: fewer threads
    }
    run();
    for (auto & th : pool) {
        th.join();
    }
    return ok;
}

// Each (layer, K or V) tensor is gathered on its own, over the context's threads: one
// thread cannot keep enough scattered reads in flight to reach the memory bandwidth.
static bool edgekv_host_compact(const llama_edgekv_kv & e, int32_t n_keep, const int32_t * keep, int32_t n_threads) {
    const size_t n_idx = (size_t) e.n_layer*e.n_head_kv*n_keep;
    bool in_place = true;
    for (size_t i = 0; i < n_idx && in_place; ++i) {
        in_place = i % n_keep == 0 || keep[i] > keep[i - 1];
    }
    return edgekv_host_parallel(2*e.n_layer, n_threads, [&](int32_t item, edgekv_scratch & tmp) {
        const int32_t l = item/2;
        const auto & layer = e.layers()[l];
        const int32_t * kl = keep + (size_t) l*e.n_head_kv*n_keep;
        if (item % 2 == 0) {
            edgekv_host_gather_rows((uint8_t *) layer.k->data, ggml_row_size(layer.k->type, e.hd_k), e.n_head_kv,
                                    e.cells, kl, n_keep, in_place, tmp);
        } else if (!e.v_trans()) {
            edgekv_host_gather_rows((uint8_t *) layer.v->data, ggml_row_size(layer.v->type, e.hd_v), e.n_head_kv,
                                    e.cells, kl, n_keep, in_place, tmp);
        } else {
            edgekv_host_gather_vt((uint8_t *) layer.v->data, ggml_type_size(layer.v->type), e.kv_size(),
                                  layer.v->ne[0], e.hd_v, e.cells, kl, n_keep, in_place, tmp);
        }
    });
}

#ifdef EDGEKV_X86_DISPATCH
// F16 to F32 eight at a time (exact, as every conversion of F16 to F32)
__attribute__((target("avx,f16c")))
static void edgekv_f16c_to_f32(const ggml_fp16_t * x, float * y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i))));
    }
    for (; i < n; ++i) {
        y[i] = ggml_fp16_to_fp32(x[i]);
    }
}

static bool edgekv_has_f16c() {
    static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    return has;
}
#endif

// n values of type t at x as F32 (what the CPU backend's get_rows does for each type)
static void edgekv_to_f32(ggml_type t, const void * x, float * y, int64_t n) {
    if (t == GGML_TYPE_F32) {
        memcpy(y, x, n*sizeof(float));
#ifdef EDGEKV_X86_DISPATCH
    } else if (t == GGML_TYPE_F16 && edgekv_has_f16c()) {
        edgekv_f16c_to_f32((const ggml_fp16_t *) x, y, n);
#endif
    } else {
        ggml_get_type_traits(t)->to_float(x, y, n);
    }
}

// whether cells at[0..m) are consecutive (one run of a transposed V's channel row)
static bool edgekv_is_run(const uint32_t * at, int32_t m) {
    for (int32_t j = 1; j < m; ++j) {
        if (at[j] != at[j - 1] + 1) {
            return false;
        }
    }
    return true;
}

// the elements at cells at[0..m) of one channel row of a transposed V (F32, F16 or BF16: el
// is 4 or 2 bytes) as F32 into y: a run is converted where it lies, other cells are gathered
// into raw first, with constant-size copies (one load and store each, not a call)
static void edgekv_vt_to_f32(ggml_type type, size_t el, const uint8_t * row, const uint32_t * at, int32_t m, bool run,
                             uint8_t * raw, float * y) {
    const uint8_t * src = row + (size_t) at[0]*el;
    if (!run) {
        for (int32_t j = 0; j < m; ++j) {
            if (el == 2) {
                memcpy(raw + 2*(size_t) j, row + 2*(size_t) at[j], 2);
            } else {
                memcpy(raw + 4*(size_t) j, row + 4*(size_t) at[j], 4);
            }
        }
        src = raw;
    }
    edgekv_to_f32(type, src, y, m);
}

// Undoing llama.cpp's Hadamard rotation of a quantised cache's rows (H is its own inverse),
// exactly as edgekv's reference (unrotate in edgekv/kvcache/snapshot.py), so that every CPU
// and both engines get the same floats: butterflies (a, b) -> (a + b, a - b) with the stride
// 1, 2, 4, ... in float64, then times 1/sqrt(block), rounded once to float. The sums are
// exact for float and dequantised q8_0/q4_0 rows (but for extreme scale spreads), so this is
// the product correctly rounded. Adds and one multiply only: nothing to contract into an FMA.

// the butterflies of one block of channels, [block][lanes] doubles, lanes side by side
static void edgekv_fwht_lanes(double * t, int32_t block, int32_t lanes) {
    for (int32_t h = 1; h < block; h *= 2) {
        for (int32_t j0 = 0; j0 < block; j0 += 2*h) {
            for (int32_t j = j0; j < j0 + h; ++j) {
                double * a = t + (size_t) j*lanes;
                double * b = t + (size_t) (j + h)*lanes;
                for (int32_t w = 0; w < lanes; ++w) {
                    const double u = a[w], v = b[w];
                    a[w] = u + v;
                    b[w] = u - v;
                }
            }
        }
    }
}

// n rows held channel-major, x[c*n + w] (each run of block channels one rotated block)
static void edgekv_unrotate_cm(float * x, int32_t hd, int32_t n, int32_t block, std::vector<double> & t) {
    const double scale = 1.0 / std::sqrt((double) block);
    t.resize((size_t) block*n);
    for (int32_t b0 = 0; b0 < hd; b0 += block) {
        float * xb = x + (size_t) b0*n;
        for (size_t i = 0; i < (size_t) block*n; ++i) {
            t[i] = xb[i];
        }
        edgekv_fwht_lanes(t.data(), block, n);
        for (size_t i = 0; i < (size_t) block*n; ++i) {
            xb[i] = (float) (t[i]*scale);
        }
    }
}

// n rows of hd floats, row-major: tiles of rows turned channel-major for the butterflies
#ifdef EDGEKV_X86_DISPATCH
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void edgekv_unrotate_tiles(float * x, size_t n, int32_t hd, int32_t block, std::vector<double> & t) {
    constexpr int32_t T = 16;
    const double scale = 1.0 / std::sqrt((double) block);
    t.resize((size_t) block*T);
    for (size_t r0 = 0; r0 < n; r0 += T) {
        const int32_t m = (int32_t) std::min<size_t>(T, n - r0);
        for (int32_t b0 = 0; b0 < hd; b0 += block) {
            for (int32_t c = 0; c < block; ++c) {
                double * tc = t.data() + (size_t) c*T;
                for (int32_t i = 0; i < T; ++i) {
                    tc[i] = i < m ? x[(r0 + i)*hd + b0 + c] : 0.0;
                }
            }
            edgekv_fwht_lanes(t.data(), block, T);
            for (int32_t i = 0; i < m; ++i) {
                float * o = x + (r0 + i)*hd + b0;
                for (int32_t c = 0; c < block; ++c) {
                    o[c] = (float) (t[(size_t) c*T + i]*scale);
                }
            }
        }
    }
}

#ifdef EDGEKV_X86_DISPATCH
// The same butterflies with one row's block in registers, channels as lanes: a stride
// shorter than a register pairs lanes of one register (a permuted copy, the sum kept in the
// lower lane and the difference in the upper, operands in the reference's order), a longer
// one pairs registers. Every element sees the same adds in the same order as
// edgekv_fwht_lanes, so the floats are its floats. Without the transposes to and from
// channel-major tiles, 8192 rows of 64 took 0.56 ms (AVX-512) and 0.94 ms (AVX2) against
// the tiles' 3.3 ms on one thread of an Intel Xeon.
//
// What differs between instruction sets (a register's width, its conversions, the strides
// within it) is in a struct of its own; the loops over rows and registers are written once
// and flattened into each target's entry, where those calls inline.
struct edgekv_rows_avx512 {
    typedef __m512d reg;
    static constexpr int W = 8;
    // W channels as doubles, through the strides within the register
    __attribute__((target("avx512f"))) static void load(const float * p, reg & r) {
        r = _mm512_cvtps_pd(_mm256_loadu_ps(p));
        __m512d q = _mm512_permute_pd(r, 0x55);                                      // stride 1
        r = _mm512_mask_sub_pd(_mm512_add_pd(r, q), 0xAA, q, r);
        q = _mm512_permutex_pd(r, _MM_SHUFFLE(1, 0, 3, 2));                           // stride 2
        r = _mm512_mask_sub_pd(_mm512_add_pd(r, q), 0xCC, q, r);
        q = _mm512_shuffle_f64x2(r, r, _MM_SHUFFLE(1, 0, 3, 2));                      // stride 4
        r = _mm512_mask_sub_pd(_mm512_add_pd(r, q), 0xF0, q, r);
    }
    __attribute__((target("avx512f"))) static void store(float * p, const reg & r, double scale) {
        _mm256_storeu_ps(p, _mm512_cvtpd_ps(_mm512_mul_pd(r, _mm512_set1_pd(scale))));
    }
};

struct edgekv_rows_avx2 {
    typedef __m256d reg;
    static constexpr int W = 4;
    // W channels as doubles, through the strides within the register
    __attribute__((target("avx2"))) static void load(const float * p, reg & r) {
        r = _mm256_cvtps_pd(_mm_loadu_ps(p));
        __m256d q = _mm256_permute_pd(r, 0x5);                                         // stride 1
        r = _mm256_blend_pd(_mm256_add_pd(r, q), _mm256_sub_pd(q, r), 0xA);
        q = _mm256_permute2f128_pd(r, r, 0x01);                                       // stride 2
        r = _mm256_blend_pd(_mm256_add_pd(r, q), _mm256_sub_pd(q, r), 0xC);
    }
    __attribute__((target("avx2"))) static void store(float * p, const reg & r, double scale) {
        _mm_storeu_ps(p, _mm256_cvtpd_ps(_mm256_mul_pd(r, _mm256_set1_pd(scale))));
    }
};

// the registers' strides (W, 2W, ...): GCC's vector operators on the ISA's own register type
template <class ISA, int BLOCK>
static void edgekv_unrotate_rows_in_registers(float * x, size_t n, int32_t hd) {
    constexpr int R = BLOCK/ISA::W;
    const double scale = 1.0/std::sqrt((double) BLOCK);
    for (size_t i = 0; i < n; ++i) {
        for (int32_t b0 = 0; b0 < hd; b0 += BLOCK) {
            float * o = x + i*hd + b0;
            typename ISA::reg r[R];
            for (int k = 0; k < R; ++k) {
                ISA::load(o + ISA::W*k, r[k]);
            }
            for (int h = 1; h < R; h *= 2) {
                for (int j0 = 0; j0 < R; j0 += 2*h) {
                    for (int j = j0; j < j0 + h; ++j) {
                        const typename ISA::reg u = r[j], v = r[j + h];
                        r[j] = u + v;
                        r[j + h] = u - v;
                    }
                }
            }
            for (int k = 0; k < R; ++k) {
                ISA::store(o + ISA::W*k, r[k], scale);
            }
        }
    }
}

template <int BLOCK>
__attribute__((target("avx512f"), flatten))
static void edgekv_unrotate_rows_avx512(float * x, size_t n, int32_t hd) {
    edgekv_unrotate_rows_in_registers<edgekv_rows_avx512, BLOCK>(x, n, hd);
}

template <int BLOCK>
__attribute__((target("avx2"), flatten))
static void edgekv_unrotate_rows_avx2(float * x, size_t n, int32_t hd) {
    edgekv_unrotate_rows_in_registers<edgekv_rows_avx2, BLOCK>(x, n, hd);
}
#endif

// n rows of hd floats, row-major, unrotated in place: the register kernels for the usual
// blocks (64 and 128 channels) where the CPU has AVX2 or AVX-512, else the tiles
static void edgekv_unrotate_rows(float * x, size_t n, int32_t hd, int32_t block, std::vector<double> & t) {
#ifdef EDGEKV_X86_DISPATCH
    if ((block == 64 || block == 128) && hd % block == 0) {
        if (edgekv_use_avx512()) {
            block == 64 ? edgekv_unrotate_rows_avx512<64>(x, n, hd) : edgekv_unrotate_rows_avx512<128>(x, n, hd);
            return;
        }
        if (__builtin_cpu_supports("avx2")) {
            block == 64 ? edgekv_unrotate_rows_avx2<64>(x, n, hd) : edgekv_unrotate_rows_avx2<128>(x, n, hd);
            return;
        }
    }
#endif
    edgekv_unrotate_tiles(x, n, hd, block, t);
}

// Cells i0..i0+m (ordinals) of KV head h of t, a layer's K or V in host memory, as F32 rows
// [m][hd] into y, as the read hands them out: each row converted by its type's to_float and,
// where llama.cpp rotates it (rot > 0), unrotated by edgekv's recipe; a transposed V one
// channel row's run of the m cells at a time into tile [hd][m], then the tile's columns as
// rows. raw holds m values of a transposed V's type (its gather), tile hd*m floats.
static void edgekv_host_rows(const llama_edgekv_kv & e, const ggml_tensor * t, bool trans, int32_t rot, int32_t h,
                             int32_t hd, int32_t i0, int32_t m, uint8_t * raw, float * tile, float * y,
                             std::vector<double> & work) {
    const int32_t H = e.n_head_kv, n = (int32_t) e.cells.size();
    const uint32_t * at = e.cells.data() + i0;
    if (!trans) {
        const size_t row_bytes = ggml_row_size(t->type, hd);
        for (int32_t j = 0; j < m; ++j) {
            if (i0 + j + 8 < n) { // the rows of one head lie apart: a row read cold stalls the conversion
                edgekv_prefetch((const uint8_t *) t->data + ((size_t) at[j + 8]*H + h)*row_bytes, row_bytes);
            }
            edgekv_to_f32(t->type, (const uint8_t *) t->data + ((size_t) at[j]*H + h)*row_bytes, y + (size_t) j*hd, hd);
        }
        if (rot) { // unrotated while the rows are in cache
            edgekv_unrotate_rows(y, (size_t) m, hd, rot, work);
        }
        return;
    }
    // F32, F16 or BF16: one value of 4 or 2 bytes; cells ascend, so consecutive cells (the
    // usual case after a compaction) are one run of a channel row, converted where it lies
    const size_t el = ggml_type_size(t->type);
    const bool run = edgekv_is_run(at, m);
    for (int32_t d = 0; d < hd; ++d) {
        const uint8_t * row = (const uint8_t *) t->data + ((size_t) h*hd + d)*e.kv_size()*el;
        edgekv_vt_to_f32(t->type, el, row, at, m, run, raw, tile + (size_t) d*m);
    }
    for (int32_t j = 0; j < m; ++j) {
        for (int32_t d = 0; d < hd; ++d) {
            y[(size_t) j*hd + d] = tile[(size_t) d*m + j];
        }
    }
}

// Read where the cache is in host memory: each (layer, K or V) converts its rows straight
// into the caller's array, over the context's threads, instead of a graph's get_rows into
// the scheduler's buffer and a copy out of it, 64 cells of a head at a time (a transposed V:
// every channel row of a block before the next).
static bool edgekv_host_read(const llama_edgekv_kv & e, int32_t il, int32_t n_layers, float * k, float * v, int32_t n,
                             int32_t k_rot, int32_t v_rot, int32_t n_threads) {
    const int32_t H = e.n_head_kv;
    return edgekv_host_parallel(2*n_layers, n_threads, [&](int32_t item, edgekv_scratch & tmp) {
        const int32_t l = item/2;
        const bool is_k = item % 2 == 0;
        float * out = is_k ? k : v;
        if (!out) {
            return;
        }
        const ggml_tensor * t = is_k ? e.layers()[il + l].k : e.layers()[il + l].v;
        const int32_t hd = is_k ? e.hd_k : e.hd_v;
        const bool trans = !is_k && e.v_trans();
        out += (size_t) l*H*n*hd;
        constexpr int32_t block = 64;
        tmp.resize(trans ? block*ggml_type_size(t->type) + (size_t) hd*block*sizeof(float) : 0);
        uint8_t * raw = tmp.data();
        float * tile = trans ? (float *) (tmp.data() + block*ggml_type_size(t->type)) : nullptr;
        std::vector<double> work;
        for (int32_t h = 0; h < H; ++h) {
            for (int32_t i0 = 0; i0 < n; i0 += block) {
                edgekv_host_rows(e, t, trans, is_k ? k_rot : v_rot, h, hd, i0, std::min(block, n - i0), raw, tile,
                                 out + ((size_t) h*n + i0)*hd, work);
            }
        }
    });
}

int32_t llama_edgekv_seq_compact(
        llama_context * ctx, llama_seq_id seq_id, int32_t n_keep, const int32_t * keep, const llama_pos * pos) {
    llama_edgekv_kv e;
    int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const int32_t n = (int32_t) e.cells.size();
    if (n_keep < 1 || n_keep > n || !keep || !pos) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    const size_t n_idx = (size_t) e.n_layer*e.n_head_kv*n_keep;
    for (size_t i = 0; i < n_idx; ++i) {
        if (keep[i] < 0 || keep[i] >= n) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
    }
    for (int32_t j = 0; j < n_keep; ++j) {
        if (pos[j] < 0 || (j > 0 && pos[j] <= pos[j - 1])) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
    }

    for (const auto & layer : e.layers()) {
        if (e.v_trans() && ggml_is_quantized(layer.v->type)) {
            return LLAMA_EDGEKV_ERR_TYPE;
        }
    }

    if (edgekv_host_cache(e)) {
        llama_synchronize(ctx);
        ctx->edgekv_graph_reset(); // the cells change under the previous decode graph
        if (!edgekv_host_compact(e, n_keep, keep, (int32_t) ctx->n_threads())) {
            // a scratch buffer could not be allocated mid-way: the cache is not what it was
            LLAMA_LOG_ERROR("%s: out of memory during a host compaction; the cache is inconsistent\n", __func__);
            return LLAMA_EDGEKV_ERR_COMPUTE;
        }
    } else {
        llama_edgekv_graph g(ctx, 16*e.n_layer + 16);

        for (int32_t l = 0; l < e.n_layer; ++l) {
            const auto & layer = e.layers()[l];
            const int32_t * kl = keep + (size_t) l*e.n_head_kv*n_keep;

            ggml_tensor * ids = g.input(GGML_TYPE_I32, (int64_t) e.n_head_kv*n_keep, 1, e.head_ids(kl, n_keep, true).data());
            ids = ggml_view_1d(g.ctx, ids, ids->ne[0], 0);

            if (!edgekv_gather_rows(g, e, layer.k, e.hd_k, ids)) {
                return LLAMA_EDGEKV_ERR_TYPE;
            }

            if (!e.v_trans()) {
                if (!edgekv_gather_rows(g, e, layer.v, e.hd_v, ids)) {
                    return LLAMA_EDGEKV_ERR_TYPE;
                }
                continue;
            }

            // transposed V (F16/F32, no flash attention): gather in the untransposed copy,
            // then write the first n_keep cells of every dimension back
            ggml_tensor * v = layer.v;
            if (ggml_is_quantized(v->type)) {
                return LLAMA_EDGEKV_ERR_TYPE;
            }
            ggml_tensor * vu   = e.v_untransposed(g.ctx, v);
            ggml_tensor * rows = ggml_get_rows(g.ctx, e.head_rows(g.ctx, vu, e.hd_v), ids);
            rows = ggml_reshape_2d(g.ctx, rows, v->ne[0], n_keep);
            ggml_tensor * dst = ggml_view_2d(g.ctx, v, n_keep, v->ne[0], ggml_row_size(v->type, e.kv_size()), 0);
            ggml_build_forward_expand(g.gf, ggml_cpy(g.ctx, ggml_transpose(g.ctx, rows), dst));
        }

        if (const int32_t rc = g.compute(); rc != LLAMA_EDGEKV_OK) {
            return rc;
        }
    }

    // the bias moves with its rows
    for (size_t ikv = 0; ikv < e.bias().size(); ++ikv) {
        const std::vector<float> old = e.bias_host((int32_t) ikv);
        std::vector<float> b(old.size(), 0.0f);
        const int32_t * kl = keep + ikv*e.n_head_kv*n_keep;
        for (int32_t h = 0; h < e.n_head_kv; ++h) {
            for (int32_t j = 0; j < n_keep; ++j) {
                b[(size_t) j*e.n_head_kv + h] = old[(size_t) e.cells[kl[(size_t) h*n_keep + j]]*e.n_head_kv + h];
            }
        }
        ggml_backend_tensor_set(e.bias()[ikv], b.data(), 0, b.size()*sizeof(float));
    }

    // cells: the sequence now occupies 0..n_keep-1; the token of a cell follows head 0 of layer 0
    auto & c = e.cells0();
    std::vector<llama_kv_cell_ext> ext(n_keep);
    for (int32_t j = 0; j < n_keep; ++j) {
        ext[j] = c.ext_get(e.cells[keep[j]]);
    }
    for (uint32_t i : e.cells) {
        c.rm(i);
    }
    for (int32_t j = 0; j < n_keep; ++j) {
        c.pos_set(j, pos[j]);
        c.ext_set(j, ext[j]);
        c.seq_add(j, seq_id);
    }
    e.heads()[0] = (uint32_t) n_keep % e.kv_size();

    return LLAMA_EDGEKV_OK;
}

// The merge where the cache is in host memory: the merge graph's
// arithmetic on the CPU backend without the graph (with flash attention off, the graph
// transposes each layer's V whole, twice per call). Each member's row times its weight in
// F32, summed over the members in order in double and rounded to F32 (ggml's sum_rows),
// then rounded to the cache's type; every group of a tensor is computed before any is
// written, as the graph reads all rows before it sets any. One (layer, K or V) per thread.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
static bool edgekv_host_merge(const llama_edgekv_kv & e, int32_t n_group, int32_t n_member, const int32_t * mem,
                              const float * wn, bool reference, int32_t n_threads) {
    const int32_t H = e.n_head_kv;
    const size_t per_layer = (size_t) H*n_group*n_member;
    return edgekv_host_parallel(2*e.n_layer, n_threads, [&](int32_t item, edgekv_scratch & tmp) {
        const int32_t l = item/2;
        const bool is_k = item % 2 == 0;
        const auto & layer = e.layers()[l];
        ggml_tensor * t = is_k ? layer.k : layer.v;
        const int32_t hd = is_k ? e.hd_k : e.hd_v;
        const bool trans = !is_k && e.v_trans();
        const size_t el = ggml_type_size(t->type);
        const size_t row_bytes = ggml_row_size(t->type, hd);
        uint8_t * data = (uint8_t *) t->data;
        const int32_t * ml = mem + l*per_layer;
        const float * wl = wn + l*per_layer;
        const size_t n_out = (size_t) H*n_group*hd;
        const size_t n_f = (n_out + hd + 1) & ~(size_t) 1; // floats before the doubles, kept 8-byte aligned
        tmp.resize(n_f*sizeof(float) + hd*sizeof(double));
        float * y = (float *) tmp.data();
        float * x = y + n_out;
        double * acc = (double *) (y + n_f);
        if (trans) { // per channel row: its members' elements, each times its weight (ggml_mul, in F32), summed
            // every member of every group of one channel row is gathered and converted in one
            // call: member cells lie far apart in the row, and a call per group and channel
            // cost more than the arithmetic
            const int32_t n_el = n_group*n_member;
            std::vector<uint32_t> at(n_el);
            std::vector<uint8_t> raw((size_t) n_el*el);
            std::vector<float> xs(n_el);
            for (int32_t h = 0; h < H; ++h) {
                const size_t base0 = (size_t) h*n_el;
                for (int32_t i = 0; i < n_el; ++i) {
                    at[i] = e.cells[ml[base0 + i]];
                }
                for (int32_t d = 0; d < hd; ++d) {
                    edgekv_vt_to_f32(t->type, el, data + ((size_t) h*hd + d)*e.kv_size()*el, at.data(), n_el,
                                     false, raw.data(), xs.data());
                    for (int32_t gi = 0; gi < n_group; ++gi) {
                        const size_t g0 = (size_t) gi*n_member;
                        const float * w = wl + base0 + g0;
                        double a = 0.0;
                        for (int32_t i = 0; i < n_member; ++i) {
                            const float p = xs[g0 + i]*w[i];
                            a += (double) p;
                        }
                        y[((size_t) h*n_group + gi)*hd + d] = (float) a;
                    }
                }
            }
        } else {
            for (int32_t h = 0; h < H; ++h) {
                for (int32_t gi = 0; gi < n_group; ++gi) {
                    const size_t base = ((size_t) h*n_group + gi)*n_member;
                    const float * w = wl + base;
                    float * o = y + ((size_t) h*n_group + gi)*hd;
                    for (int32_t d = 0; d < hd; ++d) {
                        acc[d] = 0.0;
                    }
                    for (int32_t i = 0; i < n_member; ++i) { // per member row, every channel at once
                        edgekv_to_f32(t->type, data + ((size_t) e.cells[ml[base + i]]*H + h)*row_bytes, x, hd);
                        for (int32_t d = 0; d < hd; ++d) {
                            const float p = x[d]*w[i]; // ggml_mul, in F32
                            acc[d] += (double) p;
                        }
                    }
                    for (int32_t d = 0; d < hd; ++d) {
                        o[d] = (float) acc[d];
                    }
                }
            }
        }
        // F16 rounds to nearest even through the CPU backend's converter, the one its set_rows
        // calls (F16C where built; ggml-base's ggml_fp32_to_fp16_row gives every finite float
        // the same half, one at a time); other types go through the CPU backend's own
        // quantiser, the one its set_rows calls, or with reference through ggml's reference
        // one (ggml_quantize_chunk's rounding)
        const ggml_from_float_t quantize = reference ? ggml_get_type_traits(t->type)->from_float_ref
                                                     : ggml_get_type_traits_cpu(t->type)->from_float;
        const auto store = [&](const float * o, uint8_t * dst, int64_t m) {
            if (t->type == GGML_TYPE_F32) {
                memcpy(dst, o, m*sizeof(float));
            } else if (t->type == GGML_TYPE_F16) {
                ggml_cpu_fp32_to_fp16(o, (ggml_fp16_t *) dst, m);
            } else {
                quantize(o, dst, m);
            }
        };
        if (!trans) {
            for (int32_t h = 0; h < H; ++h) {
                for (int32_t gi = 0; gi < n_group; ++gi) {
                    const uint32_t cell = e.cells[ml[((size_t) h*n_group + gi)*n_member]];
                    store(y + ((size_t) h*n_group + gi)*hd, data + ((size_t) cell*H + h)*row_bytes, hd);
                }
            }
            return;
        }
        // a transposed V: per channel row, every group's element converted in one call, then scattered
        std::vector<uint32_t> cell(n_group);
        std::vector<float> ys(n_group);
        std::vector<uint8_t> out((size_t) n_group*el);
        for (int32_t h = 0; h < H; ++h) {
            for (int32_t gi = 0; gi < n_group; ++gi) {
                cell[gi] = e.cells[ml[((size_t) h*n_group + gi)*n_member]];
            }
            for (int32_t d = 0; d < hd; ++d) {
                for (int32_t gi = 0; gi < n_group; ++gi) {
                    ys[gi] = y[((size_t) h*n_group + gi)*hd + d];
                }
                store(ys.data(), out.data(), n_group);
                uint8_t * row = data + ((size_t) h*hd + d)*e.kv_size()*el;
                for (int32_t gi = 0; gi < n_group; ++gi) {
                    memcpy(row + (size_t) cell[gi]*el, out.data() + (size_t) gi*el, el);
                }
            }
        }
    });
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// the K or V rows of t (head rows hd wide, possibly transposed V): weighted group sums
// written to the first member's row, re-quantised by set_rows
static void edgekv_merge_rows(
        llama_edgekv_graph & g, const llama_edgekv_kv & e, ggml_tensor * t, int32_t hd, bool trans,
        ggml_tensor * src_ids, ggml_tensor * w, ggml_tensor * dst_ids, int32_t n_member) {
    ggml_context * ctx = g.ctx;

    ggml_tensor * base = trans ? e.v_untransposed(ctx, t) : t;
    ggml_tensor * rows = e.head_rows(ctx, base, hd);

    ggml_tensor * x = ggml_get_rows(ctx, rows, src_ids);           // [hd, H*G*M] F32
    x = ggml_mul(ctx, x, w);                                        // w: [1, H*G*M]
    x = ggml_reshape_3d(ctx, x, hd, n_member, x->ne[1]/n_member);  // [hd, M, H*G]
    x = ggml_cont(ctx, ggml_permute(ctx, x, 1, 0, 2, 3));           // [M, hd, H*G]
    x = ggml_sum_rows(ctx, x);                                      // [1, hd, H*G]
    x = ggml_reshape_2d(ctx, x, hd, x->ne[2]);

    ggml_tensor * out = ggml_set_rows(ctx, rows, x, dst_ids);
    if (!trans) {
        ggml_build_forward_expand(g.gf, out);
        return;
    }
    out = ggml_reshape_2d(ctx, out, t->ne[0], e.kv_size());
    ggml_tensor * dst = ggml_view_2d(ctx, t, e.kv_size(), t->ne[0], ggml_row_size(t->type, e.kv_size()), 0);
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx, ggml_transpose(ctx, out), dst));
}

int32_t llama_edgekv_seq_merge(
        llama_context * ctx, llama_seq_id seq_id, int32_t n_group, int32_t n_member, const int32_t * members,
        const float * weights, bool reference) {
    llama_edgekv_kv e;
    int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const int32_t n = (int32_t) e.cells.size();
    if (n_group < 1 || n_member < 1 || !members || !weights) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    const int32_t H = e.n_head_kv;
    const size_t per_layer = (size_t) H*n_group*n_member;

    // validate and normalise: member 0 of every group is a cell, weights are >= 0 and not all 0
    std::vector<int32_t> mem(per_layer*e.n_layer);
    std::vector<float>   wn (per_layer*e.n_layer);
    for (size_t grp = 0; grp < (size_t) e.n_layer*H*n_group; ++grp) {
        const int32_t * m = members + grp*n_member;
        const float   * w = weights + grp*n_member;
        if (m[0] < 0 || m[0] >= n) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
        double sum = 0.0;
        for (int32_t i = 0; i < n_member; ++i) {
            if (m[i] >= n || m[i] < -1 || (m[i] >= 0 && !(w[i] >= 0.0f))) {
                return LLAMA_EDGEKV_ERR_ARG;
            }
            sum += m[i] >= 0 ? w[i] : 0.0;
        }
        if (!(sum > 0.0)) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
        for (int32_t i = 0; i < n_member; ++i) {
            mem[grp*n_member + i] = m[i] >= 0 ? m[i] : m[0];
            wn [grp*n_member + i] = m[i] >= 0 ? (float) (w[i]/sum) : 0.0f;
        }
    }

    // Apple's Accelerate sums rows in float in its own order: there the graph, so the bytes
    // are always the graph's. Elsewhere a cache in host memory merges on the host, quantised
    // types included: they are dequantised as get_rows does and re-quantised by the CPU
    // backend's quantiser, as set_rows does (or by the reference one), one head row (whole
    // blocks) at a time.
#if defined(__APPLE__)
    bool host = false;
#else
    bool host = edgekv_host_cache(e);
#endif
    const auto exact_type = [](const ggml_tensor * t) {
        return t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16; // every path rounds these alike
    };
    const auto host_type = [&](const ggml_tensor * t, int32_t hd, bool trans) {
        if (exact_type(t)) {
            return true;
        }
        return !trans && hd % ggml_blck_size(t->type) == 0 && ggml_get_type_traits(t->type)->to_float
               && (reference ? ggml_get_type_traits(t->type)->from_float_ref
                             : ggml_get_type_traits_cpu(t->type)->from_float);
    };
    bool exact = true;
    for (const auto & layer : e.layers()) {
        host = host && host_type(layer.k, e.hd_k, false) && host_type(layer.v, e.hd_v, e.v_trans());
        exact = exact && exact_type(layer.k) && exact_type(layer.v);
    }
    if (reference && !host && !exact) {
        return LLAMA_EDGEKV_ERR_UNSUPPORTED; // set_rows rounds with the backend's quantiser
    }

    llama_kv_cache * kv = e.kv;

    if (!kv->edgekv_bias_enable()) {
        return LLAMA_EDGEKV_ERR_UNSUPPORTED;
    }

    if (host) {
        llama_synchronize(ctx);
        ctx->edgekv_graph_reset(); // the bias may be new: the next decode graph must carry it
        if (!edgekv_host_merge(e, n_group, n_member, mem.data(), wn.data(), reference, (int32_t) ctx->n_threads())) {
            LLAMA_LOG_ERROR("%s: out of memory during a host merge; the cache is inconsistent\n", __func__);
            return LLAMA_EDGEKV_ERR_COMPUTE;
        }
    } else {
        llama_edgekv_graph g(ctx, 48*e.n_layer + 16);

        for (int32_t l = 0; l < e.n_layer; ++l) {
            const auto & layer = e.layers()[l];
            const int32_t * ml = mem.data() + l*per_layer;

            // row ids per (head, group, member), head-major like the arguments
            std::vector<int32_t> src(per_layer), dst((size_t) H*n_group);
            for (int32_t h = 0; h < H; ++h) {
                for (int32_t gi = 0; gi < n_group; ++gi) {
                    const size_t base = ((size_t) h*n_group + gi)*n_member;
                    for (int32_t i = 0; i < n_member; ++i) {
                        src[base + i] = (int32_t) e.cells[ml[base + i]]*H + h;
                    }
                    dst[(size_t) h*n_group + gi] = src[base];
                }
            }
            ggml_tensor * src_ids = g.input(GGML_TYPE_I32, (int64_t) per_layer, 1, src.data());
            ggml_tensor * dst_ids = g.input(GGML_TYPE_I32, (int64_t) H*n_group, 1, dst.data());
            ggml_tensor * w       = g.input(GGML_TYPE_F32, 1, (int64_t) per_layer, wn.data() + l*per_layer);
            src_ids = ggml_view_1d(g.ctx, src_ids, src_ids->ne[0], 0);
            dst_ids = ggml_view_1d(g.ctx, dst_ids, dst_ids->ne[0], 0);

            edgekv_merge_rows(g, e, layer.k, e.hd_k, false,       src_ids, w, dst_ids, n_member);
            edgekv_merge_rows(g, e, layer.v, e.hd_v, e.v_trans(), src_ids, w, dst_ids, n_member);
        }

        if (const int32_t rc = g.compute(); rc != LLAMA_EDGEKV_OK) {
            return rc;
        }
    }

    // the merged cell stands for every token its members stood for
    for (int32_t l = 0; l < e.n_layer; ++l) {
        std::vector<float> b = e.bias_host(l);
        const int32_t * ml = members + l*per_layer;
        for (int32_t h = 0; h < H; ++h) {
            for (int32_t gi = 0; gi < n_group; ++gi) {
                const int32_t * m = ml + ((size_t) h*n_group + gi)*n_member;
                double count = 0.0;
                for (int32_t i = 0; i < n_member; ++i) {
                    if (m[i] >= 0 && (i == 0 || m[i] != m[0])) {
                        count += std::exp((double) b[(size_t) e.cells[m[i]]*H + h]);
                    }
                }
                b[(size_t) e.cells[m[0]]*H + h] = (float) std::log(count);
            }
        }
        ggml_backend_tensor_set(e.bias()[l], b.data(), 0, b.size()*sizeof(float));
    }

    return LLAMA_EDGEKV_OK;
}

int32_t llama_edgekv_bias_enable(llama_context * ctx) {
    llama_edgekv_kv e;
    const int32_t rc = e.init(ctx);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const bool was = e.kv->edgekv_bias_enabled();
    if (!e.kv->edgekv_bias_enable()) {
        return LLAMA_EDGEKV_ERR_UNSUPPORTED;
    }
    if (!was) {
        // attention graphs now carry the bias
        llama_synchronize(ctx);
        ctx->edgekv_graph_reset();
    }
    return LLAMA_EDGEKV_OK;
}

// Whether the context's cache has a K-shift pending; false where it is no cache the ops know
static bool edgekv_shift_pending(llama_context * ctx) {
    llama_edgekv_kv e;
    return e.init(ctx) == LLAMA_EDGEKV_OK && e.cells0().get_has_shift();
}

int32_t llama_edgekv_shift_apply(llama_context * ctx) {
    if (!ctx) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    try { // no exception crosses the C API (llama.cpp's update throws when it cannot reserve)
        llama_synchronize(ctx);
        const bool ran = ctx->memory_update(false);
        if (edgekv_shift_pending(ctx)) {
            return LLAMA_EDGEKV_ERR_COMPUTE;
        }
        return ran ? 1 : 0;
    } catch (const std::exception &) {
        return LLAMA_EDGEKV_ERR_COMPUTE;
    }
}

bool llama_edgekv_bias_enabled(llama_context * ctx) {
    llama_edgekv_kv e;
    return e.init(ctx) == LLAMA_EDGEKV_OK && e.kv->edgekv_bias_enabled();
}

static int32_t edgekv_bias_io(llama_context * ctx, llama_seq_id seq_id, float * out, const float * in, int32_t n) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    if (n != (int32_t) e.cells.size()) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    const int32_t H = e.n_head_kv;
    if (out && !e.kv->edgekv_bias_enabled()) {
        std::fill(out, out + (size_t) e.n_layer*H*n, 0.0f);
        return LLAMA_EDGEKV_OK;
    }
    if (in && !e.kv->edgekv_bias_enabled()) {
        bool zero = true;
        for (size_t i = 0; i < (size_t) e.n_layer*H*n; ++i) {
            zero = zero && in[i] == 0.0f;
        }
        if (zero) {
            return LLAMA_EDGEKV_OK;
        }
        const int32_t rc2 = llama_edgekv_bias_enable(ctx);
        if (rc2 != LLAMA_EDGEKV_OK) {
            return rc2;
        }
    }
    for (int32_t l = 0; l < e.n_layer; ++l) {
        std::vector<float> b = e.bias_host(l);
        for (int32_t h = 0; h < H; ++h) {
            for (int32_t i = 0; i < n; ++i) {
                float & cell = b[(size_t) e.cells[i]*H + h];
                if (out) {
                    out[((size_t) l*H + h)*n + i] = cell;
                } else {
                    cell = in[((size_t) l*H + h)*n + i];
                }
            }
        }
        if (in) {
            ggml_backend_tensor_set(e.bias()[l], b.data(), 0, b.size()*sizeof(float));
        }
    }
    return LLAMA_EDGEKV_OK;
}

int32_t llama_edgekv_seq_bias_get(llama_context * ctx, llama_seq_id seq_id, float * bias, int32_t n) {
    return bias ? edgekv_bias_io(ctx, seq_id, bias, nullptr, n) : LLAMA_EDGEKV_ERR_ARG;
}

int32_t llama_edgekv_seq_bias_set(llama_context * ctx, llama_seq_id seq_id, const float * bias, int32_t n) {
    return bias ? edgekv_bias_io(ctx, seq_id, nullptr, bias, n) : LLAMA_EDGEKV_ERR_ARG;
}

int32_t llama_edgekv_seq_read(
        llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t n_layers, float * k, float * v, int32_t n,
        bool unrotate) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    if (il < 0 || n_layers < 1 || n_layers > e.n_layer - il || n != (int32_t) e.cells.size() || n == 0) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    if (!k && !v) {
        return LLAMA_EDGEKV_OK;
    }
    for (int32_t l = il; l < il + n_layers; ++l) {
        if (v && e.v_trans() && ggml_is_quantized(e.layers()[l].v->type)) {
            return LLAMA_EDGEKV_ERR_TYPE;
        }
    }
    const int32_t k_rot = unrotate ? e.k_rot() : 0, v_rot = unrotate ? e.v_rot() : 0;
    if ((k_rot && e.hd_k % k_rot != 0) || (v_rot && e.hd_v % v_rot != 0)) {
        return LLAMA_EDGEKV_ERR_UNSUPPORTED;
    }
    if (edgekv_host_cache(e)) {
        llama_synchronize(ctx);
        return edgekv_host_read(e, il, n_layers, k, v, n, k_rot, v_rot, (int32_t) ctx->n_threads())
                   ? LLAMA_EDGEKV_OK : LLAMA_EDGEKV_ERR_COMPUTE;
    }
    const int32_t H = e.n_head_kv;

    std::vector<int32_t> ord(n), idx;
    for (int32_t i = 0; i < n; ++i) {
        ord[i] = i;
    }
    for (int32_t h = 0; h < H; ++h) {
        idx.insert(idx.end(), ord.begin(), ord.end());
    }

    // one graph for the layers: a graph run costs the scheduler's and the threads' start-up,
    // which for a small cache is more than the rows themselves
    llama_edgekv_graph g(ctx, 8*(size_t) n_layers + 8);
    ggml_tensor * ids = g.input(GGML_TYPE_I32, (int64_t) H*n, 1, e.head_ids(idx.data(), n, false).data());
    ids = ggml_view_1d(g.ctx, ids, ids->ne[0], 0);

    std::vector<ggml_tensor *> ko, vo;
    for (int32_t l = il; l < il + n_layers; ++l) {
        const auto & layer = e.layers()[l];
        if (k) {
            ko.push_back(ggml_get_rows(g.ctx, e.head_rows(g.ctx, layer.k, e.hd_k), ids));
            ggml_set_output(ko.back());
            ggml_build_forward_expand(g.gf, ko.back());
        }
        if (v) {
            ggml_tensor * base = e.v_trans() ? e.v_untransposed(g.ctx, layer.v) : layer.v;
            vo.push_back(ggml_get_rows(g.ctx, e.head_rows(g.ctx, base, e.hd_v), ids));
            ggml_set_output(vo.back());
            ggml_build_forward_expand(g.gf, vo.back());
        }
    }
    if (const int32_t rc = g.compute(); rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    for (size_t l = 0; l < ko.size(); ++l) {
        ggml_backend_tensor_get(ko[l], k + l*H*n*e.hd_k, 0, ggml_nbytes(ko[l]));
    }
    for (size_t l = 0; l < vo.size(); ++l) {
        ggml_backend_tensor_get(vo[l], v + l*H*n*e.hd_v, 0, ggml_nbytes(vo[l]));
    }
    if (k_rot || v_rot) { // on the host, as the host path does it: the same floats
        const bool ok = edgekv_host_parallel(2*n_layers, (int32_t) ctx->n_threads(), [&](int32_t item, edgekv_scratch &) {
            const bool is_k = item % 2 == 0;
            const int32_t rot = is_k ? k_rot : v_rot, hd = is_k ? e.hd_k : e.hd_v;
            float * out = is_k ? k : v;
            if (rot && out) {
                std::vector<double> work;
                edgekv_unrotate_rows(out + (size_t) (item/2)*H*n*hd, (size_t) H*n, hd, rot, work);
            }
        });
        if (!ok) {
            return LLAMA_EDGEKV_ERR_COMPUTE;
        }
    }
    return LLAMA_EDGEKV_OK;
}

#ifdef EDGEKV_X86_DISPATCH
// Window scores where the cache is in host memory (the CPU backend). Per (layer, KV head),
// the head's keys are converted to F32 once, into blocks of 16 cells that are channel-major
// inside a block, so each query meets 16 cells with independent multiply-adds and no
// horizontal sums, a chunk of cells at a time while its keys stay in cache; a masked softmax
// per query and the sum over queries follow. The graph path instead materialises an
// [n, n_q, n_head] score tensor and two permuted copies of it, four passes over memory per
// layer. The sums run in float, a softmax's denominator in double, as ggml's CPU soft_max;
// the scores agree with the graph's to float rounding. x86-64 with AVX2 and FMA only
// (checked at run time); other CPUs run the graph, whose ggml kernels are vectorised for
// them: a portable loop here, as the compiler vectorised it, took 1.9 s where the graph took
// 1.0 s (8k cells, 64 queries, SmolLM2).
//
// Every cell's logit is one chain of fused multiply-adds over the channels in order, so the
// AVX2 and the AVX-512 kernels below give the same bits; the wider one only holds more cells
// and queries in registers at once. EDGEKV_CPU=avx2 picks the AVX2 one on any CPU, so that
// an AVX-512 machine's tests (scripts/test_kernels.sh) run what an AVX2-only CPU runs.
constexpr int32_t EDGEKV_SCORE_LANES = 16;   // cells per block
constexpr int32_t EDGEKV_SCORE_CHUNK = 1024; // cells whose keys (256 KiB at 64 channels) every query passes over in turn

struct edgekv_score_head {
    int32_t n_pad, hd, n_q;
    const float   * kb;    // [.][hd][16] the head's keys from cell kb0 on, padded with zeros
    int32_t         kb0;   // the first cell kb holds: 0 (every cell) or a chunk's start
    const int32_t * pos;   // [n_pad] cell positions, INT32_MAX in the padding (never seen)
    const float   * bias;  // [n_pad]: the log-count bias, zeros while it is off
    float           scale;
    float         * lg;    // scratch [n_q][n_pad]: logits, then probabilities
    float         * mx;    // scratch [n_q][16]: running maxima of the logits, one per lane
    float         * acc;   // [n_pad] += the query head's attention, summed over queries
};

// The softmax's arithmetic on eight floats (AVX2 and FMA) or sixteen (AVX-512), one
// intrinsic per operation: both widths run the same operations on every number, so they
// give the same floats. The denominator's double sums take each group of eight floats in
// two halves, sum0 and sum1, in the same order at both widths.
struct edgekv_sums {
    __m256d sum0, sum1;
    __attribute__((target("avx2"))) static void zero(edgekv_sums & s) { s.sum0 = s.sum1 = _mm256_setzero_pd(); }
    __attribute__((target("avx2"))) static void add(edgekv_sums & s, __m128 lo, __m128 hi) { // one group of eight
        s.sum0 = _mm256_add_pd(s.sum0, _mm256_cvtps_pd(lo));
        s.sum1 = _mm256_add_pd(s.sum1, _mm256_cvtps_pd(hi));
    }
    __attribute__((target("avx2"))) static double total(const edgekv_sums & s) {
        double s4[4];
        _mm256_storeu_pd(s4, _mm256_add_pd(s.sum0, s.sum1));
        return s4[0] + s4[1] + s4[2] + s4[3];
    }
};

// The operations both widths spell alike (_mm256_add_ps, _mm512_add_ps, ...), as ggml's
// GGML_F32x8 / GGML_F32x16 macros do; T is the width's target attribute
#define EDGEKV_F32_OPS(T, W)                                                                                       \
    T static reg set1(float v) { return _mm##W##_set1_ps(v); }                                                    \
    T static reg load(const float * p) { return _mm##W##_loadu_ps(p); }                                           \
    T static void store(float * p, reg v) { _mm##W##_storeu_ps(p, v); }                                           \
    T static reg add(reg a, reg b) { return _mm##W##_add_ps(a, b); }                                              \
    T static reg sub(reg a, reg b) { return _mm##W##_sub_ps(a, b); }                                              \
    T static reg mul(reg a, reg b) { return _mm##W##_mul_ps(a, b); }                                              \
    T static reg max(reg a, reg b) { return _mm##W##_max_ps(a, b); }                                              \
    T static reg fmadd(reg a, reg b, reg c) { return _mm##W##_fmadd_ps(a, b, c); }                                \
    T static reg fnmadd(reg a, reg b, reg c) { return _mm##W##_fnmadd_ps(a, b, c); }                              \
    /* 2^n for whole numbers n in the exponent's range */                                                         \
    T static reg pow2(reg n) {                                                                                     \
        return _mm##W##_castsi##W##_ps(                                                                            \
            _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23));      \
    }

struct edgekv_f32x8 {
    typedef __m256 reg;
    typedef __m256 mask;
    static constexpr int W = 8;
    EDGEKV_F32_OPS(__attribute__((target("avx2,fma"))), 256)
    __attribute__((target("avx2,fma"))) static reg round(reg x) {
        return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __attribute__((target("avx2,fma"))) static mask less(reg a, reg b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
    __attribute__((target("avx2,fma"))) static reg zero_where(mask m, reg v) { return _mm256_andnot_ps(m, v); }
    __attribute__((target("avx2,fma"))) static void sum(reg p, edgekv_sums & s) {
        edgekv_sums::add(s, _mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
    }
};

struct edgekv_f32x16 {
    typedef __m512 reg;
    typedef __mmask16 mask;
    static constexpr int W = 16;
    EDGEKV_F32_OPS(__attribute__((target("avx512f"))), 512)
    __attribute__((target("avx512f"))) static reg round(reg x) {
        return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __attribute__((target("avx512f"))) static mask less(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
    __attribute__((target("avx512f"))) static reg zero_where(mask m, reg v) { return _mm512_maskz_mov_ps((mask) ~m, v); }
    __attribute__((target("avx512f"))) static void sum(reg p, edgekv_sums & s) {
        edgekv_sums::add(s, _mm512_extractf32x4_ps(p, 0), _mm512_extractf32x4_ps(p, 1)); // the first eight
        edgekv_sums::add(s, _mm512_extractf32x4_ps(p, 2), _mm512_extractf32x4_ps(p, 3)); // the second eight
    }
};

// exp(x) for x <= 0, in place: Cody-Waite reduction by ln 2 and a degree-5 polynomial
// (Cephes' expf coefficients, within 2 ulp); below -87 (and for -inf) exactly 0
template <class V>
static inline void edgekv_exp_neg(typename V::reg & x) {
    const typename V::reg lo = V::set1(-87.0f);
    const typename V::mask under = V::less(x, lo);
    x = V::max(x, lo);
    const typename V::reg n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
    x = V::fnmadd(n, V::set1(0.693359375f), x);
    x = V::fnmadd(n, V::set1(-2.12194440e-4f), x);
    typename V::reg y = V::set1(1.9875691500e-4f);
    y = V::fmadd(y, x, V::set1(1.3981999507e-3f));
    y = V::fmadd(y, x, V::set1(8.3334519073e-3f));
    y = V::fmadd(y, x, V::set1(4.1665795894e-2f));
    y = V::fmadd(y, x, V::set1(1.6666665459e-1f));
    y = V::fmadd(y, x, V::set1(5.0000001201e-1f));
    y = V::fmadd(y, V::mul(x, x), V::add(x, V::set1(1.0f)));
    x = V::zero_where(under, V::mul(y, V::pow2(n)));
}

// Both kernels' passes over one (layer, query head): the cells in chunks whose keys stay in
// the L2 cache while every query passes over them, QB queries a pass. A short last pass
// repeats its last query and stores nothing for the repeats. Pass::run holds the pass's
// accumulators and running maxima in registers (every loop over its queries has a constant
// trip count, so none lives in memory) and stores the maxima in a.mx between chunks.
template <int QB, typename Pass>
static void edgekv_score_passes(const edgekv_score_head & a, const float * q, const llama_pos * q_pos,
                                int32_t c_lo, int32_t c_hi) {
    for (int32_t c0 = c_lo; c0 < c_hi; c0 += EDGEKV_SCORE_CHUNK) {
        const int32_t c1 = std::min(c_hi, c0 + EDGEKV_SCORE_CHUNK);
        for (int32_t t0 = 0; t0 < a.n_q; t0 += QB) {
            const int32_t nt = std::min(QB, a.n_q - t0);
            const float * qt[QB];
            llama_pos qp[QB];
            for (int32_t u = 0; u < QB; ++u) {
                qt[u] = q + (size_t) (t0 + std::min(u, nt - 1))*a.hd;
                qp[u] = q_pos[t0 + std::min(u, nt - 1)];
            }
            Pass::run(a, c0, c1, t0, nt, qt, qp);
        }
    }
}

// AVX2 and FMA: QB queries against a block of 16 cells, 2*QB accumulators
template <int QB>
struct edgekv_score_pass_avx2 {
    __attribute__((target("avx2,fma")))
    static void run(const edgekv_score_head & a, int32_t c0, int32_t c1, int32_t t0, int32_t nt,
                    const float * const * qt, const llama_pos * qpos) {
        const int32_t L = EDGEKV_SCORE_LANES, hd = a.hd;
        const __m256 ninf = _mm256_set1_ps(-INFINITY), scale = _mm256_set1_ps(a.scale);
        __m256i qp[QB];
        __m256 mx[QB];
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            qp[u] = _mm256_set1_epi32(qpos[u]);
            mx[u] = c0 == 0 ? ninf : _mm256_loadu_ps(a.mx + 16*(size_t) (t0 + std::min(u, nt - 1)));
        }
        for (int32_t b = c0; b < c1; b += L) {
            __m256 s0[QB], s1[QB];
#pragma GCC unroll 16
            for (int32_t u = 0; u < QB; ++u) {
                s0[u] = s1[u] = _mm256_setzero_ps();
            }
            const float * kp = a.kb + (size_t) (b - a.kb0)*hd;
            for (int32_t d = 0; d < hd; ++d) {
                const __m256 k0 = _mm256_loadu_ps(kp + (size_t) d*L), k1 = _mm256_loadu_ps(kp + (size_t) d*L + 8);
#pragma GCC unroll 16
                for (int32_t u = 0; u < QB; ++u) {
                    const __m256 qd = _mm256_broadcast_ss(qt[u] + d);
                    s0[u] = _mm256_fmadd_ps(qd, k0, s0[u]);
                    s1[u] = _mm256_fmadd_ps(qd, k1, s1[u]);
                }
            }
            const __m256i p0 = _mm256_loadu_si256((const __m256i *) (a.pos + b));
            const __m256i p1 = _mm256_loadu_si256((const __m256i *) (a.pos + b + 8));
            const __m256 b0 = _mm256_loadu_ps(a.bias + b), b1 = _mm256_loadu_ps(a.bias + b + 8);
#pragma GCC unroll 16
            for (int32_t u = 0; u < QB; ++u) {
                __m256 x0 = _mm256_fmadd_ps(s0[u], scale, b0), x1 = _mm256_fmadd_ps(s1[u], scale, b1);
                x0 = _mm256_blendv_ps(x0, ninf, _mm256_castsi256_ps(_mm256_cmpgt_epi32(p0, qp[u])));
                x1 = _mm256_blendv_ps(x1, ninf, _mm256_castsi256_ps(_mm256_cmpgt_epi32(p1, qp[u])));
                mx[u] = _mm256_max_ps(_mm256_max_ps(mx[u], x0), x1);
                if (u < nt) {
                    _mm256_storeu_ps(a.lg + (size_t) (t0 + u)*a.n_pad + b, x0);
                    _mm256_storeu_ps(a.lg + (size_t) (t0 + u)*a.n_pad + b + 8, x1);
                }
            }
        }
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            if (u < nt) {
                _mm256_storeu_ps(a.mx + 16*(size_t) (t0 + u), mx[u]);
                _mm256_storeu_ps(a.mx + 16*(size_t) (t0 + u) + 8, mx[u]);
            }
        }
    }
};

// AVX-512: QB queries against NB blocks of 16 cells (one register each), NB*QB accumulators;
// per cell the same chain of multiply-adds as the AVX2 pass
template <int QB, int NB>
__attribute__((target("avx512f")))
static inline void edgekv_score_blocks_avx512(const edgekv_score_head & a, int32_t b, int32_t t0, int32_t nt,
                                              const float * const * qt, const __m512i * qp, __m512 * mx) {
    const int32_t L = EDGEKV_SCORE_LANES, hd = a.hd;
    const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(a.scale);
    __m512 s[NB][QB];
#pragma GCC unroll 16
    for (int32_t j = 0; j < NB; ++j) {
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            s[j][u] = _mm512_setzero_ps();
        }
    }
    const float * kp = a.kb + (size_t) (b - a.kb0)*hd;
    for (int32_t d = 0; d < hd; ++d) {
        __m512 k[NB];
#pragma GCC unroll 16
        for (int32_t j = 0; j < NB; ++j) {
            k[j] = _mm512_loadu_ps(kp + ((size_t) j*hd + d)*L);
        }
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            const __m512 qd = _mm512_set1_ps(qt[u][d]);
#pragma GCC unroll 16
            for (int32_t j = 0; j < NB; ++j) {
                s[j][u] = _mm512_fmadd_ps(qd, k[j], s[j][u]);
            }
        }
    }
#pragma GCC unroll 16
    for (int32_t j = 0; j < NB; ++j) {
        const int32_t bj = b + j*L;
        const __m512i p = _mm512_loadu_si512((const void *) (a.pos + bj));
        const __m512 bias = _mm512_loadu_ps(a.bias + bj);
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            const __m512 x = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(p, qp[u]),
                                                  _mm512_fmadd_ps(s[j][u], scale, bias), ninf);
            mx[u] = _mm512_max_ps(mx[u], x);
            if (u < nt) {
                _mm512_storeu_ps(a.lg + (size_t) (t0 + u)*a.n_pad + bj, x);
            }
        }
    }
}

template <int QB>
struct edgekv_score_pass_avx512 {
    __attribute__((target("avx512f")))
    static void run(const edgekv_score_head & a, int32_t c0, int32_t c1, int32_t t0, int32_t nt,
                    const float * const * qt, const llama_pos * qpos) {
        const int32_t L = EDGEKV_SCORE_LANES;
        __m512i qp[QB];
        __m512 mx[QB];
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            qp[u] = _mm512_set1_epi32(qpos[u]);
            mx[u] = c0 == 0 ? _mm512_set1_ps(-INFINITY) : _mm512_loadu_ps(a.mx + 16*(size_t) (t0 + std::min(u, nt - 1)));
        }
        int32_t b = c0;
        for (; b + 2*L <= c1; b += 2*L) {
            edgekv_score_blocks_avx512<QB, 2>(a, b, t0, nt, qt, qp, mx);
        }
        if (b < c1) { // an odd block at the end
            edgekv_score_blocks_avx512<QB, 1>(a, b, t0, nt, qt, qp, mx);
        }
#pragma GCC unroll 16
        for (int32_t u = 0; u < QB; ++u) {
            if (u < nt) {
                _mm512_storeu_ps(a.mx + 16*(size_t) (t0 + u), mx[u]);
            }
        }
    }
};

// The softmax of each query's logits (its maximum from the 16 running lanes) added to acc;
// the denominator summed in double in a fixed order of lanes
template <class V>
static void edgekv_score_softmax_in(const edgekv_score_head & a) {
    for (int32_t t = 0; t < a.n_q; ++t) {
        const float * m16 = a.mx + 16*(size_t) t;
        float m = m16[0];
        for (int32_t j = 1; j < 16; ++j) {
            m = m16[j] > m ? m16[j] : m;
        }
        if (m == -INFINITY) { // no cell visible to this query
            continue;
        }
        float * row = a.lg + (size_t) t*a.n_pad;
        const typename V::reg mv = V::set1(m);
        edgekv_sums sums;
        edgekv_sums::zero(sums);
        for (int32_t i = 0; i < a.n_pad; i += V::W) {
            typename V::reg p = V::sub(V::load(row + i), mv);
            edgekv_exp_neg<V>(p);
            V::store(row + i, p);
            V::sum(p, sums);
        }
        const typename V::reg inv = V::set1((float) (1.0/edgekv_sums::total(sums)));
        for (int32_t i = 0; i < a.n_pad; i += V::W) {
            V::store(a.acc + i, V::fmadd(V::load(row + i), inv, V::load(a.acc + i)));
        }
    }
}

__attribute__((target("avx2,fma"), flatten))
static void edgekv_score_softmax_avx2(const edgekv_score_head & a) {
    edgekv_score_softmax_in<edgekv_f32x8>(a);
}

__attribute__((target("avx512f"), flatten))
static void edgekv_score_softmax_avx512(const edgekv_score_head & a) {
    edgekv_score_softmax_in<edgekv_f32x16>(a);
}

static void edgekv_score_softmax(const edgekv_score_head & a, bool avx512) {
    if (avx512) {
        edgekv_score_softmax_avx512(a);
    } else {
        edgekv_score_softmax_avx2(a);
    }
}

// The logits of cells c_lo..c_hi-1 (whole chunks; c_lo a chunk's start) for one (layer,
// query head), and their running maxima: 8 queries a pass with AVX-512 (16 accumulators and
// 8 maxima of 32), 6 with AVX2 (12 accumulators of 16 registers); about twice the
// multiply-adds a second of the 4-query kernel they replaced, which kept its accumulators
// in memory
static void edgekv_score_logits(const edgekv_score_head & a, const float * q, const llama_pos * q_pos,
                                int32_t c_lo, int32_t c_hi, bool avx512) {
    if (avx512) {
        edgekv_score_passes<8, edgekv_score_pass_avx512<8>>(a, q, q_pos, c_lo, c_hi);
    } else {
        edgekv_score_passes<6, edgekv_score_pass_avx2<6>>(a, q, q_pos, c_lo, c_hi);
    }
}

// One (layer, query head) whose keys kb holds whole: its logits, then its softmax into acc
static void edgekv_score_one(const edgekv_score_head & a, const float * q, const llama_pos * q_pos, bool avx512) {
    edgekv_score_logits(a, q, q_pos, 0, a.n_pad, avx512);
    edgekv_score_softmax(a, avx512);
}

// Cells c0..c1-1 of KV head h of layer tensor k as F32 blocks of 16 cells, channel-major
// inside a block, from dst on; cells from n on are zeros (the padding). c0 is a multiple of
// 16. Eight cells at a time: their rows into rowf [8][hd] (the next eight rows prefetched:
// the rows of one head lie apart, and a row read cold stalled the conversion), then 8 x 8
// transposes in AVX registers into the blocks, where a scalar store per number took a
// third of the conversion's time.
__attribute__((target("avx2")))
static void edgekv_score_convert(const llama_edgekv_kv & e, const ggml_tensor * k, int32_t h, int32_t c0, int32_t c1,
                                 int32_t n, float * rowf, float * dst) {
    const int32_t H = e.n_head_kv, hd = e.hd_k, L = EDGEKV_SCORE_LANES;
    const size_t row_bytes = ggml_row_size(k->type, hd);
    const auto row = [&](int32_t i) { return (const uint8_t *) k->data + ((size_t) e.cells[i]*H + h)*row_bytes; };
    for (int32_t i0 = c0; i0 < c1; i0 += 8) {
        for (int32_t i = i0 + 8; i < std::min(i0 + 16, n); ++i) {
            edgekv_prefetch(row(i), row_bytes);
        }
        for (int32_t u = 0; u < 8; ++u) {
            if (i0 + u < n) {
                edgekv_to_f32(k->type, row(i0 + u), rowf + (size_t) u*hd, hd);
            } else {
                std::fill(rowf + (size_t) u*hd, rowf + (size_t) (u + 1)*hd, 0.0f);
            }
        }
        float * blk = dst + (size_t) ((i0 - c0)/L)*L*hd + i0 % L;
        int32_t d = 0;
        for (; d + 8 <= hd; d += 8) { // rows u = 0..7, channels d..d+7 -> channels, cells u
            __m256 r[8], t[8];
            for (int32_t u = 0; u < 8; ++u) {
                r[u] = _mm256_loadu_ps(rowf + (size_t) u*hd + d);
            }
            for (int32_t u = 0; u < 8; u += 2) {
                t[u] = _mm256_unpacklo_ps(r[u], r[u + 1]);
                t[u + 1] = _mm256_unpackhi_ps(r[u], r[u + 1]);
            }
            for (int32_t u = 0; u < 8; u += 4) {
                r[u]     = _mm256_shuffle_ps(t[u], t[u + 2], 0x44);
                r[u + 1] = _mm256_shuffle_ps(t[u], t[u + 2], 0xEE);
                r[u + 2] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0x44);
                r[u + 3] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0xEE);
            }
            for (int32_t j = 0; j < 4; ++j) { // channel d + j in the low halves, d + 4 + j in the high
                _mm256_storeu_ps(blk + (size_t) (d + j)*L, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
                _mm256_storeu_ps(blk + (size_t) (d + 4 + j)*L, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
            }
        }
        for (; d < hd; ++d) {
            for (int32_t u = 0; u < 8; ++u) {
                blk[(size_t) d*L + u] = rowf[(size_t) u*hd + d];
            }
        }
    }
}

static bool edgekv_host_score(const llama_edgekv_kv & e, const std::vector<int32_t> & todo, int32_t n_head, int32_t n_q,
                              const float * q, const llama_pos * q_pos, float kq_scale, float * out, int32_t n,
                              int32_t n_threads) {
    const int32_t H = e.n_head_kv, hd = e.hd_k, group = n_head/H, L = EDGEKV_SCORE_LANES;
    const int32_t n_pad = (n + L - 1)/L*L;
    const bool bias_on = e.kv->edgekv_bias_enabled(), avx512 = edgekv_use_avx512();
    std::vector<int32_t> pos(n_pad, std::numeric_limits<int32_t>::max());
    for (int32_t i = 0; i < n; ++i) {
        pos[i] = e.cells0().pos_get(e.cells[i]);
    }
    std::vector<std::vector<float>> bias(todo.size());
    const std::vector<float> zeros(n_pad, 0.0f);
    if (bias_on) { // per layer, the sequence's cells per KV head: [H][n_pad]
        for (size_t j = 0; j < todo.size(); ++j) {
            const std::vector<float> bh = e.bias_host(todo[j]);
            bias[j].assign((size_t) H*n_pad, 0.0f);
            for (int32_t h = 0; h < H; ++h) {
                for (int32_t i = 0; i < n; ++i) {
                    bias[j][(size_t) h*n_pad + i] = bh[(size_t) e.cells[i]*H + h];
                }
            }
        }
    }
    // Two ways to share the work out, with the same floats per cell:
    // - Many layers at once (ProtoKV asks for all of them in one call): each (layer, KV
    //   head) is an item. Its keys are converted a chunk at a time into a buffer that stays
    //   in the L2 cache while every query of the group's query heads passes over it, so
    //   no converted copy of the head goes through memory and the group reads it once.
    // - Few layers (SnapKV's scorer asks layer by layer): the keys of each (layer, KV head)
    //   are converted first, into batches that fit in 64 MiB; then each (layer, query
    //   head) is an item of its own, so one layer's nine query heads share the threads,
    //   where three KV heads on two threads left one idle half the time.
    // A KV head's query heads are summed in order afterwards.
    const size_t per_head = (size_t) n_pad*hd;
    const int32_t n_todo = (int32_t) todo.size();
    // (by KV head, a thread holds the logits of a whole group: bounded to 16 MiB, so H2O's
    // tally over a 512-token decode keeps to the per-query-head items)
    const bool by_kv_head = n_todo*H >= 8*std::max<int32_t>(1, n_threads) &&
                            (size_t) group*n_q*n_pad*sizeof(float) <= (16u << 20);
    const size_t batch_bytes = by_kv_head ? (size_t) n_head*n_pad*sizeof(float) : (size_t) H*per_head*sizeof(float);
    const int32_t batch = std::max<int32_t>(1, std::min<int32_t>(n_todo, (int32_t) ((64u << 20)/batch_bytes)));
    // every element of both is written before it is read: no zeroing (the keys of one
    // layer of an 8k cache are 6 MiB, asked for again at every call)
    std::unique_ptr<float[]> kb, acc;
    try {
        if (!by_kv_head) {
            kb.reset(new float[(size_t) batch*H*per_head]);
        }
        acc.reset(new float[(size_t) batch*n_head*n_pad]);
    } catch (const std::bad_alloc &) {
        return false;
    }
    for (int32_t j0 = 0; j0 < n_todo; j0 += batch) {
        const int32_t nb = std::min(batch, n_todo - j0);
        bool ok = true;
        if (by_kv_head) {
            ok = edgekv_host_parallel(nb*H, n_threads, [&](int32_t item, edgekv_scratch & tmp) {
                const int32_t jj = item/H, h = item % H, l = todo[j0 + jj];
                const int32_t chunk = std::min(EDGEKV_SCORE_CHUNK, n_pad);
                const size_t n_lg = (size_t) n_q*n_pad + 16*(size_t) n_q; // one query head's logits and maxima
                tmp.resize(((size_t) 8*hd + (size_t) chunk*hd + group*n_lg)*sizeof(float));
                float * rowf = (float *) tmp.data();
                float * kc = rowf + 8*hd;
                float * lg = kc + (size_t) chunk*hd;
                const float * b = bias_on ? bias[j0 + jj].data() + (size_t) h*n_pad : zeros.data();
                std::vector<edgekv_score_head> heads;
                for (int32_t g = 0; g < group; ++g) {
                    float * ac = acc.get() + ((size_t) jj*n_head + h*group + g)*n_pad;
                    std::fill(ac, ac + n_pad, 0.0f);
                    float * lgg = lg + (size_t) g*n_lg;
                    heads.push_back({n_pad, hd, n_q, kc, 0, pos.data(), b, kq_scale, lgg, lgg + (size_t) n_q*n_pad, ac});
                }
                for (int32_t c0 = 0; c0 < n_pad; c0 += chunk) {
                    const int32_t c1 = std::min(n_pad, c0 + chunk);
                    edgekv_score_convert(e, e.layers()[l].k, h, c0, c1, n, rowf, kc);
                    for (int32_t g = 0; g < group; ++g) {
                        heads[g].kb0 = c0;
                        edgekv_score_logits(heads[g], q + ((size_t) l*n_head + h*group + g)*n_q*hd, q_pos, c0, c1, avx512);
                    }
                }
                for (int32_t g = 0; g < group; ++g) {
                    edgekv_score_softmax(heads[g], avx512);
                }
            });
        } else {
            ok = edgekv_host_parallel(nb*H, n_threads, [&](int32_t item, edgekv_scratch & tmp) {
                const int32_t h = item % H, l = todo[j0 + item/H];
                tmp.resize(8*hd*sizeof(float));
                edgekv_score_convert(e, e.layers()[l].k, h, 0, n_pad, n, (float *) tmp.data(),
                                     kb.get() + (size_t) item*per_head);
            });
            ok = ok && edgekv_host_parallel(nb*n_head, n_threads, [&](int32_t item, edgekv_scratch & tmp) {
                const int32_t jj = item/n_head, qh = item % n_head, h = qh/group, l = todo[j0 + jj];
                tmp.resize(((size_t) n_q*n_pad + 16*(size_t) n_q)*sizeof(float));
                float * lg = (float *) tmp.data();
                float * ac = acc.get() + (size_t) item*n_pad;
                std::fill(ac, ac + n_pad, 0.0f);
                const float * b = bias_on ? bias[j0 + jj].data() + (size_t) h*n_pad : zeros.data();
                const edgekv_score_head a = {n_pad, hd, n_q, kb.get() + ((size_t) jj*H + h)*per_head, 0, pos.data(), b,
                                             kq_scale, lg, lg + (size_t) n_q*n_pad, ac};
                edgekv_score_one(a, q + ((size_t) l*n_head + qh)*n_q*hd, q_pos, avx512);
            });
        }
        if (!ok) {
            return false;
        }
        for (int32_t jj = 0; jj < nb; ++jj) {
            for (int32_t h = 0; h < H; ++h) {
                float * o = out + ((size_t) todo[j0 + jj]*H + h)*n;
                std::fill(o, o + n, 0.0f);
                for (int32_t g = 0; g < group; ++g) { // query head h*group + g, summed over its queries first, as the graph
                    const float * ac = acc.get() + ((size_t) jj*n_head + h*group + g)*n_pad;
                    for (int32_t i = 0; i < n; ++i) {
                        o[i] += ac[i];
                    }
                }
            }
        }
    }
    return true;
}
#endif

int32_t llama_edgekv_seq_score(
        llama_context * ctx, llama_seq_id seq_id, int32_t n_head, int32_t n_q, const float * q, const llama_pos * q_pos,
        float kq_scale, const int32_t * layers, int32_t n_layers, float * out, int32_t n) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const int32_t H = e.n_head_kv;
    if (n != (int32_t) e.cells.size() || n == 0 || n_q < 1 || !q || !q_pos || !out || n_head < H || n_head % H != 0) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    std::vector<int32_t> todo;
    if (layers) {
        if (n_layers < 0) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
        for (int32_t j = 0; j < n_layers; ++j) {
            if (layers[j] < 0 || layers[j] >= e.n_layer) {
                return LLAMA_EDGEKV_ERR_ARG;
            }
        }
        todo.assign(layers, layers + n_layers);
    } else {
        for (int32_t l = 0; l < e.n_layer; ++l) {
            todo.push_back(l);
        }
    }
#ifdef EDGEKV_X86_DISPATCH
    if (edgekv_host_cache(e) && edgekv_has_avx2_fma()) {
        llama_synchronize(ctx);
        return edgekv_host_score(e, todo, n_head, n_q, q, q_pos, kq_scale, out, n, (int32_t) ctx->n_threads())
                   ? LLAMA_EDGEKV_OK : LLAMA_EDGEKV_ERR_COMPUTE;
    }
#endif
    const auto & c = e.cells0();

    // causal mask by position, shared by every head
    std::vector<float> mask((size_t) n*n_q);
    for (int32_t t = 0; t < n_q; ++t) {
        for (int32_t i = 0; i < n; ++i) {
            mask[(size_t) t*n + i] = c.pos_get(e.cells[i]) <= q_pos[t] ? 0.0f : -INFINITY;
        }
    }
    std::vector<int32_t> ord(n), idx;
    for (int32_t i = 0; i < n; ++i) {
        ord[i] = i;
    }
    for (int32_t h = 0; h < H; ++h) {
        idx.insert(idx.end(), ord.begin(), ord.end());
    }
    const std::vector<int32_t> ids_h = e.head_ids(idx.data(), n, false);

    // one graph per layer keeps the score matrix of a single layer in memory
    for (const int32_t l : todo) {
        const auto & layer = e.layers()[l];
        llama_edgekv_graph g(ctx, 64);
        ggml_context * gc = g.ctx;

        ggml_tensor * ids = g.input(GGML_TYPE_I32, (int64_t) H*n, 1, ids_h.data());
        ids = ggml_view_1d(gc, ids, ids->ne[0], 0);
        ggml_tensor * qt = g.input(GGML_TYPE_F32, e.hd_k, (int64_t) n_q*n_head, q + (size_t) l*n_head*n_q*e.hd_k);
        qt = ggml_reshape_3d(gc, qt, e.hd_k, n_q, n_head);
        ggml_tensor * m = g.input(GGML_TYPE_F32, n, n_q, mask.data());

        if (e.kv->edgekv_bias_enabled()) {
            // the bias of the sequence's cells per KV head, then one mask per query head
            std::vector<float> bh = e.bias_host(l), b((size_t) n*H);
            for (int32_t h = 0; h < H; ++h) {
                for (int32_t i = 0; i < n; ++i) {
                    b[(size_t) h*n + i] = bh[(size_t) e.cells[i]*H + h];
                }
            }
            ggml_tensor * bt = g.input(GGML_TYPE_F32, n, H, b.data());
            bt = ggml_reshape_4d(gc, bt, n, 1, 1, H);
            bt = ggml_repeat_4d(gc, bt, n, 1, n_head/H, H);
            bt = ggml_reshape_4d(gc, bt, n, 1, n_head, 1);
            m = ggml_add(gc, ggml_repeat_4d(gc, m, n, n_q, n_head, 1), bt);
        }

        ggml_tensor * kr = ggml_get_rows(gc, e.head_rows(gc, layer.k, e.hd_k), ids); // [hd, H*n]
        kr = ggml_reshape_3d(gc, kr, e.hd_k, n, H);

        ggml_tensor * kq = ggml_mul_mat(gc, kr, qt);                  // [n, n_q, n_head]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(gc, kq, m, kq_scale, 0.0f);
        kq = ggml_cont(gc, ggml_permute(gc, kq, 1, 0, 2, 3));         // [n_q, n, n_head]
        kq = ggml_sum_rows(gc, kq);                                   // [1, n, n_head]
        kq = ggml_reshape_3d(gc, kq, n, n_head/H, H);                 // query head = kv head*group + g
        kq = ggml_cont(gc, ggml_permute(gc, kq, 1, 0, 2, 3));         // [group, n, H]
        kq = ggml_sum_rows(gc, kq);                                   // [1, n, H]
        ggml_set_output(kq);
        ggml_build_forward_expand(g.gf, kq);

        if (const int32_t rc = g.compute(); rc != LLAMA_EDGEKV_OK) {
            return rc;
        }
        ggml_backend_tensor_get(kq, out + (size_t) l*H*n, 0, ggml_nbytes(kq));
    }
    return LLAMA_EDGEKV_OK;
}

int32_t llama_edgekv_seq_key_sqnorms(llama_context * ctx, llama_seq_id seq_id, float * out, int32_t n) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const int32_t H = e.n_head_kv;
    if (!out || n != (int32_t) e.cells.size() || n == 0) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    std::vector<int32_t> ord(n), idx;
    for (int32_t i = 0; i < n; ++i) {
        ord[i] = i;
    }
    for (int32_t h = 0; h < H; ++h) {
        idx.insert(idx.end(), ord.begin(), ord.end());
    }

    // one graph for every layer: each layer's F32 rows are freed once squared and summed
    llama_edgekv_graph g(ctx, 8*(size_t) e.n_layer + 8);
    ggml_tensor * ids = g.input(GGML_TYPE_I32, (int64_t) H*n, 1, e.head_ids(idx.data(), n, false).data());
    ids = ggml_view_1d(g.ctx, ids, ids->ne[0], 0);

    std::vector<ggml_tensor *> sums;
    for (const auto & layer : e.layers()) {
        ggml_tensor * kr = ggml_get_rows(g.ctx, e.head_rows(g.ctx, layer.k, e.hd_k), ids); // [hd, H*n] F32
        ggml_tensor * s  = ggml_sum_rows(g.ctx, ggml_sqr(g.ctx, kr));                     // [1, H*n]
        ggml_set_output(s);
        ggml_build_forward_expand(g.gf, s);
        sums.push_back(s);
    }
    if (const int32_t rc = g.compute(); rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    for (size_t l = 0; l < sums.size(); ++l) {
        ggml_backend_tensor_get(sums[l], out + l*H*n, 0, ggml_nbytes(sums[l]));
    }
    return LLAMA_EDGEKV_OK;
}

// Whether an op that converts K and V rows where they lie can run: LLAMA_EDGEKV_ERR_TYPE for
// a quantised transposed V (llama.cpp never makes one), LLAMA_EDGEKV_ERR_UNSUPPORTED for a
// cache off the host (the engine reads K and V instead).
static int32_t edgekv_host_rows_status(const llama_edgekv_kv & e) {
    for (const auto & layer : e.layers()) {
        if (e.v_trans() && ggml_is_quantized(layer.v->type)) {
            return LLAMA_EDGEKV_ERR_TYPE;
        }
    }
    return edgekv_host_cache(e) ? LLAMA_EDGEKV_OK : LLAMA_EDGEKV_ERR_UNSUPPORTED;
}

// numpy's float64 sum of the squares of x[0..n) (np.add.reduce over a contiguous row, as
// np.linalg.norm adds a float64 copy's squares): below 8 values in order; up to 128, eight
// running sums of every eighth square, added in a tree, then the rest in order; above,
// the two halves (split at a multiple of 8) summed apart. A float's square is exact in
// double, so a contracted multiply-add gives the same sums.
static double edgekv_np_sumsq(const float * x, int32_t n) {
    if (n > 128) {
        int32_t half = n/2;
        half -= half % 8;
        return edgekv_np_sumsq(x, half) + edgekv_np_sumsq(x + half, n - half);
    }
    if (n < 8) {
        double s = 0.0;
        for (int32_t i = 0; i < n; ++i) {
            s += (double) x[i]*x[i];
        }
        return s;
    }
    double r[8];
    for (int32_t j = 0; j < 8; ++j) {
        r[j] = (double) x[j]*x[j];
    }
    int32_t i = 8;
    for (; i + 8 <= n; i += 8) {
        for (int32_t j = 0; j < 8; ++j) {
            r[j] += (double) x[i + j]*x[i + j];
        }
    }
    double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) {
        s += (double) x[i]*x[i];
    }
    return s;
}

int32_t llama_edgekv_seq_value_norms(llama_context * ctx, llama_seq_id seq_id, double * out, int32_t n) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const int32_t H = e.n_head_kv, hd = e.hd_v;
    if (!out || n != (int32_t) e.cells.size() || n == 0) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    if (const int32_t st = edgekv_host_rows_status(e); st != LLAMA_EDGEKV_OK) {
        return st;
    }
    const int32_t v_rot = e.v_rot();
    if (v_rot && hd % v_rot != 0) {
        return LLAMA_EDGEKV_ERR_UNSUPPORTED;
    }
    llama_synchronize(ctx);
    // a block of cells of one (layer, head) per step, converted as the read converts them
    // into rows of hd floats, then summed row by row
    constexpr int32_t block = 256;
    const bool ok = edgekv_host_parallel(e.n_layer*H, (int32_t) ctx->n_threads(), [&](int32_t item, edgekv_scratch & tmp) {
        const ggml_tensor * t = e.layers()[item/H].v;
        double * o = out + (size_t) item*n;
        const size_t el = ggml_type_size(t->type);
        tmp.resize((size_t) block*el + 2*(size_t) hd*block*sizeof(float));
        uint8_t * raw = tmp.data();
        float * rows = (float *) (tmp.data() + (size_t) block*el);
        float * tile = rows + (size_t) hd*block;
        std::vector<double> work;
        for (int32_t i0 = 0; i0 < n; i0 += block) {
            const int32_t m = std::min(block, n - i0);
            edgekv_host_rows(e, t, e.v_trans(), v_rot, item % H, hd, i0, m, raw, tile, rows, work);
            for (int32_t j = 0; j < m; ++j) {
                o[i0 + j] = std::sqrt(edgekv_np_sumsq(rows + (size_t) j*hd, hd));
            }
        }
    });
    return ok ? LLAMA_EDGEKV_OK : LLAMA_EDGEKV_ERR_COMPUTE;
}

// LagKV's scores, kept the same doubles as edgekv's reference kernel (_member_scores in
// edgekv/methods/lagkv.py): float64 arithmetic in its order, and no multiply-add fused
// into an FMA, which would round once where the reference rounds twice.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

// the minimum and maximum of n floats, and whether one is NaN, with eight running extremes
// that vectorise: a minimum or maximum does not depend on the order of the comparisons
// (two zeros of different sign may trade places, which changes no score: the scores
// square the differences)
// (inlined into each clone of its caller: a dispatched call per channel costs more than
// the few members of a shrunk group)
static inline __attribute__((always_inline)) bool edgekv_minmax(const float * x, int32_t n, float & lo, float & hi) {
    float mn[8], mx[8];
    int32_t nan[8];
    for (int32_t j = 0; j < 8; ++j) {
        mn[j] = INFINITY;
        mx[j] = -INFINITY;
        nan[j] = 0;
    }
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int32_t j = 0; j < 8; ++j) {
            const float v = x[i + j];
            nan[j] |= v != v;
            mn[j] = v < mn[j] ? v : mn[j];
            mx[j] = v > mx[j] ? v : mx[j];
        }
    }
    for (; i < n; ++i) {
        const float v = x[i];
        nan[0] |= v != v;
        mn[0] = v < mn[0] ? v : mn[0];
        mx[0] = v > mx[0] ? v : mx[0];
    }
    lo = mn[0];
    hi = mx[0];
    int32_t any = nan[0];
    for (int32_t j = 1; j < 8; ++j) {
        lo = mn[j] < lo ? mn[j] : lo;
        hi = mx[j] > hi ? mx[j] : hi;
        any |= nan[j];
    }
    return any != 0;
}

// softmax over the count members of one group of their normalised rows' channel std.
// x and ref are channel-major, [hd][count] and [hd][n_ref] (F32 as stored); s gets count scores. The loops
// over members vectorise (each member's sums still run over channels in order); an AVX2
// clone doubles their width where the CPU has it (AVX2 alone: no FMA).
#ifdef EDGEKV_X86_DISPATCH
__attribute__((target_clones("avx2", "default")))
#endif
static void edgekv_lag_group(const float * x, const float * ref, int32_t hd, int32_t count, int32_t n_ref,
                             double * s, std::vector<double> & work) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    constexpr double eps = 1e-6;
    work.resize((size_t) 2*hd + (size_t) hd*count + 2*(size_t) count);
    double * lo = work.data();
    double * inv = lo + hd;
    double * xx = inv + hd;
    double * m = xx + (size_t) hd*count;
    double * var = m + count;
    int32_t n_nan = 0;
    for (int32_t c = 0; c < hd; ++c) {
        float mnf, mxf; // exact in float: converting to double keeps the order
        const bool bad = edgekv_minmax(ref + (size_t) c*n_ref, n_ref, mnf, mxf); // a NaN spoils the channel, as numpy's min/max
        const double mn = mnf, mx = mxf;
        const double range = mx - mn;
        lo[c] = bad ? NAN : mn;
        inv[c] = bad ? NAN : 1.0 / (eps > range ? eps : range);
        n_nan += bad;
    }
    for (int32_t i = 0; i < count; ++i) {
        s[i] = 0.0;
    }
    if (n_ref > 0 && n_nan < hd) { // else no usable reference: uniform
        const int32_t ddof = hd > 1 ? 1 : 0;
        for (int32_t i = 0; i < count; ++i) {
            m[i] = 0.0;
            var[i] = 0.0;
        }
        for (int32_t c = 0; c < hd; ++c) {
            for (int32_t i = 0; i < count; ++i) {
                const double z = ((double) x[(size_t) c*count + i] - lo[c])*inv[c];
                xx[(size_t) c*count + i] = z;
                m[i] += z;
            }
        }
        for (int32_t i = 0; i < count; ++i) {
            m[i] /= hd;
        }
        for (int32_t c = 0; c < hd; ++c) {
            for (int32_t i = 0; i < count; ++i) {
                const double t = xx[(size_t) c*count + i] - m[i];
                var[i] += t*t;
            }
        }
        for (int32_t i = 0; i < count; ++i) {
            const double sd = std::sqrt(var[i]/(hd - ddof));
            s[i] = std::isnan(sd) ? -INFINITY : sd; // only from non-finite K/V: rank lowest
        }
    }
    double top = -INFINITY;
    for (int32_t i = 0; i < count; ++i) {
        top = s[i] > top ? s[i] : top;
    }
    if (!std::isfinite(top)) {
        top = 0.0;
    }
    double tot = 0.0;
    for (int32_t i = 0; i < count; ++i) {
        s[i] = std::exp(s[i] - top);
        tot += s[i];
    }
    for (int32_t i = 0; i < count; ++i) {
        s[i] = tot > 0 ? s[i]/tot : 0.0;
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// the rows of one head's groups of members as F32, each group channel-major and packed:
// group g's channel d at out[off[g]*hd + d*count[g] + w]
// (unrotated where rot, the Hadamard block of a rotated K or V, is not 0; a transposed V
// is never rotated: only a quantised V is, and that cannot be transposed)
static void edgekv_lag_rows(const llama_edgekv_kv & e, const ggml_tensor * t, bool transposed, int32_t rot, int32_t h,
                            int32_t hd, const int32_t * mem, const int32_t * count, const int32_t * off,
                            int32_t n_rows, int32_t width, float * out, std::vector<float> & buf) {
    const int32_t H = e.n_head_kv;
    const uint32_t * cells = e.cells.data();
    if (!transposed) {
        const size_t row_bytes = ggml_row_size(t->type, hd);
        buf.resize(hd);
        std::vector<double> work;
        for (int32_t g = 0; g < n_rows; ++g) {
            float * o = out + (size_t) off[g]*hd;
            for (int32_t w = 0; w < count[g]; ++w) {
                const uint8_t * src = (const uint8_t *) t->data + ((size_t) cells[mem[(size_t) g*width + w]]*H + h)*row_bytes;
                edgekv_to_f32(t->type, src, buf.data(), hd);
                for (int32_t d = 0; d < hd; ++d) {
                    o[(size_t) d*count[g] + w] = buf[d];
                }
            }
            if (rot && count[g]) {
                edgekv_unrotate_cm(o, hd, count[g], rot, work);
            }
        }
        return;
    }
    // a transposed V: per channel row, every member of every group converted at once (one
    // pass over the row while it is in cache), then placed in its group's channel-major rows
    const int32_t n_all = off[n_rows];
    if (n_all == 0) {
        return;
    }
    const size_t el = ggml_type_size(t->type);
    std::vector<uint32_t> at(n_all);
    for (int32_t g = 0; g < n_rows; ++g) {
        for (int32_t w = 0; w < count[g]; ++w) {
            at[off[g] + w] = cells[mem[(size_t) g*width + w]];
        }
    }
    const bool run = edgekv_is_run(at.data(), n_all);
    buf.resize((size_t) n_all + ((size_t) n_all*el + sizeof(float) - 1)/sizeof(float));
    float * conv = buf.data();
    uint8_t * raw = (uint8_t *) (conv + n_all);
    for (int32_t d = 0; d < hd; ++d) {
        const uint8_t * row = (const uint8_t *) t->data + ((size_t) h*hd + d)*e.kv_size()*el;
        edgekv_vt_to_f32(t->type, el, row, at.data(), n_all, run, raw, conv);
        for (int32_t g = 0; g < n_rows; ++g) {
            memcpy(out + (size_t) off[g]*hd + (size_t) d*count[g], conv + off[g], (size_t) count[g]*sizeof(float));
        }
    }
}

int32_t llama_edgekv_seq_lag_scores(
        llama_context * ctx, llama_seq_id seq_id, int32_t n_group, int32_t width, const int32_t * members,
        double * out, int32_t n) {
    llama_edgekv_kv e;
    const int32_t rc = e.init_seq(ctx, seq_id);
    if (rc != LLAMA_EDGEKV_OK) {
        return rc;
    }
    const int32_t H = e.n_head_kv;
    if (!members || !out || n != (int32_t) e.cells.size() || n == 0 || n_group < 1 || width < 1) {
        return LLAMA_EDGEKV_ERR_ARG;
    }
    const size_t per_head = (size_t) (n_group + 1)*width;
    const size_t n_members = (size_t) e.n_layer*H*per_head;
    for (size_t i = 0; i < n_members; ++i) {
        if (members[i] < -1 || members[i] >= n) {
            return LLAMA_EDGEKV_ERR_ARG;
        }
    }
    if (const int32_t st = edgekv_host_rows_status(e); st != LLAMA_EDGEKV_OK) {
        return st;
    }
    const int32_t k_rot = e.k_rot(), v_rot = e.v_rot();
    if ((k_rot && e.hd_k % k_rot != 0) || (v_rot && (e.hd_v % v_rot != 0 || e.v_trans()))) {
        return LLAMA_EDGEKV_ERR_UNSUPPORTED;
    }
    llama_synchronize(ctx);
    // one (layer, head) per item: its groups' K and V rows converted once (each group is
    // the next one's reference), then scored
    const bool ok = edgekv_host_parallel(e.n_layer*H, (int32_t) ctx->n_threads(), [&](int32_t item, edgekv_scratch & tmp) {
        const int32_t l = item/H, h = item % H;
        const auto & layer = e.layers()[l];
        const int32_t * mem = members + (size_t) item*per_head;
        std::vector<int32_t> count(n_group + 1, 0), off(n_group + 2, 0);
        for (int32_t g = 0; g <= n_group; ++g) {
            while (count[g] < width && mem[(size_t) g*width + count[g]] >= 0) {
                ++count[g];
            }
            off[g + 1] = off[g] + count[g];
        }
        // the thread's scratch (kept from item to item, uninitialised): only the members' rows
        const size_t nk = (size_t) off[n_group + 1]*e.hd_k, nv = (size_t) off[n_group + 1]*e.hd_v;
        tmp.resize((nk + nv)*sizeof(float));
        float * kx = (float *) tmp.data();
        float * vx = kx + nk;
        std::vector<float> buf;
        edgekv_lag_rows(e, layer.k, false, k_rot, h, e.hd_k, mem, count.data(), off.data(), n_group + 1, width, kx, buf);
        edgekv_lag_rows(e, layer.v, e.v_trans(), v_rot, h, e.hd_v, mem, count.data(), off.data(), n_group + 1, width, vx,
                        buf);
        std::vector<double> sk(width), sv(width), work;
        for (int32_t g = 0; g < n_group; ++g) {
            double * o = out + ((size_t) item*n_group + g)*width;
            edgekv_lag_group(kx + (size_t) off[g]*e.hd_k, kx + (size_t) off[g + 1]*e.hd_k, e.hd_k, count[g],
                             count[g + 1], sk.data(), work);
            edgekv_lag_group(vx + (size_t) off[g]*e.hd_v, vx + (size_t) off[g + 1]*e.hd_v, e.hd_v, count[g],
                             count[g + 1], sv.data(), work);
            for (int32_t w = 0; w < width; ++w) {
                o[w] = w < count[g] ? sk[w] + sv[w] : -INFINITY;
            }
        }
    });
    return ok ? LLAMA_EDGEKV_OK : LLAMA_EDGEKV_ERR_COMPUTE;
}
