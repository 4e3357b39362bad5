// edgekv's tensor capture: a ggml eval callback (llama_context_params.cb_eval)
// that copies named graph tensors to host buffers while llama_decode runs.
//
// llama.cpp names graph tensors "<name>-<layer>" (Qcur-3, kqv_out-3, ...).
// A capture is asked for a few names and a set of layers; every other node
// is answered "not needed" with a short string check, so an idle capture
// leaves the graph in one piece (ggml's scheduler splits it only at nodes a
// callback asks for). The last evaluation of a name in a decode wins: the
// model graph names Q before and after RoPE alike, and the later one is what
// attention reads.
//
// Only ggml's public API is used, so this builds against any libggml,
// patched or stock.

#include "ggml.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "capture.h"

struct edgekv_capture {
    int32_t n_name;
    int32_t n_layer;
    char    names[EDGEKV_CAPTURE_MAX_NAMES][EDGEKV_CAPTURE_NAME_LEN];
    bool    sums[EDGEKV_CAPTURE_MAX_NAMES]; // reduce to column sums instead of copying
    float * scratch;    // host copy of a tensor outside host memory
    size_t  scratch_cap;
    uint8_t * want;     // [n_name][n_layer]
    struct edgekv_capture_slot * slots; // [n_name][n_layer]
    int32_t status;
};

struct edgekv_capture * edgekv_capture_new(int32_t n_layer) {
    if (n_layer <= 0 || n_layer > 4096) {
        return NULL;
    }
    struct edgekv_capture * c = calloc(1, sizeof(*c));
    if (!c) {
        return NULL;
    }
    c->n_layer = n_layer;
    c->want  = calloc((size_t) EDGEKV_CAPTURE_MAX_NAMES * n_layer, 1);
    c->slots = calloc((size_t) EDGEKV_CAPTURE_MAX_NAMES * n_layer, sizeof(struct edgekv_capture_slot));
    if (!c->want || !c->slots) {
        edgekv_capture_free(c);
        return NULL;
    }
    return c;
}

void edgekv_capture_free(struct edgekv_capture * c) {
    if (!c) {
        return;
    }
    if (c->slots) {
        for (int32_t i = 0; i < EDGEKV_CAPTURE_MAX_NAMES * c->n_layer; ++i) {
            free(c->slots[i].data);
        }
    }
    free(c->slots);
    free(c->want);
    free(c->scratch);
    free(c);
}

static int32_t edgekv_capture_want_mode(struct edgekv_capture * c, const char * name, int32_t layer, bool on,
                                        bool sums) {
    if (!c || !name || layer < 0 || layer >= c->n_layer || strlen(name) >= EDGEKV_CAPTURE_NAME_LEN) {
        return EDGEKV_CAPTURE_ERR_ARG;
    }
    int32_t i = 0;
    while (i < c->n_name && strcmp(c->names[i], name) != 0) {
        ++i;
    }
    if (i == c->n_name) {
        if (!on) {
            return EDGEKV_CAPTURE_OK;
        }
        if (c->n_name == EDGEKV_CAPTURE_MAX_NAMES) {
            return EDGEKV_CAPTURE_ERR_ARG;
        }
        c->sums[c->n_name] = sums;
        strcpy(c->names[c->n_name++], name);
    } else if (on && c->sums[i] != sums) {
        return EDGEKV_CAPTURE_ERR_ARG; // one name, one way of capturing it
    }
    c->want[(size_t) i * c->n_layer + layer] = on ? 1 : 0;
    return EDGEKV_CAPTURE_OK;
}

int32_t edgekv_capture_want(struct edgekv_capture * c, const char * name, int32_t layer, bool on) {
    return edgekv_capture_want_mode(c, name, layer, on, false);
}

int32_t edgekv_capture_want_sums(struct edgekv_capture * c, const char * name, int32_t layer, bool on) {
    return edgekv_capture_want_mode(c, name, layer, on, true);
}

// the slot a tensor name maps to, or NULL when nobody asked for it
static struct edgekv_capture_slot * edgekv_capture_match(struct edgekv_capture * c, const char * tname) {
    const char * dash = strrchr(tname, '-');
    if (!dash || dash == tname || dash[1] < '0' || dash[1] > '9') {
        return NULL;
    }
    const size_t len = (size_t) (dash - tname);
    for (int32_t i = 0; i < c->n_name; ++i) {
        if (strlen(c->names[i]) == len && memcmp(c->names[i], tname, len) == 0) {
            char * end = NULL;
            const long layer = strtol(dash + 1, &end, 10);
            if (*end != '\0' || layer < 0 || layer >= c->n_layer) {
                return NULL;
            }
            const size_t k = (size_t) i * c->n_layer + (size_t) layer;
            return c->want[k] ? &c->slots[k] : NULL;
        }
    }
    return NULL;
}

// at least n floats in *data (grown with realloc); false when memory ran out
static bool edgekv_capture_reserve(float ** data, size_t * cap, size_t n) {
    if (n <= *cap) {
        return true;
    }
    float * d = realloc(*data, n * sizeof(float));
    if (!d) {
        return false;
    }
    *data = d;
    *cap  = n;
    return true;
}

// the bytes [offset, offset + size) of t, where the host can read them: in place when t
// lives in host memory, else copied into the capture's scratch
static const void * edgekv_capture_host(struct edgekv_capture * c, const struct ggml_tensor * t, size_t offset,
                                        size_t size) {
    if (t->buffer && ggml_backend_buffer_is_host(t->buffer)) {
        return (const char *) t->data + offset;
    }
    if (!edgekv_capture_reserve(&c->scratch, &c->scratch_cap, (size + sizeof(float) - 1)/sizeof(float))) {
        return NULL;
    }
    ggml_backend_tensor_get(t, c->scratch, offset, size);
    return c->scratch;
}

// Reduce an attention softmax p [n_kv, n_tokens, n_head] into the slot, laid out as
// [n_head + 1][width]: row h adds up p over the tokens for head h (summed over every
// evaluation since the last clear: a decode split into ubatches); row n_head is 1 where
// the mask (the softmax's src[1]) lets the last token see the cell, else 0. width is the
// largest n_kv seen; columns are cells in the cache's own order.
static int32_t edgekv_capture_sum(struct edgekv_capture * c, struct edgekv_capture_slot * s,
                                  const struct ggml_tensor * t) {
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[3] != 1) {
        return EDGEKV_CAPTURE_ERR_TYPE; // one stream only
    }
    const int64_t n_kv = t->ne[0], n_tok = t->ne[1], n_head = t->ne[2];
    const int64_t rows = n_head + 1;
    if (s->n_seen > 0 && s->ne[1] != rows) {
        return EDGEKV_CAPTURE_ERR_TYPE;
    }
    const int64_t width = s->n_seen > 0 && s->ne[0] > n_kv ? s->ne[0] : n_kv;
    if (!edgekv_capture_reserve(&s->data, &s->cap, (size_t) rows*width)) {
        return EDGEKV_CAPTURE_ERR_ALLOC;
    }
    if (s->n_seen == 0) {
        memset(s->data, 0, (size_t) rows*width*sizeof(float));
    } else if (width > s->ne[0]) { // widen the rows in place, the last first
        const int64_t old = s->ne[0];
        for (int64_t r = rows - 1; r >= 0; --r) {
            memmove(s->data + r*width, s->data + r*old, (size_t) old*sizeof(float));
            memset(s->data + r*width + old, 0, (size_t) (width - old)*sizeof(float));
        }
    }
    s->ne[0] = width; s->ne[1] = rows; s->ne[2] = 1; s->ne[3] = 1;

    const float * p = edgekv_capture_host(c, t, 0, ggml_nbytes(t));
    if (!p) {
        return EDGEKV_CAPTURE_ERR_ALLOC;
    }
    for (int64_t h = 0; h < n_head; ++h) {
        float * acc = s->data + h*width;
        for (int64_t i = 0; i < n_tok; ++i) {
            const float * row = p + (h*n_tok + i)*n_kv;
            for (int64_t j = 0; j < n_kv; ++j) {
                acc[j] += row[j];
            }
        }
    }

    float * vis = s->data + n_head*width;
    memset(vis, 0, (size_t) width*sizeof(float));
    const struct ggml_tensor * m = t->src[1];
    if (!m) { // no mask: every cell is seen
        for (int64_t j = 0; j < n_kv; ++j) {
            vis[j] = 1.0f;
        }
        return EDGEKV_CAPTURE_OK;
    }
    if ((m->type != GGML_TYPE_F32 && m->type != GGML_TYPE_F16) || m->ne[0] != n_kv || m->ne[1] < n_tok ||
        m->nb[0] != ggml_type_size(m->type)) {
        return EDGEKV_CAPTURE_ERR_TYPE;
    }
    const void * mrow = edgekv_capture_host(c, m, (size_t) (n_tok - 1)*m->nb[1], (size_t) n_kv*m->nb[0]);
    if (!mrow) {
        return EDGEKV_CAPTURE_ERR_ALLOC;
    }
    for (int64_t j = 0; j < n_kv; ++j) {
        const float x = m->type == GGML_TYPE_F32 ? ((const float *) mrow)[j]
                                                 : ggml_fp16_to_fp32(((const ggml_fp16_t *) mrow)[j]);
        vis[j] = x > -INFINITY ? 1.0f : 0.0f;
    }
    return EDGEKV_CAPTURE_OK;
}

bool edgekv_capture_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    struct edgekv_capture * c = (struct edgekv_capture *) user_data;
    if (!c || c->n_name == 0) {
        return ask ? false : true;
    }
    struct edgekv_capture_slot * s = edgekv_capture_match(c, t->name);
    if (ask) {
        return s != NULL;
    }
    if (!s) {
        return true;
    }
    if (c->sums[(s - c->slots) / c->n_layer]) {
        const int32_t rc = edgekv_capture_sum(c, s, t);
        if (rc != EDGEKV_CAPTURE_OK) {
            c->status = rc;
            return true;
        }
        s->n_seen += 1;
        return true;
    }
    if (t->type != GGML_TYPE_F32 || t->nb[0] != sizeof(float)) {
        c->status = EDGEKV_CAPTURE_ERR_TYPE;
        return true;
    }
    const int64_t n = ggml_nelements(t);
    if ((size_t) n > s->cap) {
        float * d = realloc(s->data, (size_t) n * sizeof(float));
        if (!d) {
            c->status = EDGEKV_CAPTURE_ERR_ALLOC;
            return true;
        }
        s->data = d;
        s->cap  = (size_t) n;
    }
    if (ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, s->data, 0, (size_t) n * sizeof(float));
    } else {
        // a strided view: one row of ne[0] floats at a time
        float * dst = s->data;
        for (int64_t i3 = 0; i3 < t->ne[3]; ++i3) {
            for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
                for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
                    ggml_backend_tensor_get(t, dst, i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3], t->ne[0]*sizeof(float));
                    dst += t->ne[0];
                }
            }
        }
    }
    for (int d = 0; d < 4; ++d) {
        s->ne[d] = t->ne[d];
    }
    s->n_seen += 1;
    return true;
}

const struct edgekv_capture_slot * edgekv_capture_get(const struct edgekv_capture * c, const char * name, int32_t layer) {
    if (!c || !name || layer < 0 || layer >= c->n_layer) {
        return NULL;
    }
    for (int32_t i = 0; i < c->n_name; ++i) {
        if (strcmp(c->names[i], name) == 0) {
            return &c->slots[(size_t) i * c->n_layer + layer];
        }
    }
    return NULL;
}

void edgekv_capture_clear(struct edgekv_capture * c) {
    if (!c) {
        return;
    }
    for (int32_t i = 0; i < EDGEKV_CAPTURE_MAX_NAMES * c->n_layer; ++i) {
        c->slots[i].n_seen = 0;
    }
    c->status = EDGEKV_CAPTURE_OK;
}

int32_t edgekv_capture_status(const struct edgekv_capture * c) {
    return c ? c->status : EDGEKV_CAPTURE_ERR_ARG;
}
