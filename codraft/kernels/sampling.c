// The target's side of rollout sampling at a temperature without top-k / top-p, in one call each: a
// decode step's draw (codraft/spec/sampling.py, Sampler.sample_logits) and the speculative
// accept/reject rule of a verify round (codraft/spec/verify.py, verify_drafts). In torch both build the
// target's whole distribution (log-softmax, exp, an fp64 cumulative sum over the vocabulary): the
// rule ~2 ms a round at batch 1 and ~10 ms at batch 8 over SmolLM2's 49 152 tokens on a 2-core Xeon.
// Here each row is read a few times in place.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

// The three steps of a draw at temperature t, shared with markov.c's:
// log Σ exp(x / t) over n values (the log-softmax's normaliser at temperature t)
float softmax_lse(const float *x, int64_t n, float inv_t) {
    float top = -INFINITY, lanes[LANES];
    vf vtop = (vf){0} - INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) vtop = vmax(vtop, vload(x + i));  // (a scalar loop: 3/4 of the time)
    vstore(lanes, vtop);
    for (int j = 0; j < LANES; j++) top = lanes[j] > top ? lanes[j] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    top *= inv_t;
    vf acc = {0};
    i = 0;
    for (; i + LANES <= n; i += LANES) acc += vexp_neg(vload(x + i) * inv_t - top);
    vstore(lanes, acc);
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += lanes[j];
    for (; i < n; i++) sum += expf(x[i] * inv_t - top);
    return top + logf(sum);
}

// r = max(0, softmax(l / t) - q) over n values given the normaliser lse (q NULL: zero, r the softmax) ->
// its fp64 sum, in index order
double softmax_residual(const float *l, const float *q, float *r, int64_t n, float inv_t, float lse) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf p = vexp_neg(vload(l + i) * inv_t - lse);
        vstore(r + i, vmax(q ? p - vload(q + i) : p, (vf){0}));
    }
    for (; i < n; i++) {
        float p = expf(l[i] * inv_t - lse), d = q ? p - q[i] : p;
        r[i] = d > 0.0f ? d : 0.0f;
    }
    double total = 0.0;
    for (i = 0; i < n; i++) total += r[i];
    return total;
}

// the first index whose running fp64 sum of the n weights r exceeds u times their total (the sum
// softmax_residual returned: the same sums in the same order, so the last index of positive weight is
// always reached; n - 1 where roundings leave none), as codraft/spec/sampling.py's inverse_cdf
int64_t inverse_cdf(const float *r, int64_t n, double total, double u) {
    double at = u * total, run = 0.0;
    for (int64_t i = 0; i < n; i++)
        if ((run += r[i]) > at) return i;
    return n - 1;
}

// B rows, G drafts x (B, G) drawn from q (B, G, V); the target's logits (B, G + 1, V) at temperature t;
// uniforms u (B, G) float and u2 (B,) fp64 (what verify_drafts draws, in its order):
//   p_k = softmax(logits_k / t); accept x_k while u_k q_k(x_k) < p_k(x_k); n = the accepted prefix;
//   y ~ max(0, p_n - q_n) (q_G = 0: the bonus; an all-zero residual falls back to p_n), drawn by the
//   inverse CDF in fp64 with u2; tokens = x with slot n set to y (slot G: x_0 unless n = G);
//   logprobs[j] = log p_j(tokens[j]).
// n (B,), tokens and logprobs (B, G + 1); scratch: B * V floats.
void verify_sampled(const float *logits, const int64_t *x, const float *q, const float *u, const double *u2,
                    float t, int64_t *n_out, int64_t *tokens, float *logprobs, float *scratch, int64_t B,
                    int64_t G, int64_t V) {
    float inv_t = 1.0f / t, lses[B * (G + 1)];
#pragma omp parallel for schedule(static)
    for (int64_t bk = 0; bk < B * (G + 1); bk++) lses[bk] = softmax_lse(logits + bk * V, V, inv_t);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        const float *lb = logits + b * (G + 1) * V, *qb = q + b * G * V, *lse = lses + b * (G + 1);
        int64_t n = 0;
        for (; n < G; n++) {
            int64_t xk = x[b * G + n];
            if (!(u[b * G + n] * qb[n * V + xk] < expf(lb[n * V + xk] * inv_t - lse[n]))) break;
        }
        // the residual max(0, p_n - q_n), unnormalised; an all-zero one (p = q up to round-off): p_n
        float *r = scratch + b * V;
        double total = softmax_residual(lb + n * V, n < G ? qb + n * V : NULL, r, V, inv_t, lse[n]);
        if (!(total > 0.0)) total = softmax_residual(lb + n * V, NULL, r, V, inv_t, lse[n]);
        int64_t y = inverse_cdf(r, V, total, u2[b]), *tb = tokens + b * (G + 1);
        for (int64_t j = 0; j < G; j++) tb[j] = x[b * G + j];
        tb[G] = G ? x[b * G] : y;
        tb[n] = y;
        for (int64_t j = 0; j <= G; j++) logprobs[b * (G + 1) + j] = lb[j * V + tb[j]] * inv_t - lse[j];
        n_out[b] = n;
    }
}

// A decode step's draw for B rows of V logits at temperature t with fp64 uniforms u (B,): the token
// from softmax(logits / t) by the inverse CDF (the same fp64 sums as the search) and its logprob.
void sample_rows(const float *logits, const double *u, float t, int64_t *tokens, float *logprobs, float *scratch,
                 int64_t B, int64_t V) {
    float inv_t = 1.0f / t;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        const float *l = logits + b * V;
        float lse = softmax_lse(l, V, inv_t), *r = scratch + b * V;
        int64_t y = inverse_cdf(r, V, softmax_residual(l, NULL, r, V, inv_t, lse), u[b]);
        tokens[b] = y;
        logprobs[b] = l[y] * inv_t - lse;
    }
}
