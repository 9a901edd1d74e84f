/* Vector helpers shared by the runtime's C kernels (attention.c, decoder.c): float vectors of
 * ALANES lanes (16 with AVX-512, else 8), a fused multiply-add, lane sums in one fixed order,
 * and exp(x) for x <= 0 by a polynomial. Every kernel that includes this file is built into one
 * library on the machine that runs it (-march=native, -ffp-contract=off: medusa/runtime/gemv.py). */
#ifndef MEDUSA_VEC_H
#define MEDUSA_VEC_H
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define ALANES 16
#else
#define ALANES 8
#endif
#define AI static inline __attribute__((always_inline))

typedef float avec __attribute__((vector_size(ALANES * 4), aligned(4)));
typedef int32_t aivec __attribute__((vector_size(ALANES * 4), aligned(4)));

/* Unaligned loads and stores as single vector moves. A memcpy into a vector is not: GCC expands a
 * 32-byte one as two 16-byte moves through the stack where it does not move 32 bytes by pieces
 * (AVX2 targets such as Zen 3), and the full-width read of two half-width writes cannot be
 * forwarded: every load stalled (the AVX2 attention ran 10-18x slower than with single moves). */
AI avec aload(const float* p) {
#if defined(__AVX512F__)
  return (avec)_mm512_loadu_ps(p);
#elif defined(__AVX__)
  return (avec)_mm256_loadu_ps(p);
#else
  avec v;
  memcpy(&v, p, sizeof v);
  return v;
#endif
}
AI void astore(float* p, avec v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, (__m512)v);
#elif defined(__AVX__)
  _mm256_storeu_ps(p, (__m256)v);
#else
  memcpy(p, &v, sizeof v);
#endif
}
AI avec asplat(float s) { return (avec){0} + s; }

AI avec afma(avec a, avec b, avec c) { /* a * b + c, rounded once where the CPU fuses */
#if defined(__AVX512F__)
  return (avec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
  return (avec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/* The lane sums of ALANES vectors at once: out[i] = the sum of a[i]'s lanes, added pairwise
 * (lane l + lane l + ALANES/2, then + ALANES/4, ...), a fixed order whatever the block. */
AI avec alanes_sums(const avec* a) {
#if ALANES == 16
  avec t[8], u[4], w[2];
  for (int k = 0; k < 8; k++)
    t[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 4; m++)
    u[m] = __builtin_shufflevector(t[2 * m], t[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * m], t[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int p = 0; p < 2; p++)
    w[p] = __builtin_shufflevector(u[2 * p], u[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * p], u[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(__AVX__)
  /* the same sums from in-lane shuffles but one cross-lane move per pair of vectors, the pairs
   * (a[k], a[k + 4]) so the sums land in order: each half-sum added as the generic path adds it
   * (a + b == b + a exactly) */
  __m256 t[4], u[2];
  for (int k = 0; k < 4; k++) {
    __m256 x = (__m256)a[k], y = (__m256)a[k + 4];
    t[k] = _mm256_add_ps(_mm256_blend_ps(x, y, 0xF0), _mm256_permute2f128_ps(x, y, 0x21));
  }
  for (int m = 0; m < 2; m++)
    u[m] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44), _mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0xEE));
  return (avec)_mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
#else
  avec t[4], u[2];
  for (int k = 0; k < 4; k++)
    t[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int m = 0; m < 2; m++)
    u[m] = __builtin_shufflevector(t[2 * m], t[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(t[2 * m], t[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

AI float alanes_sum(avec v) { /* one vector's lane sum, in alanes_sums's order */
  avec a[ALANES] = {v};
  avec s = alanes_sums(a);
  return s[0];
}

/* exp(x) for x <= 0 (scores minus their max): Cody-Waite reduction and a degree-6 polynomial,
 * within about 2 ulp of expf; exactly 0 below -87 (and for -inf). */
AI avec aexp(avec x) {
  const avec lo = asplat(-87.0f);
  aivec under = x < lo;
  x = (avec)(((aivec)x & ~under) | ((aivec)lo & under));
  avec t = x * asplat(1.44269504088896341f);
  avec n = (t + asplat(12582912.0f)) - asplat(12582912.0f); /* round to nearest */
  avec r = x - n * asplat(0.693359375f);
  r = r - n * asplat(-2.12194440e-4f);
  avec p = asplat(1.9875691500e-4f);
  p = p * r + asplat(1.3981999507e-3f);
  p = p * r + asplat(8.3334519073e-3f);
  p = p * r + asplat(4.1665795894e-2f);
  p = p * r + asplat(1.6666665459e-1f);
  p = p * r + asplat(5.0000001201e-1f);
  avec y = p * (r * r) + r + asplat(1.0f);
  aivec bits = (__builtin_convertvector(n, aivec) + 127) << 23;
  y = y * (avec)bits;
  return (avec)((aivec)y & ~under);
}

#endif
