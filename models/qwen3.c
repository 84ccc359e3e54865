/* Qwen3 text encoder: loading (transformers Qwen3Model / Qwen3ForCausalLM
 * state dicts) and the forward pass of shared/spec/qwen3-encoder.md section 4. */
#include "qwen3.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/weights.h"

typedef struct qwen3_layer {
    kiln_tensor input_norm;   /* [H] */
    kiln_tensor qkv;          /* [(nq + 2 nkv) d, H]: q rows, k rows, v rows, for qkv_split */
    kiln_tensor q_norm;       /* [d] */
    kiln_tensor k_norm;       /* [d] */
    kiln_tensor o;            /* [H, nq*d] */
    kiln_tensor post_norm;    /* [H] */
    kiln_tensor gate_up;      /* [2I, H]: gate rows then up rows, for the swiglu op */
    kiln_tensor down;         /* [H, I] */
} qwen3_layer;

struct kiln_qwen3 {
    kiln_backend *be;
    kiln_qwen3_config cfg;
    kiln_st *st;                  /* keeps the embedding table mapped */
    const kiln_st_tensor *embed;  /* [V, H] in its stored dtype, on the host */
    int out_idx[KILN_QWEN3_MAX_OUT];
    int n_out;
    int depth;                    /* layers run: the deepest requested index */
    qwen3_layer *layers;          /* depth entries */
    kiln_tensor final_norm;       /* loaded only when index num_hidden_layers is asked */
    kiln_arena *arena;
    void *stage;                  /* host buffer for gathered embedding rows */
    size_t stage_bytes;
    kiln_tensor rope_cos, rope_sin; /* (rope_rows, d) F32 */
    int64_t rope_rows;
};

/* --- loading ------------------------------------------------------------- */

static kiln_status resolve_layers(const kiln_qwen3_config *cfg, const int *layers, int n,
                                  int *out, kiln_err *err)
{
    int L = (int)cfg->num_hidden_layers;
    if (n < 1 || n > KILN_QWEN3_MAX_OUT)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "text_encoder_out_layers: %d indices given (1..%d allowed)", n,
                            KILN_QWEN3_MAX_OUT);
    for (int i = 0; i < n; i++) {
        int k = layers[i] < 0 ? layers[i] + L + 1 : layers[i];
        if (k < 0 || k > L)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "text_encoder_out_layers: index %d is out of range: the text "
                                "encoder has %d layers, so hidden states 0..%d (or -%d..-1); "
                                "choose them with --text-encoder-out-layers",
                                layers[i], L, L, L + 1);
        out[i] = k;
    }
    return KILN_OK;
}

/* Checks each part's shape before the fused load, whose own check only sees
 * the concatenation, so that a wrong tensor is named in the error. */
static kiln_status load_fused(kiln_backend *be, const kiln_st *st, kiln_tensor *out,
                              const char *const *names, const int64_t (*shapes)[2], int n,
                              kiln_err *err)
{
    for (int i = 0; i < n; i++)
        if (!kiln_st_expect(st, names[i], 2, shapes[i], err))
            return err->code;
    return kiln_weight_load_concat(be, st, out, names, n, err);
}

static kiln_status load_layer(kiln_qwen3 *m, const char *pre, int l, qwen3_layer *ly,
                              kiln_err *err)
{
    kiln_backend *be = m->be;
    const kiln_st *st = m->st;
    const kiln_qwen3_config *c = &m->cfg;
    int64_t H = c->hidden_size, d = c->head_dim, I = c->intermediate_size;
    int64_t nq = c->num_attention_heads * d, nkv = c->num_key_value_heads * d;
    const char *p = "self_attn";

    if (kiln_weight_load(be, st, &ly->input_norm, 1, (int64_t[]){H}, err,
                         "%slayers.%d.input_layernorm.weight", pre, l) ||
        kiln_weight_load(be, st, &ly->q_norm, 1, (int64_t[]){d}, err,
                         "%slayers.%d.%s.q_norm.weight", pre, l, p) ||
        kiln_weight_load(be, st, &ly->k_norm, 1, (int64_t[]){d}, err,
                         "%slayers.%d.%s.k_norm.weight", pre, l, p) ||
        kiln_weight_load(be, st, &ly->o, 2, (int64_t[]){H, nq}, err,
                         "%slayers.%d.%s.o_proj.weight", pre, l, p) ||
        kiln_weight_load(be, st, &ly->post_norm, 1, (int64_t[]){H}, err,
                         "%slayers.%d.post_attention_layernorm.weight", pre, l) ||
        kiln_weight_load(be, st, &ly->down, 2, (int64_t[]){H, I}, err,
                         "%slayers.%d.mlp.down_proj.weight", pre, l))
        return err->code;

    /* One GEMM for q, k and v: the k and v projections alone are 1024
     * columns wide, too few tiles to fill the GPU at 512 positions. */
    char q[256], k[256], v[256], gate[256], up[256];
    snprintf(q, sizeof q, "%slayers.%d.%s.q_proj.weight", pre, l, p);
    snprintf(k, sizeof k, "%slayers.%d.%s.k_proj.weight", pre, l, p);
    snprintf(v, sizeof v, "%slayers.%d.%s.v_proj.weight", pre, l, p);
    snprintf(gate, sizeof gate, "%slayers.%d.mlp.gate_proj.weight", pre, l);
    snprintf(up, sizeof up, "%slayers.%d.mlp.up_proj.weight", pre, l);
    const char *const qkv_names[3] = {q, k, v}, *const mlp_names[2] = {gate, up};
    const int64_t qkv_shapes[3][2] = {{nq, H}, {nkv, H}, {nkv, H}};
    const int64_t mlp_shapes[2][2] = {{I, H}, {I, H}};
    if (load_fused(be, st, &ly->qkv, qkv_names, qkv_shapes, 3, err))
        return err->code;
    return load_fused(be, st, &ly->gate_up, mlp_names, mlp_shapes, 2, err);
}

static void free_layer(kiln_backend *be, qwen3_layer *ly)
{
    kiln_tensor *all[] = {&ly->input_norm, &ly->qkv, &ly->q_norm,
                          &ly->k_norm, &ly->o, &ly->post_norm, &ly->gate_up, &ly->down};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kiln_be_free(be, all[i]);
}

/* Qwen3ForCausalLM nests the model under `model.`; Qwen3Model (Z-Image's
 * text_encoder) stores it at the top level. */
static const char *find_prefix(const kiln_st *st, kiln_err *err)
{
    if (kiln_st_find(st, "model.embed_tokens.weight"))
        return "model.";
    if (kiln_st_find(st, "embed_tokens.weight"))
        return "";
    kiln_err_set(err, KILN_ERR_NOT_FOUND,
                 "text_encoder: no model.embed_tokens.weight or embed_tokens.weight tensor");
    return NULL;
}

static kiln_status load_embedding(kiln_qwen3 *m, const char *pre, kiln_err *err)
{
    char name[128];
    snprintf(name, sizeof name, "%sembed_tokens.weight", pre);
    m->embed = kiln_st_expect(m->st, name, 2,
                              (int64_t[]){m->cfg.vocab_size, m->cfg.hidden_size}, err);
    if (!m->embed)
        return err->code;
    kiln_dtype dt = m->embed->dtype;
    if (dt != KILN_F32 && dt != KILN_BF16 && dt != KILN_F16)
        return kiln_err_set(err, KILN_ERR_FORMAT, "text_encoder: %s has unsupported dtype %s",
                            name, kiln_dtype_name(dt));
    return KILN_OK;
}

static kiln_status load_weights(kiln_qwen3 *m, const kiln_checkpoint *ck, kiln_err *err)
{
    m->st = kiln_checkpoint_weights(ck, "text_encoder", err);
    if (!m->st)
        return err->code;
    const char *pre = find_prefix(m->st, err);
    if (!pre || load_embedding(m, pre, err))
        return err->code;
    if (m->depth) {
        m->layers = calloc((size_t)m->depth, sizeof *m->layers);
        if (!m->layers)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    for (int l = 0; l < m->depth; l++)
        if (load_layer(m, pre, l, &m->layers[l], err))
            return err->code;
    if (m->depth == m->cfg.num_hidden_layers &&
        kiln_weight_load(m->be, m->st, &m->final_norm, 1, (int64_t[]){m->cfg.hidden_size}, err,
                         "%snorm.weight", pre))
        return err->code;
    return KILN_OK;
}

kiln_qwen3 *kiln_qwen3_load(kiln_backend *be, const kiln_checkpoint *ck, const int *layers,
                            int n_layers, kiln_err *err)
{
    const cJSON *cfg = kiln_checkpoint_config(ck, "text_encoder", err);
    if (!cfg)
        return NULL;
    kiln_qwen3 *m = calloc(1, sizeof *m);
    if (!m) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    m->be = be;
    if (kiln_qwen3_config_parse(cfg, &m->cfg, err) ||
        resolve_layers(&m->cfg, layers, n_layers, m->out_idx, err))
        goto fail;
    m->n_out = n_layers;
    for (int i = 0; i < n_layers; i++)
        if (m->out_idx[i] > m->depth)
            m->depth = m->out_idx[i];
    if (load_weights(m, ck, err))
        goto fail;
    m->arena = kiln_arena_create(be, 0, err);
    if (!m->arena)
        goto fail;
    if (kiln_be_check(be, err)) /* an upload that failed after its alloc */
        goto fail;
    return m;
fail:
    kiln_qwen3_destroy(m);
    return NULL;
}

void kiln_qwen3_destroy(kiln_qwen3 *m)
{
    if (!m)
        return;
    for (int l = 0; m->layers && l < m->depth; l++)
        free_layer(m->be, &m->layers[l]);
    free(m->layers);
    kiln_be_free(m->be, &m->final_norm);
    kiln_be_free(m->be, &m->rope_cos);
    kiln_be_free(m->be, &m->rope_sin);
    kiln_arena_destroy(m->arena);
    free(m->stage);
    kiln_st_close(m->st);
    free(m);
}

const kiln_qwen3_config *kiln_qwen3_get_config(const kiln_qwen3 *m) { return &m->cfg; }

int64_t kiln_qwen3_out_width(const kiln_qwen3 *m) { return m->n_out * m->cfg.hidden_size; }

int kiln_qwen3_depth(const kiln_qwen3 *m) { return m->depth; }

size_t kiln_qwen3_scratch_bytes(const kiln_qwen3 *m) { return kiln_arena_capacity(m->arena); }

/* --- forward ------------------------------------------------------------- */

static kiln_tensor view(const kiln_tensor *t, int ndim, const int64_t *shape)
{
    kiln_tensor v = *t;
    kiln_tensor_set_shape(&v, t->dtype, ndim, shape);
    return v;
}

/* RoPE tables for positions 0..T-1, as transformers' Qwen3RotaryEmbedding
 * computes them: inv_freq = 1 / theta^(arange(0, d, 2) / d) in fp32 from an
 * integer arange, phi = pos * inv_freq in fp32, cos/sin of [phi, phi] in
 * fp32, then cast to the model dtype.  Rows only depend on the position, so
 * the table of the longest T seen serves every shorter T. */
static kiln_status ensure_rope(kiln_qwen3 *m, int64_t T, kiln_err *err)
{
    if (T <= m->rope_rows)
        return KILN_OK;
    kiln_backend *be = m->be;
    int64_t d = m->cfg.head_dim, half = d / 2;
    float *host = malloc((size_t)(2 * T * d) * sizeof *host);
    if (!host)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    float *cs = host, *sn = host + T * d;
    const float theta = (float)m->cfg.rope_theta;
    for (int64_t j = 0; j < half; j++) {
        float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)d);
        for (int64_t t = 0; t < T; t++) {
            float phi = (float)t * inv_freq;
            float c = cosf(phi), s = sinf(phi);
            /* spec section 4: the bf16 model sees bf16-rounded tables */
            if (be->act_dtype == KILN_BF16) {
                c = kiln_round_bf16(c);
                s = kiln_round_bf16(s);
            }
            cs[t * d + j] = cs[t * d + j + half] = c;
            sn[t * d + j] = sn[t * d + j + half] = s;
        }
    }
    kiln_be_free(be, &m->rope_cos);
    kiln_be_free(be, &m->rope_sin);
    m->rope_rows = 0;
    const int64_t shape[2] = {T, d};
    if (!kiln_be_alloc(be, &m->rope_cos, KILN_F32, 2, shape) &&
        !kiln_be_alloc(be, &m->rope_sin, KILN_F32, 2, shape)) {
        kiln_be_upload(be, &m->rope_cos, cs, KILN_F32);
        kiln_be_upload(be, &m->rope_sin, sn, KILN_F32);
    }
    free(host);
    if (kiln_be_check(be, err)) {
        kiln_be_free(be, &m->rope_cos);
        kiln_be_free(be, &m->rope_sin);
        return kiln_err_wrap(err, "text encoder RoPE tables");
    }
    m->rope_rows = T;
    return KILN_OK;
}

static kiln_status check_inputs(const kiln_qwen3 *m, const int32_t *ids, int64_t ld,
                                const int *lens, int64_t B, int64_t T, kiln_err *err)
{
    if (B < 1 || T < 1 || B > (1 << 16) || T > (1 << 20))
        return kiln_err_set(err, KILN_ERR_INVALID, "text encoder: bad batch shape (%lld, %lld)",
                            (long long)B, (long long)T);
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > T)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "text encoder: row %lld has %d real tokens (1..%lld allowed)",
                                (long long)b, lens[b], (long long)T);
        for (int64_t t = 0; t < T; t++) {
            int32_t id = ids[b * ld + t];
            if (id < 0 || id >= m->cfg.vocab_size)
                return kiln_err_set(err, KILN_ERR_INVALID,
                                    "text encoder: token id %d is outside the vocabulary "
                                    "(%lld entries)",
                                    (int)id, (long long)m->cfg.vocab_size);
        }
    }
    return KILN_OK;
}

/* h = embed_tokens[ids], gathered on the host in the stored dtype; the upload
 * converts to the activation dtype. */
static kiln_status embed(kiln_qwen3 *m, kiln_tensor *h, const int32_t *ids, int64_t ld,
                         int64_t B, int64_t T, kiln_err *err)
{
    size_t row = (size_t)m->cfg.hidden_size * kiln_dtype_size(m->embed->dtype);
    size_t need = (size_t)(B * T) * row;
    if (need > m->stage_bytes) {
        void *p = realloc(m->stage, need);
        if (!p)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory gathering embeddings");
        m->stage = p;
        m->stage_bytes = need;
    }
    const char *table = m->embed->data;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            memcpy((char *)m->stage + (size_t)(b * T + t) * row,
                   table + (size_t)ids[b * ld + t] * row, row);
    kiln_be_upload(m->be, h, m->stage, m->embed->dtype);
    return KILN_OK;
}

typedef struct qwen3_acts {
    kiln_tensor h, x, t;     /* (B, T, H): residual, normed input, projection */
    kiln_tensor qkv;         /* (B, T, (nq + 2 nkv) d): the fused projection */
    kiln_tensor q, a;        /* (B, T, nq, d) */
    kiln_tensor k, v;        /* (B, T, nkv, d) */
    kiln_tensor gu, act;     /* (B, T, 2I), (B, T, I) */
} qwen3_acts;

static kiln_status alloc_acts(kiln_qwen3 *m, qwen3_acts *s, int64_t B, int64_t T)
{
    const kiln_qwen3_config *c = &m->cfg;
    kiln_arena *ar = m->arena;
    kiln_dtype dt = m->be->act_dtype;
    int64_t H = c->hidden_size, d = c->head_dim, I = c->intermediate_size;
    int64_t nq = c->num_attention_heads, nkv = c->num_key_value_heads;
    kiln_arena_tensor(ar, &s->h, dt, 3, (int64_t[]){B, T, H});
    kiln_arena_tensor(ar, &s->x, dt, 3, (int64_t[]){B, T, H});
    kiln_arena_tensor(ar, &s->t, dt, 3, (int64_t[]){B, T, H});
    kiln_arena_tensor(ar, &s->qkv, dt, 3, (int64_t[]){B, T, (nq + 2 * nkv) * d});
    kiln_arena_tensor(ar, &s->q, dt, 4, (int64_t[]){B, T, nq, d});
    kiln_arena_tensor(ar, &s->a, dt, 4, (int64_t[]){B, T, nq, d});
    kiln_arena_tensor(ar, &s->k, dt, 4, (int64_t[]){B, T, nkv, d});
    kiln_arena_tensor(ar, &s->v, dt, 4, (int64_t[]){B, T, nkv, d});
    kiln_arena_tensor(ar, &s->gu, dt, 3, (int64_t[]){B, T, 2 * I});
    return kiln_arena_tensor(ar, &s->act, dt, 3, (int64_t[]){B, T, I});
}

/* Writes hidden state `idx` into every output slot that asked for it. */
static void capture(kiln_qwen3 *m, kiln_tensor *out2d, int idx, const kiln_tensor *src)
{
    int64_t H = m->cfg.hidden_size;
    for (int j = 0; j < m->n_out; j++)
        if (m->out_idx[j] == idx)
            kiln_be_copy_cols(m->be, out2d, j * H, src, 0, H);
}

static void layer_forward(kiln_qwen3 *m, const qwen3_layer *ly, qwen3_acts *s,
                          const kiln_tensor *cos, const kiln_tensor *sin, const int *lens)
{
    kiln_backend *be = m->be;
    const kiln_qwen3_config *c = &m->cfg;
    float eps = (float)c->rms_norm_eps;
    const kiln_attn_opts attn = {
        .scale = 1.0f / sqrtf((float)c->head_dim),
        .causal = 1,
        .key_len = lens,
    };
    /* (B, T, heads * d) view of the attention output for the o projection */
    int64_t B = s->h.shape[0], T = s->h.shape[1];
    kiln_tensor a = view(&s->a, 3, (int64_t[]){B, T, c->num_attention_heads * c->head_dim});

    kiln_be_rms_norm(be, &s->x, &s->h, &ly->input_norm, eps);
    kiln_be_linear(be, &s->qkv, &s->x, &ly->qkv, NULL);
    /* q_norm and k_norm per head (G = head_dim), then RoPE, in one pass */
    kiln_be_qkv_split(be, &s->q, &s->k, &s->v, &s->qkv, &ly->q_norm, &ly->k_norm, eps, cos, sin,
                      KILN_ROPE_HALF);
    kiln_be_attention(be, &s->a, &s->q, &s->k, &s->v, &attn);
    kiln_be_linear(be, &s->t, &a, &ly->o, NULL);
    kiln_be_add(be, &s->h, &s->h, &s->t);

    kiln_be_rms_norm(be, &s->x, &s->h, &ly->post_norm, eps);
    kiln_be_linear(be, &s->gu, &s->x, &ly->gate_up, NULL);
    kiln_be_swiglu(be, &s->act, &s->gu);
    kiln_be_linear(be, &s->t, &s->act, &ly->down, NULL);
    kiln_be_add(be, &s->h, &s->h, &s->t);
}

/* Runs positions 0..T-1 of B rows (row b of ids starts at b * ld) and writes
 * the requested hidden states into out2d, viewed as (B * T, out_width).  The
 * caller resets the arena afterwards. */
static kiln_status forward(kiln_qwen3 *m, const int32_t *ids, int64_t ld, const int *lens,
                           int64_t B, int64_t T, kiln_tensor *out2d, kiln_err *err)
{
    kiln_backend *be = m->be;
    qwen3_acts s;
    if (ensure_rope(m, T, err))
        return err->code;
    kiln_tensor cos = view(&m->rope_cos, 2, (int64_t[]){T, m->cfg.head_dim});
    kiln_tensor sin = view(&m->rope_sin, 2, (int64_t[]){T, m->cfg.head_dim});
    if (alloc_acts(m, &s, B, T)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "text encoder scratch memory");
    }
    if (embed(m, &s.h, ids, ld, B, T, err))
        return err->code;
    capture(m, out2d, 0, &s.h);
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "text encoder embeddings");
    for (int l = 0; l < m->depth; l++) {
        layer_forward(m, &m->layers[l], &s, &cos, &sin, lens);
        capture(m, out2d, l + 1, &s.h);
        if (kiln_be_check(be, err))
            return kiln_err_wrap(err, "text encoder layer %d", l);
    }
    if (m->depth == m->cfg.num_hidden_layers) {
        kiln_be_rms_norm(be, &s.x, &s.h, &m->final_norm, (float)m->cfg.rms_norm_eps);
        capture(m, out2d, m->depth, &s.x);
        if (kiln_be_check(be, err))
            return kiln_err_wrap(err, "text encoder final norm");
    }
    return KILN_OK;
}

static kiln_status check_out(const kiln_qwen3 *m, const kiln_tensor *out, int64_t rows,
                             kiln_err *err)
{
    int64_t want = rows * kiln_qwen3_out_width(m);
    if (out->dtype != m->be->act_dtype || kiln_tensor_numel(out) != want || !out->data)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "text encoder: output tensor must hold %lld x %lld %s values",
                            (long long)rows, (long long)kiln_qwen3_out_width(m),
                            kiln_dtype_name(m->be->act_dtype));
    return KILN_OK;
}

/* The scratch of a call is released at its end: the first call's reset
 * merges the arena's blocks into one that fits, so later calls of that shape
 * allocate nothing. */
static kiln_status release(kiln_qwen3 *m, kiln_status st)
{
    kiln_arena_reset(m->arena);
    return st;
}

kiln_status kiln_qwen3_encode(kiln_qwen3 *m, const int32_t *ids, const int *lens, int64_t B,
                              int64_t T, kiln_tensor *out, kiln_err *err)
{
    if (check_inputs(m, ids, T, lens, B, T, err) || check_out(m, out, B * T, err))
        return err->code;
    kiln_tensor out2d = view(out, 2, (int64_t[]){B * T, kiln_qwen3_out_width(m)});
    return release(m, forward(m, ids, T, lens, B, T, &out2d, err));
}

static kiln_status encode_real(kiln_qwen3 *m, const int32_t *ids, const int *lens, int64_t B,
                               int64_t T, kiln_tensor *out, kiln_err *err)
{
    if (check_inputs(m, ids, T, lens, B, T, err))
        return err->code;
    int64_t total = 0, Tr = 0;
    for (int64_t b = 0; b < B; b++) {
        total += lens[b];
        if (lens[b] > Tr)
            Tr = lens[b];
    }
    if (check_out(m, out, total, err))
        return err->code;
    int64_t W = kiln_qwen3_out_width(m);
    kiln_tensor full;
    if (kiln_arena_tensor(m->arena, &full, m->be->act_dtype, 2, (int64_t[]){B * Tr, W})) {
        kiln_be_check(m->be, err);
        return kiln_err_wrap(err, "text encoder");
    }
    if (forward(m, ids, T, lens, B, Tr, &full, err))
        return err->code;
    /* Pack row b's real tokens after those of rows 0..b-1. */
    kiln_tensor dst = view(out, 3, (int64_t[]){1, total, W});
    size_t row_bytes = (size_t)W * kiln_dtype_size(full.dtype);
    int64_t off = 0;
    for (int64_t b = 0; b < B; b++) {
        kiln_tensor src = view(&full, 3, (int64_t[]){1, Tr, W});
        src.data = (char *)full.data + (size_t)(b * Tr) * row_bytes;
        kiln_be_copy_rows(m->be, &dst, off, &src, 0, lens[b]);
        off += lens[b];
    }
    if (kiln_be_check(m->be, err))
        return kiln_err_wrap(err, "text encoder output");
    return KILN_OK;
}

kiln_status kiln_qwen3_encode_real(kiln_qwen3 *m, const int32_t *ids, const int *lens, int64_t B,
                                   int64_t T, kiln_tensor *out, kiln_err *err)
{
    return release(m, encode_real(m, ids, lens, B, T, out, err));
}
