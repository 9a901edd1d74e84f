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
 * A bfloat16 weight (draft heads beside a float32 target) is packed the same way with its 16-bit
 * values (medusa_gemv_pack_bf16, medusa_gemv_bf16): half the bytes to stream, each value widened
 * to float32 exactly as it is loaded, the products and sums in float32 as below.
 *
 * Order of summation, the same for every output whatever n, the tile shape or the thread
 * count: the K products are summed left to right in chunks of KC, and the chunk sums are added
 * left to right. So row r of an n-row product is bitwise the one-row product of x[r].
 *
 * Written with GCC vector extensions (x86 intrinsics for the fused multiply-add and, on AVX2, the bfloat16
 * widening), compiled on the machine that runs it (-march=native):
 * 16 lanes where the CPU has AVX-512, else 8. Threads: the kernels' own pool (pool.c), as many as the caller asks for.
 */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#define ACC 24 /* accumulators a tile keeps in registers (of 32) */
#else
#define LANES 8 /* AVX2: 16 registers of 8 floats */
#define ACC 12
#endif
#define MAXB 4 /* output blocks per tile at most */
#define MAXR 6 /* input rows per tile at most */
#define KC 64
#define AI static inline __attribute__((always_inline))

typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t hvec __attribute__((vector_size(LANES * 2), aligned(2))); /* LANES bfloat16 weights */
typedef uint32_t uvec __attribute__((vector_size(LANES * 4), aligned(4)));

/* LANES weights at element ``i`` of a packed weight: float32 (H 0), or bfloat16 widened to
 * float32 exactly (H 1: a bfloat16 is a float32's upper half) */
AI vec loadw(const int H, const void* p, int64_t i) {
#if !defined(__AVX512F__) && defined(__AVX2__)
  if (H) { /* one widening load and a shift: GCC splits the generic form into 128-bit halves here */
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  }
#endif
  if (H) {
    hvec h;
    memcpy(&h, (const uint16_t*)p + i, sizeof h);
    return (vec)(__builtin_convertvector(h, uvec) << 16);
  }
  return *(const vec*)((const float*)p + i);
}

/* a + w * s, rounded once where the CPU fuses (FMA) and twice where it does not - the same in
 * every tile shape: the build turns the compiler's own contraction off (-ffp-contract=off),
 * which otherwise fused some shapes' products and not others'. */
AI vec madd(vec a, vec w, float s) {
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)w, _mm512_set1_ps(s), (__m512)a);
#elif defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
  return (vec)_mm256_fmadd_ps((__m256)w, _mm256_set1_ps(s), (__m256)a);
#else
  return a + w * s;
#endif
}

int medusa_gemv_lanes(void) { return LANES; }

typedef void (*medusa_task)(void* ctx, int task);
void medusa_parallel(int tasks, int threads, medusa_task fn, void* ctx);       /* pool.c */
void medusa_parallel_large(int tasks, int threads, medusa_task fn, void* ctx); /* pool.c: OpenMP */
#define LARGE_ROWS 64 /* products of more rows (a prompt's) run on OpenMP's threads */

typedef struct {
  const void* W;
  int N, K, T, H;
  void* P;
} PackJob;

static void pack_task(void* ctx, int t) {
  const PackJob* j = ctx;
  int nb = (j->N + LANES - 1) / LANES;
  for (int b = (int)((int64_t)nb * t / j->T); b < (int)((int64_t)nb * (t + 1) / j->T); b++)
    for (int k = 0; k < j->K; k++)
      for (int l = 0; l < LANES; l++) {
        int r = b * LANES + l;
        int64_t to = ((int64_t)b * j->K + k) * LANES + l, from = (int64_t)r * j->K + k;
        if (j->H)
          ((uint16_t*)j->P)[to] = r < j->N ? ((const uint16_t*)j->W)[from] : 0;
        else
          ((float*)j->P)[to] = r < j->N ? ((const float*)j->W)[from] : 0.f;
      }
}

void medusa_gemv_pack(const float* W, int N, int K, float* P, int threads) {
  int T = threads < 1 ? 1 : threads;
  PackJob job = {W, N, K, T, 0, P};
  medusa_parallel_large(T, T, pack_task, &job);
}

/* the same layout for a bfloat16 weight (its raw 16-bit values) */
void medusa_gemv_pack_bf16(const uint16_t* W, int N, int K, uint16_t* P, int threads) {
  int T = threads < 1 ? 1 : threads;
  PackJob job = {W, N, K, T, 1, P};
  medusa_parallel_large(T, T, pack_task, &job);
}

/* BN blocks of LANES outputs x NR input rows. The accumulators' array sizes are fixed so that
 * the compiler keeps them in registers once BN and NR are constants; the chunk sums so far (t)
 * stay in memory (L1), touched once per chunk, so they take no registers from the inner loop.
 * Meanwhile it prefetches blocks pg, pg + pG, ... below pn of the tile at pf (the next one). */
AI void tile(const int BN, const int NR, const int H, const float* x, int K, const void* p, float* y, int N, int j0,
             const void* pf, int pg, int pG, int pn) {
  vec t[MAXR][MAXB];
  for (int k0 = 0; k0 < K; k0 += KC) {
    int k1 = k0 + KC < K ? k0 + KC : K;
    vec a[MAXB][MAXR];
    for (int i = 0; i < BN; i++)
      for (int r = 0; r < NR; r++) a[i][r] = (vec){0};
    for (int k = k0; k < k1; k++) {
      vec w[MAXB];
      for (int i = 0; i < BN; i++) w[i] = loadw(H, p, ((int64_t)i * K + k) * LANES);
      for (int i = pg; i < pn; i += pG)
        __builtin_prefetch((const char*)pf + ((int64_t)i * K + k) * LANES * (H ? 2 : 4), 0, 2);
      for (int r = 0; r < NR; r++) {
        float xs = x[(int64_t)r * K + k];
        for (int i = 0; i < BN; i++) a[i][r] = madd(a[i][r], w[i], xs);
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

/* Each tile shape the dispatch below can ask for, its sizes constants. */
#define C(BN, NR, H) case NR: tile(BN, NR, H, x, K, p, y, N, j0, pf, pg, pG, pn); break;
#define TILES(BN, H, name)                                                                          \
  static void name(const float* x, int nr, int K, const void* p, float* y, int N, int j0,           \
                   const void* pf, int pg, int pG, int pn) {                                        \
    switch (nr) { C(BN, 1, H) C(BN, 2, H) C(BN, 3, H) C(BN, 4, H) C(BN, 5, H) C(BN, 6, H) }         \
  }
TILES(1, 0, tiles1)
TILES(2, 0, tiles2)
TILES(3, 0, tiles3)
TILES(4, 0, tiles4)
TILES(1, 1, htiles1)
TILES(2, 1, htiles2)
TILES(3, 1, htiles3)
TILES(4, 1, htiles4)
typedef void (*Tile)(const float*, int, int, const void*, float*, int, int, const void*, int, int, int);
static const Tile TILE[2][MAXB + 1] = {{0, tiles1, tiles2, tiles3, tiles4}, {0, htiles1, htiles2, htiles3, htiles4}};

typedef struct {
  const float* x;
  const void* P;
  float* y;
  int n, K, N, T, H;
} GemvJob;

/* y[n, N] = x[n, K] @ W^T with P = medusa_gemv_pack(W). Task t of T takes a contiguous range of
 * output blocks, a tile of them at a time (as many as the accumulators allow), and runs every
 * group of up to MAXR rows on a tile before the next tile. With one group the product streams
 * the weight from memory; with more, the groups after the first find the tile in the caches and
 * are bound by arithmetic, so they prefetch the next tile meanwhile: memory and arithmetic
 * overlap (a 16-row product took 0.8x the time it took without). */
static void gemv_task(void* ctx, int t) {
  const GemvJob* j = ctx;
  const float* x = j->x;
  int n = j->n, K = j->K, N = j->N, T = j->T;
  int nb = (N + LANES - 1) / LANES;
  int groups = (n + MAXR - 1) / MAXR, widest = (n + groups - 1) / groups;
  int bn = ACC / widest < MAXB ? ACC / widest : MAXB;
  int b = (int)((int64_t)nb * t / T), end = (int)((int64_t)nb * (t + 1) / T);
  for (int step = bn; b < end; b += step) {
    if (b + step > end) step = 1; /* the range's last blocks, one at a time */
    const char* p = (const char*)j->P + (int64_t)b * K * LANES * (j->H ? 2 : 4);
    int next = groups < 2 ? 0 : end - b - step < bn ? end - b - step : bn; /* blocks to prefetch */
    for (int g = 0, r = 0; g < groups; g++) {
      int nr = n / groups + (g < n % groups);
      TILE[j->H][step](x + (int64_t)r * K, nr, K, p, j->y + (int64_t)r * N, N, b * LANES,
                       p + (int64_t)step * K * LANES * (j->H ? 2 : 4), g, groups, next);
      r += nr;
    }
  }
}

void medusa_gemv(const float* x, int n, int K, const float* P, int N, float* y, int threads) {
  int T = threads < 1 ? 1 : threads;
  GemvJob job = {x, P, y, n, K, N, T, 0};
  (n > LARGE_ROWS ? medusa_parallel_large : medusa_parallel)(T, T, gemv_task, &job);
}

/* medusa_gemv with P = medusa_gemv_pack_bf16(W): a bfloat16 weight (draft heads), read at half
 * the bytes, each product in float32 as above (x and y float32) */
void medusa_gemv_bf16(const float* x, int n, int K, const uint16_t* P, int N, float* y, int threads) {
  int T = threads < 1 ? 1 : threads;
  GemvJob job = {x, P, y, n, K, N, T, 1};
  (n > LARGE_ROWS ? medusa_parallel_large : medusa_parallel)(T, T, gemv_task, &job);
}

/* y[i] = output cols[i] of row rows[i] of medusa_gemv(x, P): the same bits as the whole product
 * gives it (each output's block is run by the same tile code, one lane kept), for the few outputs
 * a vocabulary screen leaves (medusa/runtime/screen.py). One thread: a handful of blocks. */
void medusa_gemv_pick(const float* x, int K, const float* P, const int64_t* rows, const int64_t* cols, int n,
                      float* y) {
  float lanes[LANES];
  for (int i = 0; i < n; i++) {
    int64_t b = cols[i] / LANES;
    tile(1, 1, 0, x + rows[i] * K, K, P + b * K * LANES, lanes, LANES, 0, P, 0, 1, 0);
    y[i] = lanes[cols[i] % LANES];
  }
}

/* The screen's candidates (medusa/runtime/screen.py): for each of n rows of s [n, V] (the
 * bfloat16 product) with bound e_j = norms[j] * xn[r] + pad, every j with s_j + e_j >= max_k (s_k - e_k),
 * written as (rows, cols) pairs. Returns how many, or -1 when more than cap (or a row's bound is
 * not finite): the caller then takes the whole product. */
typedef int32_t ivec __attribute__((vector_size(LANES * 4), aligned(4)));

AI int any_set(ivec m) {
  int64_t w[LANES / 2];
  memcpy(w, &m, sizeof w);
  int64_t o = 0;
  for (int i = 0; i < LANES / 2; i++) o |= w[i];
  return o != 0;
}

int medusa_screen(const float* s, const float* norms, const float* xn, float pad, int n, int V, int64_t* rows,
                  int64_t* cols, int cap) {
  int found = 0;
  for (int r = 0; r < n; r++) {
    const float* sr = s + (int64_t)r * V;
    float x = xn[r], floor = -__builtin_inff();
    vec vx = (vec){0} + x, vp = (vec){0} + pad, top = (vec){0} - __builtin_inff();
    ivec nan = (ivec){0};
    int j = 0;
    for (; j + LANES <= V; j += LANES) {
      vec sv, nv;
      memcpy(&sv, sr + j, sizeof sv);
      memcpy(&nv, norms + j, sizeof nv);
      vec lo = sv - (nv * vx + vp);
      ivec up = lo > top;
      top = (vec)(((ivec)lo & up) | ((ivec)top & ~up));
      nan |= lo != lo;
    }
    if (any_set(nan)) return -1; /* NaN: the whole product says what its argmax is */
    for (int l = 0; l < LANES; l++) floor = top[l] > floor ? top[l] : floor;
    for (; j < V; j++) {
      float lo = sr[j] - (norms[j] * x + pad);
      if (lo != lo) return -1;
      floor = lo > floor ? lo : floor;
    }
    if (!__builtin_isfinite(floor)) return -1;
    vec vf = (vec){0} + floor;
    for (j = 0; j < V; j += LANES) {
      int m = V - j < LANES ? V - j : LANES;
      if (m == LANES) {
        vec sv, nv;
        memcpy(&sv, sr + j, sizeof sv);
        memcpy(&nv, norms + j, sizeof nv);
        if (!any_set((sv + (nv * vx + vp)) >= vf)) continue;
      }
      for (int l = 0; l < m; l++)
        if (sr[j + l] + (norms[j + l] * x + pad) >= floor) {
          if (found == cap) return -1;
          rows[found] = r;
          cols[found++] = j + l;
        }
    }
  }
  return found;
}

/* The screen's product with the CPU's bfloat16 dot products (AVX512-BF16: vdpbf16ps), where it
 * has them: weight and x both in bfloat16, each lane summing pairs of products in float32, twice
 * the products an instruction of the float32 kernel makes. Not exact (the screen bounds its
 * error: medusa/runtime/screen.py), so no fixed order is kept beyond each lane's left to right.
 * Layout: blocks of LANES outputs, k in pairs: Q[b][k / 2][l][k % 2] = W[b * LANES + l][k]. */
int medusa_screen_dot(void) {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

typedef struct {
  const uint16_t* W;
  int N, K, T;
  uint16_t* Q;
} DotPack;

static void dot_pack_task(void* ctx, int t) {
  const DotPack* j = ctx;
  int nb = (j->N + 15) / 16, K2 = (j->K + 1) / 2;
  for (int b = (int)((int64_t)nb * t / j->T); b < (int)((int64_t)nb * (t + 1) / j->T); b++)
    for (int p = 0; p < K2; p++)
      for (int l = 0; l < 16; l++)
        for (int h = 0; h < 2; h++) {
          int r = b * 16 + l, k = 2 * p + h;
          j->Q[(((int64_t)b * K2 + p) * 16 + l) * 2 + h] = r < j->N && k < j->K ? j->W[(int64_t)r * j->K + k] : 0;
        }
}

/* Q: (N + 15) / 16 * 16 * (K + 1) / 2 * 2 values */
void medusa_screen_pack(const uint16_t* W, int N, int K, uint16_t* Q, int threads) {
  int T = threads < 1 ? 1 : threads;
  DotPack job = {W, N, K, T, Q};
  medusa_parallel_large(T, T, dot_pack_task, &job);
}

#if defined(__AVX512BF16__)
typedef struct {
  const uint32_t* x; /* [n][K2]: pairs of bfloat16 */
  const uint16_t* Q;
  float* y;
  int n, K2, N, T;
} DotJob;

AI void dtile(const int BN, const int NR, const uint32_t* x, int K2, const uint16_t* q, float* y, int N, int j0) {
  __m512 a[4][6];
  for (int i = 0; i < BN; i++)
    for (int r = 0; r < NR; r++) a[i][r] = _mm512_setzero_ps();
  for (int p = 0; p < K2; p++) {
    __m512i w[4];
    for (int i = 0; i < BN; i++) w[i] = _mm512_loadu_si512((const void*)(q + ((int64_t)i * K2 + p) * 32));
    for (int r = 0; r < NR; r++) {
      __m512i xs = _mm512_set1_epi32((int)x[(int64_t)r * K2 + p]);
      for (int i = 0; i < BN; i++) a[i][r] = _mm512_dpbf16_ps(a[i][r], (__m512bh)w[i], (__m512bh)xs);
    }
  }
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < BN; i++) {
      int j = j0 + 16 * i, m = N - j < 16 ? N - j : 16;
      if (m > 0) memcpy(y + (int64_t)r * N + j, &a[i][r], (size_t)m * sizeof(float));
    }
}

#define D(BN, NR) case NR: dtile(BN, NR, x, K2, q, y, N, j0); break;
#define DTILES(BN, name) \
  static void name(const uint32_t* x, int nr, int K2, const uint16_t* q, float* y, int N, int j0) { \
    switch (nr) { D(BN, 1) D(BN, 2) D(BN, 3) D(BN, 4) D(BN, 5) D(BN, 6) }                          \
  }
DTILES(1, dtiles1)
DTILES(4, dtiles4)

static void dot_task(void* ctx, int t) {
  const DotJob* j = ctx;
  int nb = (j->N + 15) / 16;
  int b = (int)((int64_t)nb * t / j->T), end = (int)((int64_t)nb * (t + 1) / j->T);
  for (int step = 4; b < end; b += step) {
    if (b + step > end) step = 1;
    const uint16_t* q = j->Q + (int64_t)b * j->K2 * 32;
    for (int r = 0; r < j->n; r += 6) {
      int nr = j->n - r < 6 ? j->n - r : 6;
      (step == 4 ? dtiles4 : dtiles1)(j->x + (int64_t)r * j->K2, nr, j->K2, q, j->y + (int64_t)r * j->N, j->N,
                                      b * 16);
    }
  }
}
#endif

/* y[n, N] ~ x[n, K] @ W^T with Q = medusa_screen_pack(W) and x given as bfloat16 pairs [n][K2];
 * returns 0 where the CPU has no bfloat16 dot products (nothing written) */
int medusa_screen_product(const uint32_t* x, int n, int K2, const uint16_t* Q, int N, float* y, int threads) {
#if defined(__AVX512BF16__)
  int T = threads < 1 ? 1 : threads;
  DotJob job = {x, Q, y, n, K2, N, T};
  medusa_parallel(T, T, dot_task, &job);
  return 1;
#else
  (void)x, (void)n, (void)K2, (void)Q, (void)N, (void)y, (void)threads;
  return 0;
#endif
}
