// DSpark's proposal loop (codraft/drafts/dspark.py, propose) in one call, for the vanilla Markov head.
// In torch it is ~10 small ops per slot (gather, product, add, softmax, cumsum, search), each a
// dispatch, which together cost more than the draft's layer at batch 1.
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define CHUNK 1024  // rows of W2 per parallel task

// z[i] = base[i] + <w2 row i, e> for i < K, rows of r values: LANES rows at a time, their sums folded
// into one vector (vec.h's hsums; W2 is thin, r ~ 72, so a sum per row would cost as much as the row).
// e is padded with zeros to whole vectors, so a row's last vector may read the next row's first
// values, times zero (finite weights); the last rows, where that would read past W2, one at a time.
static void bias_logits(const float *base, const float *w2, const float *e, float *z, int64_t K, int64_t r) {
    int64_t nv = (r + LANES - 1) / LANES, i0 = 0;
    float ep[nv * LANES];
    memset(ep, 0, sizeof ep);
    memcpy(ep, e, r * sizeof(float));
    for (; i0 + LANES <= K && (i0 + LANES - 1) * r + nv * LANES <= K * r; i0 += LANES) {
        vf part[LANES];
        for (int j = 0; j < LANES; j++) {
            const float *w = w2 + (i0 + j) * r;
            part[j] = (vf){0};
            for (int64_t c = 0; c < nv; c++) part[j] += vload(w + c * LANES) * vload(ep + c * LANES);
        }
        vstore(z + i0, vload(base + i0) + hsums(part));
    }
    for (; i0 < K; i0++) {
        float t = 0.0f;
        for (int64_t c = 0; c < r; c++) t += w2[i0 * r + c] * e[c];
        z[i0] = base[i0] + t;
    }
}

// the first index of the largest of n values
static int64_t argmax(const float *z, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (z[i] > z[best]) best = i;
    return best;
}

// sampling.c: a draw's steps (softmax normaliser, the softmax with its fp64 total, inverse CDF)
float softmax_lse(const float *x, int64_t n, float inv_t);
double softmax_residual(const float *l, const float *q, float *r, int64_t n, float inv_t, float lse);
int64_t inverse_cdf(const float *r, int64_t n, double total, double u);

// q = softmax(z / temperature) over n values, then the token drawn from it with u (inverse_cdf)
static int64_t draw(const float *z, float *q, int64_t n, float temperature, double u) {
    float inv = 1.0f / temperature;
    return inverse_cdf(q, n, softmax_residual(z, NULL, q, n, inv, softmax_lse(z, n, inv)), u);
}

// B rows, G slots, the draft's K tokens, rank r. Slot k of row b, with prev the W1 row of the token
// before it (prev0[b] at slot 0, then the token drawn at slot k - 1):
//   z = base[b, k] + W2 · W1[prev]              W1 (rows, r), W2 (K, r), fp32
//   temperature 0 (greedy): the token is the first argmax of z
//   else: q[b, k] = softmax(z / temperature), the token drawn from it with u[b, k] (draw)
// base and q (B, G, K), u (B, G) fp64 (unused when greedy, as q), tokens (B, G); scratch: B * K floats.
void markov_propose(const float *base, const float *w1, const float *w2, const int64_t *prev0, const double *u,
                    float temperature, float *q, int64_t *tokens, float *scratch, int64_t B, int64_t G, int64_t K,
                    int64_t r) {
    int64_t chunks = (K + CHUNK - 1) / CHUNK;
    for (int64_t k = 0; k < G; k++) {
        // the bias in chunks of W2's rows (one row reads W2 from memory: both cores' bandwidth), then the
        // draws, a row each
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t c = 0; c < chunks; c++) {
                int64_t i = c * CHUNK, n = K - i < CHUNK ? K - i : CHUNK;
                const float *e = w1 + (k ? tokens[b * G + k - 1] : prev0[b]) * r;
                bias_logits(base + (b * G + k) * K + i, w2 + i * r, e, scratch + b * K + i, n, r);
            }
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < B; b++)
            tokens[b * G + k] = temperature > 0.0f ? draw(scratch + b * K, q + (b * G + k) * K, K, temperature,
                                                          u[b * G + k])
                                                   : argmax(scratch + b * K, K);
    }
}
