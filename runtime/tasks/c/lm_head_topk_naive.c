/* Naive q8 LM head with its top list (runtime.tasks.lm_head_topk), one logit at a time. Each group of 32 values of
 * a row of x gets its own scale: s = max|x| / 127, q = clamp(rint(x / s), -127, 127) (q = 0 for a group of zeros);
 * the head arrives row-major in s8, wq[v * k + c], with a scale per group of 32 of each row, w_scale[v * (k/32) + g].
 * logit = sum_g (s_g * w_scale_g) * (float)dot_g. Every logit of a row is kept, then the top list is chosen by
 * insertion and the log-sum-exp summed in double. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Where value c of a head row lies: in order, or (USE_VNNI: runtime.tasks.lm_head_topk_vnni) with each pair of
 * groups interleaved by 4-byte chunks, a last unpaired group in order. */
static inline long at(int k, int c)
{
#ifdef USE_VNNI
    const int g = c / 32, o = c % 32;
    if (g / 2 * 64 + 64 <= k) return (long)g / 2 * 64 + 4 * (2 * (o / 4) + g % 2) + o % 4;
#endif
    (void)k;
    return c;
}

void kernel(int m, int vocab, int k, int top, const float *x, const int8_t *wq, const float *w_scale, int32_t *ids,
            float *values, float *lse)
{
    /* EVOLVE-BLOCK-START */
    const int groups = k / 32;
    float *logits = malloc(sizeof(float) * (size_t)vocab);
    for (int i = 0; i < m; i++) {
        const float *xr = x + (long)i * k;
        int8_t q[k];
        float s[groups];
        for (int g = 0; g < groups; g++) {
            float amax = 0.0f;
            for (int c = 32 * g; c < 32 * g + 32; c++) amax = fabsf(xr[c]) > amax ? fabsf(xr[c]) : amax;
            s[g] = amax / 127.0f;
            const float inv = amax > 0.0f ? 1.0f / s[g] : 0.0f;
            for (int c = 32 * g; c < 32 * g + 32; c++) {
                int v = (int)rintf(xr[c] * inv);
                q[c] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
            }
        }
        float peak = -INFINITY;
        for (int v = 0; v < vocab; v++) {
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int c = 32 * g; c < 32 * g + 32; c++) dot += (int32_t)q[c] * wq[(long)v * k + at(k, c)];
                acc += (s[g] * w_scale[(long)v * groups + g]) * (float)dot;
            }
            logits[v] = acc;
            peak = acc > peak ? acc : peak;
        }
        double sum = 0.0;
        for (int v = 0; v < vocab; v++) sum += exp((double)logits[v] - peak);
        lse[i] = (float)(peak + log(sum));
        float *tv = values + (long)i * top;
        int32_t *ti = ids + (long)i * top;
        int count = 0;
        for (int v = 0; v < vocab; v++) {
            const float l = logits[v];
            if (count == top && !(l > tv[top - 1])) continue;
            int p = count < top ? count++ : top - 1;
            while (p > 0 && tv[p - 1] < l) {
                tv[p] = tv[p - 1];
                ti[p] = ti[p - 1];
                p--;
            }
            tv[p] = l;
            ti[p] = v;
        }
    }
    free(logits);
    /* EVOLVE-BLOCK-END */
}
