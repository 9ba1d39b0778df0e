// The small per-layer operations of a KV-cache decode step, fused: at batch 1 torch's dispatch of
// its ~45 small ops per layer costs about as much in total as streaming the weights.
// Activations, norm weights, RoPE tables and the KV cache fp32; a layer's projection weights fp32 or
// bf16 (gemv.c). Row-major, contiguous. Built by codraft/kernels/cbuild.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

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

// A head's vector is its first nd = D - D % LANES values (vec.h's vf), the rest a scalar tail.
#define MAX_NC 16  // attend's head vectors: head_dim up to 16 * LANES

// One query (D values, roped) over keys and values 0..n-1 (rows of D): softmax(q·kᵀ·scale)·v -> o.
// The first nc vectors of each head (a constant where attend_nc is inlined, so that q and the sums stay
// in registers), then a scalar tail; s: room for n rounded up to LANES.
INLINE void attend_nc(const float *q, const float *kb, const float *vb, int64_t n, int64_t D, float scale,
                      float *s, float *o, const int nc) {
    int64_t nd = (int64_t)nc * LANES;
    vf qv[MAX_NC], top = (vf){0} - INFINITY;
    for (int c = 0; c < nc; c++) qv[c] = vload(q + c * LANES);
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {  // scores, LANES keys at a time
        int cnt = n - j0 < LANES ? (int)(n - j0) : LANES;
        vf part[LANES];
        for (int j = 0; j < LANES; j++) {
            part[j] = (vf){0};
            if (j < cnt)
                for (int c = 0; c < nc; c++) part[j] += qv[c] * vload(kb + (j0 + j) * D + c * LANES);
        }
        vf sc = hsums(part);
        for (int j = 0; j < cnt && nd < D; j++) {  // the scalar tail of each row
            float t = 0.0f;
            for (int64_t i = nd; i < D; i++) t += q[i] * kb[(j0 + j) * D + i];
            sc[j] += t;
        }
        sc *= scale;
        vstore(s + j0, sc);
        if (cnt == LANES) top = vmax(top, sc);
        else
            for (int j = 0; j < cnt; j++) top[0] = top[0] > sc[j] ? top[0] : sc[j];
    }
    float mx = top[0], lanes[LANES];
    for (int i = 1; i < LANES; i++) mx = mx > top[i] ? mx : top[i];
    vf total = (vf){0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        vf e = vexp_neg(vload(s + j) - mx);
        vstore(s + j, e);
        total += e;
    }
    if (j < n) {  // the last keys: the lanes past n must not count
        vf e = vexp_neg(vload(s + j) - mx);
        vstore(lanes, e);
        for (int64_t i = j; i < n; i++) total[0] += s[i] = lanes[i - j];
    }
    float sum = 0.0f;
    vstore(lanes, total);
    for (int i = 0; i < LANES; i++) sum += lanes[i];
    vf even[MAX_NC], odd[MAX_NC];  // sums over even and odd keys: twice the chains in flight
    for (int c = 0; c < nc; c++) even[c] = odd[c] = (vf){0};
    for (j = 0; j + 1 < n; j += 2)
        for (int c = 0; c < nc; c++) {
            even[c] += s[j] * vload(vb + j * D + c * LANES);
            odd[c] += s[j + 1] * vload(vb + (j + 1) * D + c * LANES);
        }
    if (j < n)
        for (int c = 0; c < nc; c++) even[c] += s[j] * vload(vb + j * D + c * LANES);
    float inv = 1.0f / sum;
    for (int c = 0; c < nc; c++) vstore(o + c * LANES, (even[c] + odd[c]) * inv);
    for (int64_t i = nd; i < D; i++) {
        float t = 0.0f;
        for (j = 0; j < n; j++) t += s[j] * vb[j * D + i];
        o[i] = t * inv;
    }
}

static void attend(const float *q, const float *kb, const float *vb, int64_t n, int64_t D, float scale, float *s,
                   float *o) {
    switch (D / LANES) {  // head_dim 64: 4 vectors of 16, 8 of 8
        case 0: attend_nc(q, kb, vb, n, D, scale, s, o, 0); break;
        case 1: attend_nc(q, kb, vb, n, D, scale, s, o, 1); break;
        case 2: attend_nc(q, kb, vb, n, D, scale, s, o, 2); break;
        case 4: attend_nc(q, kb, vb, n, D, scale, s, o, 4); break;
        case 8: attend_nc(q, kb, vb, n, D, scale, s, o, 8); break;
        default: attend_nc(q, kb, vb, n, D, scale, s, o, D / LANES < MAX_NC ? (int)(D / LANES) : MAX_NC);
    }
}

// Keys and values of T new tokens per row b into this layer's cache (B, Hkv, L, D) at positions
// lengths[b] + t (none past L - 1: a block draft's commit has junk slots there): k normed per head
// (kn: RMSNorm weights (D), or NULL) and roped, v as is. k and v (B*T, Hkv*D), cos and sin (B*T, D).
static void cache_write(const float *k, const float *v, const float *cos, const float *sin, float *kc, float *vc,
                        const int64_t *lengths, const float *kn, float eps, int64_t B, int64_t T, int64_t Hkv,
                        int64_t D, int64_t L) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bt = 0; bt < B * T; bt++)
        for (int64_t g = 0; g < Hkv; g++) {
            int64_t b = bt / T, pos = lengths[b] + bt % T;
            if (pos >= L) continue;
            float *kd = kc + ((b * Hkv + g) * L + pos) * D, *vd = vc + ((b * Hkv + g) * L + pos) * D;
            const float *kh = k + (bt * Hkv + g) * D;
            if (kn) {  // normed into a copy, roped from it into the cache slot
                float normed[D];
                rms_norm_rows(kh, kn, normed, 1, D, eps);
                rope(normed, cos + bt * D, sin + bt * D, kd, D);
            } else
                rope(kh, cos + bt * D, sin + bt * D, kd, D);
            memcpy(vd, v + (bt * Hkv + g) * D, D * sizeof(float));
        }
}

// T new tokens per row b at positions lengths[b] + t: rope q and k, write k and v into this
// layer's cache (B, Hkv, L, D), and attend each query head over keys 0..its own position
// (grouped-query: head h reads KV head h / (H / Hkv)); with `block`, every query of row b over keys
// 0..lengths[b] + T - 1 (a block draft's slots see each other both ways). qn, kn: per-head RMSNorm
// weights (D) applied before RoPE (Qwen3's q/k norms), or NULL.
//   q (B*T, H*D), k and v (B*T, Hkv*D), cos and sin (B*T, D), out (B*T, H*D)
void decode_attention(const float *q, const float *k, const float *v, const float *cos, const float *sin,
                      float *kc, float *vc, const int64_t *lengths, float *out,
                      int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale,
                      const float *qn, const float *kn, float eps, int block) {
    cache_write(k, v, cos, sin, kc, vc, lengths, kn, eps, B, T, Hkv, D, L);
    int64_t group = H / Hkv;
#pragma omp parallel
    {
        float *qr = malloc(2 * D * sizeof(float)), *s = malloc((L + LANES) * sizeof(float));
#pragma omp for collapse(2) schedule(static)
        for (int64_t bt = 0; bt < B * T; bt++)
            for (int64_t h = 0; h < H; h++) {
                int64_t b = bt / T, n = lengths[b] + (block ? T : bt % T + 1);  // keys this query sees
                const float *kb = kc + (b * Hkv + h / group) * L * D, *vb = vc + (b * Hkv + h / group) * L * D;
                const float *qh = q + (bt * H + h) * D;
                if (qn) {
                    rms_norm_rows(qh, qn, qr + D, 1, D, eps);
                    qh = qr + D;
                }
                rope(qh, cos + bt * D, sin + bt * D, qr, D);
                attend(qr, kb, vb, n, D, scale, s, out + (bt * H + h) * D);
            }
        free(qr);
        free(s);
    }
}

// gemv.c: fp32 or bf16 weights; amx.c: bf16 weights on AMX tiles (where the row count makes it faster)
// g = silu(g) * u, LANES at once: sigmoid(g) = e / (1 + e) for g < 0 and 1 / (1 + e) otherwise, with
// e = exp(-|g|) in vexp_neg's domain. libm's expf, one value at a time, cost ~10 ms of a 24-row step.
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf x = vload(g + i), one = (vf){0} + 1.0f, ax;
        vi bits;
        memcpy(&bits, &x, sizeof bits);
        vi neg = bits < 0;  // the sign bit
        bits &= 0x7fffffff;
        memcpy(&ax, &bits, sizeof ax);
        vf e = vexp_neg((vf){0} - ax);
        vstore(g + i, x * vselect(neg, e, one) / (one + e) * vload(u + i));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void gemv_rows(const float *x, const float *w, float *y, int64_t m, int64_t in, int64_t out);
void gemv_rows_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out);
void gemv_panels_bf16(const float *x, const uint16_t *packed, float *y, int64_t m, int64_t in, int64_t out);
void gemm_amx_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out);

// how a layer's products run: fp32 weights (gemv.c), bf16 (gemv.c), bf16 on AMX tiles (amx.c), bf16
// packed in panels (gemv.c's pack_panels_bf16)
enum { FP32, BF16, BF16_AMX, BF16_PANELS };

static void product(const float *x, const void *w, int kind, float *y, int64_t m, int64_t in, int64_t out) {
    if (kind == BF16_AMX)
        gemm_amx_bf16(x, w, y, m, in, out);
    else if (kind == BF16_PANELS)
        gemv_panels_bf16(x, w, y, m, in, out);
    else if (kind == BF16)
        gemv_rows_bf16(x, w, y, m, in, out);
    else
        gemv_rows(x, w, y, m, in, out);
}

// One decoder layer for m = B*T new tokens (the products go through gemv.c or amx.c, per `kind`):
//   h = x + o_proj(attention(rope(q, k), cache))   with q, k, v = projections of rms_norm(x)
//   y = h + down(silu(gate(n)) * up(n))            with n = rms_norm(h)
// w: the layer's input norm, q, k, v, o, post-attention norm, gate, up, down weights (HF shapes);
// the norms fp32, the 7 projections fp32 (kind FP32) or bf16 (raw bits; kind BF16 or BF16_AMX; packed
// in panels for BF16_PANELS).
// k and v are written into this layer's cache as in decode_attention. scratch: layer_scratch floats.
static int64_t layer_scratch(int64_t m, int64_t D, int64_t nq, int64_t nkv, int64_t I) {
    return m * (D + nq + 2 * nkv + nq + 2 * I);
}

static void layer(const float *x, float *y, const void *const *w, const float *const *qk, const float *cos,
                  const float *sin, float *kc, float *vc, const int64_t *lengths, int64_t B, int64_t T, int64_t D,
                  int64_t H, int64_t Hkv, int64_t hd, int64_t I, int64_t L, float eps, int kind, int block,
                  float *scratch) {
    int64_t m = B * T, nq = H * hd, nkv = Hkv * hd;
    float *n = scratch, *q = n + m * D, *k = q + m * nq, *v = k + m * nkv, *att = v + m * nkv, *g = att + m * nq,
          *u = g + m * I;
    rms_norm_rows(x, w[0], n, m, D, eps);
    product(n, w[1], kind, q, m, D, nq);
    product(n, w[2], kind, k, m, D, nkv);
    product(n, w[3], kind, v, m, D, nkv);
    decode_attention(q, k, v, cos, sin, kc, vc, lengths, att, B, T, H, Hkv, hd, L, 1.0f / sqrtf((float)hd),
                     qk ? qk[0] : NULL, qk ? qk[1] : NULL, eps, block);
    product(att, w[4], kind, y, m, nq, D);
    for (int64_t i = 0; i < m * D; i++) y[i] += x[i];
    rms_norm_rows(y, w[5], n, m, D, eps);
    product(n, w[6], kind, g, m, D, I);
    product(n, w[7], kind, u, m, D, I);
    silu_mul(g, u, m * I);
    product(g, w[8], kind, n, m, I, D);
    for (int64_t i = 0; i < m * D; i++) y[i] += n[i];
}

// n_layers decoder layers of one shape in one call (a decode step's whole stack): layer l reads
// w[9 l .. 9 l + 8], its q/k norm weights qk[2 l], qk[2 l + 1] (qk NULL: layers without them) and its
// cache at kc/vc + l * (B*Hkv*L*hd) (the KV cache's (layers, B, Hkv, L, hd) tensors), and when taps[l]
// is not NULL its output is also copied there. x (B*T, D) in, y out; `block`: decode_attention's.
// At batch 1 the Python and ctypes calls around one call per layer cost ~1/4 of the layers' own time.
void decode_stack(const float *x, float *y, const void *const *w, const float *const *qk, const float *cos,
                  const float *sin, float *kc, float *vc, const int64_t *lengths, float *const *taps,
                  int64_t n_layers, int64_t B, int64_t T, int64_t D, int64_t H, int64_t Hkv, int64_t hd, int64_t I,
                  int64_t L, float eps, int kind, int block) {
    int64_t m = B * T, per_layer = B * Hkv * L * hd, own = layer_scratch(m, D, H * hd, Hkv * hd, I);
    float *scratch = malloc((own + m * D) * sizeof(float)), *other = scratch + own;
    // ping-pong so that the last layer writes y: layer l writes y when n_layers - l is odd
    const float *in = x;
    for (int64_t l = 0; l < n_layers; l++) {
        float *out = (n_layers - l) % 2 ? y : other;
        layer(in, out, w + 9 * l, qk ? qk + 2 * l : NULL, cos, sin, kc + l * per_layer, vc + l * per_layer, lengths,
              B, T, D, H, Hkv, hd, I, L, eps, kind, block, scratch);
        if (taps[l]) memcpy(taps[l], out, m * D * sizeof(float));
        in = out;
    }
    free(scratch);
}

// A block draft's commit (codraft/drafts/block_backbone.py) in one call: T new context positions per
// row b, at lengths[b] + t, from their tapped target features x (B*T, Din), into every layer's cache:
//   c = rms_norm(fc · x), then for layer l: k = k_norm(W_k · c) roped, v = W_v · c (cache_write)
// w: fc, then each layer's W_k and W_v (products per `kind`, as decode_stack's); norms: the hidden
// norm, then each layer's k norm (D = hd values); the caches as decode_stack's.
void context_stack(const float *x, const void *const *w, const float *const *norms, const float *cos,
                   const float *sin, float *kc, float *vc, const int64_t *lengths, int64_t n_layers, int64_t B,
                   int64_t T, int64_t Din, int64_t D, int64_t Hkv, int64_t hd, int64_t L, float eps, int kind) {
    int64_t m = B * T, nkv = Hkv * hd, per_layer = B * Hkv * L * hd;
    float *c = malloc((m * D + 2 * m * nkv) * sizeof(float)), *k = c + m * D, *v = k + m * nkv;
    product(x, w[0], kind, c, m, Din, D);
    rms_norm_rows(c, norms[0], c, m, D, eps);  // (in place: a row's scale is read before it is written)
    for (int64_t l = 0; l < n_layers; l++) {
        product(c, w[1 + 2 * l], kind, k, m, D, nkv);
        product(c, w[2 + 2 * l], kind, v, m, D, nkv);
        cache_write(k, v, cos, sin, kc + l * per_layer, vc + l * per_layer, lengths, norms[1 + l], eps, B, T, Hkv,
                    hd, L);
    }
    free(c);
}
