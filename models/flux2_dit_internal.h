/* Private structures of the FLUX.2 DiT, shared by flux2_dit_load.c,
 * flux2_dit.c (forward driver) and flux2_dit_blocks.c. */
#ifndef KILN_MODELS_FLUX2_DIT_INTERNAL_H
#define KILN_MODELS_FLUX2_DIT_INTERNAL_H

#include "dit_replay.h"
#include "flux2_dit.h"

typedef struct flux2_double_w {
    kiln_tensor qkv, add_qkv;           /* [3D, D]: to_q|to_k|to_v, add_q|add_k|add_v */
    kiln_tensor out, add_out;           /* [D, D] */
    kiln_tensor norm_q, norm_k, norm_add_q, norm_add_k; /* [d] */
    kiln_tensor ff_in, ffc_in;          /* [2F, D] */
    kiln_tensor ff_out, ffc_out;        /* [D, F] */
} flux2_double_w;

typedef struct flux2_single_w {
    kiln_tensor qkv;    /* [3D, D]: rows 0..3D of to_qkv_mlp_proj */
    kiln_tensor mlp_in; /* [2F, D]: its remaining rows, gate then up */
    kiln_tensor out;    /* [D, D + F] */
    kiln_tensor norm_q, norm_k;
} flux2_single_w;

/* The key of a recorded forward (flux2_dit_replay.c, models/dit_replay.h):
 * the shape and the memory it was recorded on. */
typedef struct flux2_replay_key {
    int64_t B, T, N, R;
    int kv_mode;
    uint64_t kv_serial;      /* which sizing of which K/V cache (CACHED) */
    uint64_t rope_epoch;     /* which allocation of the RoPE tables */
    uint64_t fwd_epoch, blk_epoch;
} flux2_replay_key;

struct kiln_flux2_dit {
    kiln_backend *be;
    kiln_flux2_dit_config cfg;

    kiln_tensor x_embedder, context_embedder; /* [D, C_in], [D, J] */
    kiln_tensor time_lin1, time_lin2;         /* [D, 256], [D, D] */
    kiln_tensor mod_img, mod_txt, mod_single; /* [6D, D], [6D, D], [3D, D] */
    kiln_tensor norm_out, proj_out;           /* [2D, D], [C_out, D] */
    flux2_double_w *dbl;                      /* [num_layers] */
    flux2_single_w *sgl;                      /* [num_single_layers] */

    /* Activations: `fwd` lives for one forward (streams, modulations),
     * `blk` for one block (its temporaries), so peak memory is one block's
     * working set on top of the streams. */
    kiln_arena *fwd, *blk;

    /* RoPE tables for the ids of the last forward that needed new ones,
     * rows [txt ; img ; ref]; a later forward whose rows are a prefix (the
     * KV pipeline's cached steps after its extract step) reuses them.  The
     * buffers hold rope_cap rows and only grow (rope_update says why). */
    int32_t *rope_ids; /* host copy of those ids, rope_rows * 4 */
    int64_t rope_rows, rope_cap;
    uint64_t rope_epoch; /* bumped whenever the buffers move */
    kiln_tensor rope_cos, rope_sin; /* (rope_cap, d) F32 */

    float *host;       /* host scratch: sinusoid inputs, table staging */
    size_t host_cap;   /* floats */

    /* Recorded forwards, least recently used replaced; off without backend
     * support or with KILN_GRAPHS=0 in the environment at load. */
    int replay_enabled;
    kiln_dit_replays replays;
    uint64_t kv_serial; /* last serial handed to a K/V cache sizing */
};

struct kiln_flux2_kv_cache {
    const kiln_flux2_dit *owner;
    kiln_backend *be;
    int64_t layers;    /* num_layers + num_single_layers */
    int64_t hidden;
    int64_t batch, tokens; /* B and R of the stored tensors; tokens 0 = empty */
    int64_t alloc_batch, alloc_tokens;
    uint64_t serial;   /* from the owner's kv_serial at each sizing */
    kiln_tensor *k, *v; /* [layers] each (B, R, D), post-norm post-RoPE */
};

/* --- one forward ------------------------------------------------------------ */

/* Shift, scale and gate vectors, each (B, D). */
typedef struct flux2_mod {
    kiln_tensor shift, scale, gate;
} flux2_mod;

/* Views of rows of the RoPE tables, each (S, d) F32. */
typedef struct flux2_rope {
    kiln_tensor cos, sin;
} flux2_rope;

typedef struct flux2_fwd {
    kiln_flux2_dit *m;
    kiln_backend *be;
    int64_t B, T, N; /* N: image tokens of the streams (without extract refs) */
    int64_t R;       /* reference K/V rows inserted between text and image keys */
    int ref_stream;  /* EXTRACT: the reference tokens run as their own stream r */
    kiln_flux2_kv_cache *kv; /* EXTRACT: written; CACHED: read; else NULL */
    kiln_tensor x, c, r;     /* (B, N, D), (B, T, D), (B, R, D) */
    kiln_tensor y;           /* (B, T + N, D): [c ; x] for the single blocks */
    flux2_mod img_msa, img_mlp, txt_msa, txt_mlp, single;
    flux2_mod ref_msa, ref_mlp, ref_single; /* t = 0 modulation, EXTRACT */
    flux2_rope rope_txt, rope_img, rope_ref, rope_main; /* main = [txt ; img] */
} flux2_fwd;

/* Where a forward's body reads its inputs and writes its output: the
 * caller's tensors, or (recorded forwards) staging copies in the fwd arena
 * that sit at the same addresses every time. */
typedef struct flux2_io {
    const kiln_tensor *x, *txt;
    kiln_tensor *out;
    kiln_tensor e;                      /* (B, time_channels) sinusoids */
    kiln_tensor x_buf, txt_buf, out_buf; /* staging, flux2_stage_inputs */
} flux2_io;

/* flux2_dit.c: embeddings, blocks and output layer from io's inputs (the
 * only device work of a forward, so the part that is recorded). */
kiln_status flux2_forward_body(flux2_fwd *f, const kiln_flux2_dit_input *in, const flux2_io *io,
                               kiln_err *err);
/* Resets the arenas, uploads the sinusoids of in->t and copies x and txt
 * into staging tensors (io->x etc. point at them).  Returns the sticky
 * error code, if any. */
kiln_status flux2_stage_inputs(flux2_fwd *f, const kiln_flux2_dit_input *in, flux2_io *io,
                               kiln_tensor *out);

/* flux2_dit_replay.c: whether this forward may be recorded (backend
 * support, no probe, not EXTRACT), and the forward through the replays. */
int flux2_replay_usable(const kiln_flux2_dit *m, const kiln_flux2_dit_input *in);
kiln_status flux2_forward_replayed(flux2_fwd *f, const kiln_flux2_dit_input *in, kiln_tensor *out,
                                   kiln_err *err);
#define flux2_replay_release(m) kiln_dit_replay_release((m)->be, &(m)->replays)

/* The blocks, flux2_dit_blocks.c: temporaries come from m->blk, which the
 * caller resets after each block; errors stay sticky in the backend. */
void flux2_double_block(flux2_fwd *f, int i);
void flux2_single_block(flux2_fwd *f, int j);

#endif
