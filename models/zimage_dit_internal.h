/* Private structures of the Z-Image DiT, shared by zimage_dit_load.c,
 * zimage_dit.c (forward driver) and zimage_dit_blocks.c. */
#ifndef KILN_MODELS_ZIMAGE_DIT_INTERNAL_H
#define KILN_MODELS_ZIMAGE_DIT_INTERNAL_H

#include "dit_replay.h"
#include "zimage_dit.h"

/* One ZImageTransformerBlock; ada/ada_b are absent (data NULL) in the
 * context refiner's unmodulated blocks. */
typedef struct zimage_block_w {
    kiln_tensor qkv;            /* [3D, D]: to_q | to_k | to_v */
    kiln_tensor out;            /* [D, D] to_out.0 */
    kiln_tensor norm_q, norm_k; /* [d] (absent without qk_norm) */
    kiln_tensor norm1, norm2, ffn_norm1, ffn_norm2; /* [D] */
    kiln_tensor w13;            /* [2F, D]: w1 (gate) | w3 (up) */
    kiln_tensor w2;             /* [D, F] */
    kiln_tensor ada, ada_b;     /* [4D, A], [4D] adaLN_modulation.0 */
} zimage_block_w;

/* Recorded forwards (zimage_dit_replay.c): up to this many items, whose
 * caption lengths are part of a recording's key. */
#define ZIMAGE_REPLAY_MAX_B 16

/* What a recording ran on: the shape, each item's caption length, and the
 * moves of the memory it points into (RoPE tables and arenas only grow;
 * each move bumps its counter). */
typedef struct zimage_replay_key {
    int64_t B, h, w, T;
    int64_t cap_len[ZIMAGE_REPLAY_MAX_B];
    uint64_t rope_epoch, fwd_epoch, blk_epoch;
} zimage_replay_key;


struct kiln_zimage_dit {
    kiln_backend *be;
    kiln_zimage_dit_config cfg;

    kiln_tensor x_emb, x_emb_b;       /* [D, P], [D] */
    kiln_tensor cap_norm;             /* [Cc] */
    kiln_tensor cap_emb, cap_emb_b;   /* [D, Cc], [D] */
    kiln_tensor t_lin1, t_lin1_b;     /* [t_hidden, 256], [t_hidden] */
    kiln_tensor t_lin2, t_lin2_b;     /* [A, t_hidden], [A] */
    kiln_tensor final_ada, final_ada_b; /* [D, A], [D] */
    kiln_tensor final_lin, final_lin_b; /* [P, D], [P] */
    /* x_pad_token and cap_pad_token, each repeated to (1, 32, D) so one
     * copy fills an item's padding rows. */
    kiln_tensor x_pad, cap_pad;
    zimage_block_w *noise_ref, *ctx_ref, *layers;

    kiln_arena *fwd, *blk; /* per forward / per block activations */

    /* RoPE tables of the last forward's layout (B items of rows
     * [image N_p ; caption L_max]); rebuilt when the layout changes, in
     * buffers that only grow (rope_epoch counts their moves, so a recorded
     * step can tell they are where it left them). */
    int64_t rope_key[4];    /* B, h, w, L_max of the tables ... */
    int64_t *rope_caps;     /* ... and each item's padded caption length */
    int64_t rope_rows, rope_cap; /* rows in use, rows allocated */
    uint64_t rope_epoch;
    kiln_tensor rope_cos, rope_sin; /* (rope_cap, d) F32 */

    float *host;     /* host scratch */
    size_t host_cap; /* floats */

    /* Recorded forwards, least recently used replaced; off without backend
     * support or with KILN_GRAPHS=0 in the environment at load. */
    int replay_enabled;
    kiln_dit_replays replays;
};

/* Views of RoPE rows for a sequence: item b's table starts `stride` rows
 * after item b-1's (stride 0: one table shared by every item). */
typedef struct zimage_rope {
    kiln_tensor cos, sin; /* (S, d) F32 of item 0 */
    int64_t stride;
} zimage_rope;

/* Modulation of one block, each (B, D): 1 + scale applied as
 * n + scale * n, gates already through tanh. */
typedef struct zimage_mod {
    kiln_tensor scale_msa, gate_msa, scale_mlp, gate_mlp;
} zimage_mod;

typedef struct zimage_fwd {
    kiln_zimage_dit *m;
    kiln_backend *be;
    int64_t B, N, Np, Lmax; /* image rows, padded; longest padded caption */
    int ragged;             /* items' padded caption lengths differ */
    const int64_t *cap_p;   /* [B] padded caption lengths */
    int64_t *lens;          /* [B] scratch: valid rows per item of the current sequence */
    kiln_tensor adaln;      /* (B, A) */
} zimage_fwd;

/* Where a forward's body reads its inputs and writes its output: the
 * caller's tensors, or (recorded forwards) staging copies in the fwd arena
 * that sit at the same addresses every time. */
typedef struct zimage_io {
    const kiln_tensor *x, *cap;
    kiln_tensor *out;
    kiln_tensor e;                       /* (B, 256) sinusoids, uploaded */
    kiln_tensor x_buf, cap_buf, out_buf; /* staging, zimage_stage_inputs */
} zimage_io;

/* zimage_dit.c: the device work of a forward from io's inputs (the part
 * that is recorded), and the staging of a recorded forward's inputs (resets
 * the arenas, uploads the sinusoids, copies x and cap; returns the sticky
 * error code, if any). */
kiln_status zimage_forward_body(zimage_fwd *f, const kiln_zimage_dit_input *in,
                                const zimage_io *io, kiln_err *err);
kiln_status zimage_stage_inputs(zimage_fwd *f, const kiln_zimage_dit_input *in, zimage_io *io,
                                kiln_tensor *out);

/* zimage_dit_replay.c: whether this forward may be recorded (backend
 * support, no probe, at most ZIMAGE_REPLAY_MAX_B items), the forward
 * through the recordings, and their release. */
int zimage_replay_usable(const kiln_zimage_dit *m, const kiln_zimage_dit_input *in);
kiln_status zimage_forward_replayed(zimage_fwd *f, const kiln_zimage_dit_input *in,
                                    kiln_tensor *out, kiln_err *err);
#define zimage_replay_release(m) kiln_dit_replay_release((m)->be, &(m)->replays)

/* zimage_dit_blocks.c: one block over x (B, S, D) in place.  lens[b] rows
 * of item b are its own (NULL: all S rows of every item); mod NULL runs the
 * unmodulated (context refiner) form.  Temporaries come from m->blk; errors
 * stay sticky in the backend. */
void zimage_block(zimage_fwd *f, const zimage_block_w *W, kiln_tensor *x, const int64_t *lens,
                  const zimage_rope *rope, const zimage_mod *mod);
/* The block's adaLN modulation from f->adaln (tensors in m->blk). */
zimage_mod zimage_modulation(zimage_fwd *f, const zimage_block_w *W);

#endif
