// y (M,O) = x (M,I) @ w (O,I)^T for few rows M; x and y fp32, w fp32 (gemv_rows) or bf16
// (gemv_rows_bf16: the raw uint16 bits, each widened exactly to fp32; products and sums in fp32, so
// the result is x @ fp32(w)^T up to summation order). Row-major, contiguous.
// Decoding is bound by how fast the weights stream from memory: every weight row is read from
// memory once and dotted with every input row (one or two weight rows by up to 6 input rows at a time)
// while it sits in L1; bf16 weights halve the bytes. One body serves both weight types (a compile-time flag
// picks the load).
// Built by codraft/kernels/cbuild.py.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

// how far ahead of the weight being read to prefetch: the hardware prefetchers alone streamed the
// weights from DRAM ~25% slower (bf16, 1 row) to ~40% slower (4 rows)
#define PREFETCH_BYTES 4096

// and into which cache: L1 (0, prefetcht0), L2 (1, prefetcht1) or none (2: the hardware prefetchers
// alone); and from how many input rows the weight rows go two at a time (pairs load each block of x
// once for two weight rows: fewer loads per FMA, for the compute-bound many-row case; one weight row
// streams one address range: 5-20% faster at 1-4 rows on a 2-core EPYC). Per weight dtype ([0] fp32,
// [1] bf16) the threshold and a prefetch mode for each side of it, whichever streams fastest on this
// machine, measured once by codraft/kernels/gemv.py (L2: a model's bf16 products ~9% faster at 1-4
// rows on a 2-core Xeon, where L1's few fill buffers bound the lines in flight). [2]: bf16 weights
// packed in panels (below), their own prefetch mode (no pairs): the rows kernel's choice cost a
// batch-8 step ~12% on a 2-core EPYC.
enum { TUNED_KINDS = 3 };
static int prefetch_mode[TUNED_KINDS][2];  // [fp32, bf16, bf16 panels][pairs]
static int pair_rows[TUNED_KINDS] = {2, 2, 2};
static int kind_index(int kind) { return kind < 0 ? 0 : kind >= TUNED_KINDS ? TUNED_KINDS - 1 : kind; }
void set_tuning(int kind, int mode_one, int mode_pairs, int rows) {
    prefetch_mode[kind_index(kind)][0] = mode_one;
    prefetch_mode[kind_index(kind)][1] = mode_pairs;
    pair_rows[kind_index(kind)] = rows;
}
int get_prefetch(int kind, int pairs) { return prefetch_mode[kind_index(kind)][pairs != 0]; }
int get_pair_rows(int kind) { return pair_rows[kind_index(kind)]; }

typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

INLINE vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

// A block of 2*LANES bf16 weights loads as LANES 32-bit lanes, each holding an even-indexed weight in
// one half and the next odd one in the other. bf16 is the top half of an fp32, so a shift widens the
// evens and a mask the odds, exactly and with no shuffle; the input rows are reordered to match
// (deinterleave), so w0/w1 pair with the first/second LANES values of each block of either layout.
// (GCC 12 compiles the in-order widening, __builtin_convertvector of 16-bit lanes, to ~3 shuffles
// per 8 weights: 10-15% slower streamed at 1-2 rows, up to 60% slower cache-hot.)
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define EVEN(u) ((u) << 16)
#define ODD(u) ((u) & 0xffff0000u)
#else
#define EVEN(u) ((u) & 0xffff0000u)
#define ODD(u) ((u) << 16)
#endif

INLINE void load_bf16(const uint16_t *p, vf *w0, vf *w1) {
    vu u, even, odd;
    memcpy(&u, p, sizeof u);
    even = EVEN(u);
    odd = ODD(u);
    memcpy(w0, &even, sizeof *w0);
    memcpy(w1, &odd, sizeof *w1);
}

INLINE float bf16_at(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// the weight at i widened to fp32 (the scalar tail of a row)
INLINE float w_at(const void *w, int64_t i, const int bf16) {
    return bf16 ? bf16_at((const uint16_t *)w + i) : ((const float *)w)[i];
}

// x (m rows of n) with each whole block of 2*LANES values reordered evens first, then odds, as
// load_bf16 widens the weights; the tail stays in place. Freed by the caller.
static float *deinterleave(const float *x, int64_t m, int64_t n) {
    float *out = malloc((m * n > 0 ? m * n : 1) * sizeof(float));
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * n;
        float *dst = out + r * n;
        int64_t i = 0;
        for (; i + 2 * LANES <= n; i += 2 * LANES)
            for (int j = 0; j < LANES; j++) {
                dst[i + j] = src[i + 2 * j];
                dst[i + LANES + j] = src[i + 2 * j + 1];
            }
        for (; i < n; i++) dst[i] = src[i];
    }
    return out;
}

// pairwise, in registers: log2(LANES) shuffle + add steps (this runs once per weight row and input
// row; a store and a scalar loop made it as costly as the dot itself from ~8 rows on)
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
INLINE float hsum(vf v) {
#if LANES == 16
    vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf8 h = v;
#endif
    vf4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}
#else
INLINE float hsum(vf v) {
    float s[LANES];
    memcpy(s, &v, sizeof s);
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int k = 0; k < half; k++) s[k] += s[k + half];
    return s[0];
}
#endif

// Keeps v in a vector register at this point: without it GCC folds each load of a block of x into
// every FMA that uses it (a load per FMA, not per block) and the loop became bound by loads.
// (x86 with registers as wide as vf: AVX's ymm for 8 lanes, AVX-512's zmm for 16.)
#if (defined(__x86_64__) || defined(__i386__)) && (LANES == 8 && defined(__AVX__) || LANES == 16 && defined(__AVX512F__))
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

// x rows dotted per tile: 2 weight rows x 6 input rows are 12 accumulators, 2 weights and a block of x
// in registers, within AVX2's 16; all the rows of a decode step up to 6 in one pass over the weights.
#define TILE_ROWS 6

// half h (0: the first LANES values, or the evens of bf16) of the weight block at i, widened to fp32
INLINE vf half_w(const void *w, int64_t i, const int h, const int bf16) {
    if (!bf16) return load((const float *)w + i + h * LANES);
    vf w0, w1;
    load_bf16((const uint16_t *)w + i, &w0, &w1);
    return h ? w1 : w0;
}

// out[TILE_ROWS j + k] = <w_j, x[k]> for weight rows j < nw (nw <= 2, `stride` values apart) and input
// rows k < nk (nk <= TILE_ROWS), constants after inlining. Each block of x is loaded once for both weight
// rows and each weight block once for all the input rows. Up to 4 sums keep a second accumulator for
// the second half of each block, to hide the FMA latency; more have chains enough.
INLINE void dots(const void *w, int64_t stride, const float *const *x, int64_t n, float *out, const int nw,
                 const int nk, const int bf16, const int hint) {
    const int split = nw * nk <= 4;
    vf a[2][TILE_ROWS][2];
    for (int j = 0; j < nw; j++)  // only the used ones: `= {0}` compiled to a memset call per weight row
        for (int k = 0; k < nk; k++) a[j][k][0] = a[j][k][1] = (vf){0};
    int64_t i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES) {
        for (int j = 0; j < nw; j++) {
            const char *ahead = (const char *)w + (j * stride + i) * (bf16 ? 2 : 4) + PREFETCH_BYTES;
            for (int b = 0; hint != 2 && b < 2 * LANES * (bf16 ? 2 : 4); b += 64) {
                if (hint)
                    __builtin_prefetch(ahead + b, 0, 2);
                else
                    __builtin_prefetch(ahead + b, 0, 3);
            }
        }
        for (int h = 0; h < 2; h++) {
            vf wv[2];
            for (int j = 0; j < nw; j++) {
                wv[j] = half_w(w, j * stride + i, h, bf16);
                IN_REGISTER(wv[j]);
            }
            for (int k = 0; k < nk; k++) {
                vf xk = load(x[k] + i + h * LANES);
                IN_REGISTER(xk);
                for (int j = 0; j < nw; j++) a[j][k][split ? h : 0] += wv[j] * xk;
            }
        }
    }
    for (int j = 0; j < nw; j++)
        for (int k = 0; k < nk; k++) {
            float s = hsum(split ? a[j][k][0] + a[j][k][1] : a[j][k][0]);
            for (int64_t t = i; t < n; t++) s += w_at(w, j * stride + t, bf16) * x[k][t];
            out[TILE_ROWS * j + k] = s;
        }
}

#define DOTS(nw, nk) \
    case (nw - 1) * TILE_ROWS + nk - 1: dots(row, in, xs, in, d, nw, nk, bf16, hint); break
// columns o0..o1 of y: each weight row, or pair of rows (from pair_rows input rows on), read from memory
// once and dotted with all the rows of x, TILE_ROWS at a time, while it sits in L1 (the rows of x come
// from L1 or L2: a decode step's few rows are a few KB).
INLINE void weight_rows(const float *x, const void *w, float *y, int64_t m, int64_t in, int64_t out,
                        int64_t o0, int64_t o1, const int bf16, const int hint) {
    const int64_t step = m >= pair_rows[bf16] ? 2 : 1;
    for (int64_t o = o0; o < o1; o += step) {
        const void *row = bf16 ? (const void *)((const uint16_t *)w + o * in)
                               : (const void *)((const float *)w + o * in);
        int nw = step == 2 && o + 1 < o1 ? 2 : 1;
        for (int64_t r = 0; r < m; r += TILE_ROWS) {
            const float *xs[TILE_ROWS];
            int nk = m - r < TILE_ROWS ? (int)(m - r) : TILE_ROWS;
            for (int k = 0; k < nk; k++) xs[k] = x + (r + k) * in;
            float d[2 * TILE_ROWS];
            switch ((nw - 1) * TILE_ROWS + nk - 1) {  // constant nw, nk per call let the compiler unroll them
                DOTS(1, 1); DOTS(1, 2); DOTS(1, 3); DOTS(1, 4); DOTS(1, 5); DOTS(1, 6);
                DOTS(2, 1); DOTS(2, 2); DOTS(2, 3); DOTS(2, 4); DOTS(2, 5); DOTS(2, 6);
            }
            for (int j = 0; j < nw; j++)
                for (int k = 0; k < nk; k++) y[(r + k) * out + o + j] = d[TILE_ROWS * j + k];
        }
    }
}

// weight rows per task: ~16 KB of them (a third of a typical L1d), but at least 4 tasks per thread
static int64_t chunk_rows(int64_t in, int64_t out, int64_t weight_size) {
    int64_t fit = 16384 / (in * weight_size + 1), balanced = out / (4 * omp_get_max_threads());
    int64_t rows = fit < balanced ? fit : balanced;
    return rows > 1 ? rows & ~(int64_t)1 : 1;  // even: weight rows go in pairs
}

// f(..., mode) with the prefetch mode a constant in each of three copies of f
#define BY_MODE(mode, f, ...)          \
    do {                               \
        if ((mode) == 0)               \
            f(__VA_ARGS__, 0);         \
        else if ((mode) == 1)          \
            f(__VA_ARGS__, 1);         \
        else                           \
            f(__VA_ARGS__, 2);         \
    } while (0)

// the columns of one task
INLINE void task(const float *x, const void *w, float *y, int64_t m, int64_t in, int64_t out, int64_t o,
                 int64_t chunk, const int bf16) {
    int64_t o1 = o + chunk < out ? o + chunk : out;
    BY_MODE(prefetch_mode[bf16][m >= pair_rows[bf16]], weight_rows, x, w, y, m, in, out, o, o1, bf16);
}

void gemv_rows(const float *x, const float *w, float *y, int64_t m, int64_t in, int64_t out) {
    int64_t chunk = chunk_rows(in, out, sizeof *w);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o += chunk) task(x, w, y, m, in, out, o, chunk, 0);
}

void gemv_rows_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out) {
    int64_t chunk = chunk_rows(in, out, sizeof *w);
    float *xd = deinterleave(x, m, in);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o += chunk) task(xd, w, y, m, in, out, o, chunk, 1);
    free(xd);
}

// ---- bf16 weights packed in panels (copies of the rollout weights, codraft/kernels/panels.py) ----
// The layout above dots each weight row with each input row: every product ends in a horizontal sum,
// and each FMA needs its own block of x, so 2-8 input rows ran at ~60-70% of the FMA rate with the
// weights in cache. Packed in panels of PANEL output rows (pack_panels_bf16), the weights of one input
// index k for a whole panel are one vector load, widened into 2 x LANES outputs by load_bf16 (evens:
// the panel's first LANES outputs, odds: the next LANES), and each input row contributes one broadcast
// x[r][k]: FMAs into accumulators that are already y's outputs. Measured on a 2-core EPYC
// (docs/bench-spec.md, session 20): 1.1x the rows kernel streamed at 1 row, 1.2-1.4x at 2-4 rows,
// ~1.4x with the weights in cache at 4-8 rows (at the FMA rate).
#define PANEL (2 * LANES)
int panel_rows(void) { return PANEL; }
// input rows per tile: AVX-512's 32 vector registers hold 8 rows x 2 x LANES accumulators (AVX2's 16
// hold 4), so each widened weight vector serves twice the FMAs
#ifndef ROW_TILE
#define ROW_TILE (LANES == 16 ? 8 : 4)
#endif

// w (out, in) row-major bf16 -> packed (ceil(out / PANEL), in, PANEL): panel p, input k holds outputs
// p*PANEL + j at even position 2j and p*PANEL + LANES + j at 2j + 1 (zero past `out`)
void pack_panels_bf16(const uint16_t *w, uint16_t *packed, int64_t out, int64_t in) {
    int64_t panels = (out + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < in; k++)
            for (int j = 0; j < LANES; j++) {
                int64_t a = p * PANEL + j, b = a + LANES;
                uint16_t *dst = packed + (p * in + k) * PANEL + 2 * j;
                dst[0] = a < out ? w[a * in + k] : 0;
                dst[1] = b < out ? w[b * in + k] : 0;
            }
}

// y[r0 .. r0+R, the outputs of panels p0 .. p0+NP] over all k: R*NP*2 accumulators (R, NP constants
// after inlining; ROW_TILE x 1, (ROW_TILE - 1 .. 2) x 2, 1 x 4: 8-28 chains of FMAs hide their latency).
INLINE void panel_tile(const float *x, const uint16_t *packed, float *y, int64_t in, int64_t out, int64_t r0,
                       int64_t p0, const int R, const int NP, const int hint) {
    vf a[ROW_TILE][4][2];
    for (int r = 0; r < R; r++)
        for (int n = 0; n < NP; n++) a[r][n][0] = a[r][n][1] = (vf){0};
    const uint16_t *base = packed + p0 * in * PANEL;
    const int per_line = 64 / (PANEL * 2) > 0 ? 64 / (PANEL * 2) : 1;  // k's per cache line of a panel
    for (int64_t k = 0; k < in; k++) {
        if (hint != 2 && k % per_line == 0)
            for (int n = 0; n < NP; n++) {
                const char *ahead = (const char *)(base + (n * in + k) * PANEL) + PREFETCH_BYTES;
                for (int b = 0; b < PANEL * 2; b += 64) {
                    if (hint)
                        __builtin_prefetch(ahead + b, 0, 2);
                    else
                        __builtin_prefetch(ahead + b, 0, 3);
                }
            }
        for (int n = 0; n < NP; n++) {
            vf w0, w1;
            load_bf16(base + (n * in + k) * PANEL, &w0, &w1);
            IN_REGISTER(w0);
            IN_REGISTER(w1);
            for (int r = 0; r < R; r++) {
                vf xb = x[(r0 + r) * in + k] - (vf){0};  // broadcast
                a[r][n][0] += w0 * xb;
                a[r][n][1] += w1 * xb;
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int n = 0; n < NP; n++) {
            int64_t o = (p0 + n) * PANEL, valid = out - o < PANEL ? out - o : PANEL;
            float tmp[PANEL], *dst = valid == PANEL ? y + (r0 + r) * out + o : tmp;
            memcpy(dst, &a[r][n][0], sizeof(vf));
            memcpy(dst + LANES, &a[r][n][1], sizeof(vf));
            if (dst == tmp) memcpy(y + (r0 + r) * out + o, tmp, valid * sizeof(float));
        }
}

#define PANEL_TILE(R, NP) panel_tile(x, packed, y, in, out, r0, p, R, NP, hint)
// the last rest (1 .. ROW_TILE - 1) rows from r0 over np panels from p, as one tile over 4 panels for a
// single row, else 2 (rest x 2 x 2 accumulators: up to 28 of AVX-512's 32 registers, 12 of AVX2's 16).
// AVX-512 used to take 4-7 rows as a 4-row tile over one panel, then 1-3 rows: SmolLM2's products at
// 5-7 rows took 1.42x as long that way, 1.18x at 4, on a 2-core Xeon (scripts/panel_tile_ab.py,
// session 25). Returns how many panels it did
INLINE int last_rows(const float *x, const uint16_t *packed, float *y, int64_t in, int64_t out, int64_t r0,
                     int64_t p, int np, const int rest, const int hint) {
    if (rest == 1) {
        switch (np) {
            case 4: PANEL_TILE(1, 4); return 4;
            case 3: PANEL_TILE(1, 3); return 3;
            case 2: PANEL_TILE(1, 2); return 2;
            default: PANEL_TILE(1, 1); return 1;
        }
    }
    np = np >= 2 ? 2 : 1;
#define TAIL(R) \
    case R:     \
        if (np == 2) PANEL_TILE(R, 2); else PANEL_TILE(R, 1); break;
    switch (rest) {
        TAIL(2)
        TAIL(3)
#if ROW_TILE > 4
        TAIL(4)
        TAIL(5)
        TAIL(6)
        TAIL(7)
#endif
    }
#undef TAIL
    return np;
}

// panels p0 .. p1 for all m rows: per group of panels (4 / the last tile's rows, so that tile has
// chains enough), tiles of ROW_TILE rows one panel at a time, then the last m % ROW_TILE rows
INLINE void panels(const float *x, const uint16_t *packed, float *y, int64_t m, int64_t in, int64_t out, int64_t p0,
                   int64_t p1, const int hint) {
    const int rest = (int)(m % ROW_TILE), group = rest == 1 ? 4 : rest ? 2 : 1;
    for (int64_t g = p0; g < p1; g += group) {
        int64_t g1 = g + group < p1 ? g + group : p1, r0 = 0;
        for (; r0 + ROW_TILE <= m; r0 += ROW_TILE)
            for (int64_t p = g; p < g1; p++) PANEL_TILE(ROW_TILE, 1);
        for (int64_t p = g; rest && p < g1;) p += last_rows(x, packed, y, in, out, r0, p, (int)(g1 - p), rest, hint);
    }
}

// y (m, out) = x (m, in) @ w^T with w packed by pack_panels_bf16, prefetched as tuned for panels
void gemv_panels_bf16(const float *x, const uint16_t *packed, float *y, int64_t m, int64_t in, int64_t out) {
    int64_t n_panels = (out + PANEL - 1) / PANEL, chunk = n_panels / (4 * omp_get_max_threads());
    if (chunk < 1) chunk = 1;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < n_panels; p += chunk)
        BY_MODE(prefetch_mode[2][0], panels, x, packed, y, m, in, out, p, p + chunk < n_panels ? p + chunk : n_panels);
}
