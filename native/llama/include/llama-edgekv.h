// edgekv extensions to llama.cpp: KV-sequence compaction, merging with a log-count
// attention bias, K/V read and attention scoring, run where the cache lives.
// edgekv copies this file into llama.cpp (native/build_llama.py); stock builds lack it.
//
// The ops work on one sequence of a unified, single-stream KV cache (llama_kv_cache)
// whose used cells all belong to that sequence. Per-(layer, KV head) arrays index the
// sequence's cells by ordinal: 0..n-1 in cell order, the order of llama.cpp's own
// per-sequence state blob. Layers are the cache's layers in model order.
// Every call returns LLAMA_EDGEKV_OK or a negative error code and leaves the cache
// untouched on error.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Version of the edgekv patch set compiled into this libllama. Callers use the
// presence of this symbol to choose the native engine over the state engine.
//   1: entry point only
//   2: info, cells, compact, merge, log-count bias, read, score
//   3: llama.cpp's naming (llama_edgekv_seq_<verb> for per-sequence ops), status enum
//   4: llama_edgekv_seq_score scores only the layers it is given
//   5: llama_edgekv_seq_key_sqnorms
//   6: llama_edgekv_seq_read reads a run of layers in one graph
//   7: llama_edgekv_seq_lag_scores
//   8: llama_edgekv_seq_lag_scores and llama_edgekv_seq_read (asked to) undo llama.cpp's
//      Hadamard rotation of a quantised cache
//   9: llama_edgekv_seq_merge can round with ggml's reference quantisers (reference)
//  10: llama_edgekv_seq_value_norms
//  11: llama_edgekv_shift_apply
#define LLAMA_EDGEKV_API_VERSION 11

// what every op returns: LLAMA_EDGEKV_OK (or a count, where documented) or an error
enum llama_edgekv_status {
    LLAMA_EDGEKV_OK              =  0,
    LLAMA_EDGEKV_ERR_UNSUPPORTED = -1, // cache kind the ops do not handle (iSWA, recurrent, several streams, shared cells, pending shift, uneven heads)
    LLAMA_EDGEKV_ERR_ARG         = -2, // argument out of range (index, count, position)
    LLAMA_EDGEKV_ERR_COMPUTE     = -3, // the ggml graph could not be allocated or computed
    LLAMA_EDGEKV_ERR_TYPE        = -4, // cache type whose rows the op cannot move or convert
    LLAMA_EDGEKV_ERR_BACKEND     = -5, // the cache's backend cannot run an op that writes into it (supports_op)
};

LLAMA_API int32_t llama_edgekv_api_version(void);

// Shape of the cache: n_layer cache layers, n_head_kv KV heads per layer,
// head sizes of K and V, kv_size cells. Any pointer may be NULL.
LLAMA_API int32_t llama_edgekv_cache_info(
        struct llama_context * ctx,
                     int32_t * n_layer,
                     int32_t * n_head_kv,
                     int32_t * n_embd_head_k,
                     int32_t * n_embd_head_v,
                     int32_t * kv_size);

// Number of cells of seq_id (>= 0) or a negative error code; fills pos[0..min(n, cap))
// with their positions when pos is not NULL.
LLAMA_API int32_t llama_edgekv_seq_cells(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                   llama_pos * pos,
                     int32_t   cap);

// Compaction: for every (layer l, head h), keep[(l*n_head_kv + h)*n_keep + j] is the
// ordinal of the cell whose K and V rows move to cell j; the bytes move unchanged
// (quantised rows are not re-quantised). Cells 0..n_keep-1 then hold the sequence at
// positions pos[0..n_keep), strictly increasing; every other cell is freed. The
// log-count bias moves with its rows.
LLAMA_API int32_t llama_edgekv_seq_compact(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                     int32_t   n_keep,
               const int32_t * keep,
             const llama_pos * pos);

// Merge: for every (layer, head) and each of n_group groups of up to n_member cells
// (members[((l*n_head_kv + h)*n_group + g)*n_member + m], ordinals, -1 = unused),
// the K and V rows become the weights-weighted average of the members (weights are
// normalised per group) and are written to the group's first member, re-quantised to
// the cache type. That cell's log-count bias becomes log(sum over members of
// exp(bias)), so it carries the attention weight of every token it stands for. The
// other members are left as they are: compact them away afterwards. Enables the bias.
// Quantised rows are rounded as the backend's set_rows rounds them or, with reference, by
// ggml's reference quantiser (the type's from_float_ref, what ggml_quantize_chunk writes
// and what a host-side edit of the state blob writes). Only a cache in host memory can
// round with the reference: elsewhere a quantised cache gets LLAMA_EDGEKV_ERR_UNSUPPORTED.
LLAMA_API int32_t llama_edgekv_seq_merge(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                     int32_t   n_group,
                     int32_t   n_member,
               const int32_t * members,
                 const float * weights,
                        bool   reference);

// Log-count bias: once enabled, attention (flash and non-flash) adds bias[l][h][cell]
// to the logits of KV head h in layer l. New tokens get 0. The bias is not part of
// llama.cpp's state blob: save it with _get and put it back with _set.
LLAMA_API int32_t llama_edgekv_bias_enable (struct llama_context * ctx);
LLAMA_API bool    llama_edgekv_bias_enabled(struct llama_context * ctx);

// bias[(l*n_head_kv + h)*n + i] for the n cells of seq_id (zeros while the bias is off)
LLAMA_API int32_t llama_edgekv_seq_bias_get(struct llama_context * ctx, llama_seq_id seq_id,       float * bias, int32_t n);
LLAMA_API int32_t llama_edgekv_seq_bias_set(struct llama_context * ctx, llama_seq_id seq_id, const float * bias, int32_t n);

// Read the K and V rows of seq_id's n cells as F32 for the n_layers layers from il on, in
// one graph: k[((l*n_head_kv + h)*n + i)*n_embd_head_k + d], l counted from il. k or v may be
// NULL. A quantised cache that llama.cpp Hadamard-rotates is returned as stored (rotated), or,
// with unrotate, as the model computed it: each block unrotated by float64 Walsh-Hadamard
// butterflies, times 1/sqrt(block), rounded once to float (edgekv's reference recipe).
LLAMA_API int32_t llama_edgekv_seq_read(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                     int32_t   il,
                     int32_t   n_layers,
                       float * k,
                       float * v,
                     int32_t   n,
                        bool   unrotate);

// Attention scores on the device: for every layer l and KV head h, out[(l*n_head_kv + h)*n + i]
// is the sum over the n_q queries and the query heads of the group of
// softmax_i(kq_scale * q.k_i + bias_i), causal by position (cell i is seen by query t when
// pos_i <= q_pos[t]). q[((l*n_head + qh)*n_q + t)*n_embd_head_k + d] holds n_head query heads
// per layer, in the cache's domain (rotated like K when llama.cpp rotates it).
// layers[0..n_layers-1] names the layers to score (NULL: all); the q and out rows of the
// other layers are neither read nor written, so a caller that reuses one layer's
// selection for the next ones does not pay for scoring them.
LLAMA_API int32_t llama_edgekv_seq_score(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                     int32_t   n_head,
                     int32_t   n_q,
                 const float * q,
             const llama_pos * q_pos,
                       float   kq_scale,
               const int32_t * layers,
                     int32_t   n_layers,
                       float * out,
                     int32_t   n);

// Squared L2 norms of every layer's keys, on the device: out[(l*n_head_kv + h)*n + i] is
// the sum over the head's channels of k*k for cell ordinal i, as stored (a rotated cache
// stays rotated: the rotation keeps the norm). One graph of get_rows, sqr and sum_rows for
// all layers. The CPU backend adds the float squares in channel order in double and rounds
// once to float (without Apple's Accelerate); other backends add in their own order, equal
// up to rounding.
LLAMA_API int32_t llama_edgekv_seq_key_sqnorms(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                       float * out,
                     int32_t   n);

// L2 norms of every layer's values where the cache is in host memory, without reading V
// out: out[(l*n_head_kv + h)*n + i] is the norm of cell ordinal i's value row for head h,
// as llama_edgekv_seq_read hands it out (F32, a quantised cache's rotation undone), in
// double: the float squares added as numpy adds a contiguous row (np.linalg.norm over a
// float64 copy: eight running sums per block of 128, halves above), then the square root.
// LLAMA_EDGEKV_ERR_UNSUPPORTED where the cache is not in host memory (read V instead).
LLAMA_API int32_t llama_edgekv_seq_value_norms(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                      double * out,
                     int32_t   n);

// LagKV's scores (arXiv:2504.04704, Eqs. 5-9) where the cache is in host memory, without
// reading K and V out: for every layer l, KV head h and group g < n_group,
//   out[((l*n_head_kv + h)*n_group + g)*width + w] = s_K + s_V
// for the cell ordinal members[((l*n_head_kv + h)*(n_group + 1) + g)*width + w], where s is the
// softmax over the group's members of the standard deviation (ddof 1) across a head's channels
// of the member's row, min-max normalised per channel by the members of group g + 1 (group
// n_group is a reference only). A group's members end at its first -1; padding scores
// -INFINITY, a group without a reference scores uniformly, a non-finite row scores 0.
// float64, in the order of edgekv's reference kernel, so the scores are the same doubles.
// Where llama.cpp Hadamard-rotates a quantised K or V, the rows are unrotated first, as
// edgekv's reference does it: fast Walsh-Hadamard butterflies in float64, times
// 1/sqrt(block), rounded once to float.
// LLAMA_EDGEKV_ERR_UNSUPPORTED where the cache is not in host memory (read K and V instead).
LLAMA_API int32_t llama_edgekv_seq_lag_scores(
        struct llama_context * ctx,
                llama_seq_id   seq_id,
                     int32_t   n_group,
                     int32_t   width,
               const int32_t * members,
                      double * out,
                     int32_t   n);

// Apply now what llama.cpp keeps pending for the cache until the next llama_decode: the
// re-rotation of K that llama_memory_seq_add (a context shift) asks for, by llama.cpp's own
// update, so the same bytes. The next decode then starts at once, and the per-sequence ops
// (which refuse a cache with a shift pending) serve again. 1 if an update ran, 0 if none
// was pending, LLAMA_EDGEKV_ERR_COMPUTE if it failed (a shift is then still pending).
LLAMA_API int32_t llama_edgekv_shift_apply(struct llama_context * ctx);

#ifdef __cplusplus
}
#endif
