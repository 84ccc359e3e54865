#include <math.h>

#include "cpu_ops.h"

static float silu(float v) { return v / (1.0f + expf(-v)); }

void cpu_silu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t n = kiln_tensor_numel(x);
    if (CPU_REQUIRE(be, kiln_tensor_numel(y) == n))
        return;
    for (int64_t i = 0; i < n; i++)
        cpu_f32(y)[i] = silu(cpu_f32(x)[i]);
}

void cpu_tanh(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t n = kiln_tensor_numel(x);
    if (CPU_REQUIRE(be, kiln_tensor_numel(y) == n))
        return;
    for (int64_t i = 0; i < n; i++)
        cpu_f32(y)[i] = tanhf(cpu_f32(x)[i]);
}

void cpu_swiglu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t rows = kiln_tensor_rows(x), f = kiln_tensor_cols(y);
    if (CPU_REQUIRE(be, kiln_tensor_cols(x) == 2 * f && kiln_tensor_rows(y) == rows &&
                            y->data != x->data))
        return;
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = cpu_f32(x) + r * 2 * f;
        float *ys = cpu_f32(y) + r * f;
        for (int64_t i = 0; i < f; i++)
            ys[i] = silu(xs[i]) * xs[f + i];
    }
}

void cpu_add(kiln_backend *be, kiln_tensor *y, const kiln_tensor *a, const kiln_tensor *b)
{
    int64_t n = kiln_tensor_numel(y);
    if (CPU_REQUIRE(be, kiln_tensor_numel(a) == n && kiln_tensor_numel(b) == n))
        return;
    for (int64_t i = 0; i < n; i++)
        cpu_f32(y)[i] = cpu_f32(a)[i] + cpu_f32(b)[i];
}

void cpu_gated_add(kiln_backend *be, kiln_tensor *x, const kiln_tensor *gate,
                   const kiln_tensor *y)
{
    int64_t n = kiln_tensor_numel(x);
    if (CPU_REQUIRE(be, kiln_tensor_numel(y) == n))
        return;
    if (!gate) {
        for (int64_t i = 0; i < n; i++)
            cpu_f32(x)[i] += cpu_f32(y)[i];
        return;
    }
    if (CPU_REQUIRE(be, x->ndim == 3 && kiln_tensor_numel(gate) == x->shape[0] * x->shape[2]))
        return;
    int64_t bsz = x->shape[0], s = x->shape[1], d = x->shape[2];
    for (int64_t b = 0; b < bsz; b++)
        for (int64_t t = 0; t < s; t++)
            for (int64_t i = 0; i < d; i++)
                cpu_f32(x)[(b * s + t) * d + i] +=
                    cpu_f32(gate)[b * d + i] * cpu_f32(y)[(b * s + t) * d + i];
}

/* fp32 pipeline of diffusers: x + dt * v with every value fp32 (pipeline.md
 * section 7; the bf16 rounding chain belongs to the bf16 backends). */
void cpu_euler_step(kiln_backend *be, kiln_tensor *x, const kiln_tensor *v, float dt)
{
    int64_t n = kiln_tensor_numel(x);
    if (CPU_REQUIRE(be, kiln_tensor_numel(v) == n))
        return;
    for (int64_t i = 0; i < n; i++)
        cpu_f32(x)[i] = cpu_f32(x)[i] + dt * cpu_f32(v)[i];
}

/* Same operation order as diffusers: neg + g * (pos - neg). */
void cpu_cfg(kiln_backend *be, kiln_tensor *out, const kiln_tensor *pos, const kiln_tensor *neg,
             float g)
{
    int64_t n = kiln_tensor_numel(out);
    if (CPU_REQUIRE(be, kiln_tensor_numel(pos) == n && kiln_tensor_numel(neg) == n))
        return;
    for (int64_t i = 0; i < n; i++) {
        float p = cpu_f32(pos)[i], q = cpu_f32(neg)[i];
        cpu_f32(out)[i] = q + g * (p - q);
    }
}
