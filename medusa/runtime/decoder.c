/* A whole decoding pass of a Llama-style decoder in one call: every layer's norms, products,
 * rotary embedding, cache writes, attention, activation and residual adds, for every row of
 * every sequence in the pass (medusa/runtime/native.py says where it is used).
 *
 * Why: a pass of a small model on a CPU spends about as long in the decoder's small operations
 * (norms, rotary embedding, residual adds, the activation, and the module calls around them) as
 * in its weight products; done here they cost microseconds, and the pass is its products.
 *
 * Per layer, for rows x[R, H] (the residual stream):
 *   h = rmsnorm(x) * w_in;  qkv = h @ [Wq; Wk; Wv]^T (+ bias);  q, k rotated by cos/sin;
 *   k, v written to each row's sequence cache (medusa_write_rows);
 *   a = attention of q over each row's keys (medusa_rows_attention: the row's layout);
 *   x = x + a @ Wo^T;  h = rmsnorm(x) * w_post;  [g, u] = h @ [Wg; Wu]^T;
 *   x = x + (silu(g) * u) @ Wd^T.
 * then out = rmsnorm(x) * w_final.
 *
 * Order of arithmetic: each row's values are computed from that row alone in one fixed order
 * (the products by gemv.c's, attention by attention.c's rules; a norm's sum of squares in
 * ALANES-wide partial sums left to right, the lanes then added in vec.h's order), so a row's
 * bits are the same whatever other rows or sequences share the pass.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

void medusa_gemv(const float* x, int n, int K, const float* P, int N, float* y, int threads); /* gemv.c */
int medusa_rows_attention(const float* q, int64_t q_head, int64_t q_row, int rows, int heads, int kv_heads, int D,
                          float scale, const int64_t* seg_k, const int64_t* seg_v, const int64_t* head_stride,
                          const int64_t* pos_stride, const int32_t* row_seg, const int32_t* lo, const int32_t* hi,
                          const int32_t* extra_start, const int32_t* extra_pos, float* out, int threads);
void medusa_write_rows(const float* k, const float* v, int64_t src_head, int64_t src_row, int kv_heads, int D,
                       int nseg, const int32_t* row0, const int32_t* nrows, const int32_t* start, const int64_t* dst_k,
                       const int64_t* dst_v, const int64_t* dst_head, const int64_t* dst_pos); /* attention.c */

/* One layer's entries in the table (int64 each: addresses, or a feature slot) */
enum {
  T_NORM_IN, T_NORM_POST, T_QKV, T_QKV_BIAS, T_O, T_O_BIAS, T_GATE_UP, T_GATE_UP_BIAS, T_DOWN, T_DOWN_BIAS,
  T_LO, T_FEATURE, T_FIELDS
};
#define PTR(t, f) ((const float*)(intptr_t)(t)[f])

int medusa_decoder_fields(void) { return T_FIELDS; }

/* y[n] = w[n] * (x[n] / sqrt(mean(x^2) + eps)) for one row of n (a multiple of ALANES) */
static void rmsnorm(const float* x, const float* w, int n, float eps, float* y) {
  avec acc = asplat(0.0f);
  for (int i = 0; i < n; i += ALANES) {
    avec v = aload(x + i);
    acc = acc + v * v;
  }
  float inv = 1.0f / sqrtf(alanes_sum(acc) / (float)n + eps);
  for (int i = 0; i < n; i += ALANES) astore(y + i, aload(w + i) * (aload(x + i) * asplat(inv)));
}

/* each of ``heads`` D-wide vectors at p (stride D) rotated: v * cos + rotate_half(v) * sin */
static void rotate(float* p, int heads, int D, const float* cos, const float* sin) {
  int half = D / 2;
  float t[512];
  for (int h = 0; h < heads; h++) {
    float* v = p + (int64_t)h * D;
    for (int i = 0; i < half; i++) t[i] = v[i] * cos[i] + (-v[i + half]) * sin[i];
    for (int i = half; i < D; i++) t[i] = v[i] * cos[i] + v[i - half] * sin[i];
    memcpy(v, t, sizeof(float) * D);
  }
}

/* a[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u, exp taken of -|g| only (vec.h's range) */
static void swiglu(const float* g, const float* u, int n, float* a) {
  int i = 0;
  for (; i + ALANES <= n; i += ALANES) {
    avec x = aload(g + i);
    aivec neg = x < asplat(0.0f);
    avec e = aexp((avec)((aivec)x | ((aivec){0} + INT32_MIN))); /* exp(-|x|): the sign bit set */
    avec one = asplat(1.0f);
    avec sig = (avec)(((aivec)(one / (one + e)) & ~neg) | ((aivec)(e / (one + e)) & neg));
    astore(a + i, x * sig * aload(u + i));
  }
  for (; i < n; i++) {
    float x = g[i], e = expf(-fabsf(x));
    a[i] = x * (x < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e)) * u[i];
  }
}

static void add_bias(float* y, const float* bias, int rows, int n) {
  if (!bias) return;
  for (int r = 0; r < rows; r++)
    for (int i = 0; i < n; i++) y[(int64_t)r * n + i] += bias[i];
}

/* x[R, H]: the rows' residual stream (the embeddings in; the last layer's output out), updated in
 * place. table[layers][T_FIELDS]; caches[layers][4][nseg]: each segment's key and value buffer
 * addresses, head and position strides. dims: heads, kv_heads, D, inter, nseg. cos/sin [R, D].
 * row0/nrows/start per segment; row_seg/hi/extra_start/extra_pos: the attention layout (lo per
 * layer in the table). feats [R, nfeat * H]: the residual entering each layer whose T_FEATURE
 * slot is >= 0. out [R, H]: the final norm's output. Returns 0, or -1 for shapes it does not take. */
int medusa_decoder(float* x, int R, int H, int layers, const int64_t* table, const int64_t* caches,
                   const int32_t* dims, float eps, float scale, const float* cos, const float* sin,
                   const int32_t* row0, const int32_t* nrows, const int32_t* start, const int32_t* row_seg,
                   const int32_t* hi, const int32_t* extra_start, const int32_t* extra_pos, float* feats, int nfeat,
                   const float* final_norm, float* out, int threads) {
  int heads = dims[0], kv = dims[1], D = dims[2], inter = dims[3], nseg = dims[4];
  int N = (heads + 2 * kv) * D, A = heads * D;
  if (H % ALANES || D % 2 || D > 512 || R < 1) return -1;
  float* h = malloc(sizeof(float) * (size_t)R * H);
  float* qkv = malloc(sizeof(float) * (size_t)R * N);
  float* att = malloc(sizeof(float) * (size_t)R * A);
  float* gu = malloc(sizeof(float) * (size_t)R * 2 * inter);
  float* act = malloc(sizeof(float) * (size_t)R * inter);
  float* y = malloc(sizeof(float) * (size_t)R * H);
  int rc = 0;
  for (int l = 0; l < layers && rc == 0; l++) {
    const int64_t* t = table + (int64_t)l * T_FIELDS;
    const int64_t* c = caches + (int64_t)l * 4 * nseg;
    if (t[T_FEATURE] >= 0)
      for (int r = 0; r < R; r++)
        memcpy(feats + ((int64_t)r * nfeat + t[T_FEATURE]) * H, x + (int64_t)r * H, sizeof(float) * H);
    for (int r = 0; r < R; r++) rmsnorm(x + (int64_t)r * H, PTR(t, T_NORM_IN), H, eps, h + (int64_t)r * H);
    medusa_gemv(h, R, H, PTR(t, T_QKV), N, qkv, threads);
    add_bias(qkv, PTR(t, T_QKV_BIAS), R, N);
    for (int r = 0; r < R; r++) {
      float* row = qkv + (int64_t)r * N;
      rotate(row, heads + kv, D, cos + (int64_t)r * D, sin + (int64_t)r * D); /* q's heads, then k's */
    }
    medusa_write_rows(qkv + A, qkv + A + kv * D, D, N, kv, D, nseg, row0, nrows, start, c, c + nseg, c + 2 * nseg,
                      c + 3 * nseg);
    rc = medusa_rows_attention(qkv, D, N, R, heads, kv, D, scale, c, c + nseg, c + 2 * nseg, c + 3 * nseg, row_seg,
                               (const int32_t*)(intptr_t)t[T_LO], hi, extra_start, extra_pos, att, threads);
    medusa_gemv(att, R, A, PTR(t, T_O), H, y, threads);
    add_bias(y, PTR(t, T_O_BIAS), R, H);
    for (int64_t i = 0; i < (int64_t)R * H; i++) x[i] = x[i] + y[i];
    for (int r = 0; r < R; r++) rmsnorm(x + (int64_t)r * H, PTR(t, T_NORM_POST), H, eps, h + (int64_t)r * H);
    medusa_gemv(h, R, H, PTR(t, T_GATE_UP), 2 * inter, gu, threads);
    add_bias(gu, PTR(t, T_GATE_UP_BIAS), R, 2 * inter);
    for (int r = 0; r < R; r++)
      swiglu(gu + (int64_t)r * 2 * inter, gu + (int64_t)r * 2 * inter + inter, inter, act + (int64_t)r * inter);
    medusa_gemv(act, R, inter, PTR(t, T_DOWN), H, y, threads);
    add_bias(y, PTR(t, T_DOWN_BIAS), R, H);
    for (int64_t i = 0; i < (int64_t)R * H; i++) x[i] = x[i] + y[i];
  }
  if (rc == 0)
    for (int r = 0; r < R; r++) rmsnorm(x + (int64_t)r * H, final_norm, H, eps, out + (int64_t)r * H);
  free(h);
  free(qkv);
  free(att);
  free(gu);
  free(act);
  free(y);
  return rc;
}

void medusa_gemv_bf16(const float* x, int n, int K, const uint16_t* P, int N, float* y, int threads); /* gemv.c */

/* y[n, N] = x[n, K] @ W^T from W's packed float32 (half 0) or bfloat16 (half 1) copy */
static void product(int half, const float* x, int n, int K, const void* P, int N, float* y, int threads) {
  if (half)
    medusa_gemv_bf16(x, n, K, (const uint16_t*)P, N, y, threads);
  else
    medusa_gemv(x, n, K, (const float*)P, N, y, threads);
}

/* One drafter layer (medusa/runtime/drafter.py) for T rows of one or more sequences (segments):
 * the rows' input g[T, H] and, for an EAGLE-3 layer, the tokens' embeddings emb[T, H] (float32).
 * EAGLE-3 (emb given): hn = rmsnorm(g) * w_hidden;  x = [rmsnorm(emb) * w_in ; hn] (2H wide);
 * EAGLE (emb NULL: g is the fused pair, a stock decoder layer): x = rmsnorm(g) * w_in, or g itself
 * where w_in is 0 (EAGLE-1's layer has no input norm);  then per row:
 *   qkv = x @ [Wq; Wk; Wv]^T;  q, k rotated by cos/sin;  k, v written to the row's segment's cache;
 *   a = attention of q over the row's cached keys (the layout: lo/hi run, then extra positions);
 *   r = (hn if norm_before_residual else g) + a @ Wo^T;  h = rmsnorm(r) * w_post;
 *   out = r + (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T   (the pre-norm output: the next draft's feature).
 * w: addresses of w_in, w_hidden, w_post (float32 [H]), then the packed qkv, o, gate/up and down
 * weights (float32, or bfloat16 with ``half``). dims: heads, kv_heads, D, inter, nseg. caches
 * [4][nseg]: each segment's key and value buffer addresses, head and position strides; segment s's
 * rows are row0[s] .. row0[s]+nrows[s]-1, written at its positions start[s] ..; row_seg[T] names
 * each row's segment. Every product reads its weights once for all rows of all segments.
 * Returns 0, or -1 for shapes it does not take. */
int medusa_draft_layer(const float* g, const float* emb, int T, int H, const int32_t* dims, float eps, float scale,
                       const int64_t* w, int half, int norm_before_residual, const float* cos, const float* sin,
                       const int64_t* caches, const int32_t* row0, const int32_t* nrows, const int32_t* start,
                       const int32_t* row_seg, const int32_t* lo, const int32_t* hi, const int32_t* extra_start,
                       const int32_t* extra_pos, float* out, int threads) {
  int heads = dims[0], kv = dims[1], D = dims[2], inter = dims[3], nseg = dims[4];
  int N = (heads + 2 * kv) * D, A = heads * D, W = emb ? 2 * H : H;
  if (H % ALANES || D % 2 || D > 512 || T < 1 || nseg < 1) return -1;
  float* x = malloc(sizeof(float) * (size_t)T * W);
  float* qkv = malloc(sizeof(float) * (size_t)T * N);
  float* att = malloc(sizeof(float) * (size_t)T * A);
  float* res = malloc(sizeof(float) * (size_t)T * H);
  float* h = malloc(sizeof(float) * (size_t)T * H);
  float* gu = malloc(sizeof(float) * (size_t)T * 2 * inter);
  float* act = malloc(sizeof(float) * (size_t)T * inter);
  const float *w_in = PTR(w, 0), *w_hidden = PTR(w, 1), *w_post = PTR(w, 2);
  const void *qkv_w = (const void*)(intptr_t)w[3], *o_w = (const void*)(intptr_t)w[4];
  const void *gu_w = (const void*)(intptr_t)w[5], *down_w = (const void*)(intptr_t)w[6];
  for (int r = 0; r < T; r++) {
    float* xr = x + (int64_t)r * W;
    const float* gr = g + (int64_t)r * H;
    if (emb) {
      rmsnorm(emb + (int64_t)r * H, w_in, H, eps, xr);
      rmsnorm(gr, w_hidden, H, eps, xr + H);
    } else if (w_in) {
      rmsnorm(gr, w_in, H, eps, xr);
    } else {
      memcpy(xr, gr, sizeof(float) * H);
    }
  }
  product(half, x, T, W, qkv_w, N, qkv, threads);
  for (int r = 0; r < T; r++)
    rotate(qkv + (int64_t)r * N, heads + kv, D, cos + (int64_t)r * D, sin + (int64_t)r * D); /* q's heads, then k's */
  const int64_t *dst_k = caches, *dst_v = caches + nseg, *dst_head = caches + 2 * nseg, *dst_pos = caches + 3 * nseg;
  medusa_write_rows(qkv + A, qkv + A + kv * D, D, N, kv, D, nseg, row0, nrows, start, dst_k, dst_v, dst_head, dst_pos);
  int rc = medusa_rows_attention(qkv, D, N, T, heads, kv, D, scale, dst_k, dst_v, dst_head, dst_pos, row_seg, lo, hi,
                                 extra_start, extra_pos, att, threads);
  if (rc == 0) {
    product(half, att, T, A, o_w, H, res, threads);
    for (int r = 0; r < T; r++) {
      const float* base = emb && norm_before_residual ? x + (int64_t)r * W + H : g + (int64_t)r * H;
      for (int i = 0; i < H; i++) res[(int64_t)r * H + i] += base[i];
      rmsnorm(res + (int64_t)r * H, w_post, H, eps, h + (int64_t)r * H);
    }
    product(half, h, T, H, gu_w, 2 * inter, gu, threads);
    for (int r = 0; r < T; r++)
      swiglu(gu + (int64_t)r * 2 * inter, gu + (int64_t)r * 2 * inter + inter, inter, act + (int64_t)r * inter);
    product(half, act, T, inter, down_w, H, out, threads);
    for (int64_t i = 0; i < (int64_t)T * H; i++) out[i] += res[i];
  }
  free(x);
  free(qkv);
  free(att);
  free(res);
  free(h);
  free(gu);
  free(act);
  return rc;
}
