// The GEMV kernel alone, outside Python: GB/s and GFLOP/s of gemv_rows(_bf16) over MB of weights (in
// 2 MB pages) as calls of OUT x IN each, cycled, best of 15 passes. Build a variant of gemv.c and this
// against it to compare kernels in the same minute (docs/bench-spec.md, session 19):
//   cc -O3 -march=native -fopenmp -shared -fPIC -Icodraft/kernels codraft/kernels/gemv.c -o /tmp/libgemv.so
//   cc -O3 -march=native -fopenmp scripts/gemv_harness.c -L/tmp -lgemv -Wl,-rpath,/tmp -o /tmp/gemv_harness
//   OMP_NUM_THREADS=2 /tmp/gemv_harness BF16 ROWS IN OUT [PREFETCH PAIR_ROWS MB]
// BF16 1 or 0 (fp32 weights); PREFETCH 0 (L1), 1 (L2), 2 (none), default 1; PAIR_ROWS: weight rows in
// pairs from that many input rows, default 4; MB default 256 (streamed from memory), ~0.3 with OUT 256
// and one thread for the kernel's arithmetic with its weights in L2.
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

void gemv_rows(const float *x, const float *w, float *y, int64_t m, int64_t in, int64_t out);
void gemv_rows_bf16(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out);
void set_tuning(int bf16, int mode_one, int mode_pairs, int rows);

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s BF16 ROWS IN OUT [PREFETCH PAIR_ROWS MB]\n", argv[0]);
        return 2;
    }
    int bf16 = atoi(argv[1]), m = atoi(argv[2]), mode = argc > 5 ? atoi(argv[5]) : 1;
    int64_t in = atoll(argv[3]), out = atoll(argv[4]);
    double mb = argc > 7 ? atof(argv[7]) : 256;
    set_tuning(bf16, mode, mode, argc > 6 ? atoi(argv[6]) : 4);
    size_t per = (size_t)(in * out) * (bf16 ? 2 : 4), calls = (size_t)(mb * (1 << 20)) / per;
    if (calls < 1) calls = 1;
    char *w = aligned_alloc(2 << 20, (calls * per + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    float *x = malloc(sizeof(float) * m * in), *y = malloc(sizeof(float) * m * out);
    if (!w || !x || !y) return 1;
    madvise(w, calls * per, MADV_HUGEPAGE);  // before the pages are touched, as codraft's rehome does
    for (size_t i = 0; i < calls * per; i++) w[i] = (char)((i * 7 + 1) & 0x3f);  // small finite values
    for (int64_t i = 0; i < m * in; i++) x[i] = 0.01f * (float)(i % 13);
    size_t inner = ((size_t)32 << 20) / (calls * per);  // small weights: repeat them to time ~32 MB a pass
    if (inner < 1) inner = 1;
    double best = 1e30;
    for (int pass = 0; pass < 15; pass++) {
        double t0 = omp_get_wtime();
        for (size_t it = 0; it < inner; it++)
            for (size_t c = 0; c < calls; c++)
                if (bf16)
                    gemv_rows_bf16(x, (const uint16_t *)(w + c * per), y, m, in, out);
                else
                    gemv_rows(x, (const float *)(w + c * per), y, m, in, out);
        double t = (omp_get_wtime() - t0) / (double)inner;
        if (t < best) best = t;
    }
    printf("%s m=%d %ldx%ld prefetch=%d %.2f MB: %.1f GB/s %.1f GFLOP/s %.1f us/call\n", bf16 ? "bf16" : "fp32", m,
           (long)out, (long)in, mode, mb, calls * per / best / 1e9, 2.0 * m * in * out * calls / best / 1e9,
           best / calls * 1e6);
    return 0;
}
