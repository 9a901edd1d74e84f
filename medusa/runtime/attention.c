/* Attention for every row of a decoding pass in one call: several sequences, their trees,
 * each row over its own cached keys (medusa/runtime/rows.py says where it is used).
 *
 * A row r belongs to a segment (a sequence) whose keys and values for this layer live at
 * seg_k[s], seg_v[s]: element (kv head g, position p, d) at base + g * head_stride[s] +
 * p * pos_stride[s] + d. The row attends to positions lo[r] .. hi[r]-1 of its segment, then to
 * its extra positions extra_pos[extra_start[r] .. extra_start[r+1]-1] (its tree ancestors past
 * the contiguous run, ascending). That list is exactly, in the same order, the keys the row's
 * token sees in a one-token pass once its ancestors are accepted and compacted.
 *
 * Order of arithmetic, the same for a row whatever else is in the call (other rows, other
 * sequences, the thread count, the blocking):
 *   score_j = (sum over d of q[d] * k_j[d]) * scale, as LANES-wide partial sums over the D/LANES
 *             chunks left to right, then the lanes added pairwise (halves, then quarters, ...);
 *   m = max_j score_j (exact);  e_j = exp(score_j - m) by the polynomial below;
 *   s = sum_j e_j as LANES-wide partial sums over chunks of LANES keys (in the row's key order),
 *       the lanes then added pairwise;
 *   out = (sum_j e_j * v_j, accumulated in the row's key order) / s.
 * So a row's output is bitwise the same alone, in a tree, or beside other sequences' rows.
 *
 * Work: tasks of (a block of up to RB consecutive rows of one segment, one KV head); a block's
 * rows share each key and value load; OpenMP spreads the tasks over the caller's threads.
 * Compiled with gemv.c into one library on the machine that runs it (-march=native).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define ALANES 16
#else
#define ALANES 8
#endif
#define RB 8 /* rows per task at most */
#define AI static inline __attribute__((always_inline))

typedef float avec __attribute__((vector_size(ALANES * 4), aligned(4)));
typedef int32_t aivec __attribute__((vector_size(ALANES * 4), aligned(4)));

AI avec aload(const float* p) {
  avec v;
  memcpy(&v, p, sizeof v);
  return v;
}
AI void astore(float* p, avec v) { memcpy(p, &v, sizeof v); }
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

AI float alanes_sum(avec v) { /* pairwise: halves, then quarters, ... (a fixed order) */
  float a[ALANES];
  memcpy(a, &v, sizeof a);
  for (int w = ALANES / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; i++) a[i] += a[i + w];
  return a[0];
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

typedef struct {
  int row0, rows, seg;
} Block;

static void task(const float* q, int64_t q_head, int64_t q_row, int G, int D, float scale, const float* K,
                 const float* V, int64_t pos_stride, const int32_t* lo, const int32_t* hi, const int32_t* extra_start,
                 const int32_t* extra_pos, Block b, int g, float* out, int heads) {
  int nq = b.rows * G, width = 0, jmin = 1 << 30, jmax = 0;
  int count[RB];
  for (int i = 0; i < b.rows; i++) {
    int r = b.row0 + i;
    count[i] = hi[r] - lo[r] + extra_start[r + 1] - extra_start[r];
    int padded = (count[i] + ALANES - 1) / ALANES * ALANES;
    if (padded > width) width = padded;
    if (lo[r] < jmin) jmin = lo[r];
    if (hi[r] > jmax) jmax = hi[r];
  }
  float* S = malloc(sizeof(float) * (size_t)nq * width);          /* [nq, width] scores, then e */
  float* acc = calloc((size_t)nq * D, sizeof(float));             /* [nq, D] weighted values */
  float* Q = malloc(sizeof(float) * (size_t)nq * D);              /* [nq, D] the block's queries */
  float sums[RB * 64];
  for (int i = 0; i < b.rows; i++)
    for (int h = 0; h < G; h++)
      memcpy(Q + (size_t)(i * G + h) * D, q + (g * G + h) * q_head + (int64_t)(b.row0 + i) * q_row, sizeof(float) * D);
  for (int x = 0; x < nq; x++)
    for (int j = 0; j < width; j++) S[(size_t)x * width + j] = -INFINITY;
  /* scores: the contiguous runs (a key load shared by the block's rows), then each row's extras */
  for (int j = jmin; j < jmax; j++) {
    const float* k = K + (int64_t)j * pos_stride;
    for (int i = 0; i < b.rows; i++) {
      int r = b.row0 + i;
      if (j < lo[r] || j >= hi[r]) continue;
      for (int h = 0; h < G; h++) {
        const float* qq = Q + (size_t)(i * G + h) * D;
        avec a = aload(qq) * aload(k);
        for (int d = ALANES; d < D; d += ALANES) a = afma(aload(qq + d), aload(k + d), a);
        S[(size_t)(i * G + h) * width + (j - lo[r])] = alanes_sum(a) * scale;
      }
    }
  }
  for (int i = 0; i < b.rows; i++) {
    int r = b.row0 + i, base = hi[r] - lo[r];
    for (int e = extra_start[r]; e < extra_start[r + 1]; e++) {
      const float* k = K + (int64_t)extra_pos[e] * pos_stride;
      for (int h = 0; h < G; h++) {
        const float* qq = Q + (size_t)(i * G + h) * D;
        avec a = aload(qq) * aload(k);
        for (int d = ALANES; d < D; d += ALANES) a = afma(aload(qq + d), aload(k + d), a);
        S[(size_t)(i * G + h) * width + base + (e - extra_start[r])] = alanes_sum(a) * scale;
      }
    }
  }
  /* softmax numerators and their sums, in each row's key order */
  for (int x = 0; x < nq; x++) {
    float* s = S + (size_t)x * width;
    float m = -INFINITY;
    for (int j = 0; j < count[x / G]; j++) m = s[j] > m ? s[j] : m;
    avec total = asplat(0.0f);
    for (int j = 0; j < width; j += ALANES) {
      avec e = aexp(aload(s + j) - asplat(m));
      astore(s + j, e);
      total += e;
    }
    sums[x] = alanes_sum(total);
  }
  /* weighted values: the contiguous runs, then the extras, in each row's key order */
  for (int j = jmin; j < jmax; j++) {
    const float* v = V + (int64_t)j * pos_stride;
    for (int i = 0; i < b.rows; i++) {
      int r = b.row0 + i;
      if (j < lo[r] || j >= hi[r]) continue;
      for (int h = 0; h < G; h++) {
        int x = i * G + h;
        avec p = asplat(S[(size_t)x * width + (j - lo[r])]);
        float* o = acc + (size_t)x * D;
        for (int d = 0; d < D; d += ALANES) astore(o + d, afma(p, aload(v + d), aload(o + d)));
      }
    }
  }
  for (int i = 0; i < b.rows; i++) {
    int r = b.row0 + i, base = hi[r] - lo[r];
    for (int e = extra_start[r]; e < extra_start[r + 1]; e++) {
      const float* v = V + (int64_t)extra_pos[e] * pos_stride;
      for (int h = 0; h < G; h++) {
        int x = i * G + h;
        avec p = asplat(S[(size_t)x * width + base + (e - extra_start[r])]);
        float* o = acc + (size_t)x * D;
        for (int d = 0; d < D; d += ALANES) astore(o + d, afma(p, aload(v + d), aload(o + d)));
      }
    }
  }
  for (int i = 0; i < b.rows; i++)
    for (int h = 0; h < G; h++) {
      int x = i * G + h;
      float* dst = out + ((int64_t)(b.row0 + i) * heads + g * G + h) * D;
      avec s = asplat(sums[x]);
      for (int d = 0; d < D; d += ALANES) astore(dst + d, aload(acc + (size_t)x * D + d) / s);
    }
  free(S);
  free(acc);
  free(Q);
}

int medusa_attention_lanes(void) { return ALANES; }

/* q: element (h, r, d) at q + h * q_head + r * q_row + d; out: [rows, heads, D] contiguous.
 * Returns 0, or -1 for a shape the kernel does not take (D not a multiple of the lanes,
 * more than 64 queries a block). */
int medusa_rows_attention(const float* q, int64_t q_head, int64_t q_row, int rows, int heads, int kv_heads, int D,
                          float scale, const int64_t* seg_k, const int64_t* seg_v, const int64_t* head_stride,
                          const int64_t* pos_stride, const int32_t* row_seg, const int32_t* lo, const int32_t* hi,
                          const int32_t* extra_start, const int32_t* extra_pos, float* out, int threads) {
  int G = heads / kv_heads;
  if (D % ALANES || heads % kv_heads || G > 64) return -1;
  Block* blocks = malloc(sizeof(Block) * (rows > 0 ? rows : 1));
  int nb = 0;
  for (int r = 0; r < rows; r++) {
    if (nb && blocks[nb - 1].seg == row_seg[r] && blocks[nb - 1].rows < RB && blocks[nb - 1].row0 + blocks[nb - 1].rows == r)
      blocks[nb - 1].rows++;
    else
      blocks[nb++] = (Block){r, 1, row_seg[r]};
  }
  int tasks = nb * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int t = 0; t < tasks; t++) {
    Block b = blocks[t / kv_heads];
    int g = t % kv_heads, s = b.seg;
    const float* K = (const float*)(intptr_t)seg_k[s] + g * head_stride[s];
    const float* V = (const float*)(intptr_t)seg_v[s] + g * head_stride[s];
    task(q, q_head, q_row, G, D, scale, K, V, pos_stride[s], lo, hi, extra_start, extra_pos, b, g, out, heads);
  }
  free(blocks);
  return 0;
}
