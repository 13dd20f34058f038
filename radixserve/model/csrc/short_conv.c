/* LFM2's short convolution for one layer of a step, one call instead of ~12 torch ops.
 *
 * Why: a decode step's conv layer is a handful of tiny tensors (one row of n_embd), where each
 * torch op costs more than its arithmetic. The roundings are exactly model/short_conv.py's
 * torch path (built without reassociation or fused multiply-adds, kernels.py), so both paths
 * give the same bits: the input row B * x rounded to bf16 once (a bf16 product is exact in f32),
 * then out = bf16(C * (sum over j of w[:, j] * row_j)) with each product rounded to f32 and the
 * sum taken in order of j, a row before position 0 reading zeros. Every output row is computed
 * on its own, so its bits do not depend on how many tokens the step holds.
 */
#include <omp.h>
#include <stdint.h>

#include "common.h"

/* Rows in parallel only when there are enough of them to pay for waking the pool. */
#define PAR_ROWS 16

/* bcx [T, 3e] bf16: each token's [B | C | x]. ck, cv: the layer's input rows in the pool's
 * window part, two halves of width e / 2 a cell (row stride e / 2). new_cells [T]: where token
 * t's row goes; reads [T * L]: the cell the output of token t reads at tap j (-1: a position
 * before 0); w [e, L] f32, the depthwise kernel. out [T, e] bf16. Every new row is stored
 * before any output reads (a token reads rows of the step's earlier tokens). */
void short_conv_bf16(const uint16_t *bcx, int64_t T, int e, int L, uint16_t *ck, uint16_t *cv,
                     const int64_t *new_cells, const int64_t *reads, const float *w,
                     uint16_t *out) {
    const int h = e / 2;
#pragma omp parallel if (T >= PAR_ROWS)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *b = bcx + t * 3 * e, *x = b + 2 * e;
            uint16_t *dk = ck + new_cells[t] * h, *dv = cv + new_cells[t] * h;
            for (int i = 0; i < h; i++) {
                dk[i] = f32_to_bf16(bf16_to_f32(b[i]) * bf16_to_f32(x[i]));
                dv[i] = f32_to_bf16(bf16_to_f32(b[h + i]) * bf16_to_f32(x[h + i]));
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *c = bcx + t * 3 * e + e;
            const int64_t *rd = reads + t * L;
            uint16_t *o = out + t * e;
            float acc[e];
            for (int j = 0; j < L; j++) { /* tap by tap: each element's sum in order of j */
                for (int half = 0; half < 2; half++) {
                    const uint16_t *r = rd[j] >= 0 ? (half ? cv : ck) + rd[j] * h : 0;
                    float *a = acc + half * h;
                    const float *wj = w + (int64_t)half * h * L + j;
                    for (int i = 0; i < h; i++) {
                        float p = (r ? bf16_to_f32(r[i]) : 0.f) * wj[(int64_t)i * L];
                        a[i] = j ? a[i] + p : p;
                    }
                }
            }
            for (int i = 0; i < e; i++) o[i] = f32_to_bf16(bf16_to_f32(c[i]) * acc[i]);
        }
    }
}
