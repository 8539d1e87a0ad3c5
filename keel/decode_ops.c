/* keel/decode_ops.c: the work of keel.decode's decode step between its matrix multiplies, and
 * keel.rollout's sampling, one call per fused group instead of one torch op each (keel/native.py
 * builds this file with the system's C compiler and loads it with ctypes).
 * Tensors are contiguous rows; `bf16` selects bf16 storage (uint16, rounded to nearest even as
 * torch rounds) or fp32. Element-wise groups compute in fp32 and round where transformers'
 * forward rounds in that dtype; the attention and the sampling work in fp32 throughout.
 * Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register; the compiler splits
 * them where the CPU has narrower ones). */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16 load16(const void *p, long i, int bf16) {
    v16 f;
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)p + i, sizeof f);
    }
    return f;
}

static inline float hsum(v16 v) { /* a tree of halves: 4 shuffles and adds, not 15 dependent adds */
    v16 t = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    t += __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    t += __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    t += __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return t[0];
}

/* lane t = hsum(v[t]) for 16 vectors, bit for bit (the same tree of halves for each: lanes i
 * and i+8, then i and i+4, then i and i+2, then the two left), as 15 adds over lanes of two keys,
 * then four, eight and sixteen keys at once rather than 64 adds in 16 separate trees */
static inline v16 hsum16(const v16 v[16]) {
    v16 x[8], y[4], z[2];
    for (int p = 0; p < 8; p++) /* lanes 0-7: key 2p's i + (i+8); 8-15: key 2p+1's */
        x[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int u = 0; u < 4; u++) /* lanes 4k..4k+3: key 4u+k's i + (i+4) */
        y[u] = __builtin_shufflevector(x[2 * u], x[2 * u + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(x[2 * u], x[2 * u + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int w = 0; w < 2; w++) /* lanes 2k, 2k+1: key 8w+k's i + (i+2) */
        z[w] = __builtin_shufflevector(y[2 * w], y[2 * w + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(y[2 * w], y[2 * w + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

typedef int32_t v16i __attribute__((vector_size(64)));

/* the bf16 bits of 16 floats (rounded to nearest even, as torch rounds; a NaN stays a NaN), in
 * the low halves of 16 words */
static inline v16u bf16_bits(v16 f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
    v16u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (v16u)(((v16i)r & ~nan) | ((v16i)((u >> 16) | 0x40u) & nan));
}

/* 16 values of a row in the dtype, stored from fp32 (rounded to nearest even, as torch rounds; a
 * NaN stays a NaN) */
static inline void store16(void *p, long i, v16 f, int bf16) {
    if (bf16) {
        v16h h = __builtin_convertvector(bf16_bits(f), v16h);
        memcpy((uint16_t *)p + i, &h, sizeof h);
    } else {
        memcpy((float *)p + i, &f, sizeof f);
    }
}

/* the values torch would store for these fp32 results in the dtype, as fp32. The empty asm makes
 * the value exist as such, so that the compiler cannot fuse the product that made it into a later
 * add (a fused multiply-add rounds once where torch rounds twice). */
static inline v16 round16(v16 f, int bf16) {
    if (!bf16) {
#if defined(__AVX512F__)
        __asm__("" : "+v"(f)); /* f is one zmm register */
#else
        __asm__ volatile("" : : "r"(&f) : "memory"); /* f is several registers: through memory */
#endif
        return f;
    }
    const v16u r = bf16_bits(f) << 16;
    memcpy(&f, &r, sizeof f);
    return f;
}

/* exp(x), 16 at a time: Cephes' expf (range reduction by ln 2, degree-6 polynomial; within 2 ulp
 * of expf) on x clamped to [-87, 88]; `zero_below`: exactly 0 where x < -87 (-inf: a masked key). */
static inline v16 vexp(v16 x, int zero_below) {
    const v16 lo = (v16){0} - 87.0f, hi = (v16){0} + 88.0f;
    v16i keep = x >= lo;
    x = (v16)(((v16i)x & keep) | ((v16i)lo & ~keep));
    v16i over = x > hi;
    x = (v16)(((v16i)hi & over) | ((v16i)x & ~over));
    const float magic = 12582912.0f; /* 1.5 · 2^23: adding it rounds to an integer */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    y = y * (v16)e;
    return zero_below ? (v16)((v16i)y & keep) : y;
}

/* ---- the element-wise groups (row widths are multiples of 16: keel/native.py checks) ---- */

#define PARALLEL_ROWS 8 /* rows from which the element-wise kernels split over threads */

/* transformers' LlamaRMSNorm: y = weight * dtype(x / sqrt(mean(x^2) + eps)), normalised in fp32.
 * With `delta` (not NULL), first h += delta in place (the residual add, rounded to the dtype). */
void keel_add_rms_norm(void *h, const void *delta, const void *weight, void *out, int rows, int n, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        long o = (long)r * n;
        v16 ss = {0};
        for (int i = 0; i < n; i += 16) {
            v16 x = load16(h, o + i, bf16);
            if (delta) {
                x = round16(x + load16(delta, o + i, bf16), bf16);
                store16(h, o + i, x, bf16);
            }
            ss += x * x;
        }
        float inv = 1.0f / sqrtf(hsum(ss) / (float)n + eps);
        for (int i = 0; i < n; i += 16)
            store16(out, o + i, load16(weight, i, bf16) * round16(load16(h, o + i, bf16) * inv, bf16), bf16);
    }
}

/* transformers' apply_rotary_pos_emb, out = x·cos + rotate_half(x)·sin, each product rounded to
 * the result's dtype before the sum as torch computes it: the result is x's dtype when cos and sin
 * are of it (the decode step, in place on qkv), fp32 when x is bf16 and cos, sin fp32 (bf16
 * autocast: torch promotes). Forward: src = x (src_bf16), dst = out (dst_bf16). Backward
 * (`backward` set), as autograd computes it through transformers' ops: src = the gradient of out
 * (fp32), dst = x's gradient in x's dtype (dst_bf16): each product's gradient (g·cos, g·sin)
 * rounded to x's dtype (the mul's input), rotate_half's two halves swapped and the first negated,
 * summed in x's dtype. src and dst [B, H, T, D] at strides (sb, sh, st, 1) and (db, dh, dt, 1)
 * (they may be the same memory); cos and sin [B or 1, T, D] rows of D (cos_bf16; batch stride cb,
 * 0 where broadcast). Split over threads from PARALLEL_ROWS positions (b, t) on. */
void keel_rotary(const void *src, long sb, long sh, long st, int src_bf16, const void *cos, const void *sin, int cos_bf16, long cb,
                 void *dst, long db, long dh, long dt, int dst_bf16, int backward, int B, int H, int T, int D) {
    const int half = D / 2;
    const long rows = (long)B * H * T;
#pragma omp parallel for schedule(static) if ((long)B * T >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        const long b = r / ((long)H * T), h = (r / T) % H, t = r % T;
        const long so = b * sb + h * sh + t * st, o = b * db + h * dh + t * dt, c = b * cb + t * D;
        for (int i = 0; i < half; i += 16) {
            v16 v1 = load16(src, so + i, src_bf16), v2 = load16(src, so + half + i, src_bf16);
            v16 c1 = load16(cos, c + i, cos_bf16), c2 = load16(cos, c + half + i, cos_bf16);
            v16 s1 = load16(sin, c + i, cos_bf16), s2 = load16(sin, c + half + i, cos_bf16);
            if (!backward) {
                store16(dst, o + i, round16(v1 * c1, dst_bf16) + round16(-v2 * s1, dst_bf16), dst_bf16);
                store16(dst, o + half + i, round16(v2 * c2, dst_bf16) + round16(v1 * s2, dst_bf16), dst_bf16);
            } else {
                v16 r1 = round16(v1 * s1, dst_bf16), r2 = round16(v2 * s2, dst_bf16); /* rotate_half's output gradient */
                store16(dst, o + i, round16(v1 * c1, dst_bf16) + r2, dst_bf16);
                store16(dst, o + half + i, round16(v2 * c2, dst_bf16) - r1, dst_bf16);
            }
        }
    }
}

/* The step's keys and values, read from each row of qkv [B, qkv_row] (heads H..H+KV-1 the keys,
 * the next KV the values, each of D values), copied to column `col` of the cache's key and value
 * buffers [B, KV, capacity, D] (strides kv_row, kv_head; rows of D contiguous values). */
void keel_append_kv(const void *qkv, long qkv_row, void *kbuf, void *vbuf, long kv_row, long kv_head, long col, int B, int H,
                    int KV, int D, int bf16) {
    const long es = bf16 ? 2 : 4;
    for (int b = 0; b < B; b++)
        for (int g = 0; g < KV; g++) {
            const long to = ((long)b * kv_row + (long)g * kv_head + col * D) * es;
            const char *row = (const char *)qkv + (long)b * qkv_row * es;
            memcpy((char *)kbuf + to, row + (long)(H + g) * D * es, D * es);
            memcpy((char *)vbuf + to, row + (long)(H + KV + g) * D * es, D * es);
        }
}

/* out [rows, n] = silu(gate) * up, gate and up the two halves of each row of gu [rows, 2n]; silu
 * is rounded to the dtype before the product, as torch computes it. */
void keel_silu_mul(const void *gu, void *out, int rows, int n, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        long o = (long)r * 2 * n;
        for (int i = 0; i < n; i += 16) {
            v16 g = load16(gu, o + i, bf16);
            v16 s = round16(g / (1.0f + vexp(-g, 0)), bf16);
            store16(out, (long)r * n + i, s * load16(gu, o + n + i, bf16), bf16);
        }
    }
}

/* ---- attention of one new token per row over [shared prefix ‖ the row's own keys] ---- */

static inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

/* the keys `ahead` positions past own position j and the values at j (read in the second pass),
 * rows of D values of `es` bytes at base: two streams from memory at once */
static inline __attribute__((always_inline)) void prefetch_own(const void *k, const void *v, long base, int j, int D, int es) {
    for (int c = 0; c < D * es; c += 64) {
        __builtin_prefetch((const char *)k + (base + (long)(j + 8) * D) * es + c);
        __builtin_prefetch((const char *)v + (base + (long)j * D) * es + c);
    }
}

/* the largest of s[0..W) (W a multiple of 16; -inf where all are) */
static inline float row_max(const float *s, int W) {
    v16 mx = (v16){0} - INFINITY;
    for (int j = 0; j < W; j += 16) {
        v16 x;
        memcpy(&x, s + j, sizeof x);
        v16i gt = x > mx;
        mx = (v16)(((v16i)x & gt) | ((v16i)mx & ~gt));
    }
    float M = -INFINITY;
    for (int i = 0; i < 16; i++) M = mx[i] > M ? mx[i] : M;
    return M;
}

/* s[j] = exp(s[j] - M) in place for j < W (-inf: exactly 0); returns their sum. The first
 * `n_copy` (a multiple of 16) also go to `copy` rounded to bf16 (NULL: none). */
static inline float exp_shifted(float *s, int W, float M, uint16_t *copy, int n_copy) {
    v16 sum = {0};
    for (int j = 0; j < W; j += 16) {
        v16 x;
        memcpy(&x, s + j, sizeof x);
        x = vexp(x - M, 1);
        memcpy(s + j, &x, sizeof x);
        sum += x;
        if (j < n_copy) store16(copy, j, x, 1);
    }
    return hsum(sum);
}

/* ONE(REP, NC) (defined at each use) for the shapes keel.decode._NativeOps.serves admits: the
 * grouped-query ratios of Llama-family checkpoints, rep ∈ {1, 2, 3, 4, 8}, and head dims D ∈ {32,
 * 64, 128} (NC = D / 16), each a compile-time constant in its instantiation */
#define BY_D(R, D)              \
    switch (D) {                \
    case 32: ONE(R, 2); break;  \
    case 64: ONE(R, 4); break;  \
    default: ONE(R, 8); break;  \
    }
#define BY_SHAPE(rep, D)           \
    switch (rep) {                 \
    case 1: BY_D(1, D); break;     \
    case 2: BY_D(2, D); break;     \
    case 3: BY_D(3, D); break;     \
    case 4: BY_D(4, D); break;     \
    default: BY_D(8, D); break;    \
    }

/* The own keys row b's attention reads: L, or none for an idle row (see keel_decode_attention:
 * its newest own key, position L-1, is hidden from it). */
static inline int own_keys(const int64_t *m, int L) { return L > 0 && !m[L - 1] ? 0 : L; }

/* The scores of row b's visible own keys j < L for its REP query heads: S[r*W + j] = qv[r] · k_j
 * (qv: the queries times the scale, fp32; keys in the dtype at k + base + j*D), fp32 FMAs, the
 * keys and values ahead prefetched; 16 keys at a time through hsum16, where hidden keys get a
 * score too (the callers set theirs to -inf), the last L mod 16 one at a time, hidden ones left
 * as they are. Arrays are of the
 * largest shape, [8][8], not REP × NC: the compiler keeps fixed-size ones in registers,
 * variable-length ones in memory. */
static inline __attribute__((always_inline)) void own_scores(const int REP, const int NC, const v16 qv[8][8], const void *k,
                                                             const void *v, long base, int L, const int64_t *m, float *S,
                                                             long W, int bf16) {
    const int D = NC * 16;
    int j = 0;
    /* 16 keys at a time, masked ones too (the caller sets their scores to -inf), each score
     * summed exactly as below */
    for (; j + 16 <= L; j += 16) {
        v16 acc[8][16];
        for (int t = 0; t < 16; t++) {
            prefetch_own(k, v, base, j + t, D, bf16 ? 2 : 4);
            v16 a[8];
            for (int r = 0; r < REP; r++) a[r] = (v16){0};
            for (int c = 0; c < NC; c++) {
                v16 kc = load16(k, base + (long)(j + t) * D + c * 16, bf16);
                for (int r = 0; r < REP; r++) a[r] += qv[r][c] * kc;
            }
            for (int r = 0; r < REP; r++) acc[r][t] = a[r];
        }
        for (int r = 0; r < REP; r++) {
            const v16 sums = hsum16(acc[r]);
            memcpy(S + (long)r * W + j, &sums, sizeof sums);
        }
    }
    for (; j < L; j++) {
        prefetch_own(k, v, base, j, D, bf16 ? 2 : 4);
        if (!m[j]) continue;
        v16 acc[8];
        for (int r = 0; r < REP; r++) acc[r] = (v16){0};
        for (int c = 0; c < NC; c++) {
            v16 kc = load16(k, base + (long)j * D + c * 16, bf16);
            for (int r = 0; r < REP; r++) acc[r] += qv[r][c] * kc;
        }
        for (int r = 0; r < REP; r++) S[(long)r * W + j] = hsum(acc[r]);
    }
}

/* acc[r] += S[r*W + j] · v_j over row b's visible own values j < L (in the dtype at v + base +
 * j*D), fp32 */
static inline __attribute__((always_inline)) void own_values(const int REP, const int NC, const void *v, long base, int L,
                                                             const int64_t *m, const float *S, long W, v16 acc[8][8],
                                                             int bf16) {
    const int D = NC * 16;
    for (int j = 0; j < L; j++) {
        if (!m[j]) continue;
        for (int c = 0; c < NC; c++) {
            v16 vv = load16(v, base + (long)j * D + c * 16, bf16);
            for (int r = 0; r < REP; r++) acc[r][c] += S[(long)r * W + j] * vv;
        }
    }
}

/* One (row b, kv head g) pair: its `rep` query heads over the prefix and the row's own keys.
 * REP and NC (= D/16) are compile-time constants in every instantiation below, so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void attend_one(
    const int REP, const int NC, int b, int g, const void *q, long q_row, const float *pkt, const float *pv,
    int P, int P16, const void *k, const void *v, long kv_row, long kv_head, int L, int L16, const int64_t *mask,
    long mask_row, void *out, float *S, int H, float scale, int bf16) {
    const int D = NC * 16, W = P16 + L16;
    const long qo = (long)b * q_row + (long)g * REP * D;
    const long base = (long)b * kv_row + (long)g * kv_head;
    const int64_t *m = mask + (long)b * mask_row;
    L = own_keys(m, L);
    float qs[8][128]; /* of the largest shape, not REP × NC: the compiler keeps fixed-size arrays in
                       * registers (variable-length ones in memory) */
    v16 qv[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) {
            qv[r][c] = load16(q, qo + (long)r * D + c * 16, bf16) * scale;
            memcpy(&qs[r][c * 16], &qv[r][c], sizeof(v16));
        }
    /* scores: prefix keys 16 at a time, s[j0..j0+16) = Σ_d q[d] · Kt[d, j0..j0+16); own keys one
     * at a time. Padding and masked keys get -inf. */
    {
        const float *kt = pkt + (long)g * D * P16;
        for (int j0 = 0; j0 < P16; j0 += 32) { /* two blocks of 16 keys: twice the independent sums in flight */
            const int two = j0 + 32 <= P16;
            v16 acc[8][2];
            for (int r = 0; r < REP; r++) acc[r][0] = acc[r][1] = (v16){0};
            for (int d = 0; d < D; d++) {
                v16 k0, k1 = {0};
                memcpy(&k0, kt + (long)d * P16 + j0, sizeof k0);
                if (two) memcpy(&k1, kt + (long)d * P16 + j0 + 16, sizeof k1);
                for (int r = 0; r < REP; r++) {
                    acc[r][0] += qs[r][d] * k0;
                    acc[r][1] += qs[r][d] * k1;
                }
            }
            for (int r = 0; r < REP; r++) memcpy(S + (long)r * W + j0, acc[r], (two ? 2 : 1) * sizeof(v16));
        }
        own_scores(REP, NC, qv, k, v, base, L, m, S + P16, W, bf16);
    }
    for (int r = 0; r < REP; r++) {
        for (int j = P; j < P16; j++) S[(long)r * W + j] = -INFINITY;
        for (int j = 0; j < L16; j++)
            if (j >= L || !m[j]) S[(long)r * W + P16 + j] = -INFINITY;
    }
    /* softmax of each query head's W scores (-inf: weight 0) */
    float inv[8];
    for (int r = 0; r < REP; r++) {
        float *s = S + (long)r * W;
        float tot = exp_shifted(s, W, row_max(s, W), NULL, 0);
        inv[r] = tot > 0.0f ? 1.0f / tot : 0.0f;
    }
    /* weighted sum of values, each value row read once for all query heads */
    v16 acc[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = (v16){0};
    {
        const float *vp = pv + (long)g * P16 * D;
        for (int j = 0; j < P; j++)
            for (int c = 0; c < NC; c++) {
                v16 vv;
                memcpy(&vv, vp + (long)j * D + c * 16, sizeof vv);
                for (int r = 0; r < REP; r++) acc[r][c] += S[(long)r * W + j] * vv;
            }
    }
    own_values(REP, NC, v, base, L, m, S + P16, W, acc, bf16);
    for (int r = 0; r < REP; r++) {
        const long o = ((long)b * H + g * REP + r) * D;
        for (int c = 0; c < NC; c++) store16(out, o + c * 16, acc[r][c] * inv[r], bf16);
    }
}

/* q [B, H, D] (row b, head h at b*q_row + h*D); the prefix (P = 0: none), zero past P: fp32 keys
 * transposed [KV, D, P16] and values [KV, P16, D]; own keys/values of row b, kv head g,
 * position j at b*kv_row + g*kv_head + j*D in the dtype; mask[b*mask_row + j] != 0 where own key j
 * is visible to row b; out [B, H, D] contiguous in the dtype; scratch [B*KV, H/KV, P16 + L16] fp32
 * (L16: L rounded up to a multiple of 16). Query head h reads kv head h / (H/KV). Scores, softmax
 * and the weighted sum are fp32; the output is rounded once. D ∈ {32, 64, 128} and H/KV ∈ {1, 2, 3, 4, 8}
 * (keel/native.py checks). A row whose newest own key (position L-1) is hidden from it is idle: a
 * rollout row that is not decoding this step (its turn ended before the batch's), whose output
 * keel.decode discards. Its own keys are not read (at the end of a ragged turn most rows are idle
 * and their own keys were most of the attention's memory traffic); its output is the prefix's
 * attention alone (zero without a prefix). */
void keel_decode_attention(const void *q, long q_row, const float *pkt, const float *pv, int P, int P16, const void *k,
                           const void *v, long kv_row, long kv_head, int L, const int64_t *mask, long mask_row, void *out,
                           float *scratch, int B, int H, int KV, int D, float scale, int bf16) {
    const int rep = H / KV, L16 = (L + 15) / 16 * 16, W = P16 + L16;
#pragma omp parallel for schedule(static)
    for (int item = 0; item < B * KV; item++) {
        const int g = item / B, b = item % B; /* kv head outer: one prefix head stays in cache */
        float *S = scratch + (long)item * rep * W;
#define ONE(R, N) attend_one(R, N, b, g, q, q_row, pkt, pv, P, P16, k, v, kv_row, kv_head, L, L16, mask, mask_row, out, S, H, scale, bf16)
        BY_SHAPE(rep, D);
#undef ONE
    }
}

/* ---- the next token of each row ---- */

/* Inverse-CDF sampling from softmax(logits / temperature) over each row of logits [rows, V]
 * (fp32), as keel.rollout._choose does it in torch: the first token whose running sum of
 * probabilities reaches u[r] times their total; temperature ≤ 0: the first maximal logit (greedy,
 * u unused). tok[r] and its log-probability logp[r]; `active` (NULL: every row): rows r with
 * active[r] == 0 are not sampled (tok 0, logp 0: a rollout's rows whose turn has ended). The scan
 * recomputes each block's exponentials (the same values as the total's) instead of keeping a
 * [rows, V] buffer. */
static inline v16 block_exp(const float *l, int j, float t, float M) {
    v16 z;
    memcpy(&z, l + j, sizeof z);
    return vexp(z / t - M, 1);
}

void keel_sample(const float *logits, int rows, int V, float temperature, const float *u, const int8_t *active, int64_t *tok,
                 float *logp) {
    const int V16 = V / 16 * 16;
    const float t = temperature > 0.0f ? temperature : 1.0f;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        if (active && !active[r]) {
            tok[r] = 0, logp[r] = 0.0f;
            continue;
        }
        const float *l = logits + (long)r * V;
        /* the first maximum (torch.argmax's tie rule; NaNs never win), 16 lanes at a time: each
         * lane keeps its largest value and where it first saw it; then the largest of the lanes,
         * the smallest position among the lanes that hold it, and the tail past the last block */
        float M = -INFINITY;
        int best = 0;
        {
            v16 mx = (v16){0} - INFINITY;
            v16i at = {0}, pos = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            for (int j = 0; j < V16; j += 16, pos += 16) {
                v16 x;
                memcpy(&x, l + j, sizeof x);
                v16i gt = x > mx;
                mx = (v16)(((v16i)x & gt) | ((v16i)mx & ~gt));
                at = (pos & gt) | (at & ~gt);
            }
            for (int i = 0; i < 16; i++) M = mx[i] > M ? mx[i] : M;
            best = V; /* some lane holds M (all -inf or NaN: every lane holds -inf at position 0) */
            for (int i = 0; i < 16; i++)
                if (mx[i] == M && at[i] < best) best = at[i];
            for (int j = V16; j < V; j++)
                if (l[j] > M) M = l[j], best = j;
        }
        M /= t;
        v16 sum = {0};
        float tail = 0.0f;
        for (int j = 0; j < V16; j += 16) sum += block_exp(l, j, t, M);
        for (int j = V16; j < V; j++) tail += expf(l[j] / t - M);
        const float total = hsum(sum) + tail;
        int chosen = best;
        if (temperature > 0.0f) {
            const float target = u[r] * total;
            float c = 0.0f;
            int j = 0;
            for (; j < V16; j += 16) { /* whole blocks of 16 first, then token by token from the block that crosses */
                float bs = hsum(block_exp(l, j, t, M));
                if (c + bs >= target) break;
                c += bs;
            }
            chosen = V - 1; /* u·total past the last sum by rounding: the last token, as torch clamps */
            v16 z = {0};
            for (; j < V; j++) {
                if (j < V16 && j % 16 == 0) z = block_exp(l, j, t, M);
                c += j < V16 ? z[j % 16] : expf(l[j] / t - M);
                if (c >= target) {
                    chosen = j;
                    break;
                }
            }
        }
        tok[r] = chosen;
        logp[r] = (l[chosen] / t - M) - logf(total);
    }
}

/* ---- the same attention in bf16 with AMX tiles for the shared prefix ----
 * At the rollout's shapes the prefix is most of the attention's arithmetic (the KG task: 560
 * shared keys, every row's query heads against all of them) and it is the same keys for every
 * row, so it is a matrix product: all rows' queries of kv head g [B·rep, D] × the prefix keys
 * [D, P], then the probabilities [B·rep, P] × the prefix values [P, D]. On a CPU with AMX those
 * two products run as bf16 tiles (fp32 sums); the rows' own keys keep the fp32 code above, and
 * the softmax spans both parts in fp32 as before. The prefix's probabilities enter the second
 * product rounded to bf16 (as a bf16 flash-attention kernel rounds them).
 * Built only where the compiler targets AMX (-march=native on such a CPU); keel_amx() says
 * whether it is there and the kernel lets this process use the tiles. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KEEL_AMX 1
#endif

/* 1 where keel_decode_attention_amx runs: built with AMX, and the kernel grants this process the
 * tile data state (Linux's ARCH_REQ_XCOMP_PERM; oneDNN asks for it too, asking again is harmless). */
int keel_amx(void) {
#ifdef KEEL_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* floats of scratch the attention needs. kind 0, keel_decode_attention: scores [B·KV, H/KV, P16 +
 * L16]. kind 1, keel_decode_attention_amx: scores [KV, M16, P32 + L16], own-value sums [KV, M16, D],
 * 1/softmax totals [KV, M16], bf16 probabilities [KV, M16, P32] and packed queries [KV, M16, D]
 * (M16: B·H/KV rounded up to 16 rows; P16, P32, L16: P, L rounded up to 16, 32, 16), 64-byte
 * aligned within it. kind 2, keel_decode_attention_dpbf16: for each (row, kv head) pair, scores
 * [H/KV, P32 + L16] then bf16 probabilities [H/KV, P32]. */
long keel_attention_scratch(int B, int H, int KV, int D, int P, int L, int kind) {
    const long L16 = round_up(L, 16), P32 = round_up(P, 32);
    if (kind == 0) return (long)B * H * (round_up(P, 16) + L16);
    if (kind == 2) return (long)B * H * (P32 + L16 + P32 / 2);
    const long M16 = round_up((long)B * (H / KV), 16);
    return 16 + KV * M16 * (P32 + L16) + KV * M16 * D + round_up(KV * M16, 16) + KV * M16 * P32 / 2 + KV * M16 * D / 2;
}

#ifdef KEEL_AMX
/* One (row b, kv head g) pair between the two tile products: its own keys' scores (fp32 FMAs,
 * as keel_decode_attention; tiles were tried here and were slower: the keys stream from memory
 * either way), the softmax over [its prefix scores (raw q·k from the tiles) ‖ own scores], the
 * prefix probabilities in bf16 for the second product, and its own values' weighted sum (fp32,
 * unnormalised). */
static inline __attribute__((always_inline)) void amx_own(
    const int REP, const int NC, int b, int g, const void *q, long q_row, int P, int P32, const void *k, const void *v,
    long kv_row, long kv_head, int L, int L16, const int64_t *mask, long mask_row, float *S, uint16_t *Pb, float *O,
    float *inv, long M16, int W, float scale) {
    const int D = NC * 16;
    const long qo = (long)b * q_row + (long)g * REP * D;
    const long base = (long)b * kv_row + (long)g * kv_head;
    const long row0 = (long)g * M16 + (long)b * REP; /* this pair's first query row in S, Pb, O, inv */
    const int64_t *m = mask + (long)b * mask_row;
    L = own_keys(m, L);
    v16 qv[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) qv[r][c] = load16(q, qo + (long)r * D + c * 16, 1) * scale;
    own_scores(REP, NC, qv, k, v, base, L, m, S + row0 * W + P32, W, 1);
    for (int r = 0; r < REP; r++) {
        float *s = S + (row0 + r) * W;
        for (int j = 0; j < P32; j += 16) {
            v16 x;
            memcpy(&x, s + j, sizeof x);
            x *= scale;
            memcpy(s + j, &x, sizeof x);
        }
        for (int j = P; j < P32; j++) s[j] = -INFINITY;
        for (int j = 0; j < L16; j++)
            if (j >= L || !m[j]) s[P32 + j] = -INFINITY;
        float tot = exp_shifted(s, W, row_max(s, W), Pb + (row0 + r) * P32, P32);
        inv[row0 + r] = tot > 0.0f ? 1.0f / tot : 0.0f;
    }
    v16 acc[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = (v16){0};
    own_values(REP, NC, v, base, L, m, S + row0 * W + P32, W, acc, 1);
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) memcpy(O + (row0 + r) * D + c * 16, &acc[r][c], sizeof(v16));
}

/* every tile 16 rows of 64 bytes (bf16 A/B operands of 32 values, fp32 results of 16) */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}
#endif

/* keel_decode_attention's inputs and output, in bf16, with the prefix laid out for the tiles:
 * keys pkv [KV, D/2, P32, 2] and values pvv [KV, P32/2, D, 2] (pairs of consecutive dims, resp.
 * positions, side by side; zero past P), P ≥ 1; scratch of keel_attention_scratch(..., 1) floats.
 * Call only where keel_amx() returned 1. */
void keel_decode_attention_amx(const void *q, long q_row, const uint16_t *pkv, const uint16_t *pvv, int P, const void *k,
                               const void *v, long kv_row, long kv_head, int L, const int64_t *mask, long mask_row,
                               void *out, float *scratch, int B, int H, int KV, int D, float scale) {
#ifdef KEEL_AMX
    const int rep = H / KV, P32 = (int)round_up(P, 32), L16 = (int)round_up(L, 16), W = P32 + L16;
    const long M = (long)B * rep, M16 = round_up(M, 16), MT = M16 / 16;
    float *base = (float *)round_up((long)scratch, 64);
    float *S = base, *O = S + KV * M16 * W, *inv = O + KV * M16 * D;
    uint16_t *Pb = (uint16_t *)(inv + round_up(KV * M16, 16)), *Qp = Pb + KV * M16 * P32;
#pragma omp parallel
    {
        amx_configure();
        /* prefix scores: queries [M16, D] × keys [D, P32] for each kv head, 16 rows × 32 keys a time */
#pragma omp for schedule(static)
        for (long it = 0; it < KV * MT; it++) {
            const int g = (int)(it / MT);
            const long m0 = (it % MT) * 16;
            uint16_t *A = Qp + ((long)g * M16 + m0) * D;
            for (long i = 0; i < 16; i++) {
                const long mi = m0 + i;
                if (mi < M)
                    memcpy(A + i * D, (const uint16_t *)q + (mi / rep) * q_row + (long)(g * rep + mi % rep) * D, D * 2);
                else
                    memset(A + i * D, 0, D * 2);
            }
            for (int n = 0; n < P32; n += 32) {
                _tile_zero(0);
                _tile_zero(1);
                for (int d = 0; d < D; d += 32) {
                    const uint16_t *bk = pkv + (((long)g * (D / 2) + d / 2) * P32 + n) * 2;
                    _tile_loadd(4, A + d, D * 2);
                    _tile_loadd(6, bk, P32 * 4);
                    _tile_loadd(7, bk + 32, P32 * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
                _tile_stored(0, S + ((long)g * M16 + m0) * W + n, W * 4);
                _tile_stored(1, S + ((long)g * M16 + m0) * W + n + 16, W * 4);
            }
        }
        /* each (row, kv head): own keys, softmax, own values */
#pragma omp for schedule(static)
        for (int item = 0; item < B * KV; item++) {
            const int g = item / B, b = item % B;
#define ONE(R, N) \
    amx_own(R, N, b, g, q, q_row, P, P32, k, v, kv_row, kv_head, L, L16, mask, mask_row, S, Pb, O, inv, M16, W, scale)
            BY_SHAPE(rep, D);
#undef ONE
        }
        /* prefix values: probabilities [M16, P32] × values [P32, D], 64 dims a time; then the own
         * part added, normalised and rounded once */
#pragma omp for schedule(static)
        for (long it = 0; it < KV * MT; it++) {
            const int g = (int)(it / MT);
            const long m0 = (it % MT) * 16;
            float tmp[16 * 64];
            for (int d0 = 0; d0 < D; d0 += 64) {
                const int wide = D - d0 >= 64;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int n = 0; n < P32; n += 32) {
                    const uint16_t *bv = pvv + (((long)g * (P32 / 2) + n / 2) * D + d0) * 2;
                    _tile_loadd(4, Pb + ((long)g * M16 + m0) * P32 + n, P32 * 2);
                    _tile_loadd(5, bv, D * 4);
                    _tile_loadd(6, bv + 32, D * 4);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                    if (wide) {
                        _tile_loadd(7, bv + 64, D * 4);
                        _tile_loadd(5, bv + 96, D * 4);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, tmp, 64 * 4);
                _tile_stored(1, tmp + 16, 64 * 4);
                _tile_stored(2, tmp + 32, 64 * 4);
                _tile_stored(3, tmp + 48, 64 * 4);
                for (long i = 0; i < 16 && m0 + i < M; i++) {
                    const long mi = m0 + i, row = (long)g * M16 + mi;
                    const long o = ((mi / rep) * H + (long)g * rep + mi % rep) * D + d0;
                    for (int c = 0; c < (wide ? 64 : 32); c += 16) {
                        v16 x, own;
                        memcpy(&x, tmp + i * 64 + c, sizeof x);
                        memcpy(&own, O + row * D + d0 + c, sizeof own);
                        store16(out, o + c, (x + own) * inv[row], 1);
                    }
                }
            }
        }
        _tile_release();
    }
#endif
}

/* ---- the same bf16 attention on AVX512-BF16 dot products, for CPUs without AMX ----
 * keel_decode_attention_amx's inputs, layout and arithmetic, one (row, kv head) pair at a time:
 * the prefix's scores are raw q·k summed in fp32 from pairs of bf16 products (VDPBF16PS: one
 * 32-bit lane holds a pair of consecutive dims of a key, as in the tiles' layout), then scaled;
 * the own keys, the softmax and the own values as in amx_own; the prefix's probabilities rounded
 * to bf16 for their product with the values (pairs of consecutive positions in a lane); the
 * output (prefix part + own part) · 1/total, rounded once. Half the bytes and multiply-adds of
 * the fp32 kernel's prefix loops, which read the prefix as fp32: on a Zen 4 EPYC (no AMX), at
 * batch 16, SmolLM2's heads and a 560-token prefix, a call (its Python side included) takes 86
 * µs against 153 (LOG.md, thirty-third session). */
#if defined(__AVX512BF16__)
#ifndef KEEL_AMX
#include <immintrin.h>
#endif
#define KEEL_DPBF16 1
#endif

/* 1 where keel_decode_attention_dpbf16 runs (built for a CPU with AVX512-BF16) */
int keel_dpbf16(void) {
#ifdef KEEL_DPBF16
    return 1;
#else
    return 0;
#endif
}

#ifdef KEEL_DPBF16
static inline __attribute__((always_inline)) void dot_one(
    const int REP, const int NC, int b, int g, const void *q, long q_row, const uint16_t *pkv, const uint16_t *pvv, int P,
    int P32, const void *k, const void *v, long kv_row, long kv_head, int L, int L16, const int64_t *mask, long mask_row,
    void *out, float *S, uint16_t *Pb, int H, float scale) {
    const int D = NC * 16, W = P32 + L16;
    const long qo = (long)b * q_row + (long)g * REP * D;
    const long base = (long)b * kv_row + (long)g * kv_head;
    const int64_t *m = mask + (long)b * mask_row;
    L = own_keys(m, L);
    uint32_t qw[8][64]; /* the queries as pairs of consecutive dims (arrays of the largest shape, not REP × NC:
                         * the compiler keeps fixed-size ones in registers, variable-length ones in memory) */
    for (int r = 0; r < REP; r++) memcpy(qw[r], (const uint16_t *)q + qo + (long)r * D, D * 2);
    /* prefix scores, 32 keys at a time: blocks of [D/2, 32] words of this kv head. Meanwhile
     * the pair's own keys and values (read next, cold in a decode step) are fetched, a share
     * a block. */
    const uint32_t *kw = (const uint32_t *)pkv + (long)g * (D / 2) * P32;
    const long own_bytes = (long)L * D * 2;
    const long share = round_up(own_bytes / (P32 / 32) + 1, 64);
    for (int n = 0; n < P32; n += 32) {
        for (long c = (long)(n / 32) * share; c < own_bytes && c < (long)(n / 32 + 1) * share; c += 64) {
            __builtin_prefetch((const char *)k + base * 2 + c);
            __builtin_prefetch((const char *)v + base * 2 + c);
        }
        const uint32_t *blk = kw + (long)n * (D / 2);
        __m512 acc[8][2];
        for (int r = 0; r < REP; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int d2 = 0; d2 < D / 2; d2++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(blk + d2 * 32);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(blk + d2 * 32 + 16);
#pragma GCC unroll 8
            for (int r = 0; r < REP; r++) {
                const __m512bh qq = (__m512bh)_mm512_set1_epi32((int)qw[r][d2]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qq, k0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qq, k1);
            }
        }
        for (int r = 0; r < REP; r++) {
            _mm512_storeu_ps(S + (long)r * W + n, _mm512_mul_ps(acc[r][0], _mm512_set1_ps(scale)));
            _mm512_storeu_ps(S + (long)r * W + n + 16, _mm512_mul_ps(acc[r][1], _mm512_set1_ps(scale)));
        }
    }
    /* own keys: fp32, as amx_own */
    v16 qv[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) qv[r][c] = load16(q, qo + (long)r * D + c * 16, 1) * scale;
    own_scores(REP, NC, qv, k, v, base, L, m, S + P32, W, 1);
    float inv[8];
    for (int r = 0; r < REP; r++) {
        float *s = S + (long)r * W;
        for (int j = P; j < P32; j++) s[j] = -INFINITY;
        for (int j = 0; j < L16; j++)
            if (j >= L || !m[j]) s[P32 + j] = -INFINITY;
        float tot = exp_shifted(s, W, row_max(s, W), Pb + (long)r * P32, P32);
        inv[r] = tot > 0.0f ? 1.0f / tot : 0.0f;
    }
    /* prefix values, two positions a lane: values [P32/2, D] words of this kv head; pairs past P
     * have probability 0 and are skipped */
    __m512 pa[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) pa[r][c] = _mm512_setzero_ps();
    const uint32_t *vw = (const uint32_t *)pvv + (long)g * (P32 / 2) * D;
    for (int n2 = 0; n2 < (P + 1) / 2; n2++) {
        __m512bh pr[8];
        for (int r = 0; r < REP; r++) {
            uint32_t w;
            memcpy(&w, Pb + (long)r * P32 + 2 * n2, sizeof w);
            pr[r] = (__m512bh)_mm512_set1_epi32((int)w);
        }
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(vw + (long)n2 * D + c * 16);
#pragma GCC unroll 8
            for (int r = 0; r < REP; r++) pa[r][c] = _mm512_dpbf16_ps(pa[r][c], pr[r], vv);
        }
    }
    v16 acc[8][8];
    for (int r = 0; r < REP; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = (v16){0};
    own_values(REP, NC, v, base, L, m, S + P32, W, acc, 1);
    for (int r = 0; r < REP; r++) {
        const long o = ((long)b * H + g * REP + r) * D;
        for (int c = 0; c < NC; c++) {
            store16(out, o + c * 16, ((v16)pa[r][c] + acc[r][c]) * inv[r], 1);
        }
    }
}
#endif

/* keel_decode_attention_amx's inputs, output and values' layout, keys in blocks of 32 positions
 * [KV, P32/32, D/2, 32, 2] (P ≥ 1); scratch of keel_attention_scratch(..., 2) floats. Call only
 * where keel_dpbf16() returned 1. */
void keel_decode_attention_dpbf16(const void *q, long q_row, const uint16_t *pkv, const uint16_t *pvv, int P, const void *k,
                                  const void *v, long kv_row, long kv_head, int L, const int64_t *mask, long mask_row,
                                  void *out, float *scratch, int B, int H, int KV, int D, float scale) {
#ifdef KEEL_DPBF16
    const int rep = H / KV, P32 = (int)round_up(P, 32), L16 = (int)round_up(L, 16), W = P32 + L16;
    const long per = (long)rep * (W + P32 / 2); /* floats of scratch per pair: scores, then bf16 probabilities */
#pragma omp parallel for schedule(static)
    for (int item = 0; item < B * KV; item++) {
        const int g = item / B, b = item % B; /* kv head outer: one prefix head stays in cache */
        float *S = scratch + item * per;
        uint16_t *Pb = (uint16_t *)(S + (long)rep * W);
#define ONE(R, N) dot_one(R, N, b, g, q, q_row, pkv, pvv, P, P32, k, v, kv_row, kv_head, L, L16, mask, mask_row, out, S, Pb, H, scale)
        BY_SHAPE(rep, D);
#undef ONE
    }
#endif
}

/* ---- bf16 training attention: keel.logprobs' forwards and backwards under bf16 autocast ----
 *
 * Causal grouped-query attention where query row t of batch row b sees keys 0 .. n[b,t]-1 (the
 * masks keel.logprobs builds: a causal offset by the cached prefix, right padding), for q
 * [B, H, Tq, D], k and v [B, KV, Tk, D] and the output [B, Tq, H, D], all bf16 and contiguous.
 * FlashAttention-2's arithmetic, with whole score rows in place of its online softmax (a row of
 * ≤ a few thousand keys fits in cache): the five products as AVX512-BF16 dot products of bf16
 * pairs into fp32 sums, the softmax in fp32, the probabilities rounded to bf16 before they
 * multiply the values, the forward keeping each row's log-sum-exp for the backward, which
 * recomputes the probabilities from it (dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), rounded to bf16
 * before its two products). Work goes in blocks of TA_POS query positions × the H/KV query
 * heads of one kv head, so the keys and values are read once per block and the causal limit
 * cuts each block's columns to its widest row. */
#define TA_POS 16

#ifdef _OPENMP
#include <omp.h>
#define TA_THREAD omp_get_thread_num()
#else
#define TA_THREAD 0
#endif

#ifdef KEEL_DPBF16
/* C[MR, 16·NR] (+)= A[MR, 2·K2] · B[2·K2, 16·NR] in fp32: A bf16 rows (row r at A + r·lda, its
 * pairs of consecutive columns), B words of bf16 pairs along the sum (pair k2 of column n at
 * B[k2·ldb + n]) */
static inline __attribute__((always_inline)) void ta_tile(const int MR, const int NR, const uint16_t *A, long lda,
                                                          const uint32_t *B, long ldb, float *C, long ldc, int K2, int acc) {
    __m512 c[8][4];
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NR; n++) c[r][n] = acc ? _mm512_loadu_ps(C + r * ldc + 16 * n) : _mm512_setzero_ps();
    for (int k2 = 0; k2 < K2; k2++) {
        __m512bh b[4];
        for (int n = 0; n < NR; n++) b[n] = (__m512bh)_mm512_loadu_si512(B + (long)k2 * ldb + 16 * n);
        for (int r = 0; r < MR; r++) {
            uint32_t w;
            memcpy(&w, A + r * lda + 2 * k2, sizeof w);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)w);
            for (int n = 0; n < NR; n++) c[r][n] = _mm512_dpbf16_ps(c[r][n], a, b[n]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NR; n++) _mm512_storeu_ps(C + r * ldc + 16 * n, c[r][n]);
}

#define TA_NR(MR, nr)                                                                                   \
    switch (nr) {                                                                                       \
    case 1: ta_tile(MR, 1, A + m * lda, lda, B + n, ldb, C + m * ldc + n, ldc, K2, acc); break;       \
    case 2: ta_tile(MR, 2, A + m * lda, lda, B + n, ldb, C + m * ldc + n, ldc, K2, acc); break;       \
    case 3: ta_tile(MR, 3, A + m * lda, lda, B + n, ldb, C + m * ldc + n, ldc, K2, acc); break;       \
    default: ta_tile(MR, 4, A + m * lda, lda, B + n, ldb, C + m * ldc + n, ldc, K2, acc); break;      \
    }

/* C[M, N] (+)= A[M, 2·K2] · B as ta_tile, N a multiple of 16: tiles of 6 rows × 64 columns (24 of
 * the 32 vector registers as sums), or of 8 rows × 48 where M is a multiple of 8 */
static void ta_gemm(const uint16_t *A, long lda, const uint32_t *B, long ldb, float *C, long ldc, int M, int N, int K2, int acc) {
    const int rows = M % 8 == 0 ? 8 : 6, NRmax = rows == 8 ? 3 : 4;
    for (int n = 0; n < N; n += 16 * NRmax) {
        const int nr = (N - n) / 16 < NRmax ? (N - n) / 16 : NRmax;
        for (int m = 0; m < M; m += rows) {
            switch (M - m < rows ? M - m : rows) {
            case 1: TA_NR(1, nr); break;
            case 2: TA_NR(2, nr); break;
            case 3: TA_NR(3, nr); break;
            case 4: TA_NR(4, nr); break;
            case 5: TA_NR(5, nr); break;
            case 6: TA_NR(6, nr); break;
            case 7: TA_NR(7, nr); break;
            default: TA_NR(8, nr); break;
            }
        }
    }
}
#undef TA_NR

/* keys or values of one kv head (n rows of D bf16) as the B operand of a product that sums over
 * their D columns: [D/2][ldb] words, word (d2, j) = row j's columns 2·d2, 2·d2+1; rows n..ldb-1 zero */
static void ta_pack_cols(const uint16_t *x, int n, int D, uint32_t *dst, long ldb) {
    for (int d2 = 0; d2 < D / 2; d2++) {
        uint32_t *o = dst + (long)d2 * ldb;
        for (int j = 0; j < n; j++) memcpy(o + j, x + (long)j * D + 2 * d2, 4);
        for (long j = n; j < ldb; j++) o[j] = 0;
    }
}

/* n rows of D bf16 as the B operand of a product that sums over the rows: [rows2/2][D] words, word
 * (j2, d) = rows 2·j2 and 2·j2+1 of column d; rows n..rows2-1 zero */
static void ta_pack_rows(const uint16_t *x, int n, int D, uint32_t *dst, int rows2) {
    for (int j2 = 0; j2 < rows2 / 2; j2++)
        for (int d = 0; d < D; d += 16) {
            v16h lo = {0}, hi = {0};
            if (2 * j2 < n) memcpy(&lo, x + (long)2 * j2 * D + d, sizeof lo);
            if (2 * j2 + 1 < n) memcpy(&hi, x + (long)(2 * j2 + 1) * D + d, sizeof hi);
            const v16u w = __builtin_convertvector(lo, v16u) | __builtin_convertvector(hi, v16u) << 16;
            memcpy(dst + (long)j2 * D + d, &w, sizeof w);
        }
}

/* a block's query rows, row r = (t - t0)·rep + h of kv head g, gathered from x (q: [B, H, Tq, D];
 * the output's gradient: [B, Tq, H, D] when `by_pos`) into R2 contiguous rows (the last zero when
 * R is odd) */
static void ta_gather(const uint16_t *x, int by_pos, int b, int g, int t0, int t1, int rep, int H, int Tq, int D, uint16_t *dst, int R2) {
    int r = 0;
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < rep; h++, r++) {
            const int head = g * rep + h;
            const long src = by_pos ? (((long)b * Tq + t) * H + head) * D : (((long)b * H + head) * Tq + t) * D;
            memcpy(dst + (long)r * D, x + src, (size_t)D * 2);
        }
    for (; r < R2; r++) memset(dst + (long)r * D, 0, (size_t)D * 2);
}

/* ta_gather's inverse for fp32 block rows (R of them): rounded to bf16 into x's layout */
static void ta_scatter(const float *src, int by_pos, int b, int g, int t0, int t1, int rep, int H, int Tq, int D, uint16_t *x) {
    int r = 0;
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < rep; h++, r++) {
            const int head = g * rep + h;
            const long dst = by_pos ? (((long)b * Tq + t) * H + head) * D : (((long)b * H + head) * Tq + t) * D;
            for (int c = 0; c < D; c += 16) {
                v16 v;
                memcpy(&v, src + (long)r * D + c, sizeof v);
                store16(x, dst + c, v, 1);
            }
        }
}

/* x [R2][D] bf16 → [D][R2] bf16 (the A operand of a product that sums over the block's rows) */
static void ta_transpose(const uint16_t *x, int R2, int D, uint16_t *dst) {
    for (int r = 0; r < R2; r++)
        for (int d = 0; d < D; d++) dst[(long)d * R2 + r] = x[(long)r * D + d];
}

/* x with -inf in the lanes of keys j + l ≥ nv (hidden from the row) */
static inline v16 ta_hide(v16 x, int j, int nv) {
    if (j + 16 <= nv) return x;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i keep = lane + j < nv;
    return (v16)(((v16i)x & keep) | ((v16i)((v16){0} - INFINITY) & ~keep));
}

static inline int ta_block_cols(const int32_t *n, int t0, int t1) {
    int w = 0;
    for (int t = t0; t < t1; t++) w = n[t] > w ? n[t] : w;
    return (int)round_up(w, 16);
}
#endif

/* floats of one thread's scratch (R2 block rows, K16 keys): forward — gathered queries, scores,
 * bf16 probabilities, output sums; backward — keys [D/2][K16] and [K16/2][D], values [D/2][K16]
 * words, the keys' and values' gradients transposed [D][K16], queries, output gradient and their
 * transposes, scores and dO·Vᵀ, probabilities and dS as row pairs, dS as rows, the queries'
 * gradient, deltas (the kernels lay them out in this order) */
static long ta_thread_floats(long R2, long K16, long D, int backward) {
    if (!backward) return R2 * D / 2 + R2 * K16 + R2 * K16 / 2 + R2 * D;
    return 3 * K16 * D / 2 + 2 * D * K16 + 2 * R2 * D + 2 * R2 * K16 + R2 * K16 + R2 * K16 / 2 + R2 * D + R2;
}

/* floats of scratch keel_train_attention (backward 0: also the packed keys and values of every
 * (row, kv head), K16·D words each) or keel_train_attention_backward (1) needs with `threads` threads */
long keel_train_attention_scratch(int B, int H, int KV, int Tk, int D, int threads, int backward) {
    const long R2 = round_up((long)(H / KV) * TA_POS, 2), K16 = round_up(Tk, 16);
    return (backward ? 0 : (long)B * KV * K16 * D) + threads * ta_thread_floats(R2, K16, D, backward);
}

/* out[b, t, h] = softmax_j<n[b,t](scale · q[b,h,t] · k[b,g,j]) · v[b,g,j] (g = h / (H/KV)) in bf16,
 * lse[b, h, t] its log-sum-exp (NULL: not kept). Call only where keel_dpbf16() returned 1; every
 * n[b, t] in 1..Tk; D a multiple of 32. */
void keel_train_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *n, uint16_t *out, float *lse,
                          float *scratch, int threads, int B, int H, int KV, int Tq, int Tk, int D, float scale) {
#ifdef KEEL_DPBF16
    const int rep = H / KV, R2 = (int)round_up(rep * TA_POS, 2), K16 = (int)round_up(Tk, 16), blocks = (Tq + TA_POS - 1) / TA_POS;
    const long pack = (long)K16 * D; /* words of one pair's two packs */
    const long per_thread = ta_thread_floats(R2, K16, D, 0);
    float *thread_base = scratch + (long)B * KV * pack;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < B * KV; item++) {
            const long kv = (long)item * Tk * D; /* item = b·KV + g: k's layout */
            uint32_t *kt = (uint32_t *)scratch + item * pack, *vp = kt + pack / 2;
            ta_pack_cols(k + kv, Tk, D, kt, K16);
            ta_pack_rows(v + kv, Tk, D, vp, K16);
        }
        float *mine = thread_base + TA_THREAD * per_thread;
        uint16_t *qc = (uint16_t *)mine;
        float *S = mine + (long)R2 * D / 2, *O = S + (long)R2 * K16 + (long)R2 * K16 / 2;
        uint16_t *Pb = (uint16_t *)(S + (long)R2 * K16);
#pragma omp for schedule(dynamic)
        for (int w = 0; w < B * KV * blocks; w++) {
            const int item = w / blocks, b = item / KV, g = item % KV, t0 = (w % blocks) * TA_POS;
            const int t1 = t0 + TA_POS < Tq ? t0 + TA_POS : Tq, R = (t1 - t0) * rep;
            const int32_t *nb = n + (long)b * Tq;
            const int N = ta_block_cols(nb, t0, t1);
            const uint32_t *kt = (const uint32_t *)scratch + item * pack, *vp = kt + pack / 2;
            ta_gather(q, 0, b, g, t0, t1, rep, H, Tq, D, qc, R2);
            ta_gemm(qc, D, kt, K16, S, K16, R, N, D / 2, 0);
            for (int r = 0; r < R; r++) {
                const int t = t0 + r / rep, h = g * rep + r % rep, nv = nb[t];
                float *s = S + (long)r * K16;
                v16 mx = (v16){0} - INFINITY;
                for (int j = 0; j < N; j += 16) {
                    v16 x;
                    memcpy(&x, s + j, sizeof x);
                    x = ta_hide(x, j, nv);
                    memcpy(s + j, &x, sizeof x);
                    v16i gt = x > mx;
                    mx = (v16)(((v16i)x & gt) | ((v16i)mx & ~gt));
                }
                float M = -INFINITY;
                for (int l = 0; l < 16; l++) M = mx[l] > M ? mx[l] : M;
                M *= scale;
                v16 sum = {0};
                for (int j = 0; j < N; j += 16) {
                    v16 x;
                    memcpy(&x, s + j, sizeof x);
                    x = vexp(x * scale - M, 1);
                    memcpy(s + j, &x, sizeof x);
                    sum += x;
                }
                const float tot = hsum(sum), inv = tot > 0.0f ? 1.0f / tot : 0.0f;
                for (int j = 0; j < N; j += 16) {
                    v16 x;
                    memcpy(&x, s + j, sizeof x);
                    store16(Pb + (long)r * K16, j, x * inv, 1);
                }
                if (lse) lse[((long)b * H + h) * Tq + t] = M + logf(tot);
            }
            ta_gemm(Pb, K16, vp, D, O, D, R, D, N / 2, 0);
            ta_scatter(O, 1, b, g, t0, t1, rep, H, Tq, D, out);
        }
    }
#endif
}

/* The gradients of keel_train_attention's inputs for the gradient dout [B, Tq, H, D] of its output
 * out, from its lse: dq [B, H, Tq, D], dk, dv [B, KV, Tk, D], bf16. Same conditions. */
void keel_train_attention_backward(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *n, const uint16_t *out,
                                   const uint16_t *dout, const float *lse, uint16_t *dq, uint16_t *dk, uint16_t *dv, float *scratch,
                                   int threads, int B, int H, int KV, int Tq, int Tk, int D, float scale) {
#ifdef KEEL_DPBF16
    const int rep = H / KV, R2 = (int)round_up(rep * TA_POS, 2), K16 = (int)round_up(Tk, 16);
    const long per_thread = ta_thread_floats(R2, K16, D, 1);
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + TA_THREAD * per_thread;
        uint32_t *kt = (uint32_t *)mine, *kp = kt + (long)K16 * D / 2, *vt = kp + (long)K16 * D / 2;
        float *dkt = (float *)(vt + (long)K16 * D / 2), *dvt = dkt + (long)D * K16;
        uint16_t *qc = (uint16_t *)(dvt + (long)D * K16), *doc = qc + (long)R2 * D, *qT = doc + (long)R2 * D, *doT = qT + (long)R2 * D;
        float *S = (float *)(doT + (long)R2 * D), *dP = S + (long)R2 * K16;
        uint32_t *Pi = (uint32_t *)(dP + (long)R2 * K16), *dSi = Pi + (long)R2 / 2 * K16;
        uint16_t *dSb = (uint16_t *)(dSi + (long)R2 / 2 * K16);
        float *dQ = (float *)(dSb + (long)R2 * K16), *delta = dQ + (long)R2 * D;
#pragma omp for schedule(dynamic)
        for (int item = 0; item < B * KV; item++) {
            const int b = item / KV, g = item % KV;
            const long kv = (long)item * Tk * D;
            const int32_t *nb = n + (long)b * Tq;
            ta_pack_cols(k + kv, Tk, D, kt, K16);
            ta_pack_rows(k + kv, Tk, D, kp, K16);
            ta_pack_cols(v + kv, Tk, D, vt, K16);
            memset(dkt, 0, sizeof(float) * D * K16);
            memset(dvt, 0, sizeof(float) * D * K16);
            for (int t0 = 0; t0 < Tq; t0 += TA_POS) {
                const int t1 = t0 + TA_POS < Tq ? t0 + TA_POS : Tq, R = (t1 - t0) * rep, Rp = (int)round_up(R, 2);
                const int N = ta_block_cols(nb, t0, t1);
                ta_gather(q, 0, b, g, t0, t1, rep, H, Tq, D, qc, Rp);
                ta_gather(dout, 1, b, g, t0, t1, rep, H, Tq, D, doc, Rp);
                ta_transpose(qc, Rp, D, qT);
                ta_transpose(doc, Rp, D, doT);
                for (int r = 0; r < R; r++) { /* rowsum(dO ∘ O) */
                    const int t = t0 + r / rep, h = g * rep + r % rep;
                    v16 acc = {0};
                    for (int c = 0; c < D; c += 16)
                        acc += load16(doc, (long)r * D + c, 1) * load16(out, (((long)b * Tq + t) * H + h) * D + c, 1);
                    delta[r] = hsum(acc);
                }
                ta_gemm(qc, D, kt, K16, S, K16, R, N, D / 2, 0);
                ta_gemm(doc, D, vt, K16, dP, K16, R, N, D / 2, 0);
                for (int r = 0; r < Rp; r += 2) { /* P and dS·scale, as bf16 rows and as row pairs */
                    for (int j = 0; j < N; j += 16) {
                        v16 p[2], ds[2];
                        for (int e = 0; e < 2; e++) {
                            const int rr = r + e;
                            if (rr >= R) {
                                p[e] = ds[e] = (v16){0};
                                continue;
                            }
                            const int t = t0 + rr / rep, h = g * rep + rr % rep, nv = nb[t];
                            v16 x, y;
                            memcpy(&x, S + (long)rr * K16 + j, sizeof x);
                            memcpy(&y, dP + (long)rr * K16 + j, sizeof y);
                            x = ta_hide(x, j, nv);
                            p[e] = vexp(x * scale - lse[((long)b * H + h) * Tq + t], 1);
                            ds[e] = p[e] * (y - delta[rr]) * scale;
                            store16(dSb + (long)rr * K16, j, ds[e], 1);
                        }
                        const v16u pw = bf16_bits(p[0]) | bf16_bits(p[1]) << 16;
                        const v16u dw = bf16_bits(ds[0]) | bf16_bits(ds[1]) << 16;
                        memcpy(Pi + (long)(r / 2) * K16 + j, &pw, sizeof pw);
                        memcpy(dSi + (long)(r / 2) * K16 + j, &dw, sizeof dw);
                    }
                }
                ta_gemm(doT, Rp, Pi, K16, dvt, K16, D, N, Rp / 2, 1);  /* dVᵀ += dOᵀ · P */
                ta_gemm(qT, Rp, dSi, K16, dkt, K16, D, N, Rp / 2, 1);  /* dKᵀ += Qᵀ · dS */
                ta_gemm(dSb, K16, kp, D, dQ, D, R, D, N / 2, 0);       /* dQ = dS · K */
                ta_scatter(dQ, 0, b, g, t0, t1, rep, H, Tq, D, dq);
            }
            for (int j = 0; j < Tk; j++) /* the transposed sums back to rows, in bf16 */
                for (int c = 0; c < D; c += 16) {
                    v16 x, y;
                    for (int l = 0; l < 16; l++) {
                        x[l] = dkt[(long)(c + l) * K16 + j];
                        y[l] = dvt[(long)(c + l) * K16 + j];
                    }
                    store16(dk, kv + (long)j * D + c, x, 1);
                    store16(dv, kv + (long)j * D + c, y, 1);
                }
        }
    }
#endif
}

/* ---- bf16 linear layers on AVX512-BF16 dot products, the decode step's GEMMs ----
 * y[M, N] = x[M, K] · wᵀ in bf16 for a bf16 weight w[N, K] laid out once by keel_pack_pairs as
 * [N/32][K/2][32] words (word (t, k2, c) = w[32·t + c, 2·k2 .. 2·k2+1]: each tile of 32 output
 * columns one stream of K·64 bytes). oneDNN's bf16 matmul (torch's `mkldnn._linear_pointwise` on a
 * laid-out weight, keel.decode._Packed) sums each output in VDPBF16PS pairs in blocks of `kblock`
 * inputs, each block from zero, the blocks' sums added in order, and rounds once to bf16: this
 * kernel does the same instructions in the same order, so its outputs are oneDNN's bit for bit
 * where `kblock` is oneDNN's for the shape and row count (keel.decode._pair_blocks finds it by
 * comparing the two; for SmolLM2's down projection it differs between one row and more). At decode
 * shapes it reads the weights as one stream each: SmolLM2-135M's 211 products at 8 rows take
 * 9.3–9.9 ms against oneDNN's 14.7–19.7 ms on a Zen 4 EPYC, where a read of the 270 MB of weights
 * takes 8.3 ms (LOG.md, thirty-eighth session). Call only where keel_dpbf16() returned 1; N a
 * multiple of 32, K and kblock even. */
void keel_pack_pairs(const uint16_t *w, uint32_t *p, int N, int K) {
#ifdef KEEL_DPBF16
    const int K2 = K / 2;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < N / 32; t++)
        for (int c = 0; c < 32; c++) {
            const uint32_t *row = (const uint32_t *)(w + (long)(32 * t + c) * K);
            uint32_t *dst = p + (long)t * K2 * 32 + c;
            for (int k2 = 0; k2 < K2; k2++) dst[(long)k2 * 32] = row[k2];
        }
#endif
}

/* ta_tile at 1-8 rows with the tile's strides known to the compiler: through ta_gemm (runtime
 * strides) the products at 32 rows took 8-10% longer (LOG.md, thirty-eighth session) */
#ifdef KEEL_DPBF16
#define PAIRS_MR(mr, ...)                  \
    switch (mr) {                          \
    case 1: ta_tile(1, __VA_ARGS__); break; \
    case 2: ta_tile(2, __VA_ARGS__); break; \
    case 3: ta_tile(3, __VA_ARGS__); break; \
    case 4: ta_tile(4, __VA_ARGS__); break; \
    case 5: ta_tile(5, __VA_ARGS__); break; \
    case 6: ta_tile(6, __VA_ARGS__); break; \
    case 7: ta_tile(7, __VA_ARGS__); break; \
    default: ta_tile(8, __VA_ARGS__); break; \
    }
#endif

void keel_linear_pairs(const uint16_t *x, const uint32_t *p, uint16_t *y, int M, int N, int K, int kblock) {
#ifdef KEEL_DPBF16
    const int K2 = K / 2, B2 = kblock / 2;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < N / 32; t++) {
        const uint32_t *tile = p + (long)t * K2 * 32;
        for (int m = 0; m < M; m += 8) {
            const int mr = M - m < 8 ? M - m : 8;
            const uint16_t *a = x + (long)m * K;
            float sum[8 * 32], part[8 * 32];
            for (int k2 = 0; k2 < K2; k2 += B2) {
                const int n2 = K2 - k2 < B2 ? K2 - k2 : B2;
                PAIRS_MR(mr, 2, a + 2 * k2, K, tile + (long)k2 * 32, 32, k2 ? part : sum, 32, n2, 0);
                if (k2)
                    for (int i = 0; i < mr * 32; i += 16)
                        _mm512_storeu_ps(sum + i, _mm512_add_ps(_mm512_loadu_ps(sum + i), _mm512_loadu_ps(part + i)));
            }
            for (int r = 0; r < mr; r++) {
                uint16_t *out = y + (long)(m + r) * N + 32 * t;
                _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sum + 32 * r)));
                _mm256_storeu_si256((__m256i *)(out + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sum + 32 * r + 16)));
            }
        }
    }
#endif
}
#ifdef KEEL_DPBF16
#undef PAIRS_MR
#endif

/* ---- one decode step's decoder layers in one call ---- */

/* keel.decode.LeanDecoder._layers for a bf16 model whose products are all keel_linear_pairs: per
 * layer the q/k/v product, rotary in place on its rows, the step's keys and values appended at
 * column `col` of the layer's cache buffers, the attention over [shared prefix ‖ col + 1 own
 * columns] (`kernel`: 0 keel_decode_attention, 1 its amx form, 2 its dpbf16 form), the output
 * product, the residual add and RMSNorm, the gate/up product, SwiGLU, the down product, the
 * residual add and the next RMSNorm (the final norm after the last layer) — the calls the Python
 * loop makes, in its order, on buffers of the shapes it allocates, so the same values bit for bit,
 * without ~55 µs of Python and ctypes a layer between them. h [B, hidden] is updated in place, x
 * [B, hidden] ends as the final norm's output; qkv, att, o, gu, act, down are work buffers of
 * [B, (H + 2·KV)·D], [B, H·D], [B, hidden], [B, 2·I], [B, I], [B, hidden]. layers:
 * DECODE_LAYER_FIELDS int64 a layer: the packed q/k/v, o, gate/up and down weights
 * (keel_pack_pairs), the two norms' weights, the key and value buffers, the prefix's keys and
 * values as the attention kernel reads them (0 without a prefix), and each product's input block
 * for one row, then for more (keel.decode._Pairs.blocks). The mask is int64 [B, P + col + 1] rows
 * of mask_row; scratch of keel_attention_scratch(B, H, KV, D, P, col + 1, kernel) floats. */
#define DECODE_LAYER_FIELDS 18
int keel_decode_layer_fields(void) { return DECODE_LAYER_FIELDS; }

void keel_decode_layers(const int64_t *layers, int n_layers, uint16_t *h, uint16_t *x, uint16_t *qkv, uint16_t *att, uint16_t *o,
                        uint16_t *gu, uint16_t *act, uint16_t *down, const uint16_t *final_norm, const uint16_t *cos,
                        const uint16_t *sin, const int64_t *mask, long mask_row, float *scratch, long kv_row, long kv_head, long col,
                        int P, int kernel, int B, int hidden, int H, int KV, int D, int I, float eps, float scale) {
    const int row = (H + 2 * KV) * D, more = B > 1, L = (int)col + 1;
    keel_add_rms_norm(h, NULL, (const void *)layers[4], x, B, hidden, eps, 1);
    for (int i = 0; i < n_layers; i++) {
        const int64_t *f = layers + (long)i * DECODE_LAYER_FIELDS;
        const uint32_t *wqkv = (const uint32_t *)f[0], *wo = (const uint32_t *)f[1], *wgu = (const uint32_t *)f[2],
                       *wdown = (const uint32_t *)f[3];
        void *kbuf = (void *)f[6], *vbuf = (void *)f[7];
        const uint16_t *pk = (const uint16_t *)f[8], *pv = (const uint16_t *)f[9];
        const void *next = i + 1 < n_layers ? (const void *)layers[(long)(i + 1) * DECODE_LAYER_FIELDS + 4] : (const void *)final_norm;
        keel_linear_pairs(x, wqkv, qkv, B, row, hidden, (int)f[10 + more]);
        keel_rotary(qkv, row, D, 0, 1, cos, sin, 1, D, qkv, row, D, 0, 1, 0, B, H + KV, 1, D);
        keel_append_kv(qkv, row, kbuf, vbuf, kv_row, kv_head, col, B, H, KV, D, 1);
        if (kernel == 2)
            keel_decode_attention_dpbf16(qkv, row, pk, pv, P, kbuf, vbuf, kv_row, kv_head, L, mask + P, mask_row, att, scratch, B, H, KV,
                                         D, scale);
        else if (kernel == 1)
            keel_decode_attention_amx(qkv, row, pk, pv, P, kbuf, vbuf, kv_row, kv_head, L, mask + P, mask_row, att, scratch, B, H, KV, D,
                                      scale);
        else
            keel_decode_attention(qkv, row, (const float *)pk, (const float *)pv, P, (int)round_up(P, 16), kbuf, vbuf, kv_row, kv_head, L,
                                  mask + P, mask_row, att, scratch, B, H, KV, D, scale, 1);
        keel_linear_pairs(att, wo, o, B, hidden, H * D, (int)f[12 + more]);
        keel_add_rms_norm(h, o, (const void *)f[5], x, B, hidden, eps, 1);
        keel_linear_pairs(x, wgu, gu, B, 2 * I, hidden, (int)f[14 + more]);
        keel_silu_mul(gu, act, B, I, 1);
        keel_linear_pairs(act, wdown, down, B, hidden, I, (int)f[16 + more]);
        keel_add_rms_norm(h, down, next, x, B, hidden, eps, 1);
    }
}
