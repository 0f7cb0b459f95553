/* Elementwise parts of a decoder layer in one pass each, for the CPU runtime's fp32 layers.
 *
 * In PyTorch an RMSNorm is six passes over its input (pow, mean, add, rsqrt, two multiplies,
 * each with a fresh output) and a gated MLP's SiLU(gate) * up two more; on a prefill step of
 * 1024 tokens these took about a fifth of the time the linear layers did. Here each is one
 * pass that reads its inputs once and writes its output once.
 *
 *   rms_norm:  y = w * (x * 1 / sqrt(mean(x^2) + eps))       per row of `dim` floats
 *   silu_mul:  y = silu(g) * u,  silu(g) = g / (1 + exp(-g))  element by element
 *   rope:      y = x * cos + rotate_half(x) * sin,  rotate_half(x) = [-x[D/2:], x[:D/2]]
 *
 * Same formulas, same order of the per-element operations as the PyTorch modules they stand
 * in for; what differs is the order in which mean(x^2) is summed and exp's last bits (two fp32
 * ulps at most), so results agree to within fp32 rounding, not bit for bit. rope is bit for
 * bit: two products and a sum per element, each rounded once, as PyTorch's three passes do
 * (the compiler must not contract them into a fused multiply-add, see rope_row).
 *
 * Input rows are addressed as [outer, inner, dim] with element strides (so, si, 1): a
 * contiguous tensor, or one head's columns of a fused projection's output, read in place.
 * Outputs are contiguous. Rows are split over `threads` (torch's own OpenMP pool when built
 * with -fopenmp).
 */
#ifdef _OPENMP
#include <omp.h>
#endif
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static void rms_row(const float *restrict x, const float *restrict w, float *restrict y,
                    int64_t n, float eps) {
    float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* y[r] = rms_norm(x[r]) for rows r = o * inner + i of x at o * so + i * si. */
void kvskill_rms_norm(const float *x, int64_t outer, int64_t inner, int64_t so, int64_t si,
                      const float *w, int64_t dim, float eps, float *y, int64_t threads) {
    int64_t rows = outer * inner;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++)
        rms_row(x + (r / inner) * so + (r % inner) * si, w, y + r * dim, dim, eps);
}

static inline float silu(float g) {
    /* exp of -|g| only (never overflows): for g >= 0, g / (1 + exp(-g)) as PyTorch writes it;
     * for g < 0 the same value as (g * exp(g)) / (1 + exp(g)); one division either way */
    float e = exp_nonpositive(-fabsf(g));
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

/* y[r, :] = silu(g[r, :]) * u[r, :] over `rows` rows of n floats; g and u rows are gs and us
 * elements apart (the two halves of one fused gate/up projection, or two tensors). */
void kvskill_silu_mul(const float *g, int64_t gs, const float *u, int64_t us, int64_t rows,
                      int64_t n, float *y, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict gr = g + r * gs;
        const float *restrict ur = u + r * us;
        float *restrict yr = y + r * n;
        for (int64_t i = 0; i < n; i++) yr[i] = silu(gr[i]) * ur[i];
    }
}

/* Not contracted into fma(x, c, r * s): that rounds once less than PyTorch's separate
 * multiply and add passes and would change the last bit. */
__attribute__((optimize("fp-contract=off"))) static void rope_row(
    const float *restrict x, const float *restrict c, const float *restrict s, float *restrict y,
    int64_t half) {
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int64_t i = 0; i < half; i++) y[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
}

/* y[t, h, :] = rope(x[t, h, :]) with cos and sin of token t; row (t, h) of x at
 * t * st + h * sh, of y at t * yt + h * yh; cos and sin rows cs and ss elements apart. */
void kvskill_rope(const float *x, int64_t tokens, int64_t heads, int64_t st, int64_t sh,
                  int64_t dim, const float *cos, int64_t cs, const float *sin, int64_t ss,
                  float *y, int64_t yt, int64_t yh, int64_t threads) {
    int64_t rows = tokens * heads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / heads, h = r % heads;
        rope_row(x + t * st + h * sh, cos + t * cs, sin + t * ss, y + t * yt + h * yh, dim / 2);
    }
}
