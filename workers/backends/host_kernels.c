/* bfloat16 kernels of the packed forward on CPU, on one thread (see host_kernels.py, which builds this
 * file at model load with the host's C compiler for the host's own instruction sets, -march=native).
 *
 * The arithmetic is written on GCC/Clang vectors of 16 floats, which the compiler lowers to what the
 * CPU has: one AVX-512 register, two AVX2 ones, four SSE ones. Values are computed in float32 and
 * rounded to bfloat16 to nearest, ties to even, as torch rounds.
 *
 *   softmax_rows_bf16   attention's softmax, in place
 *   add_layer_norm_bf16 LayerNorm(a + b): a BERT layer's residual add and norm in one pass
 *   quantize_rows       an int8 linear's input: SmoothQuant scale, per-token absmax, int8, in one pass
 *   rescale_rows        an int8 linear's output: int32 x token scale x channel scale + bias (+ GELU)
 * The last two take and give bfloat16 or float32 (int8_linear.py); they are not bfloat16-only.
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

/* ------------------------------------------------------------------ int8 linears (int8_linear.py) */

typedef int8_t bytes __attribute__((vector_size(LANES)));

/* LANES values from a row of bfloat16 (is_bf16) or float32 ones; lanes past `count` are `pad`. */
static inline floats load_any(const void *from, int is_bf16, int64_t count, float pad) {
    if (is_bf16)
        return load_bf16(from, count, pad);
    floats v;
    if (count == LANES) {
        memcpy(&v, from, sizeof v);
        return v;
    }
    for (int64_t j = 0; j < LANES; j++)
        v[j] = j < count ? ((const float *)from)[j] : pad;
    return v;
}

static inline void store_any(void *to, int is_bf16, floats v, int64_t count) {
    if (is_bf16)
        store_bf16(to, v, count);
    else
        memcpy(to, &v, 4 * count);
}

/* Rounded to the nearest integer, ties to even (as torch.round), for |v| < 2^22. */
static inline floats round_even(floats v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

/* Each row of x (rows x cols, bfloat16 if is_bf16 else float32) times input_scale (cols floats; NULL:
 * none), then quantized to int8 by its own symmetric scale: q = round(v * (127 / peak)), peak = the
 * row's max |v| (at least 1e-12); token_scale[i] = peak * (1 / 127). The same float32 operations, in
 * the same order, as int8_linear.Int8Linear's torch path, in one read of the row for the peak and one
 * for the quantization instead of five passes over the matrix. */
void quantize_rows(const void *x, int is_bf16, const float *input_scale, int64_t rows, int64_t cols, int8_t *q,
                   float *token_scale) {
    const int64_t width = is_bf16 ? 2 : 4;
    for (int64_t i = 0; i < rows; i++) {
        const char *row = (const char *)x + i * cols * width;
        floats top = {0};
        for (int64_t j = 0; j < cols; j += LANES) {
            int64_t count = cols - j < LANES ? cols - j : LANES;
            floats v = load_any(row + j * width, is_bf16, count, 0.0f);
            if (input_scale)
                v *= load_any(input_scale + j, 0, count, 0.0f);
            floats magnitude = (floats)((uints)v & 0x7FFFFFFFu);
            ints greater = magnitude > top;
            top = (floats)(((ints)magnitude & greater) | ((ints)top & ~greater));
        }
        float peak = 1e-12f;
        for (int j = 0; j < LANES; j++)
            peak = top[j] > peak ? top[j] : peak;
        float multiplier = 127.0f / peak;
        for (int64_t j = 0; j < cols; j += LANES) {
            int64_t count = cols - j < LANES ? cols - j : LANES;
            floats v = load_any(row + j * width, is_bf16, count, 0.0f);
            if (input_scale)
                v *= load_any(input_scale + j, 0, count, 0.0f);
            bytes b = __builtin_convertvector(__builtin_convertvector(round_even(v * multiplier), ints), bytes);
            memcpy(q + i * cols + j, &b, count);
        }
        token_scale[i] = peak * (1.0f / 127.0f);
    }
}

/* erfc(z) for z >= 0 to a relative error under 1.2e-7 everywhere (a Chebyshev fit: t e^(-z^2 + P(t)),
 * t = 1 / (1 + z / 2)), so GELU's small negative tail (x/2 erfc(|x| / sqrt 2)) keeps float32's relative
 * precision too. P(0)... = 0 to 3e-8 at z = 0: the exponent is clamped to <= 0 for exp_nonpositive. */
static inline floats erfc_nonnegative(floats z) {
    floats t = 1.0f / (1.0f + 0.5f * z);
    floats p = t * 0.17087277f - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    floats exponent = p - z * z;
    ints positive = exponent > 0.0f;
    exponent = (floats)((ints)exponent & ~positive);
    return t * exp_nonpositive(exponent);
}

/* The exact (erf) GELU: x/2 (1 + erf(x / sqrt 2)) = x (1 - erfc(z) / 2) for x >= 0, x erfc(z) / 2 below. */
static inline floats gelu(floats v) {
    floats half_erfc = 0.5f * erfc_nonnegative((floats)((uints)v & 0x7FFFFFFFu) * 0.70710678f);
    ints negative = v < 0.0f;
    floats factor = (floats)(((ints)half_erfc & negative) | ((ints)(1.0f - half_erfc) & ~negative));
    return v * factor;
}

/* out = acc (rows x cols int32) x token_scale[i] x weight_scale[j] + bias[j] (bias NULL: none), then
 * the exact GELU if `activation` is 1, ReLU if 2, written as bfloat16 (is_bf16) or float32: an int8 linear's
 * output in one pass over its int32 product instead of three or four. */
void rescale_rows(const int32_t *acc, const float *token_scale, const float *weight_scale, const float *bias,
                  int64_t rows, int64_t cols, int activation, void *out, int is_bf16) {
    const int64_t width = is_bf16 ? 2 : 4;
    for (int64_t i = 0; i < rows; i++) {
        const int32_t *from = acc + i * cols;
        char *to = (char *)out + i * cols * width;
        float scale = token_scale[i];
        for (int64_t j = 0; j < cols; j += LANES) {
            int64_t count = cols - j < LANES ? cols - j : LANES;
            ints products;
            if (count == LANES)
                memcpy(&products, from + j, sizeof products);
            else
                for (int64_t k = 0; k < LANES; k++)
                    products[k] = k < count ? from[j + k] : 0;
            floats v = __builtin_convertvector(products, floats) * scale * load_any(weight_scale + j, 0, count, 0.0f);
            if (bias)
                v += load_any(bias + j, 0, count, 0.0f);
            if (activation == 1)
                v = gelu(v);
            else if (activation == 2)
                v = (floats)((ints)v & (ints)(v > 0.0f)); /* ReLU */
            store_any(to + j * width, is_bf16, v, count);
        }
    }
}
