/* bfloat16 kernels of the packed forward on CPU, on one thread (see host_kernels.py, which builds this
 * file at model load with the host's C compiler for the host's own instruction sets, -march=native).
 *
 * The arithmetic is written on GCC/Clang vectors of 16 floats, which the compiler lowers to what the
 * CPU has: one AVX-512 register, two AVX2 ones, four SSE ones. Values are computed in float32 and
 * rounded to bfloat16 to nearest, ties to even, as torch rounds.
 *
 *   softmax_rows_bf16   attention's softmax, in place
 *   add_layer_norm_bf16 LayerNorm(a + b): a BERT layer's residual add and norm in one pass
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float floats __attribute__((vector_size(4 * LANES)));
typedef int32_t ints __attribute__((vector_size(4 * LANES)));
typedef uint32_t uints __attribute__((vector_size(4 * LANES)));
typedef uint16_t halves __attribute__((vector_size(2 * LANES)));

/* LANES bfloat16 values from `count` <= LANES of them at `from`; the lanes past `count` are `pad`. */
static inline floats load_bf16(const uint16_t *from, int64_t count, float pad) {
    if (count == LANES) {
        halves h;
        memcpy(&h, from, sizeof h);
        return (floats)(__builtin_convertvector(h, uints) << 16);
    }
    floats v;
    for (int64_t j = 0; j < LANES; j++)
        v[j] = pad;
    for (int64_t j = 0; j < count; j++) {
        uint32_t bits = (uint32_t)from[j] << 16;
        memcpy((char *)&v + 4 * j, &bits, 4);
    }
    return v;
}

/* Rounded to bfloat16, to nearest, ties to even (the values are finite), `count` of them stored. */
static inline void store_bf16(uint16_t *to, floats v, int64_t count) {
    uints bits = (uints)v;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    halves h = __builtin_convertvector(bits >> 16, halves);
    if (count == LANES) {
        memcpy(to, &h, sizeof h);
        return;
    }
    for (int64_t j = 0; j < count; j++)
        to[j] = h[j];
}

/* e^t for t <= 0: t = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6 (error under 2e-7
 * relative), 2^n put into the exponent bits. Below -87 (float32's smallest normal is e^-87.3) the
 * result is 0, as it is for a masked -inf score. */
static inline floats exp_nonpositive(floats t) {
    const float log2e = 1.44269504f, ln2_hi = 0.693145752f, ln2_lo = 1.42860677e-06f;
    const float round = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    ints live = t >= -87.0f;        /* lanes all ones where t is in range, zero below (and -inf) */
    floats clamped = (floats)(((ints)t & live) | ((ints)((floats){0} - 87.0f) & ~live));
    floats n = (clamped * log2e + round) - round;
    floats r = clamped - n * ln2_hi - n * ln2_lo;
    floats p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    floats scale = (floats)((__builtin_convertvector(n, ints) + 127) << 23);
    return (floats)((ints)(p * scale) & live);
}

/* Softmax of each row: its maximum subtracted, exponentiated by exp_nonpositive, summed in float32 and
 * scaled by one reciprocal.
 * rows x cols bfloat16 values, row i at data + i * row_stride; work holds cols + LANES floats. A row is
 * read once into work as float32, padded with -inf to whole vectors (whose e^x is 0), so the exp pass
 * has no partial vector; only reading and writing the row do. */
void softmax_rows_bf16(uint16_t *data, int64_t rows, int64_t cols, int64_t row_stride, float *work) {
    for (int64_t i = 0; i < rows; i++) {
        uint16_t *row = data + i * row_stride;
        floats top = (floats){0} - INFINITY;
        for (int64_t j = 0; j < cols; j += LANES) {
            floats v = load_bf16(row + j, cols - j < LANES ? cols - j : LANES, -INFINITY);
            memcpy(work + j, &v, sizeof v);
            ints greater = v > top;
            top = (floats)(((ints)v & greater) | ((ints)top & ~greater));
        }
        float most = top[0];
        for (int j = 1; j < LANES; j++)
            most = top[j] > most ? top[j] : most;
        floats sums = {0};
        for (int64_t j = 0; j < cols; j += LANES) {
            floats e;
            memcpy(&e, work + j, sizeof e);
            e = exp_nonpositive(e - most);
            memcpy(work + j, &e, sizeof e);
            sums += e;
        }
        float total = 0.0f;
        for (int j = 0; j < LANES; j++)
            total += sums[j];
        float inverse = 1.0f / total;
        for (int64_t j = 0; j < cols; j += LANES) {
            floats e;
            memcpy(&e, work + j, sizeof e);
            store_bf16(row + j, e * inverse, cols - j < LANES ? cols - j : LANES);
        }
    }
}

/* out = LayerNorm(a + b) over rows of `cols` values (a, b, out: rows x cols, contiguous; weight and
 * bias: cols bfloat16; out may be a or b). a + b is rounded to bfloat16 first, as torch's add stores
 * it; mean and variance (biased, two passes) in float32, as torch's bfloat16 layer_norm computes them.
 * work holds cols + LANES floats. */
void add_layer_norm_bf16(const uint16_t *a, const uint16_t *b, const uint16_t *weight, const uint16_t *bias,
                         uint16_t *out, int64_t rows, int64_t cols, float eps, float *work) {
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *x = a + i * cols, *y = b + i * cols;
        floats sums = {0};
        for (int64_t j = 0; j < cols; j += LANES) {
            int64_t count = cols - j < LANES ? cols - j : LANES;
            floats v = load_bf16(x + j, count, 0.0f) + load_bf16(y + j, count, 0.0f);
            uint16_t rounded[LANES];
            store_bf16(rounded, v, LANES);
            v = load_bf16(rounded, count, 0.0f); /* the sum as torch's bfloat16 add leaves it; 0 past the row */
            memcpy(work + j, &v, sizeof v);
            sums += v;
        }
        float total = 0.0f;
        for (int j = 0; j < LANES; j++)
            total += sums[j];
        float mean = total / (float)cols;
        floats squares = {0};
        for (int64_t j = 0; j < cols; j += LANES) {
            floats v;
            memcpy(&v, work + j, sizeof v);
            int64_t count = cols - j < LANES ? cols - j : LANES;
            floats d = v - mean;
            for (int64_t k = count; k < LANES; k++)
                d[k] = 0.0f; /* lanes past the row */
            squares += d * d;
        }
        float variance = 0.0f;
        for (int j = 0; j < LANES; j++)
            variance += squares[j];
        float inverse = 1.0f / sqrtf(variance / (float)cols + eps);
        uint16_t *row = out + i * cols;
        for (int64_t j = 0; j < cols; j += LANES) {
            int64_t count = cols - j < LANES ? cols - j : LANES;
            floats v;
            memcpy(&v, work + j, sizeof v);
            floats scaled = (v - mean) * inverse * load_bf16(weight + j, count, 0.0f) + load_bf16(bias + j, count, 0.0f);
            store_bf16(row + j, scaled, count);
        }
    }
}
