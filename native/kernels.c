// Host kernels for edgekv's methods that need no llama.cpp: they run over numpy arrays on
// either engine. Each has a body for AVX-512 with VNNI (checked per call: Intel since
// Cascade Lake, AMD since Zen 4) and one for AVX2 with FMA (AMD since Zen 1, Intel since
// Haswell), which an AVX-512 CPU runs under EDGEKV_CPU=avx2. Elsewhere a call returns
// EDGEKV_KERNEL_UNSUPPORTED and the caller keeps its numpy path. Expected Attention's
// edgekv_expected_logits has one body, AVX2 with FMA, which AVX-512 CPUs run too, so its
// floats are the same on both. The unscreened edgekv_best_two has no AVX2 body: one (6
// keys by 16 prototypes) ran at 58 GFLOP/s on the Xeon, slower than numpy's BLAS products
// there; the screen skips most products and so pays on AVX2 as well.

#include "kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define EDGEKV_X86 1
#include <immintrin.h>
#endif

// The running best two scores per SIMD lane: lane l of a key sees prototypes l, l + 16,
// l + 32, ... in increasing order, so a strict > keeps the first of equal scores.
// ``second`` is the largest score of the lane's prototypes other than its best (equal to
// it on a tie), which is all the caller's bound needs.
typedef struct {
    float top[16];
    float second[16];
    int32_t arg[16];
} edgekv_lanes;

// Fold the 16 lanes of one key into its best prototype and the largest score of the others.
static void edgekv_fold_lanes(const edgekv_lanes * s, float * top, float * second, int32_t * arg) {
    const int w = 16;
    int best = 0;
    for (int l = 1; l < w; l++) {
        if (s->top[l] > s->top[best] || (s->top[l] == s->top[best] && s->arg[l] < s->arg[best])) {
            best = l;
        }
    }
    float sec = -INFINITY;
    for (int l = 0; l < w; l++) {
        sec = s->second[l] > sec ? s->second[l] : sec;
        if (l != best && s->top[l] > sec) {
            sec = s->top[l];
        }
    }
    *top = s->top[best];
    *second = sec;
    *arg = s->arg[best];
}

#ifdef EDGEKV_X86

// AVX-512: 12 keys by 32 prototypes a tile, 24 accumulators; the prototypes' transposed
// rows pt[k][j] (32 floats a row per tile), the keys' channels broadcast. At 8k cells, 517
// prototypes and d = 64 it runs at about 120 GFLOP/s on the Xeon (8 keys a tile: 113).
#define EDGEKV_TILE_KEYS 12
// Tiles of keys a block holds: each tile of prototypes (8 KiB of pt at d = 64) is read from
// L2 once per block and stays in L1 while the block's tiles pass over it.
#define EDGEKV_TILES 6

// The r keys of a tile, channel-major (xt[k * EDGEKV_TILE_KEYS + i] = x[i][k]): the tile's
// inner loop then broadcasts them from one pointer that steps by a row. Four keys by eight
// channels at a time, two 4 x 4 transposes in the halves of 256-bit registers: the scalar
// loop's load and store per number took a tenth of the kernel.
__attribute__((target("avx512f"))) static void edgekv_transpose_keys(const float * x, int64_t d, int r, float * xt) {
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) {
        for (int i = 0; i < EDGEKV_TILE_KEYS; i += 4) {
            __m256 v[4];
            for (int u = 0; u < 4; u++) {  // a short tile's last rows are zeros
                v[u] = i + u < r ? _mm256_loadu_ps(x + (i + u) * d + k) : _mm256_setzero_ps();
            }
            const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
            const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
            const __m256 c[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                                 _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
            for (int u = 0; u < 4; u++) {  // channel k + u in the low half, k + 4 + u in the high
                _mm_storeu_ps(xt + (k + u) * EDGEKV_TILE_KEYS + i, _mm256_castps256_ps128(c[u]));
                _mm_storeu_ps(xt + (k + 4 + u) * EDGEKV_TILE_KEYS + i, _mm256_extractf128_ps(c[u], 1));
            }
        }
    }
    for (; k < d; k++) {
        for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
            xt[k * EDGEKV_TILE_KEYS + i] = i < r ? x[i * d + k] : 0.0f;
        }
    }
}


// edgekv_fold_lanes in registers, for lanes without a NaN (the scalar fold takes the
// others, so that NaNs fall as they always did): the largest top, of equal tops the lowest
// prototype, and the largest of every second and every other lane's top.
__attribute__((target("avx512f"))) static inline void edgekv_fold_lanes512(const edgekv_lanes * s, float * top,
                                                                           float * second, int32_t * arg) {
    const __m512 t = _mm512_loadu_ps(s->top), sc = _mm512_loadu_ps(s->second);
    if (_mm512_cmp_ps_mask(t, sc, _CMP_UNORD_Q) != 0) {
        edgekv_fold_lanes(s, top, second, arg);
        return;
    }
    const __m512i a = _mm512_loadu_si512(s->arg);
    const __mmask16 at_max = _mm512_cmp_ps_mask(t, _mm512_set1_ps(_mm512_reduce_max_ps(t)), _CMP_EQ_OQ);
    const int32_t best_arg = _mm512_mask_reduce_min_epi32(at_max, a);
    const __mmask16 hits = _mm512_mask_cmpeq_epi32_mask(at_max, a, _mm512_set1_epi32(best_arg));
    const int best = __builtin_ctz((unsigned) hits);  // the first such lane, as the scalar scan
    const __m512 others = _mm512_mask_blend_ps((__mmask16) (1u << best), t, _mm512_set1_ps(-INFINITY));
    *top = s->top[best];
    *second = _mm512_reduce_max_ps(_mm512_max_ps(sc, others));
    *arg = best_arg;
}

__attribute__((target("avx512f"))) static inline void edgekv_update512(__m512 v, __m512i idx, float * top,
                                                                        float * second, int32_t * arg) {
    __m512 t = _mm512_loadu_ps(top);
    __m512 s = _mm512_loadu_ps(second);
    __m512i a = _mm512_loadu_si512(arg);
    __mmask16 gt = _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ);
    s = _mm512_mask_blend_ps(gt, _mm512_max_ps(s, v), t);
    t = _mm512_mask_blend_ps(gt, t, v);
    a = _mm512_mask_blend_epi32(gt, a, idx);
    _mm512_storeu_ps(top, t);
    _mm512_storeu_ps(second, s);
    _mm512_storeu_si512(arg, a);
}

// The screen's channels in the principal axes (a caller's fewer: zeros past them)
#define EDGEKV_SCREEN_AXES 32

// What a tile needs to skip prototypes (edgekv_best_two's doc). The screen is an integer
// product over r channels in the keys' principal axes: each key and each prototype in
// those axes, quantised to signed bytes (the key's as unsigned, offset by 128, for
// vpdpbusd), and multiplied back by their scales. Each key's bound then adds what the other
// channels can add (rest_x * rest_p) and what the quantisation and the rounding can hide (cut).
typedef struct {
    const uint32_t *uxt;     // [8][EDGEKV_TILE_KEYS]: 4 channels of each key of the tile, offset bytes
    const int8_t *  qpt;     // [8][cp][4]: 4 channels of each prototype
    const int32_t * corr;    // [cp]: 128 times each prototype's channel sum (the keys' offset)
    const float *   rest_p;  // [cp]
    const float *   scale;   // [keys of the tile]: the key's scale times the prototypes'
    const float *   rest_x;  // [keys of the tile]
    const float *   cut;     // [keys of the tile]: the quantisation's bound plus the slack
    float *         lb;      // [keys of the tile]: the best full product so far
    int64_t *       live;    // += the 16-prototype halves computed
} edgekv_prune;

// Which 16-prototype halves from j on may hold a prototype that beats each key's best so far:
// a product's upper bound is its screen (an exact integer sum, at most 32 * 255 * 127 in
// magnitude, converted exactly and scaled once) plus ||x's rest|| ||p's rest|| plus the
// cut. Below the key's best so far, the prototype cannot be the key's best, nor matter to
// the caller's check of the best. Not below (a NaN included): its product is computed.
// Four keys at a time, eight accumulators: 24 at once kept the compiler spilling them.
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline int edgekv_screen512(
        const edgekv_prune * pr, int64_t cp, int64_t j, int rows, __mmask16 live[EDGEKV_TILE_KEYS][2]) {
    const __m512i c0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(pr->corr + j));
    const __m512i c1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(pr->corr + j + 16));
    const __m512 rp0 = _mm512_loadu_ps(pr->rest_p + j), rp1 = _mm512_loadu_ps(pr->rest_p + j + 16);
    int n_live = 0;
    for (int i0 = 0; i0 < EDGEKV_TILE_KEYS; i0 += 4) {
        __m512i a[4][2];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            a[u][0] = c0;
            a[u][1] = c1;
        }
        const int8_t * q = pr->qpt + 4 * j;
#pragma GCC unroll 8
        for (int g = 0; g < EDGEKV_SCREEN_AXES / 4; g++) {
            const __m512i p0 = _mm512_loadu_si512(q + 4 * cp * g), p1 = _mm512_loadu_si512(q + 4 * cp * g + 64);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                const __m512i xb = _mm512_set1_epi32((int32_t) pr->uxt[g * EDGEKV_TILE_KEYS + i0 + u]);
                a[u][0] = _mm512_dpbusd_epi32(a[u][0], xb, p0);
                a[u][1] = _mm512_dpbusd_epi32(a[u][1], xb, p1);
            }
        }
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            const int i = i0 + u;
            const __m512 s = _mm512_set1_ps(pr->scale[i]);
            const __m512 rx = _mm512_set1_ps(pr->rest_x[i]);
            const __m512 thr = _mm512_set1_ps(i < rows ? pr->lb[i] - pr->cut[i] : INFINITY);
            live[i][0] = _mm512_cmp_ps_mask(_mm512_fmadd_ps(rx, rp0, _mm512_mul_ps(_mm512_cvtepi32_ps(a[u][0]), s)), thr,
                                            _CMP_NLT_UQ);
            live[i][1] = _mm512_cmp_ps_mask(_mm512_fmadd_ps(rx, rp1, _mm512_mul_ps(_mm512_cvtepi32_ps(a[u][1]), s)), thr,
                                            _CMP_NLT_UQ);
            n_live += (live[i][0] != 0) + (live[i][1] != 0);
        }
    }
    return n_live;
}

// Key i's products with the 16 prototypes at pk (channel k at pk + k * cp), in four
// chains: a surviving accumulator is rare, so one chain's latency would set the pace
__attribute__((target("avx512f"), always_inline)) static inline __m512 edgekv_product512(const float * xt, int i,
                                                                                       const float * pk, int64_t cp,
                                                                                       int64_t d) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= d; k += 4) {
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * EDGEKV_TILE_KEYS + i]), _mm512_loadu_ps(pk + k * cp), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(xt[(k + 1) * EDGEKV_TILE_KEYS + i]), _mm512_loadu_ps(pk + (k + 1) * cp), a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(xt[(k + 2) * EDGEKV_TILE_KEYS + i]), _mm512_loadu_ps(pk + (k + 2) * cp), a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(xt[(k + 3) * EDGEKV_TILE_KEYS + i]), _mm512_loadu_ps(pk + (k + 3) * cp), a3);
    }
    for (; k < d; k++) {
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * EDGEKV_TILE_KEYS + i]), _mm512_loadu_ps(pk + k * cp), a0);
    }
    return _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
}

// The tile's products with 32 prototypes (channel k at pk + k * cp) over all d channels
__attribute__((target("avx512f"), always_inline)) static inline void edgekv_products512(
        const float * xt, int64_t d, const float * pk, int64_t cp, __m512 acc[EDGEKV_TILE_KEYS][2]) {
    for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
        acc[i][0] = _mm512_setzero_ps();
        acc[i][1] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < d; k++, pk += cp, xt += EDGEKV_TILE_KEYS) {
        const __m512 p0 = _mm512_loadu_ps(pk);
        const __m512 p1 = _mm512_loadu_ps(pk + 16);
#pragma GCC unroll 12
        for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {  // every row: a short tile's last are zeros
            const __m512 xb = _mm512_set1_ps(xt[i]);
            acc[i][0] = _mm512_fmadd_ps(xb, p0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xb, p1, acc[i][1]);
        }
    }
}

// Above this many surviving 16-prototype halves (of 24), a tile computes all its products
#define EDGEKV_DENSE_HALVES 8

// One tile of keys against 32 prototypes from j on: every product (pr NULL or whole, which
// still raises the keys' best so far), or only those of the 16-prototype halves where some
// prototype may beat the key's best so far
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline void edgekv_tile512(const float * xt, int64_t d, int rows,
                                                                      const float * pt, int64_t cp, int64_t j,
                                                                      int64_t c, edgekv_lanes * st,
                                                                      const edgekv_prune * pr, bool whole) {
    __m512 acc[EDGEKV_TILE_KEYS][2];
    const bool screen = pr != NULL && !whole;
    __mmask16 live[EDGEKV_TILE_KEYS][2];
    int n_live = 2 * rows;
    if (screen) {
        n_live = edgekv_screen512(pr, cp, j, rows, live);
        *pr->live += n_live;
    } else {
        for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
            live[i][0] = live[i][1] = i < rows ? (__mmask16) 0xFFFF : 0;
        }
    }
    if (!screen || n_live > EDGEKV_DENSE_HALVES) {  // every product: cheaper as a whole tile, in registers
        edgekv_products512(xt, d, pt + j, cp, acc);
    }
    const bool each = screen && n_live <= EDGEKV_DENSE_HALVES;  // a survivor's products on its own
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i i0 = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t) j));
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(16));
    const __mmask16 m0 = j + 16 <= c ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (c > j ? c - j : 0)) - 1);
    const __mmask16 m1 = j + 32 <= c ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (c > j + 16 ? c - j - 16 : 0)) - 1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < rows; i++) {  // a padded prototype scores -inf: it never wins, never is second
        for (int h = 0; h < 2; h++) {
            if (live[i][h] == 0) {
                continue;
            }
            const __m512 a = _mm512_mask_blend_ps(h == 0 ? m0 : m1, ninf,
                                                  each ? edgekv_product512(xt, i, pt + j + 16 * h, cp, d) : acc[i][h]);
            edgekv_update512(a, h == 0 ? i0 : i1, st[i].top, st[i].second, st[i].arg);
            if (pr != NULL) {
                const float best = _mm512_reduce_max_ps(a);
                pr->lb[i] = best > pr->lb[i] ? best : pr->lb[i];
            }
        }
    }
}

// float32's unit roundoff
#define EDGEKV_EPS 0x1p-24

// Row v [d] in r axes (axes [d, r], row-major): out[a] = sum_k v[k] axes[k][a], in float32
__attribute__((target("avx512f"))) static void edgekv_rotate(const float * v, int64_t d, const float * axes, int64_t r,
                                                             float * out) {
    for (int64_t a = 0; a < r; a += 16) {
        const __mmask16 m = r - a >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (r - a)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < d; k++) {
            acc = _mm512_fmadd_ps(_mm512_set1_ps(v[k]), _mm512_maskz_loadu_ps(m, axes + k * r + a), acc);
        }
        _mm512_mask_storeu_ps(out + a, m, acc);
    }
}

// edgekv_rest_norm from the rotation's squared norm in2 (summed in double in any order:
// r <= 32 terms are within 2^-48 of their exact sum, inside the 2^-40 given here)
static inline float edgekv_rest_norm_of(double n2, double in2, double rot) {
    double inside = sqrt(in2 * (1.0 - 0x1p-40)) - rot * sqrt(n2);
    inside = inside > 0.0 ? inside : 0.0;
    const double rest2 = n2 * (1.0 + 0x1p-40) - inside * inside;
    return (float) (sqrt(rest2 > 0.0 ? rest2 : 0.0) * (1.0 + 0x1p-20));
}

// An upper bound on the norm of a row outside the axes, from its squared norm n2 (exact in
// double) and its rotation va [r] (within rot * ||row|| of the exact one):
// ||row||^2 - ||row in the axes||^2, with the rotation's error against it
static float edgekv_rest_norm(double n2, const float * va, int64_t r, double rot) {
    double in2 = 0.0;
    for (int64_t a = 0; a < r; a++) {
        in2 += (double) va[a] * va[a];
    }
    return edgekv_rest_norm_of(n2, in2, rot);
}

// The squared norm of v [d] in float32 (within (d + 2) eps of the exact one)
__attribute__((target("avx512f"))) static float edgekv_sqnorm512(const float * v, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < d; k += 16) {
        const __mmask16 m = d - k >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (d - k)) - 1);
        const __m512 v16 = _mm512_maskz_loadu_ps(m, v + k);
        acc = _mm512_fmadd_ps(v16, v16, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// What the screen needs of one tile's keys (rows of x, transposed in xt): each key in the
// first r <= 32 axes (axes32 [d][32], zeros past r) as offset bytes (uxt [r / 4][tile]), its
// scale times the prototypes' (sp), its rest norm, and its cut: what the bytes' errors can
// hide (qn ep + err pan) plus the slack. Float32 sums of d <= 256 squares are within
// 2^-14 of the exact ones, and every bound leans against them by that much.
__attribute__((target("avx512f"))) static void edgekv_screen_keys(const float * x, const float * xt, int rows,
                                                                  int64_t d, const float * axes32, int64_t r,
                                                                  double rot, float sp, double ep, double pan,
                                                                  double pmax, uint32_t * uxt, float * scale,
                                                                  float * rest_x, float * cut) {
    __m512 va[EDGEKV_TILE_KEYS][2];
    edgekv_products512(xt, d, axes32, 32, va);
    const double a = 0x1p-14;
    for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
        if (i >= rows) {  // a short tile's last rows: never live
            for (int64_t g = 0; g < r / 4; g++) {
                uxt[g * EDGEKV_TILE_KEYS + i] = 0x80808080u;
            }
            scale[i] = rest_x[i] = cut[i] = 0.0f;
            continue;
        }
        const __m512 v0 = va[i][0], v1 = va[i][1];
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float s = m / 127.0f;
        const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
        const __m512i lim = _mm512_set1_epi32(127);
        // round to nearest; any rounding will do, as the errors are measured afterwards
        const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lim),
                                            _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lim),
                                            _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        const __m512 f0 = _mm512_cvtepi32_ps(q0), f1 = _mm512_cvtepi32_ps(q1);
        const __m512 sv = _mm512_set1_ps(s);
        const __m512 e0 = _mm512_fnmadd_ps(sv, f0, v0), e1 = _mm512_fnmadd_ps(sv, f1, v1);  // one rounding each
        const double err = sqrt((double) _mm512_reduce_add_ps(_mm512_fmadd_ps(e0, e0, _mm512_mul_ps(e1, e1)))) * (1.0 + a);
        const double qn = (double) s * sqrt((double) _mm512_reduce_add_ps(_mm512_fmadd_ps(f0, f0, _mm512_mul_ps(f1, f1)))) *
                          (1.0 + 0x1p-20);  // an exact integer sum
        const double in2 = (double) _mm512_reduce_add_ps(_mm512_fmadd_ps(v0, v0, _mm512_mul_ps(v1, v1)));
        const double n2 = (double) edgekv_sqnorm512(x + (int64_t) i * d, d) * (1.0 + a);
        double inside = sqrt(in2 * (1.0 - a)) - rot * sqrt(n2);
        inside = inside > 0.0 ? inside : 0.0;
        const double rest2 = n2 - inside * inside;
        rest_x[i] = (float) (sqrt(rest2 > 0.0 ? rest2 : 0.0) * (1.0 + 0x1p-20));
        scale[i] = s * sp;
        // bytes q + 128: the offset vpdpbusd's unsigned operand needs
        uint8_t b[32];
        _mm_storeu_si128((__m128i *) b, _mm_xor_si128(_mm512_cvtepi32_epi8(q0), _mm_set1_epi8((char) 0x80)));
        _mm_storeu_si128((__m128i *) (b + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(q1), _mm_set1_epi8((char) 0x80)));
        for (int64_t g = 0; g < r / 4; g++) {
            uint32_t w;
            memcpy(&w, b + 4 * g, 4);
            uxt[g * EDGEKV_TILE_KEYS + i] = w;
        }
        // the slack: the rounding of the screen's scaling (eps each, on about twice the
        // product of the norms: 8 eps), of a full product ((d + 4) eps) and of both
        // rotations (2 rot), twice over
        const double norm = sqrt(n2) * pmax;
        const double slack = 2.0 * ((8.0 + (double) d + 4.0) * EDGEKV_EPS + 2.0 * rot) * 1.03 * norm;
        cut[i] = (float) ((qn * ep + err * pan + slack) * (1.0 + 0x1p-20));
    }
}

// The prototypes' side of the screen, once per call: their bytes in groups of 4 channels
// (qpt [r / 4][cp][4]), the keys' offset correction, the norms outside the axes, one
// scale for all (*sp), and the largest quantisation error and norm in the axes (*ep, *pa)
__attribute__((target("avx512f"))) static void edgekv_screen_prototypes(const float * pt, int64_t d, int64_t cp,
                                                                        const float * axes, int64_t r, double rot,
                                                                        float * pa, int8_t * qpt, int32_t * corr,
                                                                        float * rest_p, float * sp, double * ep,
                                                                        double * pan, double * pmax) {
    float col[256];  // d <= 256 (the caller checks)
    float m = 0.0f;
    *pmax = 0.0;
    for (int64_t j = 0; j < cp; j++) {
        for (int64_t k = 0; k < d; k++) {
            col[k] = pt[k * cp + j];
        }
        edgekv_rotate(col, d, axes, r, pa + j * r);
        double n2 = 0.0;
        for (int64_t k = 0; k < d; k++) {
            n2 += (double) col[k] * col[k];
        }
        rest_p[j] = edgekv_rest_norm(n2, pa + j * r, r, rot);
        *pmax = sqrt(n2) > *pmax ? sqrt(n2) : *pmax;
        for (int64_t a = 0; a < r; a++) {
            m = fabsf(pa[j * r + a]) > m ? fabsf(pa[j * r + a]) : m;
        }
    }
    const float s = m / 127.0f;
    *sp = s;
    *ep = 0.0;
    *pan = 0.0;
    for (int64_t j = 0; j < cp; j++) {
        double e2 = 0.0, n2 = 0.0;
        int32_t sum = 0;
        for (int64_t a = 0; a < r; a++) {
            const float v = pa[j * r + a];
            long q = s > 0.0f ? lrintf(v / s) : 0;
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            qpt[((a / 4) * cp + j) * 4 + a % 4] = (int8_t) q;
            sum += (int32_t) q;
            const double back = (double) s * (double) q;
            e2 += ((double) v - back) * ((double) v - back);
            n2 += (double) v * v;
        }
        corr[j] = 128 * sum;
        *ep = sqrt(e2) > *ep ? sqrt(e2) : *ep;
        *pan = sqrt(n2) > *pan ? sqrt(n2) : *pan;
    }
    *ep *= 1.0 + 0x1p-40;
    *pan *= 1.0 + 0x1p-40;
    *pmax *= 1.0 + 0x1p-40;
}

__attribute__((target("avx512f,avx512vnni"))) static bool edgekv_best_two_avx512(const float * x, int64_t n, int64_t d,
                                                                                   const float * pt, int64_t c,
                                                                                   int64_t cp,
                                                                                   struct edgekv_screen * sc,
                                                                                   float * top, float * second,
                                                                                   int32_t * arg) {
    const int block = EDGEKV_TILES * EDGEKV_TILE_KEYS;
    const int64_t r = sc != NULL ? EDGEKV_SCREEN_AXES : 0, groups = r / 4;
    edgekv_lanes st[EDGEKV_TILES * EDGEKV_TILE_KEYS];
    float lb[EDGEKV_TILES * EDGEKV_TILE_KEYS], scale[EDGEKV_TILES * EDGEKV_TILE_KEYS];
    float rest_x[EDGEKV_TILES * EDGEKV_TILE_KEYS], cut[EDGEKV_TILES * EDGEKV_TILE_KEYS];
    // one allocation: the block's keys transposed, then the screen's arrays
    const size_t bytes = sizeof(float) * block * d + sizeof(uint32_t) * block * groups + sizeof(float) * (r + 1) * cp +
                         sizeof(int32_t) * cp + (size_t) r * cp + sizeof(float) * 32 * d;
    float * xt = malloc(bytes);
    if (xt == NULL) {
        return false;
    }
    uint32_t * uxt = (uint32_t *) (xt + block * d);
    float * pa = (float *) (uxt + block * groups);
    float * rest_p = pa + r * cp;
    int32_t * corr = (int32_t *) (rest_p + cp);
    int8_t * qpt = (int8_t *) (corr + cp);
    float * axes32 = (float *) (qpt + r * cp);  // the caller's axes, 32 columns wide (zeros past its r)
    for (int64_t k = 0; k < d && r > 0; k++) {
        for (int64_t a = 0; a < 32; a++) {
            axes32[k * 32 + a] = a < sc->r ? sc->axes[k * sc->r + a] : 0.0f;
        }
    }
    // A rotated row's error, over its norm: the rotation's float32 sums and the axes' float32
    // rounding, each channel within (d + 1) eps of the row's norm
    const double rot = (double) (d + 1) * EDGEKV_EPS * sqrt((double) r) * 1.01;
    float sp = 0.0f;
    double ep = 0.0, pan = 0.0, pmax = 0.0;
    if (r > 0) {
        edgekv_screen_prototypes(pt, d, cp, axes32, r, rot, pa, qpt, corr, rest_p, &sp, &ep, &pan, &pmax);
    }
    // Skipping pays while few halves survive: each survivor's product is computed on its
    // own, at about three times the cost per multiply-add of the full tile. Where more
    // than a fifth of them survive (keys spread over many axes: a model's first layer),
    // the rest of the keys are computed in full.
    bool prune = r > 0;
    int64_t blocks = 0;
    for (int64_t lo = 0; lo < n; lo += block, blocks++) {
        const int64_t nb = n - lo < block ? n - lo : block;
        const int tiles = (int) ((nb + EDGEKV_TILE_KEYS - 1) / EDGEKV_TILE_KEYS);
        prune = r > 0 && (prune || blocks % 8 == 0);  // tried again now and then
        int64_t live = 0;
        for (int t = 0; t < tiles; t++) {
            const int rows = nb - t * EDGEKV_TILE_KEYS < EDGEKV_TILE_KEYS ? (int) (nb - t * EDGEKV_TILE_KEYS) : EDGEKV_TILE_KEYS;
            edgekv_transpose_keys(x + (lo + t * EDGEKV_TILE_KEYS) * d, d, rows, xt + t * EDGEKV_TILE_KEYS * d);
        }
        for (int t = 0; prune && t < tiles; t++) {  // each key in the axes, as offset bytes
            const int rows = nb - t * EDGEKV_TILE_KEYS < EDGEKV_TILE_KEYS ? (int) (nb - t * EDGEKV_TILE_KEYS) : EDGEKV_TILE_KEYS;
            const int k0 = t * EDGEKV_TILE_KEYS;
            edgekv_screen_keys(x + (lo + k0) * d, xt + k0 * d, rows, d, axes32, r, rot, sp, ep, pan, pmax,
                               uxt + k0 * groups, scale + k0, rest_x + k0, cut + k0);
        }
        for (int64_t i = 0; i < nb; i++) {
            lb[i] = -INFINITY;
            _mm512_storeu_ps(st[i].top, _mm512_set1_ps(-INFINITY));
            _mm512_storeu_ps(st[i].second, _mm512_set1_ps(-INFINITY));
            _mm512_storeu_si512(st[i].arg, _mm512_setzero_si512());
        }
        // Prototypes in tiles of 32, each staying in L1 for the block. With pruning, from
        // where the block's own prototypes likely sit (ProtoKV's chunk prototypes follow
        // the cells), so that each key's best so far is high from the first tile on; the
        // order does not change the answer (a tie in float32 is the caller's to decide).
        const int64_t j0 = prune ? (lo * c / n) / 32 * 32 : 0;
        for (int64_t jj = 0; jj < cp; jj += 32) {
            const int64_t j = (j0 + jj) % cp;
            for (int t = 0; t < tiles; t++) {
                const int rows = nb - t * EDGEKV_TILE_KEYS < EDGEKV_TILE_KEYS ? (int) (nb - t * EDGEKV_TILE_KEYS) : EDGEKV_TILE_KEYS;
                const int k0 = t * EDGEKV_TILE_KEYS;
                const edgekv_prune pr = {uxt + k0 * groups, qpt, corr, rest_p, scale + k0, rest_x + k0, cut + k0,
                                         lb + k0, &live};
                // the block's first tile of prototypes is computed whole: no best so far
                // the block's first tile of prototypes is computed whole: no best so far
                edgekv_tile512(xt + k0 * d, d, rows, pt, cp, j, c, st + k0, prune ? &pr : NULL, jj == 0);
            }
        }
        for (int64_t i = 0; i < nb; i++) {
            edgekv_fold_lanes512(&st[i], top + lo + i, second + lo + i, arg + lo + i);
        }
        if (prune) {  // not counted: the first tile, computed whole
            sc->screened += 2 * nb * (cp / 32 - 1);
            sc->passed += live;
        }
        prune = prune && 5 * live <= 2 * nb * (cp / 32 - 1);
    }
    free(xt);
    return true;
}


// numpy's pairwise sum of the n float64 numbers at p, for 8 <= n <= 128 (one of numpy's
// blocks): eight interleaved partial sums (lane j adds p[j], p[j + 8], ...), then
// ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest in order.
static inline double edgekv_np_tree(const double l[8], const double * p, int m, int n) {
    double s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; m < n; m++) {
        s += p[m];
    }
    return s;
}

// A row's squared norm and its product with mu, numpy's way: eight lanes of float64
// products (each rounded before it is added), folded as edgekv_np_tree, the rest in order
static inline void edgekv_np_row_tail(const double a[8], const double b[8], const float * row, const double * mu,
                                      int64_t k, int64_t d, double * ssq, double * sdot) {
    *ssq = edgekv_np_tree(a, NULL, 0, 0);
    *sdot = edgekv_np_tree(b, NULL, 0, 0);
    for (; k < d; k++) {
        *ssq += (double) row[k] * (double) row[k];
        *sdot += (double) row[k] * mu[k];
    }
}

__attribute__((target("avx512f"))) static inline double edgekv_np_block_sum512(const double * p, int n) {
    __m512d r = _mm512_loadu_pd(p);
    int m = 8;
    for (; m + 8 <= n; m += 8) {
        r = _mm512_add_pd(r, _mm512_loadu_pd(p + m));
    }
    double l[8];
    _mm512_storeu_pd(l, r);
    return edgekv_np_tree(l, p, m, n);
}

__attribute__((target("avx512f"))) static inline void edgekv_np_row512(const float * row, const double * mu, int64_t d,
                                                                       double * ssq, double * sdot) {
    __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(row));
    __m512d sq = _mm512_mul_pd(v, v);
    __m512d dot = _mm512_mul_pd(v, _mm512_loadu_pd(mu));
    int64_t k = 8;
    for (; k + 8 <= d; k += 8) {
        v = _mm512_cvtps_pd(_mm256_loadu_ps(row + k));
        sq = _mm512_add_pd(sq, _mm512_mul_pd(v, v));
        dot = _mm512_add_pd(dot, _mm512_mul_pd(v, _mm512_loadu_pd(mu + k)));
    }
    double a[8], b[8];
    _mm512_storeu_pd(a, sq);
    _mm512_storeu_pd(b, dot);
    edgekv_np_row_tail(a, b, row, mu, k, d, ssq, sdot);
}

// The same eight lanes as two 256-bit halves
__attribute__((target("avx2"))) static inline double edgekv_np_block_sum256(const double * p, int n) {
    __m256d r0 = _mm256_loadu_pd(p), r1 = _mm256_loadu_pd(p + 4);
    int m = 8;
    for (; m + 8 <= n; m += 8) {
        r0 = _mm256_add_pd(r0, _mm256_loadu_pd(p + m));
        r1 = _mm256_add_pd(r1, _mm256_loadu_pd(p + m + 4));
    }
    double l[8];
    _mm256_storeu_pd(l, r0);
    _mm256_storeu_pd(l + 4, r1);
    return edgekv_np_tree(l, p, m, n);
}

__attribute__((target("avx2"))) static inline void edgekv_np_row256(const float * row, const double * mu, int64_t d,
                                                                    double * ssq, double * sdot) {
    __m256d v0 = _mm256_cvtps_pd(_mm_loadu_ps(row)), v1 = _mm256_cvtps_pd(_mm_loadu_ps(row + 4));
    __m256d sq0 = _mm256_mul_pd(v0, v0), sq1 = _mm256_mul_pd(v1, v1);
    __m256d dot0 = _mm256_mul_pd(v0, _mm256_loadu_pd(mu)), dot1 = _mm256_mul_pd(v1, _mm256_loadu_pd(mu + 4));
    int64_t k = 8;
    for (; k + 8 <= d; k += 8) {
        v0 = _mm256_cvtps_pd(_mm_loadu_ps(row + k));
        v1 = _mm256_cvtps_pd(_mm_loadu_ps(row + k + 4));
        sq0 = _mm256_add_pd(sq0, _mm256_mul_pd(v0, v0));
        sq1 = _mm256_add_pd(sq1, _mm256_mul_pd(v1, v1));
        dot0 = _mm256_add_pd(dot0, _mm256_mul_pd(v0, _mm256_loadu_pd(mu + k)));
        dot1 = _mm256_add_pd(dot1, _mm256_mul_pd(v1, _mm256_loadu_pd(mu + k + 4)));
    }
    double a[8], b[8];
    _mm256_storeu_pd(a, sq0);
    _mm256_storeu_pd(a + 4, sq1);
    _mm256_storeu_pd(b, dot0);
    _mm256_storeu_pd(b + 4, dot1);
    edgekv_np_row_tail(a, b, row, mu, k, d, ssq, sdot);
}

// edgekv_irregularity's pass, written once: each ISA's wrapper inlines it with its own
// block sum and row products (constants there, so the calls are inlined too)
__attribute__((always_inline)) static inline void edgekv_irregularity_chunks(
        const float * x, int64_t d, const int64_t * bounds, int64_t n_chunks, double * mu, double * acc, double * delta,
        double (*block_sum)(const double *, int),
        void (*row_products)(const float *, const double *, int64_t, double *, double *)) {
    for (int64_t i = 0; i < n_chunks; i++) {
        const int64_t lo = bounds[i], hi = bounds[i + 1];
        const double size = (double) (hi - lo);
        for (int64_t k = 0; k < d; k++) {  // the chunk's sum, row by row from +0.0 (numpy's sum(axis=0))
            acc[k] = 0.0;
        }
        for (int64_t t = lo; t < hi; t++) {
            for (int64_t k = 0; k < d; k++) {
                acc[k] += (double) x[t * d + k];
            }
        }
        for (int64_t k = 0; k < d; k++) {
            mu[k] = acc[k] / size;
        }
        for (int64_t t = lo; t < hi; t++) {  // the squared deviations, summed row by row
            for (int64_t k = 0; k < d; k++) {
                const double e = (double) x[t * d + k] - mu[k];
                acc[k] = t == lo ? e * e : acc[k] + e * e;
            }
        }
        const double spread = sqrt(block_sum(acc, (int) d) / size);  // ||sigma||
        for (int64_t k = 0; k < d; k++) {  // acc is free again: mu's squares
            acc[k] = mu[k] * mu[k];
        }
        const double mu_norm = sqrt(block_sum(acc, (int) d));
        for (int64_t t = lo; t < hi; t++) {  // the row's squared norm and its product with mu, side by side
            double ssq, sdot;
            row_products(x + t * d, mu, d, &ssq, &sdot);
            const double den = sqrt(ssq) * mu_norm;
            const double cos = den > 0 ? sdot / den : 0.0;
            delta[t] = spread > 0 ? (1.0 - cos) / spread : 0.0;
        }
    }
}

__attribute__((target("avx512f"))) static void edgekv_irregularity_avx512(const float * x, int64_t d,
                                                                           const int64_t * bounds, int64_t n_chunks,
                                                                           double * mu, double * acc, double * delta) {
    edgekv_irregularity_chunks(x, d, bounds, n_chunks, mu, acc, delta, edgekv_np_block_sum512, edgekv_np_row512);
}

__attribute__((target("avx2"))) static void edgekv_irregularity_avx2(const float * x, int64_t d,
                                                                      const int64_t * bounds, int64_t n_chunks,
                                                                      double * mu, double * acc, double * delta) {
    edgekv_irregularity_chunks(x, d, bounds, n_chunks, mu, acc, delta, edgekv_np_block_sum256, edgekv_np_row256);
}

// AVX2 with FMA: the screened edgekv_best_two and edgekv_irregularity for CPUs without
// AVX-512 (AMD before Zen 4, most Intel desktops). Without VNNI the screen runs in float32:
// each key and prototype in the r principal axes, products over those r channels with
// FMAs (r / 64 of a full product at d = 64), and the same bounds for what the other
// channels and the roundings can add, with no bytes' error to add. A tile is 6 keys by 16
// prototypes, 12 accumulators of the 16 registers. The screen runs over a block's tiles
// first; then the keys that passed each group of 8 prototypes are gathered, six at a time,
// so that the products that pass run at the tile's rate (one at a time, each load of a
// prototype channel served one key, and a tile with many passes computed all 12 groups).
// Without a screen the kernel declines: numpy's BLAS products are as fast as this tile's
// (edgekv_best_two's header).
#define EDGEKV_TILE2_KEYS 6
// Keys a block holds (8 tiles): a 16-prototype half of pt (4 KiB at d = 64) and of the
// screen's rotated prototypes stays in L1 while the block's tiles pass over it.
#define EDGEKV_BLOCK2 48

// Six rows (each d floats, at xs[0..5]) against 16 columns of P (rows ld apart), channel by
// channel: a<i><h> = sum over k < d of xs[i][k] * P[k * ld + 8 h + lane]. The accumulators
// are named variables, not an array: GCC stored an array's twelve back to memory at every
// channel (a float load from xs might alias them), which halved the tile's speed.
#define EDGEKV_ROW256(i)                                   \
    do {                                                   \
        const __m256 xb = _mm256_broadcast_ss(x##i + k);   \
        a##i##0 = _mm256_fmadd_ps(xb, p0, a##i##0);        \
        a##i##1 = _mm256_fmadd_ps(xb, p1, a##i##1);        \
    } while (0)
#define EDGEKV_TILE256(xs, d, P, ld)                                                                 \
    const float *x0 = (xs)[0], *x1 = (xs)[1], *x2 = (xs)[2], *x3 = (xs)[3], *x4 = (xs)[4], *x5 = (xs)[5]; \
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;           \
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;                           \
    for (int64_t k = 0; k < (d); k++) {                                                              \
        const __m256 p0 = _mm256_loadu_ps((P) + k * (ld)), p1 = _mm256_loadu_ps((P) + k * (ld) + 8);   \
        EDGEKV_ROW256(0);                                                                            \
        EDGEKV_ROW256(1);                                                                            \
        EDGEKV_ROW256(2);                                                                            \
        EDGEKV_ROW256(3);                                                                            \
        EDGEKV_ROW256(4);                                                                            \
        EDGEKV_ROW256(5);                                                                            \
    }

// EDGEKV_TILE256 into acc[i][h]
__attribute__((target("avx2,fma"), always_inline)) static inline void edgekv_products256(
        const float * const xs[EDGEKV_TILE2_KEYS], int64_t d, const float * P, int64_t ld, __m256 acc[EDGEKV_TILE2_KEYS][2]) {
    EDGEKV_TILE256(xs, d, P, ld)
    acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11, acc[2][0] = a20, acc[2][1] = a21;
    acc[3][0] = a30, acc[3][1] = a31, acc[4][0] = a40, acc[4][1] = a41, acc[5][0] = a50, acc[5][1] = a51;
}

// The screen of six keys (as, in the axes) against 16 prototypes (P, in the axes): bit
// 2 i + h set where key i's bound (its product in the axes plus rest_x[i] times each
// prototype's rest norm rp<h>) is not below thr[i] (a NaN included) for some prototype of
// the 8 in group h; with valid, only among those that exist. Most tiles have none, found
// with one test; the keys' bits are formed only when some bound passes.
#define EDGEKV_BOUND256(i, h) \
    _mm256_cmp_ps(_mm256_fmadd_ps(_mm256_broadcast_ss(rx + (i)), rp##h, a##i##h), _mm256_broadcast_ss(thr + (i)), _CMP_NLT_UQ)
__attribute__((target("avx2,fma"), always_inline)) static inline unsigned edgekv_screen256(
        const float * const as[EDGEKV_TILE2_KEYS], int64_t r, const float * P, int64_t ld, const float * rx,
        const float * thr, __m256 rp0, __m256 rp1, const __m256 * valid) {
    EDGEKV_TILE256(as, r, P, ld)
    __m256 c[EDGEKV_TILE2_KEYS][2] = {{EDGEKV_BOUND256(0, 0), EDGEKV_BOUND256(0, 1)},
                                      {EDGEKV_BOUND256(1, 0), EDGEKV_BOUND256(1, 1)},
                                      {EDGEKV_BOUND256(2, 0), EDGEKV_BOUND256(2, 1)},
                                      {EDGEKV_BOUND256(3, 0), EDGEKV_BOUND256(3, 1)},
                                      {EDGEKV_BOUND256(4, 0), EDGEKV_BOUND256(4, 1)},
                                      {EDGEKV_BOUND256(5, 0), EDGEKV_BOUND256(5, 1)}};
    if (valid != NULL) {  // the last prototypes: the padding's bounds are zeros, which may pass
        for (int i = 0; i < EDGEKV_TILE2_KEYS; i++) {
            c[i][0] = _mm256_and_ps(c[i][0], valid[0]);
            c[i][1] = _mm256_and_ps(c[i][1], valid[1]);
        }
    }
    __m256 any = c[0][0];
    for (int i = 0; i < EDGEKV_TILE2_KEYS; i++) {
        any = _mm256_or_ps(any, _mm256_or_ps(c[i][0], c[i][1]));
    }
    if (_mm256_movemask_ps(any) == 0) {
        return 0;
    }
    unsigned bits = 0;
    for (int i = 0; i < EDGEKV_TILE2_KEYS; i++) {
        bits |= (unsigned) (_mm256_movemask_ps(c[i][0]) != 0) << 2 * i;
        bits |= (unsigned) (_mm256_movemask_ps(c[i][1]) != 0) << (2 * i + 1);
    }
    return bits;
}

// The sum of the squares of v [d] in double, in any order: float32 squares are exact in
// double, and d <= 256 of them summed are within 2^-45 of the exact sum
__attribute__((target("avx2,fma"), always_inline)) static inline double edgekv_sumsq256(const float * v, int64_t d) {
    __m256d a = _mm256_setzero_pd();
    int64_t k = 0;
    for (; k + 4 <= d; k += 4) {
        const __m256d w = _mm256_cvtps_pd(_mm_loadu_ps(v + k));
        a = _mm256_fmadd_pd(w, w, a);
    }
    double l[4];
    _mm256_storeu_pd(l, a);
    double n2 = (l[0] + l[1]) + (l[2] + l[3]);
    for (; k < d; k++) {
        n2 += (double) v[k] * v[k];
    }
    return n2;
}

// edgekv_fold_lanes for lanes without a NaN (the scalar fold takes the others, so that
// NaNs fall as they always did), in two 8-lane halves
__attribute__((target("avx2"), always_inline)) static inline void edgekv_fold_lanes256(const edgekv_lanes * s,
                                                                                      float * top, float * second,
                                                                                      int32_t * arg) {
    const __m256 t0 = _mm256_loadu_ps(s->top), t1 = _mm256_loadu_ps(s->top + 8);
    const __m256 s0 = _mm256_loadu_ps(s->second), s1 = _mm256_loadu_ps(s->second + 8);
    const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(t0, s0, _CMP_UNORD_Q), _mm256_cmp_ps(t1, s1, _CMP_UNORD_Q));
    if (_mm256_movemask_ps(nan) != 0) {
        edgekv_fold_lanes(s, top, second, arg);
        return;
    }
    __m256 m = _mm256_max_ps(t0, t1);  // the largest top, in every lane
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
    const __m256i big = _mm256_set1_epi32(INT32_MAX);
    const __m256i a0 = _mm256_loadu_si256((const __m256i *) s->arg), a1 = _mm256_loadu_si256((const __m256i *) (s->arg + 8));
    // of the lanes at the largest top, the lowest prototype
    __m256i b = _mm256_min_epi32(_mm256_blendv_epi8(big, a0, _mm256_castps_si256(_mm256_cmp_ps(t0, m, _CMP_EQ_OQ))),
                                 _mm256_blendv_epi8(big, a1, _mm256_castps_si256(_mm256_cmp_ps(t1, m, _CMP_EQ_OQ))));
    b = _mm256_min_epi32(b, _mm256_permute2x128_si256(b, b, 1));
    b = _mm256_min_epi32(b, _mm256_shuffle_epi32(b, 0x4E));
    b = _mm256_min_epi32(b, _mm256_shuffle_epi32(b, 0xB1));
    const int32_t best_arg = _mm256_cvtsi256_si32(b);
    // the first such lane, as the scalar scan
    const unsigned hits = (unsigned) _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(t0, m, _CMP_EQ_OQ),
                                                                      _mm256_castsi256_ps(_mm256_cmpeq_epi32(a0, b)))) |
                          (unsigned) _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(t1, m, _CMP_EQ_OQ),
                                                                      _mm256_castsi256_ps(_mm256_cmpeq_epi32(a1, b)))) << 8;
    const int best = __builtin_ctz(hits);
    float others[16];
    _mm256_storeu_ps(others, t0);
    _mm256_storeu_ps(others + 8, t1);
    *top = others[best];
    others[best] = -INFINITY;
    __m256 o = _mm256_max_ps(_mm256_max_ps(s0, s1), _mm256_max_ps(_mm256_loadu_ps(others), _mm256_loadu_ps(others + 8)));
    o = _mm256_max_ps(o, _mm256_permute2f128_ps(o, o, 1));
    o = _mm256_max_ps(o, _mm256_shuffle_ps(o, o, 0x4E));
    o = _mm256_max_ps(o, _mm256_shuffle_ps(o, o, 0xB1));
    *second = _mm256_cvtss_f32(o);
    *arg = best_arg;
}

// edgekv_update512 on 8 lanes: v above the lane's top (ordered) takes its place, the old
// top becomes second; otherwise second = max(second, v), a NaN v included
__attribute__((target("avx2"), always_inline)) static inline float edgekv_update256(__m256 v, __m256i idx, float * top,
                                                                                   float * second, int32_t * arg) {
    const __m256 t = _mm256_loadu_ps(top), s = _mm256_loadu_ps(second);
    const __m256 a = _mm256_loadu_ps((const float *) arg);
    const __m256 gt = _mm256_cmp_ps(v, t, _CMP_GT_OQ);
    _mm256_storeu_ps(second, _mm256_blendv_ps(_mm256_max_ps(s, v), t, gt));
    _mm256_storeu_ps(top, _mm256_blendv_ps(t, v, gt));
    _mm256_storeu_ps((float *) arg, _mm256_blendv_ps(a, _mm256_castsi256_ps(idx), gt));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // the largest, for the bound
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}


// Up to six keys (xs[0..m-1]) against the 8 prototypes at P (channel k at P + k * ld), in
// two chains a key (even and odd channels): the keys that passed one group's screen,
// gathered from the block, so that each load of P serves them all
#define EDGEKV_GROUP256(i)                                                                  \
    if (m > (i)) {                                                                          \
        a##i = _mm256_fmadd_ps(_mm256_broadcast_ss(x##i + k), p0, a##i);                    \
        b##i = _mm256_fmadd_ps(_mm256_broadcast_ss(x##i + k + 1), p1, b##i);                \
    }
#define EDGEKV_GROUP1(i)                                                                    \
    if (m > (i)) {                                                                          \
        a##i = _mm256_fmadd_ps(_mm256_broadcast_ss(x##i + k), p0, a##i);                    \
    }
__attribute__((target("avx2,fma"), always_inline)) static inline void edgekv_group256(
        const float * const xs[EDGEKV_TILE2_KEYS], const int m, int64_t d, const float * P, int64_t ld,
        __m256 out[EDGEKV_TILE2_KEYS]) {
    const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3], *x4 = xs[4], *x5 = xs[5];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    int64_t k = 0;
    for (; k + 2 <= d; k += 2) {
        const __m256 p0 = _mm256_loadu_ps(P + k * ld), p1 = _mm256_loadu_ps(P + (k + 1) * ld);
        EDGEKV_GROUP256(0)
        EDGEKV_GROUP256(1)
        EDGEKV_GROUP256(2)
        EDGEKV_GROUP256(3)
        EDGEKV_GROUP256(4)
        EDGEKV_GROUP256(5)
    }
    if (k < d) {  // an odd channel count's last channel, on the first chain
        const __m256 p0 = _mm256_loadu_ps(P + k * ld);
        EDGEKV_GROUP1(0)
        EDGEKV_GROUP1(1)
        EDGEKV_GROUP1(2)
        EDGEKV_GROUP1(3)
        EDGEKV_GROUP1(4)
        EDGEKV_GROUP1(5)
    }
    out[0] = _mm256_add_ps(a0, b0), out[1] = _mm256_add_ps(a1, b1), out[2] = _mm256_add_ps(a2, b2);
    out[3] = _mm256_add_ps(a3, b3), out[4] = _mm256_add_ps(a4, b4), out[5] = _mm256_add_ps(a5, b5);
}

// edgekv_group256 with m a constant in each call, so that each count gets its own loop
__attribute__((target("avx2,fma"))) static void edgekv_groups256(const float * const xs[EDGEKV_TILE2_KEYS], int m,
                                                                 int64_t d, const float * P, int64_t ld,
                                                                 __m256 out[EDGEKV_TILE2_KEYS]) {
    switch (m) {
        case 1: edgekv_group256(xs, 1, d, P, ld, out); break;
        case 2: edgekv_group256(xs, 2, d, P, ld, out); break;
        case 3: edgekv_group256(xs, 3, d, P, ld, out); break;
        case 4: edgekv_group256(xs, 4, d, P, ld, out); break;
        case 5: edgekv_group256(xs, 5, d, P, ld, out); break;
        default: edgekv_group256(xs, 6, d, P, ld, out); break;
    }
}

// A key's products with one group of 8 prototypes (h: the half's first or second) into its
// lanes, and its best so far (lb) and screen threshold (thr) raised
__attribute__((target("avx2"), always_inline)) static inline void edgekv_take256(__m256 v, __m256i idx, edgekv_lanes * s,
                                                                                int h, float * lb, float * thr, float cut) {
    const float best = edgekv_update256(v, idx, s->top + 8 * h, s->second + 8 * h, s->arg + 8 * h);
    if (best > *lb) {
        *lb = best;
        *thr = best - cut;
    }
}

// Lanes 0..7 set where prototype j + lane exists (columns past c score -inf)
__attribute__((target("avx2"), always_inline)) static inline __m256 edgekv_valid256(int64_t j, int64_t c) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t) (c - j)), lane));
}

__attribute__((target("avx2,fma"))) static bool edgekv_best_two_avx2(const float * x, int64_t n, int64_t d,
                                                                    const float * pt, int64_t c, int64_t cp,
                                                                    struct edgekv_screen * sc, float * top,
                                                                    float * second, int32_t * arg) {
    const int64_t r = sc->r;
    const int64_t rw = r <= 16 ? 16 : 32;  // the rotated rows' width: whole 16-column tiles
    edgekv_lanes st[EDGEKV_BLOCK2];
    float lb[EDGEKV_BLOCK2], rest_x[EDGEKV_BLOCK2], cut[EDGEKV_BLOCK2];
    float thr[EDGEKV_BLOCK2];  // lb less cut: the screen's threshold
    // one allocation: the axes (rw columns, zeros past r), the keys of a block in the axes,
    // the prototypes in the axes (channel-major, like pt) and their rest norms
    const size_t floats = (size_t) d * rw + (size_t) EDGEKV_BLOCK2 * rw + (size_t) r * cp + cp + (size_t) (EDGEKV_TILE2_KEYS + 1) * d;
    float * axes = malloc(sizeof(float) * floats);
    if (axes == NULL) {
        return false;
    }
    float * xa = axes + d * rw;
    float * pa = xa + EDGEKV_BLOCK2 * rw;
    float * rest_p = pa + r * cp;
    float * cols = rest_p + cp;  // six prototypes' columns
    float * zero_row = cols + EDGEKV_TILE2_KEYS * d;  // stands in for a short tile's missing keys (read, never used)
    for (int64_t k = 0; k < d; k++) {
        for (int64_t a = 0; a < rw; a++) {
            axes[k * rw + a] = a < r ? sc->axes[k * r + a] : 0.0f;
        }
    }
    // A rotated row's error over its norm, as edgekv_best_two_avx512 has it
    const double rot = (double) (d + 1) * EDGEKV_EPS * sqrt((double) r) * 1.01;
    double pmax = 0.0;
    for (int64_t j0 = 0; j0 < cp; j0 += EDGEKV_TILE2_KEYS) {  // the prototypes in the axes, six at a time
        const float * cs[EDGEKV_TILE2_KEYS];
        for (int u = 0; u < EDGEKV_TILE2_KEYS; u++) {  // cp is a multiple of 32: the last six are short
            for (int64_t k = 0; k < d; k++) {
                cols[u * d + k] = j0 + u < cp ? pt[k * cp + j0 + u] : 0.0f;
            }
            cs[u] = cols + u * d;
        }
        float va[EDGEKV_TILE2_KEYS][32];
        for (int64_t h = 0; h < rw; h += 16) {
            __m256 acc[EDGEKV_TILE2_KEYS][2];
            edgekv_products256(cs, d, axes + h, rw, acc);
            for (int u = 0; u < EDGEKV_TILE2_KEYS; u++) {
                _mm256_storeu_ps(va[u] + h, acc[u][0]);
                _mm256_storeu_ps(va[u] + h + 8, acc[u][1]);
            }
        }
        for (int u = 0; u < EDGEKV_TILE2_KEYS && j0 + u < cp; u++) {
            const int64_t j = j0 + u;
            const double n2 = edgekv_sumsq256(cs[u], d) * (1.0 + 0x1p-40);
            for (int64_t a = 0; a < r; a++) {
                pa[a * cp + j] = va[u][a];
            }
            rest_p[j] = edgekv_rest_norm_of(n2, edgekv_sumsq256(va[u], r), rot);
            pmax = sqrt(n2) > pmax ? sqrt(n2) : pmax;
        }
    }
    pmax *= 1.0 + 0x1p-40;
    bool prune = true;
    int64_t blocks = 0;
    for (int64_t k = 0; k < d; k++) {
        zero_row[k] = 0.0f;
    }
    for (int64_t lo = 0; lo < n; lo += EDGEKV_BLOCK2, blocks++) {
        const int64_t nb = n - lo < EDGEKV_BLOCK2 ? n - lo : EDGEKV_BLOCK2;
        const int tiles = (int) ((nb + EDGEKV_TILE2_KEYS - 1) / EDGEKV_TILE2_KEYS);
        prune = prune || blocks % 8 == 0;  // tried again now and then
        int64_t live = 0, screened = 0;  // this block's halves
        for (int64_t i = 0; i < nb; i++) {
            lb[i] = thr[i] = -INFINITY;
            for (int l = 0; l < 16; l++) {
                st[i].top[l] = st[i].second[l] = -INFINITY;
                st[i].arg[l] = 0;
            }
        }
        for (int64_t i = nb; i < (int64_t) tiles * EDGEKV_TILE2_KEYS; i++) {  // a short tile's missing keys never pass
            rest_x[i] = 0.0f;
            thr[i] = INFINITY;
        }
        for (int t = 0; prune && t < tiles; t++) {  // each key in the axes: its rest norm and its cut
            const float * xs[EDGEKV_TILE2_KEYS];
            for (int u = 0; u < EDGEKV_TILE2_KEYS; u++) {
                const int64_t i = (int64_t) t * EDGEKV_TILE2_KEYS + u;
                xs[u] = i < nb ? x + (lo + i) * d : zero_row;
            }
            for (int64_t h = 0; h < rw; h += 16) {
                __m256 acc[EDGEKV_TILE2_KEYS][2];
                edgekv_products256(xs, d, axes + h, rw, acc);
                for (int u = 0; u < EDGEKV_TILE2_KEYS; u++) {
                    float * row = xa + ((int64_t) t * EDGEKV_TILE2_KEYS + u) * rw + h;
                    _mm256_storeu_ps(row, acc[u][0]);
                    _mm256_storeu_ps(row + 8, acc[u][1]);
                }
            }
            for (int u = 0; u < EDGEKV_TILE2_KEYS; u++) {
                const int64_t i = (int64_t) t * EDGEKV_TILE2_KEYS + u;
                if (i >= nb) {
                    break;
                }
                const double n2 = edgekv_sumsq256(xs[u], d) * (1.0 + 0x1p-40);
                rest_x[i] = edgekv_rest_norm_of(n2, edgekv_sumsq256(xa + i * rw, r), rot);
                // the slack: the screen's r-term sum and the bound's FMA ((r + 2) eps on at
                // most (1 + rot)^2 ||x|| ||p||), both rotations (2 rot), and a full product
                // against the best so far ((d + 4) eps), twice over
                const double slack = 2.0 * (((double) r + 2.0 + (double) d + 4.0) * EDGEKV_EPS + 2.0 * rot) * 1.03;
                cut[i] = (float) (slack * sqrt(n2) * pmax * (1.0 + 0x1p-20));
            }
        }
        // Prototypes in halves of 16 from where the block's own likely sit (ProtoKV's chunk
        // prototypes follow the cells): the first half computed whole sets each key's best
        // so far; the order does not change the answer (a tie is the caller's to decide)
        const int64_t j0 = prune ? (lo * c / n) / 16 * 16 : 0;
        const float * xs_all[EDGEKV_BLOCK2];  // the block's keys, and the screen's rows of them
        const float * as_all[EDGEKV_BLOCK2];
        for (int i = 0; i < tiles * EDGEKV_TILE2_KEYS; i++) {
            xs_all[i] = i < nb ? x + (lo + i) * d : zero_row;
            as_all[i] = i < nb ? xa + (int64_t) i * rw : zero_row;
        }
        for (int64_t jj = 0; jj < cp; jj += 16) {
            const int64_t j = (j0 + jj) % cp;
            const __m256 valid[2] = {edgekv_valid256(j, c), edgekv_valid256(j + 8, c)};
            const __m256i idx0 = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                  _mm256_set1_epi32((int32_t) j));
            const __m256i idx[2] = {idx0, _mm256_add_epi32(idx0, _mm256_set1_epi32(8))};
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            if (!prune || jj == 0) {  // the whole half, tile by tile in registers
                for (int t = 0; t < tiles; t++) {
                    const int i0 = t * EDGEKV_TILE2_KEYS;
                    const int rows = nb - i0 < EDGEKV_TILE2_KEYS ? (int) (nb - i0) : EDGEKV_TILE2_KEYS;
                    __m256 acc[EDGEKV_TILE2_KEYS][2];
                    edgekv_products256(xs_all + i0, d, pt + j, cp, acc);
                    for (int u = 0; u < rows; u++) {
                        for (int h = 0; h < 2; h++) {
                            edgekv_take256(_mm256_blendv_ps(ninf, acc[u][h], valid[h]), idx[h], &st[i0 + u], h,
                                           &lb[i0 + u], &thr[i0 + u], cut[i0 + u]);
                        }
                    }
                }
                continue;
            }
            // the screen, every tile: which 8-prototype groups may beat each key's best so far
            uint8_t pass[2][EDGEKV_BLOCK2];
            int n_pass[2] = {0, 0};
            for (int t = 0; t < tiles; t++) {
                const int i0 = t * EDGEKV_TILE2_KEYS;
                const int rows = nb - i0 < EDGEKV_TILE2_KEYS ? (int) (nb - i0) : EDGEKV_TILE2_KEYS;
                const unsigned bits = edgekv_screen256(as_all + i0, r, pa + j, cp, rest_x + i0, thr + i0,
                                                       _mm256_loadu_ps(rest_p + j), _mm256_loadu_ps(rest_p + j + 8),
                                                       j + 16 > c ? valid : NULL);
                screened += rows;
                for (int u = 0; bits != 0 && u < rows; u++) {
                    const unsigned b = bits >> 2 * u & 3;
                    live += b != 0;  // counted in 16-prototype halves, as the AVX-512 body
                    pass[0][n_pass[0]] = (uint8_t) (i0 + u);
                    n_pass[0] += (int) (b & 1);
                    pass[1][n_pass[1]] = (uint8_t) (i0 + u);
                    n_pass[1] += (int) (b >> 1);
                }
            }
            // the keys that passed, group by group, up to six a tile
            for (int h = 0; h < 2; h++) {
                for (int s = 0; s < n_pass[h]; s += EDGEKV_TILE2_KEYS) {
                    const int m = n_pass[h] - s < EDGEKV_TILE2_KEYS ? n_pass[h] - s : EDGEKV_TILE2_KEYS;
                    const float * xs[EDGEKV_TILE2_KEYS];
                    for (int u = 0; u < EDGEKV_TILE2_KEYS; u++) {
                        xs[u] = u < m ? xs_all[pass[h][s + u]] : zero_row;
                    }
                    __m256 g[EDGEKV_TILE2_KEYS];
                    edgekv_groups256(xs, m, d, pt + j + 8 * h, cp, g);
                    for (int u = 0; u < m; u++) {
                        const int i = pass[h][s + u];
                        edgekv_take256(_mm256_blendv_ps(ninf, g[u], valid[h]), idx[h], &st[i], h, &lb[i], &thr[i],
                                       cut[i]);
                    }
                }
            }
        }
        for (int64_t i = 0; i < nb; i++) {
            edgekv_fold_lanes256(&st[i], top + lo + i, second + lo + i, arg + lo + i);
        }
        if (prune) {
            sc->screened += screened;
            sc->passed += live;
        }
        prune = prune && 5 * live <= 2 * screened;
    }
    free(axes);
    return true;
}

// Expected Attention's logits: the covariance term x^T C x for every key and every query
// head of a KV head's group, over the matrices' upper triangles (w: C's diagonal, and C[i][j] +
// C[j][i] above it). That is d (d + 1) / 2 multiply-adds a key and matrix against
// numpy's d * d, and no [n, g * d] product written out and read back. A block of 24 keys
// is transposed so that each channel is three vectors of keys; the triangle's entries are
// broadcast, three matrices at a time: 9 accumulators whose chains each take one FMA a
// step (a block of 16 keys has only six, too few to cover the FMA's latency: 1.4x slower).
// Each row's chain runs over j ascending, then the rows' over i ascending, in float32.
// The mean term follows on the same transposed keys, in double.
#define EDGEKV_QUAD_VECS 3
#define EDGEKV_QUAD_KEYS (8 * EDGEKV_QUAD_VECS)
#define EDGEKV_QUAD_MATS 3

// Keys r0.. of a block (rows of d floats at rows[0..23]) into kt [d][24]: 8 x 8 transposes
// in registers, then the channels past a multiple of 8 one at a time.
__attribute__((target("avx2"))) static void edgekv_quad_transpose(const float * const rows[EDGEKV_QUAD_KEYS],
                                                                   int64_t d, float * kt) {
    const int64_t d8 = d & ~(int64_t) 7;
    for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
        const float * const * rv = rows + 8 * v;
        for (int64_t c = 0; c < d8; c += 8) {
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) {
                r[i] = _mm256_loadu_ps(rv[i] + c);
            }
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            // r[0..3] hold channels (0, 4), (1, 5), (2, 6), (3, 7) of rows 0..3, r[4..7] of rows 4..7
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(kt + (c + i) * EDGEKV_QUAD_KEYS + 8 * v, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                _mm256_storeu_ps(kt + (c + i + 4) * EDGEKV_QUAD_KEYS + 8 * v,
                                 _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
            }
        }
        for (int64_t c = d8; c < d; c++) {
            for (int i = 0; i < 8; i++) {
                kt[c * EDGEKV_QUAD_KEYS + 8 * v + i] = rv[i][c];
            }
        }
    }
}

// m (1..3) matrices' forms for the 24 keys of kt: w points at the first matrix's entry
// (0, 0), whose g matrices' entries are interleaved; out [m][24].
__attribute__((target("avx2,fma"), always_inline)) static inline void edgekv_quad_tile(const float * kt, int64_t d,
                                                                                      const float * w, int64_t g,
                                                                                      int m, float * out) {
    __m256 acc[EDGEKV_QUAD_MATS][EDGEKV_QUAD_VECS];
    for (int t = 0; t < EDGEKV_QUAD_MATS; t++) {
        for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
            acc[t][v] = _mm256_setzero_ps();
        }
    }
    const float * wi = w;
    for (int64_t i = 0; i < d; i++) {
        __m256 y[EDGEKV_QUAD_MATS][EDGEKV_QUAD_VECS];
        for (int t = 0; t < EDGEKV_QUAD_MATS; t++) {
            for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
                y[t][v] = _mm256_setzero_ps();
            }
        }
        const float * wr = wi;
        for (int64_t j = i; j < d; j++, wr += g) {
            __m256 k[EDGEKV_QUAD_VECS];
            for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
                k[v] = _mm256_loadu_ps(kt + j * EDGEKV_QUAD_KEYS + 8 * v);
            }
            for (int t = 0; t < EDGEKV_QUAD_MATS; t++) {
                if (t < m) {
                    const __m256 b = _mm256_broadcast_ss(wr + t);
                    for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
                        y[t][v] = _mm256_fmadd_ps(b, k[v], y[t][v]);
                    }
                }
            }
        }
        for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
            const __m256 ki = _mm256_loadu_ps(kt + i * EDGEKV_QUAD_KEYS + 8 * v);
            for (int t = 0; t < EDGEKV_QUAD_MATS; t++) {
                if (t < m) {
                    acc[t][v] = _mm256_fmadd_ps(ki, y[t][v], acc[t][v]);
                }
            }
        }
        wi += (d - i) * g;
    }
    for (int t = 0; t < m; t++) {
        for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
            _mm256_storeu_ps(out + t * EDGEKV_QUAD_KEYS + 8 * v, acc[t][v]);
        }
    }
}

// The mean term of m (1..3) query heads for the 24 keys of kt, in double: mu [g][d] from
// head h0, each key's products over the channels in order, a chain of FMAs.
__attribute__((target("avx2,fma"))) static void edgekv_mean_term(const float * kt, int64_t d, const double * mu,
                                                                int m, double * lin) {
    for (int t = 0; t < m; t++) {
        __m256d acc[2 * EDGEKV_QUAD_VECS];
        for (int v = 0; v < 2 * EDGEKV_QUAD_VECS; v++) {
            acc[v] = _mm256_setzero_pd();
        }
        for (int64_t j = 0; j < d; j++) {
            const __m256d b = _mm256_broadcast_sd(mu + t * d + j);
            for (int v = 0; v < EDGEKV_QUAD_VECS; v++) {
                const __m256 k = _mm256_loadu_ps(kt + j * EDGEKV_QUAD_KEYS + 8 * v);
                acc[2 * v] = _mm256_fmadd_pd(b, _mm256_cvtps_pd(_mm256_castps256_ps128(k)), acc[2 * v]);
                acc[2 * v + 1] = _mm256_fmadd_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(k, 1)), acc[2 * v + 1]);
            }
        }
        for (int v = 0; v < 2 * EDGEKV_QUAD_VECS; v++) {
            _mm256_storeu_pd(lin + t * EDGEKV_QUAD_KEYS + 4 * v, acc[v]);
        }
    }
}

__attribute__((target("avx2,fma"))) static void edgekv_expected_logits_avx2(const float * x, int64_t n, int64_t d,
                                                                           const double * mu, const float * w,
                                                                           int64_t g, double c1, double c2,
                                                                           float * kt, float * pad, double * logits) {
    float quad[EDGEKV_QUAD_MATS * EDGEKV_QUAD_KEYS];
    double lin[EDGEKV_QUAD_MATS * EDGEKV_QUAD_KEYS];
    const float * rows[EDGEKV_QUAD_KEYS];
    for (int64_t r0 = 0; r0 < n; r0 += EDGEKV_QUAD_KEYS) {
        const int mk = n - r0 < EDGEKV_QUAD_KEYS ? (int) (n - r0) : EDGEKV_QUAD_KEYS;
        for (int r = 0; r < EDGEKV_QUAD_KEYS; r++) {
            rows[r] = r < mk ? x + (r0 + r) * d : pad;  // the last block's missing keys: zeros
        }
        edgekv_quad_transpose(rows, d, kt);
        for (int64_t h0 = 0; h0 < g; h0 += EDGEKV_QUAD_MATS) {
            const int m = g - h0 < EDGEKV_QUAD_MATS ? (int) (g - h0) : EDGEKV_QUAD_MATS;
            if (m == 3) {  // constant counts, so that the tile's loops unroll
                edgekv_quad_tile(kt, d, w + h0, g, 3, quad);
            } else if (m == 2) {
                edgekv_quad_tile(kt, d, w + h0, g, 2, quad);
            } else {
                edgekv_quad_tile(kt, d, w + h0, g, 1, quad);
            }
            edgekv_mean_term(kt, d, mu + h0 * d, m, lin);
            for (int t = 0; t < m; t++) {
                double * out = logits + (h0 + t) * n + r0;
                for (int r = 0; r < mk; r++) {  // two roundings, as numpy's two passes (no contraction here)
                    const double a = c1 * lin[t * EDGEKV_QUAD_KEYS + r];
                    out[r] = a + c2 * (double) quad[t * EDGEKV_QUAD_KEYS + r];
                }
            }
        }
    }
}

#endif  // EDGEKV_X86

int32_t edgekv_kernel_isa(void) {
#ifdef EDGEKV_X86
    const char * cpu = getenv("EDGEKV_CPU");
    const bool avx2_only = cpu != NULL && strcmp(cpu, "avx2") == 0;  // as an AVX2-only CPU would
    __builtin_cpu_init();
    if (!avx2_only && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")) {
        return EDGEKV_KERNEL_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return EDGEKV_KERNEL_AVX2;
    }
#endif
    return EDGEKV_KERNEL_UNSUPPORTED;
}

int32_t edgekv_best_two(const float * x, int64_t n, int64_t d, const float * pt, int64_t c, int64_t cp,
                        struct edgekv_screen * screen, float * top, float * second, int32_t * arg) {
    if (n < 0 || d < 1 || c < 1 || cp < c || cp % 32 != 0 || c > INT32_MAX) {
        return EDGEKV_KERNEL_BAD_ARGS;
    }
    if (screen != NULL && (screen->r < 4 || screen->r % 4 != 0 || screen->r > 32 || screen->r > d || d > 256 || screen->axes == NULL)) {
        return EDGEKV_KERNEL_BAD_ARGS;
    }

    const int32_t isa = edgekv_kernel_isa();
#ifdef EDGEKV_X86
    if (isa == EDGEKV_KERNEL_AVX512) {
        return edgekv_best_two_avx512(x, n, d, pt, c, cp, screen, top, second, arg) ? isa : EDGEKV_KERNEL_NO_MEMORY;
    }
    if (isa == EDGEKV_KERNEL_AVX2 && screen != NULL) {
        return edgekv_best_two_avx2(x, n, d, pt, c, cp, screen, top, second, arg) ? isa : EDGEKV_KERNEL_NO_MEMORY;
    }
#endif
    (void) x; (void) pt; (void) top; (void) second; (void) arg;
    return EDGEKV_KERNEL_UNSUPPORTED;  // no AVX-512, and no screen or no AVX2: numpy's BLAS
}

int32_t edgekv_irregularity(const float * x, int64_t n, int64_t d, const int64_t * bounds, int64_t n_chunks,
                            double * delta) {
    if (n < 0 || d < 1 || n_chunks < 1 || bounds[0] != 0 || bounds[n_chunks] != n) {
        return EDGEKV_KERNEL_BAD_ARGS;
    }
    for (int64_t i = 0; i < n_chunks; i++) {
        if (bounds[i + 1] <= bounds[i]) {
            return EDGEKV_KERNEL_BAD_ARGS;
        }
    }
    const int32_t isa = edgekv_kernel_isa();
    if (d < 8 || d > 128) {  // numpy sums other lengths in other orders: the numba pass serves
        return EDGEKV_KERNEL_UNSUPPORTED;
    }
#ifdef EDGEKV_X86
    if (isa == EDGEKV_KERNEL_AVX512 || isa == EDGEKV_KERNEL_AVX2) {
        double * buf = malloc(sizeof(double) * 2 * d);
        if (buf == NULL) {
            return EDGEKV_KERNEL_NO_MEMORY;
        }
        if (isa == EDGEKV_KERNEL_AVX512) {
            edgekv_irregularity_avx512(x, d, bounds, n_chunks, buf, buf + d, delta);
        } else {
            edgekv_irregularity_avx2(x, d, bounds, n_chunks, buf, buf + d, delta);
        }
        free(buf);
        return isa;
    }
#endif
    (void) x; (void) delta;
    return EDGEKV_KERNEL_UNSUPPORTED;
}

int32_t edgekv_expected_logits(const float * x, int64_t n, int64_t d, const double * mu, const float * w, int64_t g,
                               double c1, double c2, double * logits) {
    if (n < 0 || d < 1 || g < 1) {
        return EDGEKV_KERNEL_BAD_ARGS;
    }
#ifdef EDGEKV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {  // AVX-512 CPUs run it too
        float * kt = malloc(sizeof(float) * (size_t) d * EDGEKV_QUAD_KEYS);
        float * pad = calloc((size_t) d, sizeof(float));
        if (kt == NULL || pad == NULL) {
            free(kt);
            free(pad);
            return EDGEKV_KERNEL_NO_MEMORY;
        }
        edgekv_expected_logits_avx2(x, n, d, mu, w, g, c1, c2, kt, pad, logits);
        free(kt);
        free(pad);
        return EDGEKV_KERNEL_AVX2;
    }
#endif
    (void) x; (void) mu; (void) w; (void) c1; (void) c2; (void) logits;
    return EDGEKV_KERNEL_UNSUPPORTED;
}
