// Host kernels for edgekv's methods that need no llama.cpp: they run over numpy arrays on
// either engine. Each runs where the CPU has AVX-512 (checked per call); elsewhere, and
// under EDGEKV_CPU=avx2 (as an AVX2-only CPU would), a call returns
// EDGEKV_KERNEL_UNSUPPORTED and the caller keeps its numpy path. An AVX2 body of
// edgekv_best_two (6 keys by 16 prototypes) ran at 58 GFLOP/s on the Xeon, slower than
// numpy's BLAS products there, so AVX2 CPUs keep the BLAS.

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
// inner loop then broadcasts them from one pointer that steps by a row.
static void edgekv_transpose_keys(const float * x, int64_t d, int r, float * xt) {
    for (int64_t k = 0; k < d; k++) {
        for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
            xt[k * EDGEKV_TILE_KEYS + i] = i < r ? x[i * d + k] : 0.0f;
        }
    }
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

// What a tile needs to skip prototypes (edgekv_best_two's doc): the first r channels of
// the keys and prototypes in the keys' principal axes (xat: this tile's, channel-major;
// pat [r, cp]), bounds on what the other channels can add (rest_x, rest_p), the rounding
// (slack), and each key's best product so far (lb).
typedef struct {
    int64_t r;
    const float * xat;     // [r][EDGEKV_TILE_KEYS]
    const float * pat;     // [r][cp]
    const float * rest_x;  // [keys of the tile]
    const float * rest_p;  // [cp]
    const float * slack;   // [keys of the tile]
    float * lb;            // [keys of the tile]
    int64_t * live;        // += the 16-prototype halves computed
} edgekv_prune;

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

// One tile of keys against 32 prototypes from j on: every product (pr NULL), or only those
// of the 16-prototype halves where some prototype may beat the key's best so far
__attribute__((target("avx512f"), always_inline)) static inline void edgekv_tile512(const float * xt, int64_t d, int rows,
                                                                      const float * pt, int64_t cp, int64_t j,
                                                                      int64_t c, edgekv_lanes * st,
                                                                      const edgekv_prune * pr) {
    __m512 acc[EDGEKV_TILE_KEYS][2];
    if (pr == NULL) {
        edgekv_products512(xt, d, pt + j, cp, acc);
    } else {  // the screen: the first r channels in the principal axes
        edgekv_products512(pr->xat, pr->r, pr->pat + j, cp, acc);
    }
    __mmask16 live[EDGEKV_TILE_KEYS][2];
    int n_live = 2 * rows;
    if (pr != NULL) {
        // a product's upper bound: its screen plus ||x's rest|| ||p's rest||. Below the key's
        // best so far less slack, the prototype cannot be the key's best, nor matter to the
        // caller's check of the best. Not below (a NaN included): its product is computed.
        const __m512 rp0 = _mm512_loadu_ps(pr->rest_p + j), rp1 = _mm512_loadu_ps(pr->rest_p + j + 16);
        n_live = 0;
#pragma GCC unroll 12
        for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
            const __m512 rx = _mm512_set1_ps(i < rows ? pr->rest_x[i] : 0.0f);
            const __m512 thr = _mm512_set1_ps(i < rows ? pr->lb[i] - pr->slack[i] : INFINITY);
            live[i][0] = _mm512_cmp_ps_mask(_mm512_fmadd_ps(rx, rp0, acc[i][0]), thr, _CMP_NLT_UQ);
            live[i][1] = _mm512_cmp_ps_mask(_mm512_fmadd_ps(rx, rp1, acc[i][1]), thr, _CMP_NLT_UQ);
            n_live += (live[i][0] != 0) + (live[i][1] != 0);
        }
        *pr->live += n_live;
        if (n_live > EDGEKV_DENSE_HALVES) {  // cheaper as a whole tile, in registers
            edgekv_products512(xt, d, pt + j, cp, acc);
        }
    } else {
        for (int i = 0; i < EDGEKV_TILE_KEYS; i++) {
            live[i][0] = live[i][1] = i < rows ? (__mmask16) 0xFFFF : 0;
        }
    }
    const bool each = pr != NULL && n_live <= EDGEKV_DENSE_HALVES;  // a survivor's products on its own
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

__attribute__((target("avx512f"))) static bool edgekv_best_two_avx512(const float * x, int64_t n, int64_t d,
                                                                       const float * pt, int64_t c, int64_t cp,
                                                                       int64_t r, const float * xa, const float * pat,
                                                                       const float * rest_x, const float * rest_p,
                                                                       const float * slack, float * top, float * second,
                                                                       int32_t * arg) {
    const int block = EDGEKV_TILES * EDGEKV_TILE_KEYS;
    edgekv_lanes st[EDGEKV_TILES * EDGEKV_TILE_KEYS];
    float lb[EDGEKV_TILES * EDGEKV_TILE_KEYS];
    float * xt = malloc(sizeof(float) * block * (d + r));
    if (xt == NULL) {
        return false;
    }
    float * xat = xt + block * d;
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
            if (prune) {
                edgekv_transpose_keys(xa + (lo + t * EDGEKV_TILE_KEYS) * r, r, rows, xat + t * EDGEKV_TILE_KEYS * r);
            }
        }
        for (int64_t i = 0; i < nb; i++) {
            lb[i] = -INFINITY;
            for (int l = 0; l < 16; l++) {
                st[i].top[l] = -INFINITY;
                st[i].second[l] = -INFINITY;
                st[i].arg[l] = 0;
            }
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
                const int64_t k0 = lo + t * EDGEKV_TILE_KEYS;
                const edgekv_prune pr = {r, xat + t * EDGEKV_TILE_KEYS * r, pat, prune ? rest_x + k0 : NULL, rest_p,
                                         prune ? slack + k0 : NULL, lb + t * EDGEKV_TILE_KEYS, &live};
                edgekv_tile512(xt + t * EDGEKV_TILE_KEYS * d, d, rows, pt, cp, j, c, st + t * EDGEKV_TILE_KEYS,
                               prune ? &pr : NULL);
            }
        }
        for (int64_t i = 0; i < nb; i++) {
            edgekv_fold_lanes(&st[i], top + lo + i, second + lo + i, arg + lo + i);
        }
        // the block's first tile of prototypes is computed whole (no best so far): not counted
        prune = prune && 5 * (live - 2 * nb) <= 2 * nb * (cp / 32 - 1);
    }
    free(xt);
    return true;
}


// numpy's pairwise sum of the n float64 numbers at p, for 8 <= n <= 128 (one of numpy's
// blocks): eight interleaved partial sums (lane j of one vector adds p[j], p[j + 8], ...),
// then ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest in order.
__attribute__((target("avx512f"))) static inline double edgekv_np_block_sum(const double * p, int n) {
    __m512d r = _mm512_loadu_pd(p);
    int m = 8;
    for (; m + 8 <= n; m += 8) {
        r = _mm512_add_pd(r, _mm512_loadu_pd(p + m));
    }
    double l[8];
    _mm512_storeu_pd(l, r);
    double s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; m < n; m++) {
        s += p[m];
    }
    return s;
}

__attribute__((target("avx512f"))) static void edgekv_irregularity_avx512(const float * x, int64_t d,
                                                                           const int64_t * bounds, int64_t n_chunks,
                                                                           double * mu, double * acc, double * delta) {
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
        const double spread = sqrt(edgekv_np_block_sum(acc, (int) d) / size);  // ||sigma||
        for (int64_t k = 0; k < d; k++) {  // acc is free again: mu's squares
            acc[k] = mu[k] * mu[k];
        }
        const double mu_norm = sqrt(edgekv_np_block_sum(acc, (int) d));
        for (int64_t t = lo; t < hi; t++) {  // the row's squared norm and its product with mu, side by side
            const float * row = x + t * d;
            __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(row));
            const __m512d m0 = _mm512_loadu_pd(mu);
            __m512d sq = _mm512_mul_pd(v, v);
            __m512d dot = _mm512_mul_pd(v, m0);
            int64_t k = 8;
            for (; k + 8 <= d; k += 8) {
                v = _mm512_cvtps_pd(_mm256_loadu_ps(row + k));
                sq = _mm512_add_pd(sq, _mm512_mul_pd(v, v));
                dot = _mm512_add_pd(dot, _mm512_mul_pd(v, _mm512_loadu_pd(mu + k)));
            }
            double a[8], b[8];
            _mm512_storeu_pd(a, sq);
            _mm512_storeu_pd(b, dot);
            double ssq = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
            double sdot = ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
            for (; k < d; k++) {
                ssq += (double) row[k] * (double) row[k];
                sdot += (double) row[k] * mu[k];
            }
            const double den = sqrt(ssq) * mu_norm;
            const double cos = den > 0 ? sdot / den : 0.0;
            delta[t] = spread > 0 ? (1.0 - cos) / spread : 0.0;
        }
    }
}

#endif  // EDGEKV_X86

int32_t edgekv_kernel_isa(void) {
#ifdef EDGEKV_X86
    const char * cpu = getenv("EDGEKV_CPU");
    const bool avx2_only = cpu != NULL && strcmp(cpu, "avx2") == 0;  // as an AVX2-only CPU would
    __builtin_cpu_init();
    if (!avx2_only && __builtin_cpu_supports("avx512f")) {
        return EDGEKV_KERNEL_AVX512;
    }
#endif
    return EDGEKV_KERNEL_UNSUPPORTED;
}

int32_t edgekv_best_two(const float * x, int64_t n, int64_t d, const float * pt, int64_t c, int64_t cp, int64_t r,
                        const float * xa, const float * pat, const float * rest_x, const float * rest_p,
                        const float * slack, float * top, float * second, int32_t * arg) {
    if (n < 0 || d < 1 || c < 1 || cp < c || cp % 32 != 0 || c > INT32_MAX || r < 0 ||
        (r > 0 && (xa == NULL || pat == NULL || rest_x == NULL || rest_p == NULL || slack == NULL))) {
        return EDGEKV_KERNEL_BAD_ARGS;
    }
    const int32_t isa = edgekv_kernel_isa();
#ifdef EDGEKV_X86
    if (isa == EDGEKV_KERNEL_AVX512) {
        return edgekv_best_two_avx512(x, n, d, pt, c, cp, r, xa, pat, rest_x, rest_p, slack, top, second, arg) ? isa
                                                                                                 : EDGEKV_KERNEL_NO_MEMORY;
    }
#endif
    (void) x; (void) pt; (void) xa; (void) pat; (void) rest_x; (void) rest_p; (void) slack; (void) top; (void) second; (void) arg;
    return isa;
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
    if (isa == EDGEKV_KERNEL_AVX512) {
        double * buf = malloc(sizeof(double) * 2 * d);
        if (buf == NULL) {
            return EDGEKV_KERNEL_NO_MEMORY;
        }
        edgekv_irregularity_avx512(x, d, bounds, n_chunks, buf, buf + d, delta);
        free(buf);
        return isa;
    }
#endif
    (void) x; (void) delta;
    return isa;
}
