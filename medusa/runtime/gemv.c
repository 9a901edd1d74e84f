/* Float32 products of a few rows by a packed weight: the engine's "gemv" linear kernels.
 *
 * y[n, N] = x[n, K] @ W[N, K]^T for the handful of rows a decoding pass has (1 for plain
 * decoding, up to a few dozen for a tree). Such a product reads the whole weight for little
 * arithmetic, so it is bound by memory bandwidth; this kernel streams the weight once per
 * call at close to the machine's read bandwidth (see medusa/runtime/gemv.py).
 *
 * Layout: the weight is packed once into blocks of LANES output rows, k-major inside a block:
 * P[b][k][l] = W[b * LANES + l][k] (rows past N are zero). One vector load then holds one k
 * for LANES outputs, and each output accumulates in one vector lane: no horizontal sums.
 *
 * Order of summation, the same for every output whatever n, the tile shape or the thread
 * count: the K products are summed left to right in chunks of KC, and the chunk sums are added
 * left to right. So row r of an n-row product is bitwise the one-row product of x[r].
 *
 * Written with GCC vector extensions, compiled on the machine that runs it (-march=native):
 * 16 lanes where the CPU has AVX-512, else 8. Threads: OpenMP, as many as the caller asks for.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define WIDE 4   /* output blocks per tile for one or two rows */
#define NARROW 4 /* output blocks per tile for more rows (6 rows at a time) */
#else
#define LANES 8  /* AVX2: 16 registers of 8 floats; a 2 x 6 tile keeps 12 accumulators */
#define WIDE 4
#define NARROW 2
#endif
#define KC 64
#define AI static inline __attribute__((always_inline))

typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));

int medusa_gemv_lanes(void) { return LANES; }

void medusa_gemv_pack(const float* W, int N, int K, float* P, int threads) {
  int nb = (N + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < nb; b++)
    for (int k = 0; k < K; k++)
      for (int l = 0; l < LANES; l++) {
        int j = b * LANES + l;
        P[((int64_t)b * K + k) * LANES + l] = j < N ? W[(int64_t)j * K + k] : 0.f;
      }
}

/* BN blocks of LANES outputs x NR input rows. The accumulators' array sizes are fixed so that
 * the compiler keeps them in registers once BN and NR are constants; the chunk sums so far (t)
 * stay in memory (L1), touched once per chunk, so they take no registers from the inner loop. */
AI void tile(const int BN, const int NR, const float* x, int K, const float* p, float* y, int N, int j0) {
  vec t[6][4];
  for (int k0 = 0; k0 < K; k0 += KC) {
    int k1 = k0 + KC < K ? k0 + KC : K;
    vec a[4][6];
    for (int i = 0; i < BN; i++)
      for (int r = 0; r < NR; r++) a[i][r] = (vec){0};
    for (int k = k0; k < k1; k++) {
      vec w[4];
      for (int i = 0; i < BN; i++) w[i] = *(const vec*)(p + ((int64_t)i * K + k) * LANES);
      for (int r = 0; r < NR; r++) {
        float xs = x[(int64_t)r * K + k];
        for (int i = 0; i < BN; i++) a[i][r] += w[i] * xs;
      }
    }
    for (int i = 0; i < BN; i++)
      for (int r = 0; r < NR; r++) {
        volatile vec* q = &t[r][i];
        *q = k0 == 0 ? a[i][r] : *q + a[i][r];
      }
  }
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < BN; i++) {
      int j = j0 + LANES * i, m = N - j < LANES ? N - j : LANES;
      if (m > 0) memcpy(y + (int64_t)r * N + j, &t[r][i], (size_t)m * sizeof(float));
    }
}

#define T(BN, NR) tile(BN, NR, x + (int64_t)r * K, K, p, y + (int64_t)r * N, N, j0)
AI void rows(const int BN, const float* x, int n, int K, const float* p, float* y, int N, int j0) {
  int r = 0;
  for (; r + 6 <= n; r += 6) T(BN, 6);
  switch (n - r) {
    case 5: T(BN, 5); break;
    case 4: T(BN, 4); break;
    case 3: T(BN, 3); break;
    case 2: T(BN, 2); break;
    case 1: T(BN, 1); break;
  }
}
static void rows_wide(const float* x, int n, int K, const float* p, float* y, int N, int j0) { rows(WIDE, x, n, K, p, y, N, j0); }
static void rows_narrow(const float* x, int n, int K, const float* p, float* y, int N, int j0) { rows(NARROW, x, n, K, p, y, N, j0); }
static void rows_one(const float* x, int n, int K, const float* p, float* y, int N, int j0) { rows(1, x, n, K, p, y, N, j0); }

#ifdef _OPENMP
#include <omp.h>
#endif

/* y[n, N] = x[n, K] @ W^T with P = medusa_gemv_pack(W). Each thread takes a contiguous range
 * of output blocks. */
void medusa_gemv(const float* x, int n, int K, const float* P, int N, float* y, int threads) {
  int nb = (N + LANES - 1) / LANES;
#pragma omp parallel num_threads(threads)
  {
    int t = 0, T = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    T = omp_get_num_threads();
#endif
    int b = (int)((int64_t)nb * t / T), end = (int)((int64_t)nb * (t + 1) / T);
    const int step = n <= 2 ? WIDE : NARROW;
    for (; b + step <= end; b += step) {
      const float* p = P + (int64_t)b * K * LANES;
      if (n <= 2) rows_wide(x, n, K, p, y, N, b * LANES);
      else rows_narrow(x, n, K, p, y, N, b * LANES);
    }
    for (; b < end; b++) rows_one(x, n, K, P + (int64_t)b * K * LANES, y, N, b * LANES);
  }
}
