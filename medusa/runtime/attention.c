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
 * sequences, the thread count, the blocking). The row's key list is cut into chunks of CHUNK
 * keys (list indices 0..CHUNK-1, CHUNK..2*CHUNK-1, ...: a property of the row alone); per chunk c:
 *   score_j = (sum over d of q[d] * k_j[d]) * scale, as LANES-wide partial sums over the D/LANES
 *             chunks left to right, then the lanes added pairwise (halves, then quarters, ...),
 *             ALANES keys at once (alanes_sums: the same order for each, wherever it sits);
 *   m_c = max_j score_j (exact);  e_j = exp(score_j - m_c) by the polynomial in vec.h;
 *   s_c = sum_j e_j as LANES-wide partial sums over groups of LANES keys (in the row's key order),
 *         the lanes then added pairwise;
 *   a_c = sum_j e_j * v_j, accumulated in the row's key order;
 * then out = a_0 / s_0 for a row of one chunk, else with w_c = exp(m_c - max m) and sums taken in
 * chunk order (one rounding per fused multiply-add): out = (sum_c w_c * a_c) / (sum_c w_c * s_c).
 * So a row's output is bitwise the same alone, in a tree, or beside other sequences' rows.
 *
 * Work: tasks of (a block of up to RB consecutive rows of one segment, one KV head, one chunk),
 * spread over the caller's threads (pool.c): a long context makes many tasks, so two threads
 * share three KV heads evenly. Each query streams its chunk's keys (each block of ALANES keys
 * read once for the task's queries) with its accumulators in registers.
 * Compiled with gemv.c into one library on the machine that runs it (-march=native).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "vec.h"

#define RB 8       /* rows per task at most */
#define CHUNK 512  /* keys of a row's list per task at most (a multiple of ALANES) */
#define MAXD 128   /* the largest head size taken (medusa_attention_max_dim tells rows.py) */
#define MAXC (MAXD / ALANES) /* a head's vectors at most: 8 with AVX-512, 16 with AVX2 */

typedef struct {
  int row0, rows, seg;
} Block;

/* Each (chunk, row, head)'s partial result: D exp-weighted value sums, then the chunk's max
 * score and its sum of exps, at acc + ((chunk * rows + row) * heads + head) * (D + 2). */
typedef struct {
  float* acc;
  int rows;
} Partial;

/* scores of one query against ``n`` <= ALANES keys (pointers ``k``) into s[0..n). Per key:
 * q[0:L] * k[0:L], then a fused multiply-add per further vector of the head, left to right; a full
 * block runs its keys' sums side by side (independent chains: a key's sum does not wait on the
 * key before it), a partial one key after key, in the same order per key. */
AI void scores_c(const float* q, const float* const* k, int n, int c, float scale, float* s) {
  avec a[ALANES];
  if (n == ALANES) {
    avec qd = aload(q);
    for (int j = 0; j < ALANES; j++) a[j] = qd * aload(k[j]);
    for (int d = 1; d < c; d++) {
      qd = aload(q + d * ALANES);
      for (int j = 0; j < ALANES; j++) a[j] = afma(qd, aload(k[j] + d * ALANES), a[j]);
    }
    astore(s, alanes_sums(a) * asplat(scale));
    return;
  }
  for (int j = 0; j < ALANES; j++) {
    if (j < n) {
      const float* kk = k[j];
      avec t = aload(q) * aload(kk);
      for (int d = 1; d < c; d++) t = afma(aload(q + d * ALANES), aload(kk + d * ALANES), t);
      a[j] = t;
    } else {
      a[j] = asplat(0.0f);
    }
  }
  float tmp[ALANES];
  astore(tmp, alanes_sums(a) * asplat(scale));
  memcpy(s, tmp, sizeof(float) * n);
}

/* the largest of s[0..n), n a multiple of ALANES (a max is exact: any order gives it) */
static float amax(const float* s, int n) {
  avec m = aload(s);
  for (int j = ALANES; j < n; j += ALANES) {
    avec v = aload(s + j);
#if defined(__AVX512F__)
    m = (avec)_mm512_max_ps((__m512)m, (__m512)v);
#elif defined(__AVX__)
    m = (avec)_mm256_max_ps((__m256)m, (__m256)v);
#else
    for (int l = 0; l < ALANES; l++) m[l] = v[l] > m[l] ? v[l] : m[l];
#endif
  }
  float out = m[0];
  for (int l = 1; l < ALANES; l++) out = m[l] > out ? m[l] : out;
  return out;
}

/* acc[0..c) += p[j] * v_j for j in [a, e), in that order */
AI void weigh_c(avec* acc, const float* p, const float* V, int64_t pos_stride, int a, int e, int c) {
  for (int j = a; j < e; j++) {
    avec w = asplat(p[j]);
    const float* v = V + (int64_t)j * pos_stride;
    for (int d = 0; d < c; d++) acc[d] = afma(w, aload(v + d * ALANES), acc[d]);
  }
}

/* weigh_c for ``Q`` queries at once over the same keys (o[x] += p[x][j] * v_j for j in [a, e), in
 * that order: each query's arithmetic is weigh_c's): each value vector is loaded once for the Q
 * queries, whose sums stay in registers (Q * c of them: at most 24 with AVX-512's 32). */
AI void weigh_q(float* const* o, const float* const* p, const float* V, int64_t pos_stride, int a, int e, int Q,
                int c) {
  avec acc[6][8], v[8];
  for (int x = 0; x < Q; x++)
    for (int d = 0; d < c; d++) acc[x][d] = aload(o[x] + d * ALANES);
  for (int j = a; j < e; j++) {
    const float* vj = V + (int64_t)j * pos_stride;
    for (int d = 0; d < c; d++) v[d] = aload(vj + d * ALANES);
    for (int x = 0; x < Q; x++) {
      avec w = asplat(p[x][j]);
      for (int d = 0; d < c; d++) acc[x][d] = afma(w, v[d], acc[x][d]);
    }
  }
  for (int x = 0; x < Q; x++)
    for (int d = 0; d < c; d++) astore(o[x] + d * ALANES, acc[x][d]);
}

/* o[0..c) += p[j] * v_j for j in [a, e) (weigh_c with the sums in registers) */
AI void weigh(float* o, const float* p, const float* V, int64_t pos_stride, int a, int e, int c) {
  avec acc[MAXC];
  for (int d = 0; d < c; d++) acc[d] = aload(o + d * ALANES);
  weigh_c(acc, p, V, pos_stride, a, e, c);
  for (int d = 0; d < c; d++) astore(o + d * ALANES, acc[d]);
}

/* weigh for the ``n`` queries whose rows see every key of [a, e): in groups sharing each value
 * vector where the registers hold them (AVX-512, heads of 64 or 128), else one by one */
AI void weigh_many(float* const* o, const float* const* p, int n, const float* V, int64_t pos_stride, int a,
                       int e, int c) {
  int x = 0;
#if ALANES == 16
  if (c == 4) {
    for (; x + 6 <= n; x += 6) weigh_q(o + x, p + x, V, pos_stride, a, e, 6, 4);
    for (; x + 3 <= n; x += 3) weigh_q(o + x, p + x, V, pos_stride, a, e, 3, 4);
  } else if (c == 8) {
    for (; x + 2 <= n; x += 2) weigh_q(o + x, p + x, V, pos_stride, a, e, 2, 8);
  }
#endif
  for (; x < n; x++) weigh(o[x], p[x], V, pos_stride, a, e, c);
}

/* The keys of a row's list with index in [ka, kb) (its chunk), for every query of block ``b`` on
 * KV head ``g``: each query's max score, sum of exps and exp-weighted values over those keys,
 * written to P at the chunk's place (see Partial). */
AI void task_c(const float* q, int64_t q_head, int64_t q_row, int G, int D, float scale, const float* K,
                 const float* V, int64_t pos_stride, const int32_t* lo, const int32_t* hi, const int32_t* extra_start,
                 const int32_t* extra_pos, Block b, int g, int ka, int kb, int heads, Partial P, int chunk, int c) {
  int jmin = 1 << 30, jmax = 0, nq = b.rows * G, width = 0;
  for (int i = 0; i < b.rows; i++) {
    int r = b.row0 + i, run = hi[r] - lo[r];
    int n = run + extra_start[r + 1] - extra_start[r];
    int e = n < kb ? n : kb, re = run < e ? run : e;
    if (e - ka > width) width = e - ka;
    if (ka < re) { /* the chunk holds some of the row's contiguous run */
      if (lo[r] + ka < jmin) jmin = lo[r] + ka;
      if (lo[r] + re > jmax) jmax = lo[r] + re;
    }
  }
  if (width <= 0) return; /* no row of the block has keys this far: every chunk entry stays empty */
  width = (width + ALANES - 1) / ALANES * ALANES;
  float* S = malloc(sizeof(float) * (size_t)nq * width); /* [nq, width]: scores, then their exps */
  float* acc = malloc(sizeof(float) * (size_t)nq * D);   /* [nq, D]: weighted values */
  const float* kp[ALANES];
  float tmp[ALANES];
#define QUERY(i, h) (q + (g * G + (h)) * q_head + (int64_t)(b.row0 + (i)) * q_row)
  /* scores: blocks of ALANES positions of the contiguous runs, each block read once for the
   * task's queries (the block sits in L1); then each row's extras */
  for (int j0 = jmin; j0 < jmax; j0 += ALANES) {
    int m = jmax - j0 < ALANES ? jmax - j0 : ALANES;
    for (int j = 0; j < m; j++) kp[j] = K + (int64_t)(j0 + j) * pos_stride;
    for (int i = 0; i < b.rows; i++) {
      int r = b.row0 + i, run = hi[r] - lo[r];
      int ra = lo[r] + ka, re = lo[r] + (run < kb ? run : kb); /* the row's run within the chunk */
      int a = j0 > ra ? j0 : ra, e = j0 + m < re ? j0 + m : re;
      if (a >= e) continue;
      for (int h = 0; h < G; h++) {
        float* dst = S + (size_t)(i * G + h) * width + (a - ra);
        if (a == j0 && e - a == m) { /* the row sees the whole block: scores straight to their place */
          scores_c(QUERY(i, h), kp, m, c, scale, dst);
        } else {
          scores_c(QUERY(i, h), kp, m, c, scale, tmp);
          memcpy(dst, tmp + (a - j0), sizeof(float) * (e - a));
        }
      }
    }
  }
  for (int i = 0; i < b.rows; i++) {
    int r = b.row0 + i, run = hi[r] - lo[r], ne = extra_start[r + 1] - extra_start[r];
    int x0 = ka > run ? ka - run : 0, x1 = (kb < run + ne ? kb : run + ne) - run; /* extras in the chunk */
    for (int e0 = x0; e0 < x1; e0 += ALANES) {
      int m = x1 - e0 < ALANES ? x1 - e0 : ALANES;
      for (int j = 0; j < m; j++) kp[j] = K + (int64_t)extra_pos[extra_start[r] + e0 + j] * pos_stride;
      for (int h = 0; h < G; h++) {
        scores_c(QUERY(i, h), kp, m, c, scale, tmp);
        memcpy(S + (size_t)(i * G + h) * width + (run + e0 - ka), tmp, sizeof(float) * m);
      }
    }
  }
  /* softmax numerators and their sums, in each row's key order */
  for (int x = 0; x < nq; x++) {
    int r = b.row0 + x / G, n = hi[r] - lo[r] + extra_start[r + 1] - extra_start[r];
    int cnt = (n < kb ? n : kb) - ka;
    float* s = S + (size_t)x * width;
    float* slot = P.acc + (((size_t)chunk * P.rows + r) * heads + g * G + x % G) * (D + 2);
    if (cnt <= 0) continue; /* an empty chunk for this row: its entry is never read */
    for (int j = cnt; j < width; j++) s[j] = -INFINITY;
    float mx = amax(s, width); /* exact: the same whatever the order */
    avec total = asplat(0.0f);
    for (int j = 0; j < width; j += ALANES) {
      avec e = aexp(aload(s + j) - asplat(mx));
      astore(s + j, e);
      total += e;
    }
    slot[D] = mx;
    slot[D + 1] = alanes_sum(total);
    memset(acc + (size_t)x * D, 0, sizeof(float) * D);
  }
  /* weighted values in each row's key order: the contiguous runs block by block (the queries of
   * the rows that see a whole block together), then the extras */
  float** wo = malloc(sizeof(float*) * (size_t)nq);
  const float** wp = malloc(sizeof(float*) * (size_t)nq);
  for (int j0 = jmin; j0 < jmax; j0 += ALANES) {
    int m = jmax - j0 < ALANES ? jmax - j0 : ALANES, nw = 0;
    for (int i = 0; i < b.rows; i++) {
      int r = b.row0 + i, run = hi[r] - lo[r];
      int ra = lo[r] + ka, re = lo[r] + (run < kb ? run : kb);
      int a = j0 > ra ? j0 : ra, e = j0 + m < re ? j0 + m : re;
      if (a >= e) continue;
      for (int h = 0; h < G; h++) {
        float* o = acc + (size_t)(i * G + h) * D;
        const float* p = S + (size_t)(i * G + h) * width - ra;
        if (a == j0 && e == j0 + m) {
          wo[nw] = o;
          wp[nw++] = p;
        } else {
          weigh(o, p, V, pos_stride, a, e, c);
        }
      }
    }
    weigh_many(wo, wp, nw, V, pos_stride, j0, j0 + m, c);
  }
  free(wo);
  free(wp);
  for (int i = 0; i < b.rows; i++) {
    int r = b.row0 + i, run = hi[r] - lo[r], ne = extra_start[r + 1] - extra_start[r];
    int x0 = ka > run ? ka - run : 0, x1 = (kb < run + ne ? kb : run + ne) - run;
    for (int e = x0; e < x1; e++) {
      const float* v = V + (int64_t)extra_pos[extra_start[r] + e] * pos_stride;
      for (int h = 0; h < G; h++) {
        avec p = asplat(S[(size_t)(i * G + h) * width + run + e - ka]);
        float* o = acc + (size_t)(i * G + h) * D;
        for (int d = 0; d < c; d++) astore(o + d * ALANES, afma(p, aload(v + d * ALANES), aload(o + d * ALANES)));
      }
    }
  }
  for (int x = 0; x < nq; x++) {
    int r = b.row0 + x / G, n = hi[r] - lo[r] + extra_start[r + 1] - extra_start[r];
    if ((n < kb ? n : kb) - ka <= 0) continue;
    float* slot = P.acc + (((size_t)chunk * P.rows + r) * heads + g * G + x % G) * (D + 2);
    memcpy(slot, acc + (size_t)x * D, sizeof(float) * D);
  }
#undef QUERY
  free(S);
  free(acc);
}

/* task_c with the head's vector count known to the compiler for the common head sizes: each
 * block's scores and weighted sums inline, their sums in registers */
static void task(const float* q, int64_t q_head, int64_t q_row, int G, int D, float scale, const float* K,
                 const float* V, int64_t pos_stride, const int32_t* lo, const int32_t* hi, const int32_t* extra_start,
                 const int32_t* extra_pos, Block b, int g, int ka, int kb, int heads, Partial P, int chunk) {
#define TASK(c) task_c(q, q_head, q_row, G, D, scale, K, V, pos_stride, lo, hi, extra_start, extra_pos, b, g, ka, kb, \
                       heads, P, chunk, c)
  switch (D / ALANES) {
    case 4: TASK(4); break;
    case 8: TASK(8); break;
    case 16: TASK(16); break;
    default: TASK(D / ALANES);
  }
#undef TASK
}

int medusa_attention_lanes(void) { return ALANES; }
int medusa_attention_max_dim(void) { return MAXD; }

typedef void (*medusa_task)(void* ctx, int task);
void medusa_parallel(int tasks, int threads, medusa_task fn, void* ctx); /* pool.c */

typedef struct {
  const float* q;
  int64_t q_head, q_row;
  int G, D, kv_heads, heads;
  float scale;
  const int64_t *seg_k, *seg_v, *head_stride, *pos_stride;
  const int32_t *lo, *hi, *extra_start, *extra_pos;
  const Block* blocks;
  const int32_t* work; /* per task / kv_heads: its block, then its chunk */
  Partial P;
} AttentionJob;

static void attention_task(void* ctx, int t) {
  const AttentionJob* j = ctx;
  int w = t / j->kv_heads, g = t % j->kv_heads, chunk = j->work[2 * w + 1];
  Block b = j->blocks[j->work[2 * w]];
  int s = b.seg;
  const float* K = (const float*)(intptr_t)j->seg_k[s] + g * j->head_stride[s];
  const float* V = (const float*)(intptr_t)j->seg_v[s] + g * j->head_stride[s];
  task(j->q, j->q_head, j->q_row, j->G, j->D, j->scale, K, V, j->pos_stride[s], j->lo, j->hi, j->extra_start,
       j->extra_pos, b, g, chunk * CHUNK, (chunk + 1) * CHUNK, j->heads, j->P, chunk);
}

/* A row's chunks merged in chunk order: out = (sum_c acc_c * w_c) / (sum_c s_c * w_c), w_c =
 * exp(m_c - max_c m_c); a row of one chunk is acc_0 / s_0. */
static void merge(const Partial P, int r, int heads, int D, int chunks, float* out) {
  int c = D / ALANES;
  for (int h = 0; h < heads; h++) {
    const float* first = P.acc + ((size_t)r * heads + h) * (D + 2);
    float* dst = out + ((int64_t)r * heads + h) * D;
    avec o[MAXC], total;
    if (chunks == 1) {
      for (int d = 0; d < c; d++) astore(dst + d * ALANES, aload(first + d * ALANES) / asplat(first[D + 1]));
      continue;
    }
    float mx = -INFINITY;
    for (int k = 0; k < chunks; k++) {
      float m = P.acc[(((size_t)k * P.rows + r) * heads + h) * (D + 2) + D];
      mx = m > mx ? m : mx;
    }
    total = asplat(0.0f);
    for (int d = 0; d < c; d++) o[d] = asplat(0.0f);
    for (int k = 0; k < chunks; k++) {
      const float* slot = P.acc + (((size_t)k * P.rows + r) * heads + h) * (D + 2);
      avec w = aexp(asplat(slot[D] - mx));
      total = afma(w, asplat(slot[D + 1]), total);
      for (int d = 0; d < c; d++) o[d] = afma(w, aload(slot + d * ALANES), o[d]);
    }
    for (int d = 0; d < c; d++) astore(dst + d * ALANES, o[d] / total);
  }
}

/* q: element (h, r, d) at q + h * q_head + r * q_row + d; out: [rows, heads, D] contiguous.
 * Returns 0, or -1 for a shape the kernel does not take (D not a multiple of the lanes,
 * more than 64 queries a block). */
int medusa_rows_attention(const float* q, int64_t q_head, int64_t q_row, int rows, int heads, int kv_heads, int D,
                          float scale, const int64_t* seg_k, const int64_t* seg_v, const int64_t* head_stride,
                          const int64_t* pos_stride, const int32_t* row_seg, const int32_t* lo, const int32_t* hi,
                          const int32_t* extra_start, const int32_t* extra_pos, float* out, int threads) {
  int G = heads / kv_heads;
  if (D % ALANES || D > MAXD || heads % kv_heads || G > 64) return -1;
  if (rows < 1) return 0;
  Block* blocks = malloc(sizeof(Block) * rows);
  int32_t* chunks = malloc(sizeof(int32_t) * rows); /* each row's chunk count */
  int nb = 0, most = 1, nwork = 0;
  for (int r = 0; r < rows; r++) {
    int n = hi[r] - lo[r] + extra_start[r + 1] - extra_start[r];
    chunks[r] = n > CHUNK ? (n + CHUNK - 1) / CHUNK : 1;
    if (chunks[r] > most) most = chunks[r];
    if (nb && blocks[nb - 1].seg == row_seg[r] && blocks[nb - 1].rows < RB && blocks[nb - 1].row0 + blocks[nb - 1].rows == r)
      blocks[nb - 1].rows++;
    else
      blocks[nb++] = (Block){r, 1, row_seg[r]};
  }
  /* chunk by chunk, each chunk's blocks one after another: the blocks of one sequence read the
   * same keys while they are in cache */
  int32_t* work = malloc(sizeof(int32_t) * 2 * (size_t)nb * most);
  int32_t* span = malloc(sizeof(int32_t) * nb); /* each block's chunk count */
  for (int b = 0; b < nb; b++) {
    span[b] = 1;
    for (int i = 0; i < blocks[b].rows; i++)
      span[b] = chunks[blocks[b].row0 + i] > span[b] ? chunks[blocks[b].row0 + i] : span[b];
  }
  for (int c = 0; c < most; c++)
    for (int b = 0; b < nb; b++)
      if (c < span[b]) {
        work[2 * nwork] = b;
        work[2 * nwork + 1] = c;
        nwork++;
      }
  free(span);
  /* the partial results, in a buffer kept by the calling thread (a call's size rarely changes) */
  static __thread float* kept = NULL;
  static __thread size_t room = 0;
  size_t need = (size_t)most * rows * heads * (D + 2);
  if (need > room) {
    free(kept);
    kept = malloc(sizeof(float) * need);
    room = need;
  }
  Partial P = {kept, rows};
  AttentionJob job = {q, q_head, q_row, G, D, kv_heads, heads, scale, seg_k, seg_v, head_stride, pos_stride, lo, hi,
                      extra_start, extra_pos, blocks, work, P};
  medusa_parallel(nwork * kv_heads, threads, attention_task, &job);
  for (int r = 0; r < rows; r++) merge(P, r, heads, D, chunks[r], out);
  free(work);
  free(chunks);
  free(blocks);
  return 0;
}

/* Each segment's rows of a pass's new keys and values into its own cache buffer: segment s's
 * rows row0[s] .. row0[s]+nrows[s]-1 of ``k``/``v`` (element (g, r, d) at base + g * src_head +
 * r * src_row + d) go to positions start[s] .. of its buffers dst_k[s]/dst_v[s] (element
 * (g, p, d) at base + g * dst_head[s] + p * dst_pos[s] + d). */
void medusa_write_rows(const float* k, const float* v, int64_t src_head, int64_t src_row, int kv_heads, int D,
                       int nseg, const int32_t* row0, const int32_t* nrows, const int32_t* start, const int64_t* dst_k,
                       const int64_t* dst_v, const int64_t* dst_head, const int64_t* dst_pos) {
  for (int s = 0; s < nseg; s++) {
    float* K = (float*)(intptr_t)dst_k[s];
    float* V = (float*)(intptr_t)dst_v[s];
    for (int g = 0; g < kv_heads; g++)
      for (int i = 0; i < nrows[s]; i++) {
        int64_t from = g * src_head + (int64_t)(row0[s] + i) * src_row;
        int64_t to = g * dst_head[s] + (int64_t)(start[s] + i) * dst_pos[s];
        memcpy(K + to, k + from, sizeof(float) * D);
        memcpy(V + to, v + from, sizeof(float) * D);
      }
  }
}
