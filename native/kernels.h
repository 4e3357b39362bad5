// edgekv's host kernels over numpy arrays (native/kernels.c), wrapped by cffi as
// edgekv._edgekv_kernels. They need no llama.cpp, so both engines use them.
#pragma once

#include <stdbool.h>
#include <stdint.h>

enum edgekv_kernel_status {
    EDGEKV_KERNEL_UNSUPPORTED = -1,  // not here (no AVX2, or a kernel AVX2 has no body for): numpy's path
    EDGEKV_KERNEL_BAD_ARGS    = -2,
    EDGEKV_KERNEL_NO_MEMORY   = -3,
    EDGEKV_KERNEL_AVX2        = 1,  // AVX2 with FMA (an AVX-512 CPU under EDGEKV_CPU=avx2)
    EDGEKV_KERNEL_AVX512      = 2,
};

// The instruction set a kernel call runs now: EDGEKV_KERNEL_AVX512 (AVX-512 with VNNI, not
// under EDGEKV_CPU=avx2), else EDGEKV_KERNEL_AVX2 (AVX2 with FMA), else
// EDGEKV_KERNEL_UNSUPPORTED.
int32_t edgekv_kernel_isa(void);

// For each row i of x [n, d] (float32, row-major): arg[i], the first of the c prototypes
// with the largest float32 product x_i . p_j, top[i] that product, and second[i] the
// largest product of the other prototypes (top[i] again on a tie). The prototypes come
// transposed and padded: pt [d, cp], row k holding channel k of prototypes 0..c-1, cp a
// multiple of 32 (the columns past c are never read as prototypes). The products are
// summed in any order, with FMAs: the caller bounds their rounding. pt must be finite
// (the caller checks); a row of x with a NaN or an infinity gets a top that is not finite,
// never a finite wrong answer. Returns the edgekv_kernel_status it ran with (> 0), or < 0.
// Without a screen it runs on AVX-512 only (on AVX2, numpy's BLAS products are as fast).
//
// With a screen (NULL: none), pairs are skipped. Its axes [d, r] (row-major) are the float32
// copy of r orthonormal columns (r a multiple of 4, 4 <= r <= 32, r <= d <= 256). Keys and
// prototypes in those axes give a product over r channels: on AVX-512 in bytes (vpdpbusd),
// on AVX2 in float32. It plus bounds on what the other channels, the bytes' errors and
// every rounding can add give an upper bound on each product. A prototype whose bound is below the row's best full product so
// far is left out of top, second and arg: it is below the row's best in exact arithmetic,
// so top and arg stand, and second still bounds every prototype that could be the best.
// Keys in their principal axes carry most of a product in the first channels (ProtoKV's
// keys at 8k cells, r = 32 of 64: about one 16-prototype half in a hundred passes the screen).
// The kernel adds the halves it screened and those that passed to screened and passed.
struct edgekv_screen {
    int64_t       r;
    const float * axes;
    int64_t       screened;
    int64_t       passed;
};

int32_t edgekv_best_two(const float * x, int64_t n, int64_t d, const float * pt, int64_t c, int64_t cp,
                        struct edgekv_screen * screen, float * top, float * second, int32_t * arg);

// ProtoKV's irregularity of each row of x [n, d] (float32) in its chunk (bounds[i] to
// bounds[i + 1], n_chunks chunks covering 0..n): (1 - cos(row, chunk mean)) / ||chunk std||,
// 0 where a norm or the spread is 0, into delta [n], float64. Every number is the one
// numpy computes (edgekv/methods/protokv.py, irregularity): sums in numpy's order,
// products rounded before they are added. Only for 8 <= d <= 128 (one numpy block);
// EDGEKV_KERNEL_UNSUPPORTED for other d. The same floats on AVX-512 and AVX2.
int32_t edgekv_irregularity(const float * x, int64_t n, int64_t d, const int64_t * bounds, int64_t n_chunks,
                            double * delta);

// Expected Attention's logits of every row x_i of x [n, d] (float32, row-major: one KV head's
// keys) for each of the g query heads of its group:
//   logits[h * n + i] = c1 * (mu_h . x_i) + c2 * (x_i^T C_h x_i),
// mu [g, d] in double, C_h by its upper triangle: w holds, for i = 0..d-1 and then
// j = i..d-1, the g entries of (i, j) (C_h[i][i] on the diagonal, C_h[i][j] + C_h[j][i]
// above it), d (d + 1) / 2 * g floats. The mean term sums in double over the channels in
// order; the quadratic form in float32, for each i w[i][j] x_j over j ascending, times x_i,
// added over i ascending; both with FMAs. Then the two products are rounded and added, as
// two numpy passes would. The same floats on every CPU it runs on (AVX2 with FMA, AVX-512
// CPUs included). Returns EDGEKV_KERNEL_AVX2, or < 0.
int32_t edgekv_expected_logits(const float * x, int64_t n, int64_t d, const double * mu, const float * w, int64_t g,
                               double c1, double c2, double * logits);
