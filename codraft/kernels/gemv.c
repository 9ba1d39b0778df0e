// y (M,O) = x (M,I) @ w (O,I)^T for a few rows M, fp32, row-major, contiguous.
// Decoding is bound by how fast the weights stream from memory: every weight row is read
// once and dotted with up to 4 input rows while it sits in L1. Built by codraft/kernels/cbuild.py.
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += v[k];
    return s;
}

// out[k] = <w, x[k]> for k < nk (nk <= 4, a constant after inlining);
// two accumulators per row hide the FMA latency
static inline __attribute__((always_inline)) void dots(const float *w, const float *const *x, int64_t n,
                                                       float *out, const int nk) {
    v8 a[4][2] = {{{0}}};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8 w0 = load(w + i), w1 = load(w + i + 8);
        for (int k = 0; k < nk; k++) {
            a[k][0] += w0 * load(x[k] + i);
            a[k][1] += w1 * load(x[k] + i + 8);
        }
    }
    for (int k = 0; k < nk; k++) {
        float s = hsum(a[k][0] + a[k][1]);
        for (int64_t j = i; j < n; j++) s += w[j] * x[k][j];
        out[k] = s;
    }
}

void gemv_rows(const float *x, const float *w, float *y, int64_t m, int64_t in, int64_t out) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const float *row = w + o * in;
        for (int64_t r = 0; r < m; r += 4) {
            const float *xs[4];
            float d[4];
            int nk = m - r < 4 ? (int)(m - r) : 4;
            for (int k = 0; k < nk; k++) xs[k] = x + (r + k) * in;
            switch (nk) {  // a constant nk per call lets the compiler unroll the rows
                case 1: dots(row, xs, in, d, 1); break;
                case 2: dots(row, xs, in, d, 2); break;
                case 3: dots(row, xs, in, d, 3); break;
                default: dots(row, xs, in, d, 4);
            }
            for (int k = 0; k < nk; k++) y[(r + k) * out + o] = d[k];
        }
    }
}
