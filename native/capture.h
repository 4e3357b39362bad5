// edgekv's tensor capture through llama.cpp's eval callback (see capture.c).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define EDGEKV_CAPTURE_MAX_NAMES 4
#define EDGEKV_CAPTURE_NAME_LEN  32

enum edgekv_capture_status {
    EDGEKV_CAPTURE_OK        =  0,
    EDGEKV_CAPTURE_ERR_ARG   = -1, // bad name, layer or handle
    EDGEKV_CAPTURE_ERR_TYPE  = -2, // a wanted tensor is not F32 with contiguous rows (summed: not a
                                   // one-stream F32 softmax whose mask is F32/F16 [n_kv, >= n_tokens])
    EDGEKV_CAPTURE_ERR_ALLOC = -3, // out of host memory
};

// the last evaluation of one (name, layer) in the current decode
struct edgekv_capture_slot {
    float * data;     // ne[0]*ne[1]*ne[2]*ne[3] floats, ne[0] fastest
    size_t  cap;
    int64_t ne[4];
    int32_t n_seen;   // evaluations since the last clear (0: not captured)
};

struct ggml_tensor;
struct edgekv_capture;

struct edgekv_capture * edgekv_capture_new(int32_t n_layer);
void    edgekv_capture_free(struct edgekv_capture * c);
// ask for (or stop asking for) tensor "<name>-<layer>"; at most EDGEKV_CAPTURE_MAX_NAMES names
int32_t edgekv_capture_want(struct edgekv_capture * c, const char * name, int32_t layer, bool on);
// the same, reduced: an attention softmax [n_kv, n_tokens, n_head] becomes a slot of
// [n_head + 1] rows of width >= n_kv: per head the sum over the decode's tokens (all its
// ubatches), then 1/0 per cell for what the mask lets the last token see (see capture.c)
int32_t edgekv_capture_want_sums(struct edgekv_capture * c, const char * name, int32_t layer, bool on);
// the ggml_backend_sched_eval_callback to pass as cb_eval, with the capture as cb_eval_user_data
bool    edgekv_capture_eval(struct ggml_tensor * t, bool ask, void * user_data);
const struct edgekv_capture_slot * edgekv_capture_get(const struct edgekv_capture * c, const char * name, int32_t layer);
void    edgekv_capture_clear(struct edgekv_capture * c);
int32_t edgekv_capture_status(const struct edgekv_capture * c);
