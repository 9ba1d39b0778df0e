// What gemv.c and decode_ops.c share: the vector width in floats, 16 (zmm) with AVX-512, else 8
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
#endif
