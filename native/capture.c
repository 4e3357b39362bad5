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

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "capture.h"

struct edgekv_capture {
    int32_t n_name;
    int32_t n_layer;
    char    names[EDGEKV_CAPTURE_MAX_NAMES][EDGEKV_CAPTURE_NAME_LEN];
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
    free(c);
}

int32_t edgekv_capture_want(struct edgekv_capture * c, const char * name, int32_t layer, bool on) {
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
        strcpy(c->names[c->n_name++], name);
    }
    c->want[(size_t) i * c->n_layer + layer] = on ? 1 : 0;
    return EDGEKV_CAPTURE_OK;
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
