// What gemv.c, decode_ops.c and markov.c share: the vector width in floats, 16 (zmm) with AVX-512, else 8
// (AVX2's ymm, or what the target's vector extensions make of 32 bytes); -DLANES=8 builds the
// portable width anywhere (the tests do). With 16 lanes, bf16 weights at 1 row streamed ~8% faster
// from DRAM and up to 40% faster cache-hot on an AVX-512 Xeon (fp32: the same).
#ifndef CODRAFT_VEC_H
#define CODRAFT_VEC_H
#ifndef LANES
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
#define INLINE static inline __attribute__((always_inline))

#include <stdint.h>
#include <string.h>

// Vectors of LANES floats and their comparisons' masks, loaded from and stored to unaligned floats
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
INLINE vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
// a where take (a comparison's all-ones lanes), else b
INLINE vf vselect(vi take, vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & take) | (bi & ~take);
    memcpy(&a, &ai, sizeof a);
    return a;
}
INLINE vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

// lane j of the result = the sum of a[j]'s lanes, for LANES vectors a[] (clobbered) at once: log2(LANES)
// levels, each adding the lower and the upper half of every group of lanes of two vectors (a score per
// key this way costs ~3 vector ops for LANES keys, where a horizontal sum per key cost ~8 dependent ones)
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
#define FOLD(u, v, LO, HI) (__builtin_shufflevector(u, v, LO) + __builtin_shufflevector(u, v, HI))
#if LANES == 16
#define G16_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define G16_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define G8_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define G8_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define G4_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define G4_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define G2_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define G2_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
INLINE vf hsums(vf *a) {
    for (int i = 0; i < 8; i++) a[i] = FOLD(a[2 * i], a[2 * i + 1], G16_LO, G16_HI);
    for (int i = 0; i < 4; i++) a[i] = FOLD(a[2 * i], a[2 * i + 1], G8_LO, G8_HI);
    for (int i = 0; i < 2; i++) a[i] = FOLD(a[2 * i], a[2 * i + 1], G4_LO, G4_HI);
    return FOLD(a[0], a[1], G2_LO, G2_HI);
}
#else
#define G8_LO 0, 1, 2, 3, 8, 9, 10, 11
#define G8_HI 4, 5, 6, 7, 12, 13, 14, 15
#define G4_LO 0, 1, 4, 5, 8, 9, 12, 13
#define G4_HI 2, 3, 6, 7, 10, 11, 14, 15
#define G2_LO 0, 2, 4, 6, 8, 10, 12, 14
#define G2_HI 1, 3, 5, 7, 9, 11, 13, 15
INLINE vf hsums(vf *a) {
    for (int i = 0; i < 4; i++) a[i] = FOLD(a[2 * i], a[2 * i + 1], G8_LO, G8_HI);
    for (int i = 0; i < 2; i++) a[i] = FOLD(a[2 * i], a[2 * i + 1], G4_LO, G4_HI);
    return FOLD(a[0], a[1], G2_LO, G2_HI);
}
#endif
#else
INLINE vf hsums(vf *a) {
    float out[LANES], lanes[LANES];
    for (int j = 0; j < LANES; j++) {
        memcpy(lanes, &a[j], sizeof lanes);
        out[j] = 0.0f;
        for (int k = 0; k < LANES; k++) out[j] += lanes[k];
    }
    return vload(out);
}
#endif

// exp(x) for x <= 0, LANES at once: Cephes' expf (x = n ln2 + r, a degree-6 polynomial in r, 2^n put
// into the exponent), within a few ulp of expf; below -87 it gives exp(-87) ~ 1.6e-38 instead of less
INLINE vf vexp_neg(vf x) {
    x = vmax(x, (vf){0} - 87.0f);
    vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  // round(x / ln2) for x <= 0
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (n + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}
#endif
