// The small per-layer operations of a KV-cache decode step, fused: at batch 1 torch's dispatch of
// its ~45 small ops per layer costs about as much in total as streaming the weights.
// Activations, norm weights, RoPE tables and the KV cache fp32; a layer's projection weights fp32 or
// bf16 (gemv.c). Row-major, contiguous. Built by codraft/kernels/cbuild.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

// <a, b> over n values, 8 lanes at a time (a plain loop would not vectorise: strict fp order)
static float dot(const float *a, const float *b, int64_t n) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += acc[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for each of m rows of d values
void rms_norm_rows(const float *x, const float *w, float *y, int64_t m, int64_t d, float eps) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * d;
        float inv = 1.0f / sqrtf(dot(xr, xr, d) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) y[r * d + i] = w[i] * (xr[i] * inv);
    }
}

// rotate-half RoPE of one head vector: out = x * cos + [-x2, x1] * sin
static void rope(const float *x, const float *cos, const float *sin, float *out, int64_t dh) {
    int64_t h = dh / 2;
    for (int64_t i = 0; i < h; i++) {
        out[i] = x[i] * cos[i] - x[i + h] * sin[i];
        out[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
    }
}

// T new tokens per row b at positions lengths[b] + t: rope q and k, write k and v into this
// layer's cache (B, Hkv, L, D), and attend each query head over keys 0..its own position
// (grouped-query: head h reads KV head h / (H / Hkv)).
//   q (B*T, H*D), k and v (B*T, Hkv*D), cos and sin (B*T, D), out (B*T, H*D)
void decode_attention(const float *q, const float *k, const float *v, const float *cos, const float *sin,
                      float *kc, float *vc, const int64_t *lengths, float *out,
                      int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bt = 0; bt < B * T; bt++)
        for (int64_t g = 0; g < Hkv; g++) {
            int64_t b = bt / T, pos = lengths[b] + bt % T;
            float *kd = kc + ((b * Hkv + g) * L + pos) * D, *vd = vc + ((b * Hkv + g) * L + pos) * D;
            rope(k + (bt * Hkv + g) * D, cos + bt * D, sin + bt * D, kd, D);
            for (int64_t i = 0; i < D; i++) vd[i] = v[(bt * Hkv + g) * D + i];
        }
    int64_t group = H / Hkv;
#pragma omp parallel
    {
        float *qr = malloc(D * sizeof(float)), *s = malloc((L > 0 ? L : 1) * sizeof(float));
#pragma omp for collapse(2) schedule(static)
        for (int64_t bt = 0; bt < B * T; bt++)
            for (int64_t h = 0; h < H; h++) {
                int64_t b = bt / T, n = lengths[b] + bt % T + 1;  // keys this query sees
                const float *kb = kc + (b * Hkv + h / group) * L * D, *vb = vc + (b * Hkv + h / group) * L * D;
                rope(q + (bt * H + h) * D, cos + bt * D, sin + bt * D, qr, D);
                float mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    s[j] = dot(qr, kb + j * D, D) * scale;
                    if (s[j] > mx) mx = s[j];
                }
                for (int64_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] - mx));
                float *o = out + (bt * H + h) * D;
                for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    float p = s[j] / sum;
                    for (int64_t i = 0; i < D; i++) o[i] += p * vb[j * D + i];
                }
            }
        free(qr);
        free(s);
    }
}

// gemv.c: fp32 or bf16 weights; amx.c: bf16 weights on AMX tiles (where the row count makes it faster)
void gemv_rows(const float *x, const float *w, float *y, int64_t m, int64_t in, int64_t out);
void gemv_rows_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out);
void gemm_amx_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out);

// how a layer's products run: fp32 weights (gemv.c), bf16 (gemv.c), bf16 on AMX tiles (amx.c)
enum { FP32, BF16, BF16_AMX };

static void product(const float *x, const void *w, int kind, float *y, int64_t m, int64_t in, int64_t out) {
    if (kind == BF16_AMX)
        gemm_amx_bf16(x, w, y, m, in, out);
    else if (kind == BF16)
        gemv_rows_bf16(x, w, y, m, in, out);
    else
        gemv_rows(x, w, y, m, in, out);
}

// One decoder layer for m = B*T new tokens (the products go through gemv.c or amx.c, per `kind`):
//   h = x + o_proj(attention(rope(q, k), cache))   with q, k, v = projections of rms_norm(x)
//   y = h + down(silu(gate(n)) * up(n))            with n = rms_norm(h)
// w: the layer's input norm, q, k, v, o, post-attention norm, gate, up, down weights (HF shapes);
// the norms fp32, the 7 projections fp32 (kind FP32) or bf16 (raw bits; kind BF16 or BF16_AMX).
// k and v are written into this layer's cache as in decode_attention. scratch: layer_scratch floats.
static int64_t layer_scratch(int64_t m, int64_t D, int64_t nq, int64_t nkv, int64_t I) {
    return m * (D + nq + 2 * nkv + nq + 2 * I);
}

static void layer(const float *x, float *y, const void *const *w, const float *cos, const float *sin,
                  float *kc, float *vc, const int64_t *lengths, int64_t B, int64_t T, int64_t D, int64_t H,
                  int64_t Hkv, int64_t hd, int64_t I, int64_t L, float eps, int kind, float *scratch) {
    int64_t m = B * T, nq = H * hd, nkv = Hkv * hd;
    float *n = scratch, *q = n + m * D, *k = q + m * nq, *v = k + m * nkv, *att = v + m * nkv, *g = att + m * nq,
          *u = g + m * I;
    rms_norm_rows(x, w[0], n, m, D, eps);
    product(n, w[1], kind, q, m, D, nq);
    product(n, w[2], kind, k, m, D, nkv);
    product(n, w[3], kind, v, m, D, nkv);
    decode_attention(q, k, v, cos, sin, kc, vc, lengths, att, B, T, H, Hkv, hd, L, 1.0f / sqrtf((float)hd));
    product(att, w[4], kind, y, m, nq, D);
    for (int64_t i = 0; i < m * D; i++) y[i] += x[i];
    rms_norm_rows(y, w[5], n, m, D, eps);
    product(n, w[6], kind, g, m, D, I);
    product(n, w[7], kind, u, m, D, I);
    for (int64_t i = 0; i < m * I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    product(g, w[8], kind, n, m, I, D);
    for (int64_t i = 0; i < m * D; i++) y[i] += n[i];
}

void decode_layer(const float *x, float *y, const void *const *w, const float *cos, const float *sin,
                  float *kc, float *vc, const int64_t *lengths, int64_t B, int64_t T, int64_t D, int64_t H,
                  int64_t Hkv, int64_t hd, int64_t I, int64_t L, float eps, int kind) {
    float *scratch = malloc(layer_scratch(B * T, D, H * hd, Hkv * hd, I) * sizeof(float));
    layer(x, y, w, cos, sin, kc, vc, lengths, B, T, D, H, Hkv, hd, I, L, eps, kind, scratch);
    free(scratch);
}

// n_layers decoder layers of one shape in one call (a decode step's whole stack): layer l reads
// w[9 l .. 9 l + 8] and its cache at kc/vc + l * (B*Hkv*L*hd) (the KV cache's (layers, B, Hkv, L, hd)
// tensors), and when taps[l] is not NULL its output is also copied there. x (B*T, D) in, y out.
// At batch 1 the Python and ctypes calls around one call per layer cost ~1/4 of the layers' own time.
void decode_stack(const float *x, float *y, const void *const *w, const float *cos, const float *sin,
                  float *kc, float *vc, const int64_t *lengths, float *const *taps, int64_t n_layers,
                  int64_t B, int64_t T, int64_t D, int64_t H, int64_t Hkv, int64_t hd, int64_t I, int64_t L,
                  float eps, int kind) {
    int64_t m = B * T, per_layer = B * Hkv * L * hd, own = layer_scratch(m, D, H * hd, Hkv * hd, I);
    float *scratch = malloc((own + m * D) * sizeof(float)), *other = scratch + own;
    // ping-pong so that the last layer writes y: layer l writes y when n_layers - l is odd
    const float *in = x;
    for (int64_t l = 0; l < n_layers; l++) {
        float *out = (n_layers - l) % 2 ? y : other;
        layer(in, out, w + 9 * l, cos, sin, kc + l * per_layer, vc + l * per_layer, lengths, B, T, D, H, Hkv, hd, I,
              L, eps, kind, scratch);
        if (taps[l]) memcpy(taps[l], out, m * D * sizeof(float));
        in = out;
    }
    free(scratch);
}
