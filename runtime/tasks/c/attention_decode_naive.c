/* Naive attention over KV caches with grouped-query heads: each sequence's newest queries over its cache, fp32
 * arithmetic over a cache of kv_t (float, or _Float16 where KV_F16 is defined).
 *
 * Sequence b's cache holds keys at k + k_off[b] and values at v + v_off[b], each [kv_heads, capacity[b], d];
 * its first length[b] positions are filled, the last count[b] of them the new queries' (rows of q and out,
 * sequence after sequence). Query head h reads KV head h / (heads / kv_heads). The query at position p:
 * out = softmax(q . k[j] / sqrt(d)) @ v over first <= j <= p, where first = p + 1 - window when window is not 0
 * and the window is full, else 0. Three passes over the keys.
 */
#include <math.h>

#if KV_F16
typedef _Float16 kv_t;
#else
typedef float kv_t;
#endif

void kernel(int batch, int heads, int kv_heads, int d, int window, const float *q, const kv_t *k, const kv_t *v,
            const long *k_off, const long *v_off, const int *length, const int *count, const int *capacity,
            float *out)
{
    /* EVOLVE-BLOCK-START */
    const int group = heads / kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    long row = 0;
    for (int b = 0; b < batch; b++) {
        for (int t = 0; t < count[b]; t++, row++) {
            const int pos = length[b] - count[b] + t;
            const int first = window && pos + 1 > window ? pos + 1 - window : 0;
            for (int h = 0; h < heads; h++) {
                const long at = (long)(h / group) * capacity[b] * d;
                const kv_t *kh = k + k_off[b] + at, *vh = v + v_off[b] + at;
                const float *qh = q + (row * heads + h) * d;
                float *o = out + (row * heads + h) * d;
                float max = -INFINITY;
                for (int j = first; j <= pos; j++) {
                    float s = 0.0f;
                    for (int c = 0; c < d; c++) s += qh[c] * kh[(long)j * d + c];
                    max = fmaxf(max, s * scale);
                }
                float sum = 0.0f;
                for (int c = 0; c < d; c++) o[c] = 0.0f;
                for (int j = first; j <= pos; j++) {
                    float s = 0.0f;
                    for (int c = 0; c < d; c++) s += qh[c] * kh[(long)j * d + c];
                    const float p = expf(s * scale - max);
                    sum += p;
                    for (int c = 0; c < d; c++) o[c] += p * vh[(long)j * d + c];
                }
                for (int c = 0; c < d; c++) o[c] /= sum;
            }
        }
    }
    /* EVOLVE-BLOCK-END */
}
