// y (M,O) = x (M,I) @ w (O,I)^T with bf16 weights on Intel AMX tiles: x and y fp32, w the raw uint16
// bits of bf16 values. From ~8 rows on the vector kernel (gemv.c) is bound by its FMAs, not by the
// weights' bytes; a tile multiply does 16x16x32 products in one instruction.
// AMX multiplies bf16 by bf16, so x is split exactly into three bf16 parts, x = hi + mid + lo (each
// part holds the next 8 bits of x's 24-bit significand): every product of a part and a weight is exact
// in fp32 and the sums are fp32, so y is x @ fp32(w)^T up to summation order (as gemv.c's widening
// kernel; subnormals flush to zero).
// Layout: the weight is read as is, 16 rows x 32 values per A tile; the 16 rows of a block of x are
// packed per part in AMX's pair-interleaved B layout, so a C tile holds y^T (16 outputs x 16 rows).
// Needs I % 32 == 0 and O % 16 == 0 (codraft/kernels/amx.py checks; given other shapes, or before Linux
// grants the tile state, it runs gemv.c's kernel instead of faulting). Built by codraft/kernels/cbuild.py
// with -march=native: a CPU without AMX gets the stubs at the end (amx_ready() == 0).
#include <stdint.h>

void gemv_rows_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out);  // gemv.c

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023  // Linux: a process asks once to use the tile registers
#define XFEATURE_XTILEDATA 18
#define PARTS 3

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// 1 when the kernel may run: the CPU has AMX (compiled for it) and Linux granted the tile state
int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

static void configure(void) {  // every tile 16 rows x 64 bytes
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

// the three bf16 parts of 16 fp32 values (AVX-512 BF16 rounds to nearest even; what a part leaves of
// the significand is exact in fp32)
static void split(__m512 x, __m256i part[PARTS]) {
    for (int p = 0; p < PARTS; p++) {
        part[p] = (__m256i)_mm512_cvtneps_pbh(x);
        x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part[p]), 16)));
    }
}

// 16x16 32-bit transpose: r[i] holds row i, on return r[j] holds column j
static void transpose(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {  // lane L of a[i], a[i+1]: columns 4L, 4L+1 / 4L+2, 4L+3 of rows i, i+1
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // lane L of b[i + c]: column 4L + c of rows i..i+3
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) {  // column 4L + c: lane L of b[c], b[4 + c], b[8 + c], b[12 + c]
        __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        __m512i e2 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xee), e3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(e0, e1, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(e0, e1, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(e2, e3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(e2, e3, 0xdd);
    }
}

// x's rows in blocks of 16 (zero-padded), per part, as B tiles: the tile of part p, block blk and
// inputs k..k+31 is 16 rows of 64 bytes at packed + ((p * blocks + blk) * I/2 + k/2) * 32, its row j
// holding inputs k+2j, k+2j+1 of each of the block's 16 rows of x. One buffer per calling thread, kept.
static uint16_t *pack(const float *x, int64_t m, int64_t in, int64_t blocks) {
    static _Thread_local uint16_t *buffer;
    static _Thread_local int64_t size;
    int64_t per_part = blocks * (in / 2) * 32;
    if (PARTS * per_part > size) {
        free(buffer);
        size = PARTS * per_part;
        buffer = aligned_alloc(64, size * sizeof *buffer);
    }
    for (int64_t blk = 0; blk < blocks; blk++)
        for (int64_t k = 0; k < in; k += 32) {
            __m512i rows[PARTS][16];
            for (int r = 0; r < 16; r++) {
                __m256i lo[PARTS], hi[PARTS];
                int64_t row = 16 * blk + r;
                const float *src = x + row * in + k;
                split(row < m ? _mm512_loadu_ps(src) : _mm512_setzero_ps(), lo);
                split(row < m ? _mm512_loadu_ps(src + 16) : _mm512_setzero_ps(), hi);
                for (int p = 0; p < PARTS; p++)
                    rows[p][r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1);
            }
            for (int p = 0; p < PARTS; p++) {
                transpose(rows[p]);
                uint16_t *tile = buffer + p * per_part + (blk * (in / 2) + k / 2) * 32;
                for (int j = 0; j < 16; j++) _mm512_store_si512((__m512i *)(tile + 32 * j), rows[p][j]);
            }
        }
    return buffer;
}

// C tile c -> y[16 blk + j][o + i] for the rows of x that exist
#define STORE(c, o, blk)                                                            \
    do {                                                                            \
        _tile_stored(c, t, 64);                                                     \
        for (int64_t j = 0; j < 16 && 16 * (blk) + j < m; j++)                      \
            for (int i = 0; i < 16; i++) y[(16 * (blk) + j) * out + (o) + i] = t[i][j]; \
    } while (0)

// Outputs o..o+47 (those below out; out - o is a multiple of 16) against block blk of x. Tiles:
// accumulators 0-2 (16 outputs each), the weights of 16 outputs in 3 and 4 by turns, x's three parts
// in 5-7. A tile load costs ~3 products' issue time here (~20 ns for 1 KB, from L1 as from L3) and a
// product's latency is several issue slots: this layout loads 6 tiles per 9 products and keeps three
// chains of sums apart. In a loop of tile instructions alone it ran 1.7x faster per product than two
// weight tiles x two blocks of x; in the whole kernel the two were even within this VM's noise.
static void outputs(const uint16_t *w, const uint16_t *packed, float *y, int64_t m, int64_t in, int64_t out,
                    int64_t o, int64_t blocks, int64_t blk) {
    float t[16][16];
    int n = out - o >= 48 ? 3 : (int)((out - o) / 16);
    const uint16_t *w0 = w + o * in, *w1 = w0 + 16 * in, *w2 = w0 + 32 * in;
    int64_t per_part = blocks * (in / 2) * 32, stride = in * 2;
    // during the first block: the next 48 outputs' weights (contiguous; 64 bytes per output and step
    // of k) fetched from memory, as the prefetchers do not follow 48 rows read 64 bytes at a time
    const char *next = (const char *)(w + (o + 48) * in), *end = (const char *)(w + out * in);
    if (blk) next = end;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < in; k += 32) {
        for (int line = 0; line < 48 && next < end; line++, next += 64) _mm_prefetch(next, _MM_HINT_T0);
        const uint16_t *b = packed + (blk * (in / 2) + k / 2) * 32;
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + per_part, 64);
        _tile_loadd(7, b + 2 * per_part, 64);
        _tile_loadd(3, w0 + k, stride);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(0, 3, 6);
        _tile_dpbf16ps(0, 3, 7);
        if (n > 1) {
            _tile_loadd(4, w1 + k, stride);
            _tile_dpbf16ps(1, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (n > 2) {
            _tile_loadd(3, w2 + k, stride);
            _tile_dpbf16ps(2, 3, 5);
            _tile_dpbf16ps(2, 3, 6);
            _tile_dpbf16ps(2, 3, 7);
        }
    }
    STORE(0, o, blk);
    if (n > 1) STORE(1, o + 16, blk);
    if (n > 2) STORE(2, o + 32, blk);
}

void gemm_amx_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out) {
    if (!amx_ready() || in % 32 || out % 16) {  // a tile instruction would fault: the vector kernel
        gemv_rows_bf16(x, w, y, m, in, out);
        return;
    }
    int64_t blocks = (m + 15) / 16;
    uint16_t *packed = pack(x, m, in, blocks);
#pragma omp parallel
    {
        configure();  // tile configuration is per thread
#pragma omp for schedule(static)
        for (int64_t o = 0; o < out; o += 48)  // the weights come from memory once, then from L2
            for (int64_t blk = 0; blk < blocks; blk++) outputs(w, packed, y, m, in, out, o, blocks, blk);
        _tile_release();  // an idle thread's tile state would cost every context switch
    }
}

#else
int amx_ready(void) { return 0; }
void gemm_amx_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out) {
    gemv_rows_bf16(x, w, y, m, in, out);
}
#endif
