/* omni-serve's batch-invariant float32 GEMM: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Invariant by construction: every output element is computed by the same sequence of
 * floating-point operations, whatever M, the row's position in the batch, or the other rows:
 *   1. 8 lane sums s_j = fma chain over k = j, j + 8, j + 16, ... (k < K rounded down to 8), in k order;
 *   2. one fixed tree: ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7));
 *   3. the K % 8 tail added in k order with fma;
 *   4. the bias added last.
 * The blocking (MR rows x NR weight rows per register block) only decides which elements share
 * loads; it never changes an element's operations, so a block of 4 rows, a remainder of 1 and a
 * call with M = 1 give each row the same bits. No threads: the caller's process pins its own
 * (services/runtime/lm/invariant_gemm.py). Intrinsics, no -ffast-math: the compiler may not
 * re-associate or contract anything itself.
 *
 * Weights keep nn.Linear's [N, K] layout (no packed copy): the dot-product form reads a weight
 * row and an input row along k, both contiguous. A block of NR weight rows (NR * K * 4 bytes,
 * 24 KiB at K = 2048) stays in L1 while every block of MR input rows streams past it, so each
 * weight is read from memory once per call, not once per row as per-row GEMVs read it.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#define MR 4
#define PANEL 24

__attribute__((target("avx2,fma"))) static inline float tree_sum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                  /* s0+s4, s1+s5, s2+s6, s3+s7 */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  /* (s0+s4)+(s2+s6), (s1+s5)+(s3+s7) */
    __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    return _mm_cvtss_f32(u);
}

/* One register block of mr input rows x nr weight rows; mr and nr are constants at each call site
 * below, so the compiler keeps the accumulators in registers. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
block_avx2(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias, float *out,
           ptrdiff_t ldo, const int mr, const int nr, ptrdiff_t K) {
    __m256 acc[4][8];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    const ptrdiff_t kv = K & ~(ptrdiff_t)7;
    for (ptrdiff_t k = 0; k < kv; k += 8) {
        __m256 wv[8];
        for (int j = 0; j < nr; j++) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
        for (int i = 0; i < mr; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = tree_sum(acc[i][j]);
            for (ptrdiff_t t = kv; t < K; t++) s = __builtin_fmaf(x[i * ldx + t], w[j * ldw + t], s);
            out[i * ldo + j] = bias ? s + bias[j] : s;
        }
}

/* All of n in [0, N) for mr rows, nr weight rows at a time, the last block narrower. */
#define ROWS_AVX2(MRC, NRC)                                                                                   \
    static void rows_avx2_##MRC(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw,                \
                                const float *bias, float *out, ptrdiff_t ldo, ptrdiff_t N, ptrdiff_t K)      \
        __attribute__((target("avx2,fma")));                                                                  \
    static void rows_avx2_##MRC(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw,                \
                                const float *bias, float *out, ptrdiff_t ldo, ptrdiff_t N, ptrdiff_t K) {    \
        ptrdiff_t n = 0;                                                                                      \
        for (; n + NRC <= N; n += NRC)                                                                        \
            block_avx2(x, ldx, w + n * ldw, ldw, bias ? bias + n : NULL, out + n, ldo, MRC, NRC, K);         \
        for (; n < N; n++)                                                                                    \
            block_avx2(x, ldx, w + n * ldw, ldw, bias ? bias + n : NULL, out + n, ldo, MRC, 1, K);           \
    }
/* 12 accumulators (of 16 ymm registers) for blocks of 4, 3 and 2 rows; 8 for one row. */
ROWS_AVX2(4, 3)
ROWS_AVX2(3, 4)
ROWS_AVX2(2, 6)
ROWS_AVX2(1, 8)

/* The same operations without AVX2 (8 lanes in a plain array), for a CPU without it. */
static void rows_portable(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                          float *out, ptrdiff_t ldo, ptrdiff_t mr, ptrdiff_t N, ptrdiff_t K) {
    const ptrdiff_t kv = K & ~(ptrdiff_t)7;
    for (ptrdiff_t i = 0; i < mr; i++)
        for (ptrdiff_t n = 0; n < N; n++) {
            float s[8] = {0};
            for (ptrdiff_t k = 0; k < kv; k += 8)
                for (int j = 0; j < 8; j++) s[j] = __builtin_fmaf(x[i * ldx + k + j], w[n * ldw + k + j], s[j]);
            float r = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
            for (ptrdiff_t t = kv; t < K; t++) r = __builtin_fmaf(x[i * ldx + t], w[n * ldw + t], r);
            out[i * ldo + n] = bias ? r + bias[n] : r;
        }
}

/* The kernel this CPU runs: 2 = AVX2 + FMA, 0 = portable. Fixed for the process. */
int omni_gemm_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 0;
}

/* x [M, K] (row stride ldx), w [N, K] (row stride ldw), bias [N] or NULL, out [M, N] (row stride ldo). */
void omni_gemm_f32(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias, float *out,
                   ptrdiff_t ldo, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, int isa) {
    if (isa != 2) {
        rows_portable(x, ldx, w, ldw, bias, out, ldo, M, N, K);
        return;
    }
    /* A panel of PANEL weight rows (PANEL * K * 4 bytes: 96 KiB at K = 1024, in L2) meets every
     * block of input rows before the next panel: the weight comes from memory once per call. */
    for (ptrdiff_t n0 = 0; n0 < N; n0 += PANEL) {
        const ptrdiff_t np = N - n0 < PANEL ? N - n0 : PANEL;
        const float *wp = w + n0 * ldw, *bp = bias ? bias + n0 : NULL;
        ptrdiff_t m = 0;
        for (; m + MR <= M; m += MR) rows_avx2_4(x + m * ldx, ldx, wp, ldw, bp, out + m * ldo + n0, ldo, np, K);
        switch (M - m) {
        case 3: rows_avx2_3(x + m * ldx, ldx, wp, ldw, bp, out + m * ldo + n0, ldo, np, K); break;
        case 2: rows_avx2_2(x + m * ldx, ldx, wp, ldw, bp, out + m * ldo + n0, ldo, np, K); break;
        case 1: rows_avx2_1(x + m * ldx, ldx, wp, ldw, bp, out + m * ldo + n0, ldo, np, K); break;
        }
    }
}

/* The transcendental elementwise ops of an exact forward (the talker's shared-expert gate, the
 * MLPs' SiLU, the rotary embedding's cos and sin): each element the same scalar function of its own
 * input alone (libm's expf, cosf, sinf; for the activations then one add and one division, in this
 * order), in a plain loop. ATen's CPU kernels run pairs of vectors with Sleef's
 * exp and a run's last n % (2 * lanes) elements with libm's, which differ in the last bit on a few
 * % of inputs, so there an element's bits follow the tensor's size (a [T, 1] gate: which rows fall
 * in the tail). Here no vectors and no threads: nothing about the call can reach an element. */
void omni_sigmoid_f32(const float *x, float *out, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = 1.0f / (1.0f + expf(-x[i]));
}

void omni_silu_f32(const float *x, float *out, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = x[i] / (1.0f + expf(-x[i]));
}

void omni_cos_f32(const float *x, float *out, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = cosf(x[i]);
}

void omni_sin_f32(const float *x, float *out, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = sinf(x[i]);
}
