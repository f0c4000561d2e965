/* bfloat16 kernels of the packed forward on CPU, on one thread (see host_kernels.py, which builds this
 * file at model load with the host's C compiler for the host's own instruction sets, -march=native).
 *
 * The arithmetic is written on GCC/Clang vectors of 16 floats, which the compiler lowers to what the
 * CPU has: one AVX-512 register, two AVX2 ones, four SSE ones. Values are computed in float32 and
 * rounded to bfloat16 to nearest, ties to even, as torch rounds.
 *
 *   softmax_rows_bf16   attention's softmax, in place
 *   add_layer_norm_bf16 LayerNorm(a + b): a BERT layer's residual add and norm in one pass
 *   embed_bf16          BERT's embeddings: three table rows added, LayerNorm, for each token
 *   mean_rows_bf16      mean pooling over a packed batch's sequences, summed in float32
 *   attend_full_bf16    attention over a packed batch, BERT's full window, one call per layer
 *   quantize_rows       an int8 linear's input: SmoothQuant scale, per-token absmax, int8, in one pass
 *   rescale_rows        an int8 linear's output: int32 x token scale x channel scale + bias (+ GELU)
 *   int8_linear_rows    an int8 linear's GEMM with rescale_rows' epilogue (avx512_vnni; AMX tiles where built)
 *   bf16_linear_rows    a bfloat16 linear of a few rows (a short query): GEMM, bias, GELU (avx512_bf16; AMX)
 *   bert_layer_bf16     a whole BERT layer of a few rows in one call: the kernels above, one after another
 * attend_full_bf16's products, too, run on AMX tiles where the build targets them (the AMX tiles section).
 * quantize_rows and rescale_rows take and give bfloat16 or float32 (int8_linear.py); they are not bfloat16-only.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16
typedef float floats __attribute__((vector_size(4 * LANES)));
typedef int32_t ints __attribute__((vector_size(4 * LANES)));
typedef uint32_t uints __attribute__((vector_size(4 * LANES)));
typedef uint16_t halves __attribute__((vector_size(2 * LANES)));

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* LANES bfloat16 values from `count` <= LANES of them at `from`; the lanes past `count` are `pad`. */
static inline floats load_bf16(const uint16_t *from, int64_t count, float pad) {
    if (count == LANES) {
#ifdef __AVX512F__ /* one vpmovzxwd: GCC lowers the generic conversion to two halves, extracted and joined */
        return (floats)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)from)), 16);
#else
        halves h;
        memcpy(&h, from, sizeof h);
        return (floats)(__builtin_convertvector(h, uints) << 16);
#endif
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
#ifdef __AVX512F__ /* one vpmovdw, stored whole (as load_bf16: the generic conversion goes through memory) */
    if (count == LANES) {
        _mm256_storeu_si256((__m256i *)to, _mm512_cvtepi32_epi16((__m512i)(bits >> 16)));
        return;
    }
#endif
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
static const float LOG2E = 1.44269504f, LN2_HI = 0.693145752f, LN2_LO = 1.42860677e-06f;
/* e^r's Taylor series, highest power first. */
static const float EXP_TERMS[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};

static inline floats exp_nonpositive(floats t) {
    const float round = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    ints live = t >= -87.0f;        /* lanes all ones where t is in range, zero below (and -inf) */
    floats clamped = (floats)(((ints)t & live) | ((ints)((floats){0} - 87.0f) & ~live));
    floats n = (clamped * LOG2E + round) - round;
    floats r = clamped - n * LN2_HI - n * LN2_LO;
    floats p = r * EXP_TERMS[0] + EXP_TERMS[1];
    for (int k = 2; k < 7; k++) p = p * r + EXP_TERMS[k];
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

/* v rounded to bfloat16 (to nearest, ties to even; the values are finite) and widened back to float32:
 * store_bf16 then load_bf16 without leaving the registers. */
static inline floats round_to_bf16(floats v) {
    uints bits = (uints)v;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (floats)(bits & 0xFFFF0000u);
}

/* The sum of v's lanes, by halving the vector four times (4 dependent steps, not 15 scalar additions). */
static inline float lanes_sum(floats v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* a + b at j (a whole vector), rounded to bfloat16 as torch's add stores it, kept at work + j. */
static inline floats added(const uint16_t *x, const uint16_t *y, float *work, int64_t j) {
    floats v = round_to_bf16(load_bf16(x + j, LANES, 0.0f) + load_bf16(y + j, LANES, 0.0f));
    memcpy(work + j, &v, sizeof v);
    return v;
}

static inline floats squared_deviation(const float *work, int64_t j, float mean) {
    floats v;
    memcpy(&v, work + j, sizeof v);
    floats d = v - mean;
    return d * d;
}

/* A row's sums at j (work), normalised, scaled and shifted, `count` of them stored as bfloat16 at out + j. */
static inline void normalized(const float *work, const float *scale, const float *shift, int64_t j, float mean,
                              float inverse, uint16_t *out, int64_t count) {
    floats v, w, c;
    memcpy(&v, work + j, sizeof v);
    memcpy(&w, scale + j, sizeof w);
    memcpy(&c, shift + j, sizeof c);
    store_bf16(out + j, (v - mean) * inverse * w + c, count);
}

/* Rows of add_layer_norm_bf16 normalised together: each row's sums are chains of dependent additions, and a
 * row's three passes wait on each other (the mean, then the variance); two rows' chains in one loop keep twice
 * as many additions in flight. With load_bf16's and store_bf16's one-instruction conversions: 130-147 ns a
 * 384-wide row against 169-197 before, torch's add then layer_norm 300-380 (Xeon with AMX, one thread, 256
 * to 16,384 rows); MiniLM's packed forward 0.99-1.02x the tokens per CPU second in four alternated runs, three
 * of them 1.015-1.022x (bench.attention --forward). */
#define NORM_ROWS 2

/* add_layer_norm_bf16's work for rows of `cols` values, in floats (its callers allocate it): NORM_ROWS rows'
 * sums, the weight and the bias, each `cols` rounded up to whole vectors. */
int64_t norm_work_floats(int64_t cols) { return (NORM_ROWS + 2) * round_up(cols, LANES); }

/* add_layer_norm_bf16 for `count` (1 to NORM_ROWS; constant where inlined) rows at a, b and out, each row's
 * arithmetic in the same order whatever the count. work: NORM_ROWS rows of sums; scale, shift: the weight
 * and the bias widened; all `width` floats apart. */
static inline __attribute__((always_inline)) void norm_rows(const uint16_t *a, const uint16_t *b, uint16_t *out,
                                                            int count, int64_t cols, int64_t width, float eps,
                                                            float *work, const float *scale, const float *shift) {
    int64_t whole = cols / LANES * LANES; /* the vectors every lane of which is in the row */
    int64_t fours = whole / (4 * LANES) * (4 * LANES);
    const ints lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const ints in_row = lane < (int32_t)(cols - whole); /* the tail's lanes */
    floats s[NORM_ROWS][4] = {{{0}}}, q[NORM_ROWS][4] = {{{0}}};
    float mean[NORM_ROWS], inverse[NORM_ROWS];
    int64_t j = 0;
    for (; j < fours; j += 4 * LANES)
        for (int r = 0; r < count; r++)
            for (int v = 0; v < 4; v++)
                s[r][v] += added(a + r * cols, b + r * cols, work + r * width, j + v * LANES);
    for (; j < whole; j += LANES)
        for (int r = 0; r < count; r++)
            s[r][0] += added(a + r * cols, b + r * cols, work + r * width, j);
    for (int r = 0; r < count; r++) {
        if (whole < cols) { /* 0 past the row: it adds nothing to the sums */
            const uint16_t *x = a + r * cols + whole, *y = b + r * cols + whole;
            floats v = round_to_bf16(load_bf16(x, cols - whole, 0.0f) + load_bf16(y, cols - whole, 0.0f));
            memcpy(work + r * width + whole, &v, sizeof v);
            s[r][1] += v;
        }
        mean[r] = lanes_sum((s[r][0] + s[r][1]) + (s[r][2] + s[r][3])) / (float)cols;
    }
    for (j = 0; j < fours; j += 4 * LANES)
        for (int r = 0; r < count; r++)
            for (int v = 0; v < 4; v++)
                q[r][v] += squared_deviation(work + r * width, j + v * LANES, mean[r]);
    for (; j < whole; j += LANES)
        for (int r = 0; r < count; r++)
            q[r][0] += squared_deviation(work + r * width, j, mean[r]);
    for (int r = 0; r < count; r++) {
        if (whole < cols) /* lanes past the row: 0 */
            q[r][1] += (floats)((ints)squared_deviation(work + r * width, whole, mean[r]) & in_row);
        float variance = lanes_sum((q[r][0] + q[r][1]) + (q[r][2] + q[r][3]));
        inverse[r] = 1.0f / sqrtf(variance / (float)cols + eps);
    }
    for (j = 0; j < whole; j += LANES)
        for (int r = 0; r < count; r++)
            normalized(work + r * width, scale, shift, j, mean[r], inverse[r], out + r * cols, LANES);
    if (whole < cols)
        for (int r = 0; r < count; r++)
            normalized(work + r * width, scale, shift, whole, mean[r], inverse[r], out + r * cols, cols - whole);
}

/* out = LayerNorm(a + b) over rows of `cols` values (a, b, out: rows x cols, contiguous; weight and
 * bias: cols bfloat16; out may be a or b). a + b is rounded to bfloat16 first, as torch's add stores
 * it; mean and variance (biased, two passes) in float32, as torch's bfloat16 layer_norm computes them.
 * Each pass sums in four vectors at a time, so four chains of additions are in flight: summed in one,
 * a row's two passes waited on ~50 dependent additions, and the kernel took 0.27 us a 384-wide row on a
 * Xeon with AMX, twice torch's plain add. work: norm_work_floats(cols) floats (the weight and bias are
 * widened once for all rows). */
void add_layer_norm_bf16(const uint16_t *a, const uint16_t *b, const uint16_t *weight, const uint16_t *bias,
                         uint16_t *out, int64_t rows, int64_t cols, float eps, float *work) {
    int64_t width = round_up(cols, LANES);
    float *scale = work + NORM_ROWS * width, *shift = scale + width;
    for (int64_t j = 0; j < cols; j += LANES) {
        int64_t count = cols - j < LANES ? cols - j : LANES;
        floats w = load_bf16(weight + j, count, 0.0f), c = load_bf16(bias + j, count, 0.0f);
        memcpy(scale + j, &w, sizeof w);
        memcpy(shift + j, &c, sizeof c);
    }
    int64_t i = 0;
    for (; i + NORM_ROWS <= rows; i += NORM_ROWS)
        norm_rows(a + i * cols, b + i * cols, out + i * cols, NORM_ROWS, cols, width, eps, work, scale, shift);
    if (i < rows)
        norm_rows(a + i * cols, b + i * cols, out + i * cols, 1, cols, width, eps, work, scale, shift);
}

/* BERT's embeddings of `rows` tokens into out (rows x cols): LayerNorm(word[ids] + position[positions] +
 * type[types]), with torch's roundings (each bfloat16 sum stored rounded, word + position first) and the
 * norm as add_layer_norm_bf16 computes it; types NULL: every token's type is 0. The tables hold word_rows,
 * position_rows and type_rows rows of cols bfloat16 values. -1 where an index is out of its table (rows
 * before it written, none after): the caller raises, as torch's embedding lookup does. work: as
 * add_layer_norm_bf16's. One call for what took seven torch operators (three lookups, a zero type per
 * token, two additions, the norm). */
int embed_bf16(const int64_t *ids, const int64_t *positions, const int64_t *types, const uint16_t *word,
               int64_t word_rows, const uint16_t *position, int64_t position_rows, const uint16_t *type,
               int64_t type_rows, const uint16_t *weight, const uint16_t *bias, uint16_t *out, int64_t rows,
               int64_t cols, float eps, float *work) {
    for (int64_t i = 0; i < rows; i++) {
        int64_t id = ids[i], at = positions[i], kind = types ? types[i] : 0;
        if (id < 0 || id >= word_rows || at < 0 || at >= position_rows || kind < 0 || kind >= type_rows)
            return -1;
        const uint16_t *w = word + id * cols, *p = position + at * cols;
        uint16_t *row = out + i * cols;
        for (int64_t j = 0; j < cols; j += LANES) {
            int64_t count = cols - j < LANES ? cols - j : LANES;
            store_bf16(row + j, load_bf16(w + j, count, 0.0f) + load_bf16(p + j, count, 0.0f), count);
        }
        add_layer_norm_bf16(row, type + kind * cols, weight, bias, row, 1, cols, eps, work);
    }
    return 0;
}

/* out[s] = the mean of rows cu_seqlens[s] .. cu_seqlens[s + 1] of x (bfloat16, rows of `cols` values),
 * in float32: each column summed in row order from 0 and divided by the row count, the additions and the
 * division torch's segment_reduce(x.float(), "mean") makes. Columns go in groups of MEAN_GROUP vectors,
 * one accumulator each (independent additions in flight); the rows are walked once per group. */
#define MEAN_GROUP 4
void mean_rows_bf16(const uint16_t *x, const int32_t *cu_seqlens, int64_t sequences, int64_t cols, float *out) {
    for (int64_t s = 0; s < sequences; s++) {
        int64_t first = cu_seqlens[s], count = cu_seqlens[s + 1] - first;
        floats length = (floats){0} + (float)count;
        for (int64_t j = 0; j < cols; j += MEAN_GROUP * LANES) {
            floats sums[MEAN_GROUP] = {{0}};
            int64_t width = cols - j < MEAN_GROUP * LANES ? cols - j : MEAN_GROUP * LANES;
            for (int64_t t = first; t < first + count; t++) {
                const uint16_t *row = x + t * cols + j;
                for (int g = 0; g < MEAN_GROUP; g++) {
                    int64_t lanes = width - g * LANES;
                    if (lanes >= LANES)
                        sums[g] += load_bf16(row + g * LANES, LANES, 0.0f);
                    else if (lanes > 0)
                        sums[g] += load_bf16(row + g * LANES, lanes, 0.0f);
                }
            }
            for (int g = 0; g < MEAN_GROUP; g++) {
                int64_t lanes = width - g * LANES;
                if (lanes <= 0)
                    break;
                floats mean = sums[g] / length;
                memcpy(out + s * cols + j + g * LANES, &mean, 4 * (lanes < LANES ? lanes : LANES));
            }
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

/* Rounded to the nearest integer, ties to even (as torch.round): rint in the default rounding mode, lane by lane
 * (vectorised). Not (v + 1.5 * 2^23) - 1.5 * 2^23: the compiler fuses a product handed in (round_even(v * m)) into
 * that add (an FMA, -ffp-contract=fast), which rounds the exact product: 0.7048009 x (127 / 1.4554425) is 61.5 in
 * float32 (torch: 62) but 61.4999981 exactly, and went to 61 (one int8 level off in 2 of 40 random float32 layers). */
static inline floats round_even(floats v) {
    floats out;
    for (int i = 0; i < LANES; i++)
        out[i] = __builtin_rintf(v[i]);
    return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAS_QUANTIZE_BF16_AVX512 1

/* 16 bfloat16 values as float32, times the input scale's 16 (NULL: none). */
static inline __m512 load_scaled_bf16(const uint16_t *from, const float *input_scale) {
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)from)), 16));
    return input_scale ? _mm512_mul_ps(v, _mm512_loadu_ps(input_scale)) : v;
}

/* quantize_rows for bfloat16 rows of a multiple of 16 values (every BERT width), with the same float32
 * operations: the row's peak over four running maxima (one was a chain of dependent vmaxps, 24 of them
 * across a 384-wide row), vcvtps2dq rounding to nearest even as round_even does, vpmovdb to bytes. The
 * generic loop (its scalar tails and lane masks inlined) took 17-21 cycles a vector on Zen 5. */
static void quantize_rows_bf16_avx512(const uint16_t *x, const float *input_scale, int64_t rows, int64_t cols,
                                      int8_t *q, float *token_scale, int to_unsigned) {
    const __m128i shift = _mm_set1_epi8(to_unsigned ? (char)0x80 : 0);
    const __m512 magnitude_bits = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *row = x + i * cols;
        __m512 top[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t j = 0; j < cols; j += LANES) {
            __m512 v = load_scaled_bf16(row + j, input_scale ? input_scale + j : NULL);
            top[(j / LANES) & 3] = _mm512_max_ps(top[(j / LANES) & 3], _mm512_and_ps(v, magnitude_bits));
        }
        float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
        peak = peak > 1e-12f ? peak : 1e-12f;
        const __m512 multiplier = _mm512_set1_ps(127.0f / peak);
        for (int64_t j = 0; j < cols; j += LANES) {
            __m512 v = _mm512_mul_ps(load_scaled_bf16(row + j, input_scale ? input_scale + j : NULL), multiplier);
            __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
            _mm_storeu_si128((void *)(q + i * cols + j), _mm_xor_si128(b, shift));
        }
        token_scale[i] = peak * (1.0f / 127.0f);
    }
}
#endif

/* Each row of x (rows x cols, bfloat16 if is_bf16 else float32) times input_scale (cols floats; NULL:
 * none), then quantized to int8 by its own symmetric scale: q = round(v * (127 / peak)), peak = the
 * row's max |v| (at least 1e-12); token_scale[i] = peak * (1 / 127). The same float32 operations, in
 * the same order, as int8_linear.Int8Linear's torch path, in one read of the row for the peak and one
 * for the quantization instead of five passes over the matrix. to_unsigned: q + 128 stored as uint8
 * (int8_linear_rows' input) instead. */
void quantize_rows(const void *x, int is_bf16, const float *input_scale, int64_t rows, int64_t cols, int8_t *q,
                   float *token_scale, int to_unsigned) {
#ifdef HAS_QUANTIZE_BF16_AVX512
    if (is_bf16 && cols % LANES == 0) {
        quantize_rows_bf16_avx512(x, input_scale, rows, cols, q, token_scale, to_unsigned);
        return;
    }
#endif
    const bytes shift = (bytes){0} + (int8_t)(to_unsigned ? -128 : 0); /* q ^ 0x80 = q + 128 as uint8 */
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
            bytes b = __builtin_convertvector(__builtin_convertvector(round_even(v * multiplier), ints), bytes) ^ shift;
            memcpy(q + i * cols + j, &b, count);
        }
        token_scale[i] = peak * (1.0f / 127.0f);
    }
}

#ifdef __AVX512F__
/* The exact (erf) GELU of `count` (<= GELU_ROWS) vectors at once: x (1 - Q(x)) for x >= 0, x Q(|x|) below,
 * Q(a) = erfc(a / sqrt 2) / 2 = 2^R(a). R is a quintic in u = a - k on each unit interval around k = 0..15
 * (fit_gelu.py: least squares in float64; |x| clamped to 15.25, where Q is under float32's subnormals),
 * whose coefficients one vpermps each picks by k, the low bits of a + 2^23. 2^R = 2^round(R) (vscalefps) x
 * 2^f, |f| <= 1/2, by a quintic. Relative error against the float64 GELU under 7e-7 for x >= -3, 2e-6 to
 * -6, 5e-6 to -10 (GELU(-6) = -6e-9; test_gelu_is_the_erf_gelu_to_float32_precision). ~14 multiply-adds and
 * 6 permutes a vector; its erfc fit (t e^(-z^2 + P(t)), t = 1 / (1 + z / 2): a division, a degree-9
 * polynomial, e^x by a degree-6 one) took ~25 multiply-adds and 17 cycles a vector, ~30 % of a MiniLM
 * up-projection's int8 GEMM. Each step runs for all the vectors before the next, as their chains are long. */
#define HAS_GELU_AVX512 1
#define GELU_ROWS 8
static const float GELU_TAIL_TERMS[6][LANES] __attribute__((aligned(64))) = {
    {-1.0f, -2.6560328f, -5.45798111f, -9.53293419f, -14.9464674f, -21.7341976f, -29.9168339f, -39.507206f, -50.5137138f, -62.9421158f, -76.7965088f, -92.0799179f, -108.794601f, -126.942329f, -146.52449f, -167.542175f},
    {-1.15110433f, -2.20030499f, -3.42382622f, -4.73651028f, -6.09626245f, -7.48254347f, -8.88481236f, -10.2973013f, -11.7166576f, -13.1408215f, -14.568469f, -15.9987164f, -17.4309502f, -18.8647366f, -20.2997551f, -21.7357693f},
    {-0.459219009f, -0.577729464f, -0.638914049f, -0.670450568f, -0.687680542f, -0.697762191f, -0.704044163f, -0.708174348f, -0.71101433f, -0.713041365f, -0.714534104f, -0.715662837f, -0.716535628f, -0.717223704f, -0.717775285f, -0.718223989f},
    {-0.0524660796f, -0.0281169061f, -0.0142719336f, -0.00756696658f, -0.00429348089f, -0.00260302005f, -0.00167196104f, -0.00112735026f, -0.000791526516f, -0.000574851991f, -0.000429537817f, -0.000328799768f, -0.000256944419f, -0.000204409502f, -0.000165164107f, -0.000135285722f},
    {0.00708133541f, 0.00476521719f, 0.0023851695f, 0.00114599615f, 0.000575029931f, 0.000307432201f, 0.000175021545f, 0.000105400839f, 6.66344058e-05f, 4.39143441e-05f, 2.99884578e-05f, 2.11135048e-05f, 1.52622997e-05f, 1.12885946e-05f, 8.51883124e-06f, 6.53626557e-06f},
    {-0.00030351209f, -0.000579312036f, -0.000350926566f, -0.000164294092f, -7.56623558e-05f, -3.6474612e-05f, -1.86730467e-05f, -1.01438991e-05f, -5.81552013e-06f, -3.49608081e-06f, -2.19050139e-06f, -1.42280931e-06f, -9.53668916e-07f, -6.57059445e-07f, -4.63814047e-07f, -3.47902585e-07f}};
static const float GELU_EXP2_TERMS[] = {1.00000012f, 0.693147182f, 0.240221068f, 0.0555032715f, 0.00967603736f, 0.00134004327f};

static inline __attribute__((always_inline)) void gelu_rows(floats *v, int count) {
    __m512 terms[6];
    for (int j = 0; j < 6; j++)
        terms[j] = _mm512_load_ps(GELU_TAIL_TERMS[j]);
    const __m512 last = _mm512_set1_ps(15.25f), integers = _mm512_set1_ps(8388608.0f); /* 2^23: ulp 1 */
    __m512 u[GELU_ROWS], r[GELU_ROWS], n[GELU_ROWS];
    __m512i k[GELU_ROWS];
    _Pragma("GCC unroll 8") for (int q = 0; q < count; q++) {
        __m512 a = _mm512_min_ps(_mm512_abs_ps((__m512)v[q]), last);
        __m512 shifted = _mm512_add_ps(a, integers); /* round(a) + 2^23: k in the low mantissa bits */
        k[q] = _mm512_castps_si512(shifted);
        u[q] = _mm512_sub_ps(a, _mm512_sub_ps(shifted, integers));
        r[q] = _mm512_permutexvar_ps(k[q], terms[5]);
    }
    for (int j = 4; j >= 0; j--)
        _Pragma("GCC unroll 8") for (int q = 0; q < count; q++)
            r[q] = _mm512_fmadd_ps(r[q], u[q], _mm512_permutexvar_ps(k[q], terms[j]));
    _Pragma("GCC unroll 8") for (int q = 0; q < count; q++) {
        n[q] = _mm512_roundscale_ps(r[q], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        u[q] = _mm512_sub_ps(r[q], n[q]); /* f */
        r[q] = _mm512_fmadd_ps(_mm512_set1_ps(GELU_EXP2_TERMS[5]), u[q], _mm512_set1_ps(GELU_EXP2_TERMS[4]));
    }
    for (int j = 3; j >= 0; j--)
        _Pragma("GCC unroll 8") for (int q = 0; q < count; q++)
            r[q] = _mm512_fmadd_ps(r[q], u[q], _mm512_set1_ps(GELU_EXP2_TERMS[j]));
    _Pragma("GCC unroll 8") for (int q = 0; q < count; q++) { /* x Q below 0, x (1 - Q) above (+inf: +inf) */
        __m512 x = (__m512)v[q], tail = _mm512_scalef_ps(r[q], n[q]);
        __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
        v[q] = (floats)_mm512_mul_ps(x, _mm512_mask_sub_ps(tail, positive, _mm512_set1_ps(1.0f), tail));
    }
}

#else
/* erfc(z) for z >= 0 to a relative error under 1.2e-7 everywhere (a Chebyshev fit: t e^(-z^2 + P(t)),
 * t = 1 / (1 + z / 2)), so GELU's small negative tail (x/2 erfc(|x| / sqrt 2)) keeps float32's relative
 * precision too. P(0)... = 0 to 3e-8 at z = 0: the exponent is clamped to <= 0 for exp_nonpositive. */
static const float ERFC_TERMS[] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                                   -0.18628806f, 0.09678418f,  0.37409196f, 1.00002368f,  -1.26551223f};

static inline floats erfc_nonnegative(floats z) {
    floats t = 1.0f / (1.0f + 0.5f * z);
    floats p = t * ERFC_TERMS[0] + ERFC_TERMS[1];
    for (int k = 2; k < 10; k++) p = p * t + ERFC_TERMS[k];
    floats exponent = p - z * z;
    ints positive = exponent > 0.0f;
    exponent = (floats)((ints)exponent & ~positive);
    return t * exp_nonpositive(exponent);
}

/* The exact (erf) GELU of `count` vectors: x/2 (1 + erf(x / sqrt 2)) = x (1 - erfc(z) / 2) for x >= 0,
 * x erfc(z) / 2 below. */
static inline void gelu_rows(floats *v, int count) {
    for (int q = 0; q < count; q++) {
        floats half_erfc = 0.5f * erfc_nonnegative((floats)((uints)v[q] & 0x7FFFFFFFu) * 0.70710678f);
        ints negative = v[q] < 0.0f;
        floats factor = (floats)(((ints)half_erfc & negative) | ((ints)(1.0f - half_erfc) & ~negative));
        v[q] = v[q] * factor;
    }
}
#endif

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
                gelu_rows(&v, 1);
            else if (activation == 2)
                v = (floats)((ints)v & (ints)(v > 0.0f)); /* ReLU */
            store_any(to + j * width, is_bf16, v, count);
        }
    }
}

/* ------------------------------------------------------------------ AMX tiles
 *
 * Where the build targets AMX (amx_tile, amx_bf16, amx_int8: Xeon since Sapphire Rapids), the int8 and the
 * few-row bfloat16 GEMMs and attention's products run on its tiles: 16 rows x 64 bytes each, tdpbf16ps
 * adding a 16 x 32 bfloat16 tile times a 32 x 16 one (its rows pairs of k, the layout the packed right
 * operands already have) into a 16 x 16 float32 one, tdpbusd a 16 x 64 uint8 one times a 64 x 16 int8 one
 * (rows of 4 k) into 16 x 16 int32 sums. Linux hands a process the tiles' 8 KiB of register state only once it asks
 * (arch_prctl); where it refuses, the vector paths serve. A call keeps the caller's tile configuration
 * (oneDNN's, between its GEMMs) and puts it back when it ends (tiles_begin, tiles_end). */
#define TILE_ROWS 16
#define TILE_DEPTH 32 /* bfloat16 products summed per tile row and column: one 64-byte row of the operands */
#define TILE_BYTES 64 /* a tile row's bytes: 32 bfloat16, or 64 uint8 / int8 (tdpbusd's depth) */

#ifdef __AMX_TILE__
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static int tiles_permitted(void) {
#ifdef __linux__
    static int permitted = -1; /* not asked yet; the answer is the process's, the same on every thread */
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
#else
    return 0; /* the request is Linux's; elsewhere the vector paths */
#endif
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Tiles 0-3 sums and 4 the left operand, of `rows` rows; 6 and 7 the right one (alternating, so a load
 * overlaps the product before it), 16 rows; all rows of 64 bytes. */
static void configure_tiles(int rows) {
    struct tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = t < 6 ? rows : TILE_ROWS;
    }
    _tile_loadconfig(&config);
}

/* As configure_tiles(16), but tiles 2, 3 (sums) and 5 (the left operand) of `second` rows: two blocks of
 * rows against the same right operand. */
static inline void configure_two_blocks(int second) {
    struct tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = t == 2 || t == 3 || t == 5 ? second : TILE_ROWS;
    }
    _tile_loadconfig(&config);
}

#ifdef __AMX_BF16__
/* Tile `sum` (0-3; the id must be a constant) += tile 4 x the 64-byte-row operand at `right`, bfloat16. */
static inline void product_into(int sum, const void *right, int64_t stride) {
    switch (sum) {
    case 0: _tile_loadd(6, right, stride); _tile_dpbf16ps(0, 4, 6); break;
    case 1: _tile_loadd(7, right, stride); _tile_dpbf16ps(1, 4, 7); break;
    case 2: _tile_loadd(6, right, stride); _tile_dpbf16ps(2, 4, 6); break;
    default: _tile_loadd(7, right, stride); _tile_dpbf16ps(3, 4, 7); break;
    }
}
#endif

static inline void zero_sums(int count) {
    _tile_zero(0);
    if (count > 1) _tile_zero(1);
    if (count > 2) _tile_zero(2);
    if (count > 3) _tile_zero(3);
}

/* Sums 0 .. count-1 stored side by side as 16 rows of count x 16 floats, `stride` bytes apart. */
static inline void store_sums(int count, float *to, int64_t stride) {
    _tile_stored(0, to, stride);
    if (count > 1) _tile_stored(1, to + LANES, stride);
    if (count > 2) _tile_stored(2, to + 2 * LANES, stride);
    if (count > 3) _tile_stored(3, to + 3 * LANES, stride);
}

/* Whether this call runs by tiles (Linux permitting), configured for `rows` rows (1 to TILE_ROWS) of the
 * left operand and the sums; the configuration it replaces is kept in `saved`. */
static int tiles_begin(int rows, struct tile_config *saved) {
    if (!tiles_permitted())
        return 0;
    _tile_storeconfig(saved);
    configure_tiles(rows);
    return 1;
}

static void tiles_end(const struct tile_config *saved) {
    if (saved->palette)
        _tile_loadconfig(saved);
    else
        _tile_release();
}

#else
struct tile_config {
    char unused;
};
static int tiles_begin(int rows, struct tile_config *saved) { return (void)rows, (void)saved, 0; }
static void tiles_end(const struct tile_config *saved) { (void)saved; }
#endif

/* ------------------------------------------------------------------ int8 GEMM with its epilogue (avx512_vnni)
 *
 * int8_linear_rows: an int8 linear's whole output for a block of rows in one call, where torch._int_mm
 * (oneDNN's s8 x s8 GEMM, whose compensation for the signed input costs a pass) then rescale_rows (a
 * pass over the int32 products) took two. The activations come in as uint8, q + 128 (quantize_rows'
 * to_unsigned), the operand vpdpbusd takes unsigned: each instruction sums 4 u8 x s8 products into each
 * of 16 int32 lanes, in exact integer arithmetic (4 x 255 x 127 is far from int32's range). The shift
 * adds 128 x (the column's sum of weights) to every product, subtracted again from `compensation`
 * (computed once at load by pack_int8_weights), so the integers equal torch._int_mm's exactly. Each
 * tile of GEMM_ROWS rows x GEMM_VECTORS x 16 columns stays in registers over the whole K, then is
 * rescaled (x token scale x channel scale + bias, GELU or ReLU) and stored as bfloat16 or float32:
 * the int32 products never reach memory.
 *
 * The weights are packed at load into panels of 16 columns: for each 4 consecutive k, the 16 columns'
 * 4 bytes side by side (64 bytes: one vector), the layout vpdpbusd reads. A panel (K x 16 bytes: 6 KiB
 * at K = 384, 24 KiB at 1,536) is read from L1/L2 by each row tile; a tile's rows (K bytes each) stay in
 * L1 while the tile's panels stream past them.
 *
 * Built only where the compiler targets avx512_vnni (-march=native on a CPU that has it);
 * int8_gemm_available() says whether this build has it (elsewhere int8_linear.py keeps torch._int_mm). */
#define GEMM_ROWS 8    /* rows of a register tile */
#define GEMM_VECTORS 3 /* 16-column vectors of a register tile: 8 x 3 accumulators + 3 weights + 1 input */
#define GEMM_ROW_BLOCK 256 /* rows whose inputs stay in L2 while every panel passes them */

/* Weights w (n x k int8, row-major: the layer's out x in) packed for int8_linear_rows into `packed`
 * (round_up(n, 16) / 16 panels of k / 4 x 64 bytes; k a multiple of 4; columns past n zero), and
 * compensation[j] = 128 x sum_k w[j][k] (round_up(n, 16) int32; 0 past n). */
void pack_int8_weights(const int8_t *w, int64_t n, int64_t k, int8_t *packed, int32_t *compensation) {
    int64_t panels = (n + 15) / 16, groups = k / 4;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < 16; c++) {
            int64_t j = p * 16 + c;
            int32_t sum = 0;
            for (int64_t g = 0; g < groups; g++)
                for (int64_t r = 0; r < 4; r++) {
                    int8_t value = j < n ? w[j * k + g * 4 + r] : 0;
                    packed[(p * groups + g) * 64 + c * 4 + r] = value;
                    sum += value;
                }
            compensation[j] = 128 * sum;
        }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>

int int8_gemm_available(void) { return 1; }

_Static_assert(GEMM_ROWS <= GELU_ROWS, "a tile's rows go through gelu_rows at once");

/* Loops over a tile's constant rows and vectors, unrolled so that its accumulators are registers, not an array. */
#define UNROLLED _Pragma("GCC unroll 8")

/* Everything a tile's epilogue reads. */
struct gemm_epilogue {
    const int32_t *compensation;
    const float *token_scale, *weight_scale, *bias;
    int64_t n;
    int activation, is_bf16;
    char *out;
};

/* The int32 sums of `rows` (<= GELU_ROWS) rows from `row` on at the 16 columns from j: less the compensation,
 * x token scale x channel scale + bias, ReLU or GELU, stored as bfloat16 or float32 (both GEMMs' epilogue). */
static inline __attribute__((always_inline)) void gemm_finish(const __m512i *sums, int rows, int64_t row, int64_t j,
                                                              const struct gemm_epilogue *e) {
    const int64_t width = e->is_bf16 ? 2 : 4;
    int64_t count = e->n - j < LANES ? e->n - j : LANES;
    __m512i compensation = _mm512_loadu_si512(e->compensation + j);
    floats weight_scale, bias = {0};
    memcpy(&weight_scale, e->weight_scale + j, sizeof weight_scale);
    if (e->bias)
        memcpy(&bias, e->bias + j, sizeof bias);
    floats x[GELU_ROWS];
    UNROLLED for (int i = 0; i < rows; i++) {
        floats products = (floats)_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[i], compensation));
        /* The bias by an explicit FMA: left to the compiler, a * b + c contracted into one FMA in some of
         * this function's inlined copies and not in others (AMX blocks, VNNI tiles), and a row's bits
         * then depended on which path its batch's row count sent it down. */
        floats scaled = products * e->token_scale[row + i];
        x[i] = e->bias ? (floats)_mm512_fmadd_ps((__m512)scaled, (__m512)weight_scale, (__m512)bias)
                       : scaled * weight_scale;
        if (e->activation == 2)
            x[i] = (floats)((ints)x[i] & (ints)(x[i] > 0.0f)); /* ReLU */
    }
    if (e->activation == 1)
        gelu_rows(x, rows);
    UNROLLED for (int i = 0; i < rows; i++)
        store_any(e->out + ((row + i) * e->n + j) * width, e->is_bf16, x[i], count);
}

/* One register tile: `rows` (<= GEMM_ROWS) rows of a (row stride k) times `vectors` (<= GEMM_VECTORS)
 * panels from `panel` on, columns from `column`; always inlined with constant rows and vectors, so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void gemm_tile(const uint8_t *a, int64_t k, const int8_t *panel,
                                                            int64_t row, int64_t column, int rows, int vectors,
                                                            const struct gemm_epilogue *e) {
    __m512i acc[GEMM_ROWS][GEMM_VECTORS];
    UNROLLED for (int i = 0; i < rows; i++)
        UNROLLED for (int v = 0; v < vectors; v++)
            acc[i][v] = _mm512_setzero_si512();
    const int64_t panel_bytes = k * 16;
    for (int64_t g = 0; g < k; g += 4) {
        __m512i weights[GEMM_VECTORS];
        UNROLLED for (int v = 0; v < vectors; v++)
            weights[v] = _mm512_loadu_si512(panel + v * panel_bytes + g * 16);
        UNROLLED for (int i = 0; i < rows; i++) {
            int32_t four;
            memcpy(&four, a + i * k + g, 4);
            __m512i inputs = _mm512_set1_epi32(four);
            UNROLLED for (int v = 0; v < vectors; v++)
                acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], inputs, weights[v]);
        }
    }
    UNROLLED for (int v = 0; v < vectors; v++) {
        __m512i sums[GEMM_ROWS];
        UNROLLED for (int i = 0; i < rows; i++)
            sums[i] = acc[i][v];
        gemm_finish(sums, rows, row, column + v * 16, e);
    }
}

#define GEMM_TILE_CASE(r, vs)                                                                                        \
    case r:                                                                                                          \
        gemm_tile(a, k, panel, row, column, r, vs, e);                                                               \
        break;

static void gemm_tiles(const uint8_t *a, int64_t k, const int8_t *panel, int64_t row, int64_t column, int rows,
                       int vectors, const struct gemm_epilogue *e) {
#define GEMM_TILE_ROWS(vs)                                                                                           \
    switch (rows) {                                                                                                  \
        GEMM_TILE_CASE(1, vs)                                                                                        \
        GEMM_TILE_CASE(2, vs)                                                                                        \
        GEMM_TILE_CASE(3, vs)                                                                                        \
        GEMM_TILE_CASE(4, vs)                                                                                        \
        GEMM_TILE_CASE(5, vs)                                                                                        \
        GEMM_TILE_CASE(6, vs)                                                                                        \
        GEMM_TILE_CASE(7, vs)                                                                                        \
        GEMM_TILE_CASE(8, vs)                                                                                        \
    }
    if (vectors == 3)
        GEMM_TILE_ROWS(3)
    else if (vectors == 2)
        GEMM_TILE_ROWS(2)
    else
        GEMM_TILE_ROWS(1)
#undef GEMM_TILE_ROWS
}

/* Rows [row_begin, row_end) x panels [panel_begin, panels) by register tiles: row blocks of GEMM_ROW_BLOCK,
 * within each the panels GEMM_VECTORS at a time, each passing every row tile of the block. */
static void vnni_rows(const uint8_t *a, int64_t row_begin, int64_t row_end, int64_t k, const int8_t *packed,
                      int64_t panel_begin, int64_t panels, const struct gemm_epilogue *e) {
    for (int64_t block = row_begin; block < row_end; block += GEMM_ROW_BLOCK) {
        int64_t block_end = block + GEMM_ROW_BLOCK < row_end ? block + GEMM_ROW_BLOCK : row_end;
        for (int64_t p = panel_begin; p < panels; p += GEMM_VECTORS) {
            int vectors = panels - p < GEMM_VECTORS ? (int)(panels - p) : GEMM_VECTORS;
            for (int64_t row = block; row < block_end; row += GEMM_ROWS) {
                int tile_rows = block_end - row < GEMM_ROWS ? (int)(block_end - row) : GEMM_ROWS;
                gemm_tiles(a + row * k, k, packed + p * k * 16, row, p * 16, tile_rows, vectors, e);
            }
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* ------------------------------------------------------------------ the same GEMM by AMX tiles (amx_int8)
 *
 * Where the CPU has AMX (Sapphire Rapids and later), tdpbusd multiplies a 16 x 64 tile of uint8 inputs by a
 * 64 x 16 tile of int8 weights into 16 x 16 int32 sums in one instruction: the same u8 x s8 products as
 * vpdpbusd, exact, so the compensation and the epilogue are the VNNI kernel's. A pack_int8_weights panel
 * is already tdpbusd's weight operand: 16 k-groups of 64 bytes (16 columns x 4 k) are one 1 KiB tile,
 * read with a stride of 64. Each AMX block is 32 rows x 32 columns (2 input tiles, 2 weight tiles, 4 sum
 * tiles: the 8 tile registers) over the whole K; its sums are stored to the stack (4 KiB, in L1) and go
 * through gemm_finish 8 rows at a time. Rows past the last whole block, and an odd last panel, go to the
 * VNNI tiles, as does a K that is not a multiple of 64 (one tile row).
 *
 * Linux hands out AMX's tile state only to a process that asked for it (tiles_permitted, above). Refused (an
 * older kernel, a seccomp filter, a hypervisor without it), the VNNI kernel serves. int8_gemm_products()
 * says which this build and process use.
 *
 * MiniLM shapes, 512 rows, one thread (Emerald Rapids, python -m encoderd.bench.int8_linear): see
 * int8_linear.py's docstring for the measured rates against the VNNI tiles and torch._int_mm. */
#define AMX_ROWS TILE_ROWS /* a tile's rows: 16 input rows, 16 k-groups of weights, 16 rows of sums */
#define AMX_K TILE_BYTES /* a tile row's bytes: 64 uint8 inputs, 16 columns x 4 k of weights, 16 int32 sums */

/* One 32 x 32 block: rows from `row` of a (row stride k; k a multiple of AMX_K) by the two panels from
 * `panel`, columns from `column`, finished by gemm_finish. Tiles 0-3 sum, 4-5 hold inputs, 6-7 weights. */
static void amx_block(const uint8_t *a, int64_t k, const int8_t *panel, int64_t row, int64_t column,
                      const struct gemm_epilogue *e) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int8_t *next_panel = panel + k * 16;
    for (int64_t c = 0; c < k; c += AMX_K) {
        _tile_loadd(4, a + c, k);
        _tile_loadd(5, a + AMX_ROWS * k + c, k);
        _tile_loadd(6, panel + c * 16, 64);
        _tile_loadd(7, next_panel + c * 16, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    int32_t sums[2 * AMX_ROWS][32] __attribute__((aligned(64)));
    _tile_stored(0, &sums[0][0], sizeof sums[0]);
    _tile_stored(1, &sums[0][16], sizeof sums[0]);
    _tile_stored(2, &sums[AMX_ROWS][0], sizeof sums[0]);
    _tile_stored(3, &sums[AMX_ROWS][16], sizeof sums[0]);
    for (int i = 0; i < 2 * AMX_ROWS; i += GELU_ROWS)
        for (int v = 0; v < 2; v++) {
            __m512i vectors[GELU_ROWS];
            UNROLLED for (int q = 0; q < GELU_ROWS; q++)
                vectors[q] = _mm512_load_si512(&sums[i + q][v * 16]);
            gemm_finish(vectors, GELU_ROWS, row + i, column + v * 16, e);
        }
}

/* The 32-row blocks of rows [0, rows) by the panel pairs of the first `panels` panels (even), each pair's
 * weights (32 x K bytes) staying in L1 while the row blocks pass them. */
static void amx_rows(const uint8_t *a, int64_t rows, int64_t k, const int8_t *packed, int64_t panels,
                     const struct gemm_epilogue *e) {
    struct tile_config saved;
    tiles_begin(TILE_ROWS, &saved); /* amx_share asked tiles_permitted already */
    for (int64_t p = 0; p < panels; p += 2)
        for (int64_t row = 0; row < rows; row += 2 * AMX_ROWS)
            amx_block(a + row * k, k, packed + p * k * 16, row, p * 16, e);
    tiles_end(&saved);
}

const char *int8_gemm_products(void) { return tiles_permitted() ? "amx_int8" : "avx512_vnni"; }

/* How many rows and panels (from the first) the AMX blocks take; 0 where AMX does not serve. */
static int64_t amx_share(int64_t rows, int64_t k, int64_t panels, int64_t *amx_panels) {
    *amx_panels = panels / 2 * 2;
    if (k % AMX_K != 0 || !tiles_permitted())
        return 0;
    return rows / (2 * AMX_ROWS) * (2 * AMX_ROWS);
}

#else

const char *int8_gemm_products(void) { return "avx512_vnni"; }

static int64_t amx_share(int64_t rows, int64_t k, int64_t panels, int64_t *amx_panels) {
    (void)rows, (void)k, (void)panels;
    *amx_panels = 0;
    return 0;
}

static void amx_rows(const uint8_t *a, int64_t rows, int64_t k, const int8_t *packed, int64_t panels,
                     const struct gemm_epilogue *e) {
    (void)a, (void)rows, (void)k, (void)packed, (void)panels, (void)e;
}

#endif

/* out (rows x n, bfloat16 if is_bf16 else float32) = activation((a x w - compensation) x token_scale[i] x
 * weight_scale[j] + bias[j]) for a (rows x k uint8, q + 128), w packed by pack_int8_weights; weight_scale,
 * bias (NULL: none) and compensation hold round_up(n, 16) values. AMX blocks where they serve, the VNNI
 * tiles for the rest. */
void int8_linear_rows(const uint8_t *a, int64_t rows, int64_t k, const int8_t *packed, const int32_t *compensation,
                      int64_t n, const float *token_scale, const float *weight_scale, const float *bias,
                      int activation, void *out, int is_bf16) {
    struct gemm_epilogue e = {compensation, token_scale, weight_scale, bias, n, activation, is_bf16, out};
    int64_t panels = (n + 15) / 16, amx_panels;
    int64_t amx_rows_done = amx_share(rows, k, panels, &amx_panels);
    if (amx_rows_done > 0 && amx_panels > 0) {
        amx_rows(a, amx_rows_done, k, packed, amx_panels, &e);
        vnni_rows(a, 0, amx_rows_done, k, packed, amx_panels, panels, &e); /* an odd last panel */
    } else
        amx_rows_done = 0;
    vnni_rows(a, amx_rows_done, rows, k, packed, 0, panels, &e);
}

#else /* no avx512_vnni in this build: int8_linear.py keeps torch._int_mm */

int int8_gemm_available(void) { return 0; }

const char *int8_gemm_products(void) { return ""; }

void int8_linear_rows(const uint8_t *a, int64_t rows, int64_t k, const int8_t *packed, const int32_t *compensation,
                      int64_t n, const float *token_scale, const float *weight_scale, const float *bias,
                      int activation, void *out, int is_bf16) {
    (void)a, (void)rows, (void)k, (void)packed, (void)compensation, (void)n, (void)token_scale;
    (void)weight_scale, (void)bias, (void)activation, (void)out, (void)is_bf16;
}

#endif

/* ------------------------------------------------------------------ bfloat16 GEMM for a few rows (avx512_bf16)
 *
 * bf16_linear_rows: a bfloat16 linear's output for a short input (a query's ~10-40 tokens), where oneDNN's
 * _linear_pointwise spends more on each call (~19 us a MiniLM linear, whatever the rows) than on its
 * arithmetic (8 rows x 384 x 384: 2.4 MFLOP, ~3 us). vdpbf16ps sums 2 bfloat16 products into each of 16
 * float32 lanes; a tile of up to 8 rows x up to 8 vectors of 16 columns stays in registers over the
 * whole K, then bias, ReLU or the exact GELU (gelu_rows) are applied to those registers and the result
 * rounded to bfloat16, to nearest, ties to even (oneDNN's epilogue, in the same order).
 *
 * The weights are packed once at load (pack_bf16_weights) into panels of 16 columns: for each pair of
 * consecutive k, the 16 columns' two values side by side (64 bytes: one vector), the operand layout
 * vdpbf16ps reads. The panels are the outer loop, the input's row tiles the inner one: each weight is
 * read from memory once per call (a query's rows fit one or a few tiles, each in L1), a panel group
 * again from L1/L2 for the next row tile. A query's rows are too little work per weight to hide the
 * weights' way from L3 or memory (MiniLM's 21 MB a query): the tiles of 5 to 8 rows prefetch the next
 * panel group into L2 as they compute (bf16_prefetch).
 *
 * A tile of few rows has few accumulators, too few to cover vdpbf16ps' latency; it takes more vectors
 * (bf16_tile_vectors). Built only where the compiler targets avx512_bf16; bf16_gemm_rows() says
 * up to how many rows this build serves (elsewhere packed_linear.py keeps oneDNN for every size).
 *
 * Where the build targets AMX, the same packed panels are the tiles' right operand (16 pairs of k a
 * tile) and the products run by tiles instead (bf16_linear_by_tiles), into the same epilogue. */
#define BF16_ROWS 8       /* rows of a register tile */
#define BF16_ROWS_MANY 4  /* ... where the input has more rows than BF16_EIGHTS_UP_TO */
/* Inputs of up to this many rows go in tiles of up to 8 rows, which prefetch (bf16_prefetch): 2 x 5 x 3 took
 * 0.83-0.97x the time of 4 + 4 + 2 rows x 6 at 9-10 rows; at 12-16 rows 2 x 8 x 3 took 0.89-1.04x, as the
 * host's memory was busier or less (MiniLM's four linears, Zen 4, one thread, bench.small_linear
 * --compare-ref; without the prefetch 4 x 6 took 3-8 % less than 8 x 3). */
#define BF16_EIGHTS_UP_TO 10
#define BF16_VECTORS_MAX 8 /* 16-column vectors of a register tile, at most */
/* Rows up to which the AMX tiles serve (bf16_gemm_rows). oneDNN compiles a GEMM primitive for every row count
 * it meets and keeps a few dozen (workers/memory.py): on a Xeon with AMX a new count cost MiniLM's four linears
 * 3-12 ms once at 40-512 rows, where computing them took 0.4-1.7 ms; the tiles have no such cost. Steady (the
 * primitive built), the tiles took 1.17-1.19x less CPU than oneDNN at 32-40 rows, 1.04x at 64, but 0.81x at
 * 128 and 0.65x at 512 (bench.small_linear, one thread): up to 64 they serve. Past 64 a stream of varied
 * lengths still pays oneDNN's compilations (single queries of 33-511 tokens: MiniLM's forward took 1.5x the
 * CPU of the tiles serving to 512 rows, where a repeated 256-token query took 0.89x). */
#define BF16_TILES_ROWS 64
/* Rows up to which the vector products serve where no AMX tiles do. With oneDNN's filler rows counted (the
 * packed forward rounds what oneDNN computes to a multiple of 8, what this kernel computes not at all), a
 * lone query's forward took 1.11-1.30x less time at 33-64 tokens by the kernel (MiniLM, Zen 4, one thread);
 * the linears alone, oneDNN's over the kernel's, 1.04-1.10 at 40-64 rows on Zen 4, 1.01-1.07 on Zen 5
 * (bench.small_linear). */
#define BF16_VECTOR_ROWS 64

/* Weights w (n x k bfloat16, row-major: the layer's out x in; k even) packed for bf16_linear_rows into
 * `packed`: round_up(n, 16) / 16 panels of k / 2 x 16 x 2 values; columns past n zero. */
void pack_bf16_weights(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    int64_t panels = (n + 15) / 16, pairs = k / 2;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < pairs; g++)
            for (int64_t c = 0; c < 16; c++) {
                int64_t j = p * 16 + c;
                uint16_t *to = packed + ((p * pairs + g) * 16 + c) * 2;
                to[0] = j < n ? w[j * k + 2 * g] : 0;
                to[1] = j < n ? w[j * k + 2 * g + 1] : 0;
            }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

/* The rows up to which this kernel serves (packed_linear.py; oneDNN more): 1.15-1.7x less CPU than oneDNN
 * at 1-32 rows by vectors (Zen 5); by AMX tiles where the CPU has them, 1.27-1.47x at 1-32 rows, where by
 * vectors it fell behind oneDNN's tile GEMMs from 8 rows on (0.70x at 8, 0.21x at 32; Xeon with AMX, one
 * thread, bench.small_linear: MiniLM's four linears of a layer): there, past 32 rows, the tiles alone serve
 * (host_kernels.py asks k in whole tile rows of them). */
int bf16_gemm_rows(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles_permitted())
        return BF16_TILES_ROWS;
#endif
    return BF16_VECTOR_ROWS;
}

_Static_assert(BF16_ROWS <= GELU_ROWS, "a tile's rows go through gelu_rows at once");
#ifndef UNROLLED /* the int8 GEMM's, where the build has it */
#define UNROLLED _Pragma("GCC unroll 8")
#endif

/* Vectors of a tile of `rows` rows: 2 rows x 8, 4 x 6, 8 x 3 (16 to 24 accumulators, the vectors' weights
 * and one broadcast input: at most 31 of the 32 registers). */
static int bf16_tile_vectors(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 6 : 3; }

/* Everything a tile's epilogue reads. */
struct bf16_epilogue {
    const float *bias; /* round_up(n, 16) float32, or NULL */
    int64_t n;
    int activation; /* 0 none, 1 exact GELU, 2 ReLU */
    uint16_t *out;  /* rows x n bfloat16 */
};

/* The epilogue of one vector of `rows` (constant where inlined) rows: bias, activation, bfloat16 out. */
static inline __attribute__((always_inline)) void bf16_finish_vector(floats *x, int64_t row, int64_t j, int rows,
                                                                     const struct bf16_epilogue *e) {
    int64_t count = e->n - j < LANES ? e->n - j : LANES;
    floats bias = {0};
    if (e->bias)
        memcpy(&bias, e->bias + j, sizeof bias);
    UNROLLED for (int i = 0; i < rows; i++) {
        x[i] += bias;
        if (e->activation == 2)
            x[i] = (floats)((ints)x[i] & (ints)(x[i] > 0.0f)); /* ReLU */
    }
    if (e->activation == 1)
        gelu_rows(x, rows);
    UNROLLED for (int i = 0; i < rows; i++)
        store_bf16(e->out + (row + i) * e->n + j, x[i], count);
}

/* A tile's epilogue, out of line: instantiated per row count only, not per tile shape (the GELU unrolled
 * into each of the 40 tiles took the build from 7 to 18 s of CPU); its sums pass through L1 once. */
static __attribute__((noinline)) void bf16_finish(floats sums[][BF16_ROWS], int64_t row, int64_t column, int rows,
                                                  int vectors, const struct bf16_epilogue *e) {
    for (int v = 0; v < vectors; v++) {
        floats *x = sums[v];
        int64_t j = column + v * 16;
        switch (rows) {
        case 1: bf16_finish_vector(x, row, j, 1, e); break;
        case 2: bf16_finish_vector(x, row, j, 2, e); break;
        case 3: bf16_finish_vector(x, row, j, 3, e); break;
        case 4: bf16_finish_vector(x, row, j, 4, e); break;
        case 5: bf16_finish_vector(x, row, j, 5, e); break;
        case 6: bf16_finish_vector(x, row, j, 6, e); break;
        case 7: bf16_finish_vector(x, row, j, 7, e); break;
        default: bf16_finish_vector(x, row, j, 8, e); break;
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The epilogue of `height` rows from `row` on, whose sums were stored `count` panels wide. */
static void bf16_finish_stored(float stored[][4 * LANES], int64_t row, int height, int64_t column, int count,
                               const struct bf16_epilogue *e) {
    for (int first = 0; first < height; first += BF16_ROWS) {
        int some = height - first < BF16_ROWS ? height - first : BF16_ROWS;
        floats sums[4][BF16_ROWS];
        for (int c = 0; c < count; c++)
            for (int i = 0; i < some; i++)
                memcpy(&sums[c][i], &stored[first + i][c * LANES], sizeof sums[c][i]);
        bf16_finish(sums, row + first, column, some, count, e);
    }
}

/* Up to 16 rows: 4 panels (64 columns) of float32 sums at a time over the whole k. */
static void bf16_one_block(const uint16_t *a, int64_t rows, int64_t k, const uint16_t *packed,
                           const struct bf16_epilogue *e) {
    float stored[TILE_ROWS][4 * LANES] __attribute__((aligned(64)));
    int64_t panels = (e->n + 15) / 16;
    for (int64_t p = 0; p < panels; p += 4) {
        int count = panels - p < 4 ? (int)(panels - p) : 4;
        zero_sums(count);
        for (int64_t d = 0; d < k; d += TILE_DEPTH) {
            _tile_loadd(4, a + d, k * 2);
            for (int c = 0; c < count; c++) /* panel p + c's pairs d / 2 .. d / 2 + 15: 16 rows of 64 bytes */
                product_into(c, packed + (p + c) * k * 16 + d * 16, 64);
        }
        store_sums(count, stored[0], sizeof stored[0]);
        bf16_finish_stored(stored, 0, (int)rows, p * 16, count, e);
    }
}

/* 17 to 32 rows as two blocks, 16 rows in tiles 0, 1 (sums) and 4 (input), the rest in 2, 3 and 5: each
 * panel's weights are loaded once for both (two passes over the weights took 1.3x as long at 24 rows). */
static void bf16_two_blocks(const uint16_t *a, int64_t rows, int64_t k, const uint16_t *packed,
                            const struct bf16_epilogue *e) {
    float stored[2 * TILE_ROWS][4 * LANES] __attribute__((aligned(64)));
    const int64_t stride = sizeof stored[0];
    int64_t panels = (e->n + 15) / 16;
    for (int64_t p = 0; p < panels; p += 2) {
        int count = panels - p < 2 ? 1 : 2;
        zero_sums(4);
        for (int64_t d = 0; d < k; d += TILE_DEPTH) {
            _tile_loadd(4, a + d, k * 2);
            _tile_loadd(5, a + TILE_ROWS * k + d, k * 2);
            _tile_loadd(6, packed + p * k * 16 + d * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (count > 1) {
                _tile_loadd(7, packed + (p + 1) * k * 16 + d * 16, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, stored[0], stride);
        _tile_stored(1, stored[0] + LANES, stride);
        _tile_stored(2, stored[TILE_ROWS], stride);
        _tile_stored(3, stored[TILE_ROWS] + LANES, stride);
        bf16_finish_stored(stored, 0, (int)rows, p * 16, count, e);
    }
}

/* bf16_linear_rows by AMX tiles, for up to BF16_TILES_ROWS rows (k a multiple of TILE_DEPTH), 32 rows (two
 * blocks) at a time and a last group of fewer; 0 where it did not run (more rows, k, or Linux refused the
 * tiles). Each group reads the packed weights again: from L2 for MiniLM's layers (0.3-1.2 MB). */
static int bf16_linear_by_tiles(const uint16_t *a, int64_t rows, int64_t k, const uint16_t *packed,
                                const struct bf16_epilogue *e) {
    struct tile_config saved;
    if (rows > BF16_TILES_ROWS || k % TILE_DEPTH || !tiles_begin(rows < TILE_ROWS ? (int)rows : TILE_ROWS, &saved))
        return 0;
    for (int64_t first = 0; first < rows; first += 2 * TILE_ROWS) {
        int group = rows - first < 2 * TILE_ROWS ? (int)(rows - first) : 2 * TILE_ROWS;
        struct bf16_epilogue part = *e;
        part.out = e->out + first * e->n;
        if (group > TILE_ROWS) {
            configure_two_blocks(group - TILE_ROWS);
            bf16_two_blocks(a + first * k, group, k, packed, &part);
        } else {
            if (first) /* after two blocks; a first group of one block is configured by tiles_begin */
                configure_tiles(group);
            bf16_one_block(a + first * k, group, k, packed, &part);
        }
    }
    tiles_end(&saved);
    return 1;
}
#else
static int bf16_linear_by_tiles(const uint16_t *a, int64_t rows, int64_t k, const uint16_t *packed,
                                const struct bf16_epilogue *e) {
    return (void)a, (void)rows, (void)k, (void)packed, (void)e, 0;
}
#endif

/* The weights a tile prefetches into L2 as it computes: `lines` 64-byte lines a pair of k, from `from` up
 * to `end` (none where they are equal): its share of the next panel group, which the first tile of that
 * group would otherwise wait for. Only tiles of 3 vectors or fewer prefetch (the tiles of 5 to 8 rows and
 * the rest of their rows; a constant test where the tile is inlined): in the 4 x 6 tiles (31 of the 32
 * vector registers) the same loop, even with no line to fetch, took 10-30 % more time; with it, the 8 x 3
 * tiles took 0.80-0.85x at 5-8 rows (MiniLM's four linears; bge-base's 0.85-0.97x; Zen 4, one thread). */
struct bf16_prefetch {
    const char *from, *end;
    int lines;
};

/* One register tile: `rows` rows of a (row stride k) times `vectors` panels from `panel` on, columns from
 * `column`; always inlined with constant rows and vectors, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *a, int64_t k, const uint16_t *panel,
                                                            int64_t row, int64_t column, int rows, int vectors,
                                                            const struct bf16_epilogue *e,
                                                            const struct bf16_prefetch *ahead) {
    __m512 acc[BF16_ROWS][BF16_VECTORS_MAX];
    UNROLLED for (int i = 0; i < rows; i++)
        UNROLLED for (int v = 0; v < vectors; v++)
            acc[i][v] = _mm512_setzero_ps();
    const int64_t panel_values = k * 16;
    const char *next = ahead->from;
    for (int64_t g = 0; g < k; g += 2) {
        if (vectors <= 3 && next < ahead->end) {
            for (int l = 0; l < ahead->lines; l++)
                __builtin_prefetch(next + 64 * l, 0, 2);
            next += 64 * ahead->lines;
        }
        __m512bh weights[BF16_VECTORS_MAX];
        UNROLLED for (int v = 0; v < vectors; v++)
            weights[v] = (__m512bh)_mm512_loadu_si512(panel + v * panel_values + g * 16);
        UNROLLED for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, a + i * k + g, 4);
            __m512bh inputs = (__m512bh)_mm512_set1_epi32(pair);
            UNROLLED for (int v = 0; v < vectors; v++)
                acc[i][v] = _mm512_dpbf16_ps(acc[i][v], inputs, weights[v]);
        }
    }
    floats sums[BF16_VECTORS_MAX][BF16_ROWS];
    UNROLLED for (int v = 0; v < vectors; v++)
        UNROLLED for (int i = 0; i < rows; i++)
            memcpy(&sums[v][i], &acc[i][v], sizeof sums[v][i]);
    bf16_finish(sums, row, column, rows, vectors, e);
}

/* A tile of `rows` rows and `vectors` panels: only the shapes bf16_panels asks for (vectors at most
 * bf16_tile_vectors(rows), as 8, 6, 3, 2 or 1). */
#define BF16_TILE(r, vs)                                                                                             \
    case vs:                                                                                                         \
        bf16_tile(a, k, panel, row, column, r, vs, e, ahead);                                                        \
        break;
#define BF16_TILES_UP_TO_3(r) BF16_TILE(r, 1) BF16_TILE(r, 2) BF16_TILE(r, 3)
#define BF16_TILES_UP_TO_6(r) BF16_TILES_UP_TO_3(r) BF16_TILE(r, 6)
#define BF16_TILES_UP_TO_8(r) BF16_TILES_UP_TO_6(r) BF16_TILE(r, 8)
#define BF16_TILE_ROWS(r, widths)                                                                                    \
    case r:                                                                                                          \
        switch (vectors) { widths(r) }                                                                               \
        break;

static void bf16_tiles(const uint16_t *a, int64_t k, const uint16_t *panel, int64_t row, int64_t column, int rows,
                       int vectors, const struct bf16_epilogue *e, const struct bf16_prefetch *ahead) {
    switch (rows) {
        BF16_TILE_ROWS(1, BF16_TILES_UP_TO_8)
        BF16_TILE_ROWS(2, BF16_TILES_UP_TO_8)
        BF16_TILE_ROWS(3, BF16_TILES_UP_TO_6)
        BF16_TILE_ROWS(4, BF16_TILES_UP_TO_6)
        BF16_TILE_ROWS(5, BF16_TILES_UP_TO_3)
        BF16_TILE_ROWS(6, BF16_TILES_UP_TO_3)
        BF16_TILE_ROWS(7, BF16_TILES_UP_TO_3)
        BF16_TILE_ROWS(8, BF16_TILES_UP_TO_3)
    }
}

/* `vectors` panels as tiles of the widths bf16_tiles instantiates (8, 6, 3, 2, 1); the first prefetches
 * `ahead` (a group split into several widths is the last: nothing follows it). */
static void bf16_panels(const uint16_t *a, int64_t k, const uint16_t *panel, int64_t row, int64_t column, int rows,
                        int vectors, const struct bf16_epilogue *e, const struct bf16_prefetch *ahead) {
    static const int widths[] = {8, 6, 3, 2, 1};
    const struct bf16_prefetch none = {0};
    for (int w = 0; vectors > 0; w++)
        while (vectors >= widths[w]) {
            bf16_tiles(a, k, panel, row, column, rows, widths[w], e, ahead);
            panel += widths[w] * k * 16, column += widths[w] * 16, vectors -= widths[w];
            ahead = &none;
        }
}

/* out (rows x n bfloat16) = activation(a x w^T + bias) for a (rows x k bfloat16, dense; k even), w packed
 * by pack_bf16_weights, bias round_up(n, 16) float32 (NULL: none). The rows are split into tiles of equal
 * size (up to 8 rows: one tile; 10 rows: 5 + 5; 12 rows: 4 x 3), whose width in vectors is the one of the
 * largest; where that width is 3 vectors (bf16_prefetch), each row tile prefetches an equal share of the
 * next panel group. */
void bf16_linear_rows(const uint16_t *a, int64_t rows, int64_t k, const uint16_t *packed, int64_t n,
                      const float *bias, int activation, uint16_t *out) {
    struct bf16_epilogue e = {bias, n, activation, out};
    if (bf16_linear_by_tiles(a, rows, k, packed, &e))
        return;
    int64_t most = rows <= BF16_EIGHTS_UP_TO ? BF16_ROWS : BF16_ROWS_MANY;
    int64_t tiles = (rows + most - 1) / most;
    int tile_rows = (int)((rows + tiles - 1) / tiles);
    int vectors = bf16_tile_vectors(tile_rows);
    int64_t panels = (n + 15) / 16;
    for (int64_t p = 0; p < panels; p += vectors) {
        int group = panels - p < vectors ? (int)(panels - p) : vectors;
        int64_t after = p + group, next_panels = panels - after < vectors ? panels - after : vectors;
        int64_t next_lines = next_panels * (k / 2), share = (next_lines + tiles - 1) / tiles;
        const char *next = (const char *)(packed + after * k * 16);
        for (int64_t row = 0, t = 0; row < rows; row += tile_rows, t++) {
            int r = rows - row < tile_rows ? (int)(rows - row) : tile_rows;
            int64_t first = t * share < next_lines ? t * share : next_lines;
            int64_t last = first + share < next_lines ? first + share : next_lines;
            struct bf16_prefetch ahead = {next + 64 * first, next + 64 * last, (int)((share + k / 2 - 1) / (k / 2))};
            bf16_panels(a + row * k, k, packed + p * k * 16, row, p * 16, r, group, &e, &ahead);
        }
    }
}

#else /* no avx512_bf16 in this build: packed_linear.py keeps oneDNN */

int bf16_gemm_rows(void) { return 0; }

void bf16_linear_rows(const uint16_t *a, int64_t rows, int64_t k, const uint16_t *packed, int64_t n,
                      const float *bias, int activation, uint16_t *out) {
    (void)a, (void)rows, (void)k, (void)packed, (void)n, (void)bias, (void)activation, (void)out;
}

#endif

/* ------------------------------------------------------------------ attention over a packed batch
 *
 * attend_full_bf16: softmax(scale q k^T) v within each sequence of a packed batch, every key visible to
 * every query of its sequence (BERT's full window), heads == key/value heads. One call for the whole
 * batch of a layer: q, k and v are read where the fused QKV projection left them, (tokens, heads, dim)
 * at any token and head stride (the same for the three), dim contiguous; the context is written into
 * out, (tokens, heads, dim) dense.
 *
 * For each sequence, the keys and values of as many heads as fit PACK_BYTES are copied once into a
 * layout the products stream through (key_pack, value_pack; read token by token, so a short sequence's
 * heads come in as one run of memory, not one cache line per token and head); then for each head, ROWS
 * queries at a time: their scores against every key in float32 (scores_tile), softmax over each row in
 * float32 (exponentials rounded to bfloat16 for the second product, normalised by their sum), and the
 * context (context_tile), rounded to bfloat16 once. A head's keys and values (at most 512 tokens x 64
 * dims: 64 KiB each) and ROWS rows of scores stay in the core's cache; nothing of size tokens^2 is
 * ever stored.
 *
 * The products use avx512_bf16's vdpbf16ps (16 float32 sums of 2 bfloat16 products, one instruction)
 * where the compiler targets it (__AVX512BF16__, from -march=native on a CPU that has it); elsewhere
 * they are float32 multiply-adds on the 16-float vectors above, which any x86-64 (or other) target
 * lowers to what it has. Both sum the products in float32. */

#define ROWS 8 /* queries per tile: ROWS x 2 score vectors, then ROWS x 2 context vectors, in registers */
#define ALIGN 64

/* The larger of a and b in each lane (one vmaxps where AVX-512 is targeted; elsewhere compare and select). */
static inline floats lanes_max(floats a, floats b) {
#ifdef __AVX512F__
    floats out;
    __m512 x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    x = _mm512_max_ps(x, y);
    memcpy(&out, &x, sizeof out);
    return out;
#else
    ints greater = a > b;
    return (floats)(((ints)a & greater) | ((ints)b & ~greater));
#endif
}

/* The largest lane of v and the sum of its lanes, by halving the vector four times: a chain of 4 vector
 * steps, where lane by lane it was 15 dependent scalar ones, twice for each row of every tile (a short
 * sequence's row has one or two vectors of scores: the reductions weighed as much as its exponentials). */
static inline float largest_lane(floats v) {
    v = lanes_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = lanes_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = lanes_max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = lanes_max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* Where `heads` consecutive heads of one sequence lie: in q, k, v (elements) and packed (bytes per head). */
struct heads_layout {
    int64_t token_stride, head_stride, heads, per_head;
};

/* bfloat16 bits to float32 */
static inline float widen(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A vector of 16 keys' scores, the first `first`, stored at `to` unscaled (softmax_tile scales them in the
 * same multiply-add that subtracts the maximum; the scale is positive, so the maximum is the same key's);
 * in the last block, the lanes of keys past `length` (padding) set to -inf (their exponentials are then
 * 0). *top keeps the lanes' maxima. */
static inline void keep_scores(floats s, int64_t first, int64_t length, float *to, floats *top) {
    if (length - first < LANES) {
        const ints lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        ints valid = lane < (int32_t)(length - first);
        s = (floats)(((ints)s & valid) | ((ints)((floats){0} - INFINITY) & ~valid));
    }
    memcpy(to, &s, sizeof s);
    *top = lanes_max(s, *top);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

const char *attention_products(void) { return "avx512_bf16"; }

typedef uint16_t weight_t; /* the softmax's exponentials, as the second product reads them */

/* Keys as [block of 16 keys][dim / 2][16 keys][2 dims]: one 64-byte row per pair of dims holds that pair
 * for 16 keys, vdpbf16ps's operand (and an AMX tile's rows). Keys past `length` are zero. `heads` heads at
 * once (see pack_heads), head h's at packed + h * per_head bytes. Each row is one gather of a pair from 16
 * tokens (byte offsets from the first: 16 token strides within int32); copied 4 bytes at a time, the
 * packing had taken 14-39 % of the kernel's time over 256 down to 32 tokens (Xeon with AMX, by tiles). */
static void key_pack(const uint16_t *k, const struct heads_layout *at, int64_t length, int64_t dim, char *packed) {
    int64_t pairs = dim / 2;
    const __m512i tokens = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int32_t)(at->token_stride * 2)));
    for (int64_t h = 0; h < at->heads; h++) {
        uint32_t *head = (uint32_t *)(packed + h * at->per_head);
        for (int64_t j = 0; j < length; j += LANES) {
            __mmask16 valid = length - j >= LANES ? 0xFFFF : (__mmask16)((1u << (length - j)) - 1);
            const char *first = (const char *)(k + j * at->token_stride + h * at->head_stride);
            uint32_t *block = head + j * pairs;
            for (int64_t p = 0; p < pairs; p++)
                _mm512_storeu_si512(block + p * LANES,
                                    _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, tokens, first + 4 * p, 1));
        }
    }
}

/* Values as [pair of keys][dim][2 keys]: vdpbf16ps sums two keys' values per dimension. A key past an
 * odd `length` is zero (its weight is zero too; a zero value keeps 0 * garbage out of the sum). Each
 * 16 dims of a pair: the two keys' values widened and interleaved as one vector. */
static void value_pack(const uint16_t *v, const struct heads_layout *at, int64_t length, int64_t dim, char *packed) {
    for (int64_t j = 0; j < length; j += 2)
        for (int64_t h = 0; h < at->heads; h++) {
            const uint16_t *even = v + j * at->token_stride + h * at->head_stride;
            const uint16_t *odd = j + 1 < length ? even + at->token_stride : NULL;
            uint32_t *to = (uint32_t *)(packed + h * at->per_head) + j / 2 * dim;
            for (int64_t d = 0; d < dim; d += LANES) {
                __m512i pair = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + d)));
                if (odd)
                    pair = _mm512_or_si512(pair, _mm512_slli_epi32(
                                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(odd + d))), 16));
                _mm512_storeu_si512(to + d, pair);
            }
        }
}

/* scores[r][16 b + lane] = q_r . key (16 b + lane) for `blocks` (1 or 2) blocks of 16 keys from `block`. */
static inline void scores_tile(const uint16_t *const q[ROWS], const uint16_t *keys, int64_t dim, int64_t block,
                               int blocks, int64_t length, float *scores, int64_t scores_stride, floats top[ROWS]) {
    __m512 sums[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        sums[r][0] = sums[r][1] = _mm512_setzero_ps();
    const uint16_t *first = keys + block * LANES * dim;
    for (int64_t p = 0; p < dim / 2; p++) {
        __m512bh key[2];
        for (int b = 0; b < blocks; b++)
            key[b] = (__m512bh)_mm512_loadu_si512(first + b * LANES * dim + p * 2 * LANES);
        for (int r = 0; r < ROWS; r++) {
            int32_t pair;
            memcpy(&pair, q[r] + 2 * p, 4);
            __m512bh query = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < blocks; b++)
                sums[r][b] = _mm512_dpbf16_ps(sums[r][b], query, key[b]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < blocks; b++) {
            floats sum;
            memcpy(&sum, &sums[r][b], sizeof sum);
            int64_t first = (block + b) * LANES;
            keep_scores(sum, first, length, scores + r * scores_stride + first, &top[r]);
        }
}

/* out_r[16 c .. 16 (c + vectors)) = sum over keys of weight_r[j] value_j, times norm[r], rounded to bfloat16. */
static inline void context_tile(const weight_t *weights, int64_t weights_stride, const uint16_t *values,
                                int64_t length, int64_t dim, int64_t c, int vectors, const float norm[ROWS],
                                uint16_t *const out[ROWS]) {
    __m512 sums[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < vectors; i++)
            sums[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < (length + 1) / 2; j++) {
        __m512bh value[2];
        for (int i = 0; i < vectors; i++)
            value[i] = (__m512bh)_mm512_loadu_si512(values + j * 2 * dim + (c + i) * 2 * LANES);
        for (int r = 0; r < ROWS; r++) {
            int32_t pair;
            memcpy(&pair, weights + r * weights_stride + 2 * j, 4);
            __m512bh weight = (__m512bh)_mm512_set1_epi32(pair);
            for (int i = 0; i < vectors; i++)
                sums[r][i] = _mm512_dpbf16_ps(sums[r][i], weight, value[i]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < vectors; i++) {
            floats sum;
            memcpy(&sum, &sums[r][i], sizeof sum);
            store_bf16(out[r] + (c + i) * LANES, sum * norm[r], LANES);
        }
}

/* 2^t for t <= 0 as weights rounded to bfloat16 need it (softmax_tile's exponents count in log2 e per
 * natural unit, WEIGHT_EXPONENT_UNIT, so no multiply by log2 e and no two-part ln 2 reduction here):
 * t = n + r with |r| <= 1/2, 2^r by a degree-4 polynomial (EXP2_TERMS: a least-squares fit of the
 * relative error at 2,000 Chebyshev nodes of [-1/2, 1/2]; within 2.7e-6 relative, where e^r's Taylor
 * series to r^4 was 5e-5; a bfloat16 step is 8e-3), scaled by 2^n in one instruction (vscalefps); 0
 * below -125 (float32's smallest normals), as for padding's -inf. r comes from vreduceps (x less x
 * rounded, exactly; avx512dq) and n = x - r, exact too: one instruction fewer than rounding x and
 * subtracting (attention 1.02-1.03x by tiles, bench.attention, Xeon with AMX). */
static const float WEIGHT_EXPONENT_UNIT = LOG2E;
static const float EXP2_TERMS[] = {0.00956051f, 0.05591704f, 0.24024981f, 0.69312197f, 0.99999917f};

static inline floats exp_for_weights(floats t) {
    __m512 x;
    memcpy(&x, &t, sizeof x);
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
#ifdef __AVX512DQ__
    __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT);
    __m512 n = _mm512_sub_ps(x, r);
#else
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_sub_ps(x, n);
#endif
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(EXP2_TERMS[0]), _mm512_set1_ps(EXP2_TERMS[1]));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP2_TERMS[2]));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP2_TERMS[3]));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP2_TERMS[4]));
    __m512 e = _mm512_maskz_scalef_ps(live, p, n);
    floats out;
    memcpy(&out, &e, sizeof out);
    return out;
}

/* Exponentials as the second product reads them: rounded to bfloat16 (to nearest, ties to even). */
static inline void keep_weights(floats e, weight_t *to) {
    __m512 v;
    memcpy(&v, &e, sizeof v);
    _mm256_storeu_si256((__m256i *)to, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Two vectors of exponentials, 32 keys from `to`, rounded to bfloat16 by one instruction (vcvtne2ps2bf16):
 * half the conversions of keep_weights' one vector at a time. */
static inline void keep_weight_pair(floats first, floats second, weight_t *to) {
    __m512 a, b;
    memcpy(&a, &first, sizeof a);
    memcpy(&b, &second, sizeof b);
    _mm512_storeu_si512(to, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

#else /* float32 multiply-adds */

const char *attention_products(void) { return "float32"; }

typedef float weight_t;

/* Keys as float32 [block of 16 keys][dim][16 keys]; keys past `length` are zero. */
static void key_pack(const uint16_t *k, const struct heads_layout *at, int64_t length, int64_t dim, char *packed) {
    for (int64_t j = 0; j < round_up(length, LANES); j++)
        for (int64_t h = 0; h < at->heads; h++) {
            const uint16_t *key = k + j * at->token_stride + h * at->head_stride;
            float *to = (float *)(packed + h * at->per_head) + (j / LANES) * LANES * dim + j % LANES;
            for (int64_t d = 0; d < dim; d++)
                to[d * LANES] = j < length ? widen(key[d]) : 0.0f;
        }
}

/* Values as float32 [key][dim]. */
static void value_pack(const uint16_t *v, const struct heads_layout *at, int64_t length, int64_t dim, char *packed) {
    for (int64_t j = 0; j < length; j++)
        for (int64_t h = 0; h < at->heads; h++) {
            const uint16_t *value = v + j * at->token_stride + h * at->head_stride;
            float *to = (float *)(packed + h * at->per_head) + j * dim;
            for (int64_t d = 0; d < dim; d++)
                to[d] = widen(value[d]);
        }
}

static inline void scores_tile(const uint16_t *const q[ROWS], const float *keys, int64_t dim, int64_t block,
                               int blocks, int64_t length, float *scores, int64_t scores_stride, floats top[ROWS]) {
    floats sums[ROWS][2] = {{{0}}};
    const float *first = keys + block * LANES * dim;
    for (int64_t d = 0; d < dim; d++) {
        floats key[2];
        for (int b = 0; b < blocks; b++)
            memcpy(&key[b], first + b * LANES * dim + d * LANES, sizeof(floats));
        for (int r = 0; r < ROWS; r++) {
            float query = widen(q[r][d]);
            for (int b = 0; b < blocks; b++)
                sums[r][b] += query * key[b];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < blocks; b++) {
            int64_t first = (block + b) * LANES;
            keep_scores(sums[r][b], first, length, scores + r * scores_stride + first, &top[r]);
        }
}

static inline void context_tile(const weight_t *weights, int64_t weights_stride, const float *values,
                                int64_t length, int64_t dim, int64_t c, int vectors, const float norm[ROWS],
                                uint16_t *const out[ROWS]) {
    floats sums[ROWS][2] = {{{0}}};
    for (int64_t j = 0; j < length; j++) {
        floats value[2];
        for (int i = 0; i < vectors; i++)
            memcpy(&value[i], values + j * dim + (c + i) * LANES, sizeof(floats));
        for (int r = 0; r < ROWS; r++) {
            float weight = weights[r * weights_stride + j];
            for (int i = 0; i < vectors; i++)
                sums[r][i] += weight * value[i];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < vectors; i++)
            store_bf16(out[r] + (c + i) * LANES, sums[r][i] * norm[r], LANES);
}

static inline void keep_weights(floats e, weight_t *to) { memcpy(to, &e, sizeof e); }

static const float WEIGHT_EXPONENT_UNIT = 1.0f; /* natural exponents: exp_nonpositive */

static inline floats exp_for_weights(floats t) { return exp_nonpositive(t); }

#endif

/* Bytes of one head's keys or values packed, for sequences of `length` tokens (either layout). */
static int64_t packed_bytes(int64_t length, int64_t dim) { return round_up(round_up(length, LANES) * dim * 4, ALIGN); }

/* A sequence's keys and values are packed for this many bytes of heads at once (at least one head): read
 * token by token, each token's heads side by side, rather than head by head down the token stride. */
#define PACK_BYTES (256 * 1024)

static int64_t heads_at_once(int64_t length, int64_t dim, int64_t heads) {
    int64_t fit = PACK_BYTES / (2 * packed_bytes(length, dim));
    return fit < 1 ? 1 : fit < heads ? fit : heads;
}

static int64_t tile_rows_bytes(int64_t longest, int64_t dim); /* attention by AMX tiles' rows (below) */

/* Bytes of scratch attend_full_bf16 needs for sequences of up to `longest` tokens. */
int64_t attention_scratch_bytes(int64_t longest, int64_t dim) {
    int64_t packed = 2 * packed_bytes(longest, dim);
    int64_t keys = round_up(longest, LANES);
    int64_t rows = round_up(ROWS * keys * (4 + sizeof(weight_t)), ALIGN); /* scores and weights */
    if (tile_rows_bytes(longest, dim) > rows)
        rows = round_up(tile_rows_bytes(longest, dim), ALIGN);
    return (packed > PACK_BYTES ? packed : PACK_BYTES) + rows + ALIGN;
}

/* Softmax of ROWS rows of scores (unscaled, padded with -inf to whole vectors; top[r]: the lanes' maxima
 * of row r) into weights: the exponentials of scale x (score - the row's maximum), as the second product
 * reads them; norm[r] = 1 / their sum. The exponent is one multiply-add, in exp_for_weights' unit. */
static void softmax_tile(const float *scores, int64_t stride, int64_t length, float scale, const floats top[ROWS],
                         weight_t *weights, float norm[ROWS]) {
    int64_t padded = round_up(length, LANES);
    float unit = scale * WEIGHT_EXPONENT_UNIT;
    for (int r = 0; r < ROWS; r++) {
        float shift = -largest_lane(top[r]) * unit;
        floats sums = {0};
        for (int64_t j = 0; j < padded; j += LANES) {
            floats s;
            memcpy(&s, scores + r * stride + j, sizeof s);
            floats e = exp_for_weights(s * unit + shift);
            keep_weights(e, weights + r * stride + j);
            sums += e;
        }
        norm[r] = 1.0f / lanes_sum(sums);
    }
}

/* One sequence, one head: `length` queries from q (rows `stride` apart) against the keys and values
 * packed, into out (rows out_stride apart); rows: scratch for ROWS rows of scores and weights. */
static void attend_head(const uint16_t *q, int64_t stride, const void *key_packed, const void *value_packed,
                        uint16_t *out, int64_t out_stride, int64_t length, int64_t dim, float scale, char *rows_work) {
    int64_t keys = round_up(length, LANES);
    float *scores = (float *)rows_work;
    weight_t *weights = (weight_t *)(scores + ROWS * keys);
    for (int64_t i = 0; i < length; i += ROWS) {
        const uint16_t *rows[ROWS];
        uint16_t *outs[ROWS];
        uint16_t spare[ROWS][dim]; /* the last tile's rows past the sequence: computed, not kept */
        for (int r = 0; r < ROWS; r++) {
            int64_t row = i + r < length ? i + r : length - 1;
            rows[r] = q + row * stride;
            outs[r] = i + r < length ? out + row * out_stride : spare[r];
        }
        floats top[ROWS];
        for (int r = 0; r < ROWS; r++)
            top[r] = (floats){0} - INFINITY;
        int64_t block = 0;
        for (; block + 2 <= keys / LANES; block += 2)
            scores_tile(rows, key_packed, dim, block, 2, length, scores, keys, top);
        if (block < keys / LANES)
            scores_tile(rows, key_packed, dim, block, 1, length, scores, keys, top);
        float norm[ROWS];
        softmax_tile(scores, keys, length, scale, top, weights, norm);
        int64_t c = 0;
        for (; c + 2 <= dim / LANES; c += 2)
            context_tile(weights, keys, value_packed, length, dim, c, 2, norm, outs);
        if (c < dim / LANES)
            context_tile(weights, keys, value_packed, length, dim, c, 1, norm, outs);
    }
}

/* ------------------------------------------------------------------ attention's products by AMX tiles
 *
 * Where the build targets AMX (amx_tile, amx_bf16: Xeon since Sapphire Rapids) and the head size is a
 * multiple of 32, a head's two products run as 16 x 16 float32 tiles of tdpbf16ps (16 x 16 x 32 products
 * an instruction) instead of vdpbf16ps' 16 x 2: attend_head_by_tiles. The keys and values are packed as
 * above, which is already the tiles' operand layout (a 64-byte row per pair of dims or of keys, 16 keys
 * or dims across); queries and the exponentials are read as 16 rows of 32 bfloat16. The softmax between
 * the products is the same as the vector path's, on 16 rows at a time. On a Xeon with AMX (2 vCPUs, one
 * thread, bench.attention) the vector path reached 33-84 GFLOP/s, slower than torch's per-sequence
 * operators (oneDNN's AMX GEMMs) from 128 tokens on; by tiles 1.1-1.2x faster at 10-16 tokens, 1.7-2.5x
 * at 48-512. A sequence of up to ROWS (8) tokens stays on the vector path: it fills one 8-row vector tile
 * but half a 16-row AMX one (tiles 0.74-0.80x there). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ATTENTION_BY_TILES 1

/* Scores of 16 queries (queries: 16 rows of dim bfloat16, `query_stride` elements apart) against every
 * key, 4 blocks of 16 keys at a time, into scores (rows `keys` floats apart; unscaled). */
static void scores_by_tiles(const uint16_t *queries, int64_t query_stride, const uint16_t *keys_packed,
                            int64_t blocks, int64_t dim, float *scores, int64_t keys) {
    for (int64_t block = 0; block < blocks; block += 4) {
        int count = blocks - block < 4 ? (int)(blocks - block) : 4;
        zero_sums(count);
        for (int64_t d = 0; d < dim; d += TILE_DEPTH) {
            _tile_loadd(4, queries + d, query_stride * 2);
            for (int b = 0; b < count; b++) /* block b's dims d .. d + 31: 16 rows of 16 keys x 2 dims */
                product_into(b, keys_packed + (block + b) * LANES * dim + d * LANES, 64);
        }
        store_sums(count, scores + block * LANES, keys * 4);
    }
}

/* context[r][c] = sum over keys of weights[r][j] values[j][c], 16 rows, dim columns, 4 blocks of 16
 * columns at a time; weights: rows `keys` bfloat16 apart, zero from `length` to a whole TILE_DEPTH. */
static void context_by_tiles(const uint16_t *weights, int64_t keys, const uint16_t *values_packed, int64_t length,
                             int64_t dim, float *context) {
    for (int64_t column = 0; column < dim; column += 4 * LANES) {
        int count = (dim - column) / LANES < 4 ? (int)((dim - column) / LANES) : 4;
        zero_sums(count);
        for (int64_t j = 0; j < length; j += TILE_DEPTH) {
            _tile_loadd(4, weights + j, keys * 2);
            for (int c = 0; c < count; c++) /* keys j .. j + 31 as 16 pairs, 16 columns x 2 keys a row */
                product_into(c, values_packed + j * dim + (column + c * LANES) * 2, dim * 4);
        }
        store_sums(count, context + column, dim * 4);
    }
}

/* Softmax of 16 rows of unscaled scores (the last block's keys past `length` are masked here) into
 * bfloat16 weights, zero past `length` up to `keys`; norm[r] = 1 / row r's sum. Two rows at a time: each
 * row's maximum and sum end in a chain of dependent steps (the lanes' reduction, the exponent's shift),
 * and two independent rows keep the core busy through them. The exponentials go out 32 keys at a time
 * (keep_weight_pair; keys is a whole TILE_DEPTH): a last odd vector beside zeros, the padding's weights.
 * The softmax is over half of this kernel's time at head size 32 (bench.attention's variants). */
static void softmax_by_rows(float *scores, int64_t length, int64_t keys, float scale, uint16_t *weights,
                            float norm[TILE_ROWS]) {
    int64_t padded = round_up(length, LANES), whole = length / LANES * LANES;
    float unit = scale * WEIGHT_EXPONENT_UNIT;
    for (int r = 0; r < TILE_ROWS; r += 2) {
        float *row[2] = {scores + r * keys, scores + (r + 1) * keys};
        floats top[2] = {(floats){0} - INFINITY, (floats){0} - INFINITY};
        for (int64_t j = 0; j < whole; j += LANES)
            for (int i = 0; i < 2; i++) {
                floats s;
                memcpy(&s, row[i] + j, sizeof s);
                top[i] = lanes_max(s, top[i]);
            }
        if (whole < padded) /* the last block: keys past `length` set to -inf */
            for (int i = 0; i < 2; i++) {
                floats s;
                memcpy(&s, row[i] + whole, sizeof s);
                keep_scores(s, whole, length, row[i] + whole, &top[i]);
            }
        float shift[2] = {-largest_lane(top[0]) * unit, -largest_lane(top[1]) * unit};
        floats sums[2] = {{0}, {0}};
        for (int64_t j = 0; j < padded; j += 2 * LANES)
            for (int i = 0; i < 2; i++) {
                floats s, e[2] = {{0}, {0}};
                for (int half = 0; half < 2 && j + half * LANES < padded; half++) {
                    memcpy(&s, row[i] + j + half * LANES, sizeof s);
                    e[half] = exp_for_weights(s * unit + shift[i]);
                }
                keep_weight_pair(e[0], e[1], weights + (r + i) * keys + j);
                sums[i] += e[0];
                sums[i] += e[1];
            }
        for (int i = 0; i < 2; i++)
            norm[r + i] = 1.0f / lanes_sum(sums[i]);
    }
}

/* attend_head's work by tiles (dim a multiple of TILE_DEPTH; the tiles configured). rows_work: scratch
 * of attention_rows_bytes(length, dim). */
static void attend_head_by_tiles(const uint16_t *q, int64_t stride, const uint16_t *key_packed,
                                 const uint16_t *value_packed, uint16_t *out, int64_t out_stride, int64_t length,
                                 int64_t dim, float scale, char *rows_work) {
    int64_t keys = round_up(length, TILE_DEPTH), blocks = round_up(length, LANES) / LANES;
    float *scores = (float *)rows_work, *context = scores + TILE_ROWS * keys;
    uint16_t *weights = (uint16_t *)(context + TILE_ROWS * dim), *spare = weights + TILE_ROWS * keys;
    for (int64_t i = 0; i < length; i += TILE_ROWS) {
        int rows = length - i < TILE_ROWS ? (int)(length - i) : TILE_ROWS;
        const uint16_t *queries = q + i * stride;
        int64_t query_stride = stride;
        if (rows < TILE_ROWS) { /* the last tile: its rows past the sequence read as zeros, not past q's end */
            memset(spare, 0, TILE_ROWS * dim * 2);
            for (int r = 0; r < rows; r++)
                memcpy(spare + r * dim, queries + r * stride, dim * 2);
            queries = spare, query_stride = dim;
        }
        scores_by_tiles(queries, query_stride, key_packed, blocks, dim, scores, keys);
        float norm[TILE_ROWS];
        softmax_by_rows(scores, length, keys, scale, weights, norm);
        context_by_tiles(weights, keys, value_packed, length, dim, context);
        for (int r = 0; r < rows; r++)
            for (int64_t c = 0; c < dim; c += LANES) {
                floats sum;
                memcpy(&sum, context + r * dim + c, sizeof sum);
                store_bf16(out + (i + r) * out_stride + c, sum * norm[r], LANES);
            }
    }
}


/* A head's values packed with zero pairs up to a whole TILE_DEPTH of keys (value_pack writes the pairs
 * up to `length`): the context's last product reads them beside zero weights. */
static void pad_values(char *values, int64_t length, int64_t dim) {
    int64_t written = (length + 1) / 2 * dim * 4, whole = round_up(length, TILE_DEPTH) / 2 * dim * 4;
    memset(values + written, 0, whole - written);
}

static int64_t tile_rows_bytes(int64_t longest, int64_t dim) {
    int64_t keys = round_up(longest, TILE_DEPTH);
    return TILE_ROWS * (keys * 4 + dim * 4 + keys * 2 + dim * 2);
}

const char *attention_tiles(void) { return tiles_permitted() ? "amx_bf16" : ""; }

#else
#define ATTENTION_BY_TILES 0 /* this build's attention has the vector path alone, whatever tiles it has */
static void pad_values(char *values, int64_t length, int64_t dim) { (void)values, (void)length, (void)dim; }
static void attend_head_by_tiles(const uint16_t *q, int64_t stride, const uint16_t *key_packed,
                                 const uint16_t *value_packed, uint16_t *out, int64_t out_stride, int64_t length,
                                 int64_t dim, float scale, char *rows_work) {
    (void)q, (void)stride, (void)key_packed, (void)value_packed, (void)out, (void)out_stride, (void)length;
    (void)dim, (void)scale, (void)rows_work;
}
static int64_t tile_rows_bytes(int64_t longest, int64_t dim) { return (void)longest, (void)dim, 0; }
const char *attention_tiles(void) { return ""; }
#endif

/* Asks for tokens [begin, end)'s q, k and v (every head: `row_bytes` from each token's first) to be
 * brought into the core's L2. The next sequence's, a slice per head of this one (attend_full_bf16):
 * its packing then finds them there, where the QKV projection's output (tokens x 3 x heads x dim,
 * megabytes) had left them in L3 or memory; key_pack and value_pack waited on those reads for ~15 % of
 * the kernel at 256 tokens. */
static void prefetch_tokens(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t token_stride,
                            int64_t row_bytes, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
        const char *rows[3] = {(const char *)(k + t * token_stride), (const char *)(v + t * token_stride),
                               (const char *)(q + t * token_stride)};
        for (int i = 0; i < 3; i++)
            for (int64_t b = 0; b < row_bytes; b += 64)
                __builtin_prefetch(rows[i] + b, 0, 2);
    }
}

/* The whole packed batch: sequence s is tokens cu_seqlens[s] .. cu_seqlens[s + 1]. q, k, v: element
 * (t, h, d) at t * token_stride + h * head_stride + d; out: at t * heads * dim + h * dim + d. dim a
 * multiple of 16; work: attention_scratch_bytes(longest sequence, dim) bytes, 64-byte aligned. */
void attend_full_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t token_stride,
                      int64_t head_stride, uint16_t *out, const int32_t *cu_seqlens, int64_t sequences,
                      int64_t heads, int64_t dim, float scale, void *work) {
    int64_t row_bytes = ((heads - 1) * head_stride + dim) * 2;
    struct tile_config saved;
    int tiles = ATTENTION_BY_TILES && dim % TILE_DEPTH == 0 && tiles_begin(TILE_ROWS, &saved);
    for (int64_t s = 0; s < sequences; s++) {
        int64_t first = cu_seqlens[s], length = cu_seqlens[s + 1] - first;
        if (length <= 0)
            continue;
        int64_t next = first + length, next_length = s + 1 < sequences ? cu_seqlens[s + 2] - next : 0;
        int64_t group = heads_at_once(length, dim, heads), packed = packed_bytes(length, dim);
        char *keys = work, *values = keys + group * packed, *rows = values + group * packed;
        for (int64_t g = 0; g < heads; g += group) {
            struct heads_layout at = {token_stride, head_stride, g + group <= heads ? group : heads - g, packed};
            int64_t from = first * token_stride + g * head_stride;
            key_pack(k + from, &at, length, dim, keys);
            value_pack(v + from, &at, length, dim, values);
            for (int64_t h = 0; h < at.heads; h++) {
                int64_t slice = next_length * (g + h) / heads, slice_end = next_length * (g + h + 1) / heads;
                prefetch_tokens(q, k, v, token_stride, row_bytes, next + slice, next + slice_end);
                const uint16_t *queries = q + from + h * head_stride;
                uint16_t *context = out + first * heads * dim + (g + h) * dim;
                if (tiles && length > ROWS) { /* up to ROWS tokens fill a vector tile, half an AMX one */
                    pad_values(values + h * packed, length, dim);
                    attend_head_by_tiles(queries, token_stride, (const uint16_t *)(keys + h * packed),
                                         (const uint16_t *)(values + h * packed), context, heads * dim, length,
                                         dim, scale, rows);
                } else
                    attend_head(queries, token_stride, keys + h * packed, values + h * packed, context,
                                heads * dim, length, dim, scale, rows);
            }
        }
    }
    if (tiles)
        tiles_end(&saved);
}

/* ------------------------------------------------------------------ a whole BERT layer
 *
 * bert_layer_bf16: one post-norm BERT layer over a packed batch of a few rows (a short query), made of
 * the kernels above in the order the Python layer calls them (packed_bert.BertPieces.layer): the fused
 * QKV projection, attention over each sequence, the attention's output projection, add + LayerNorm, the
 * FFN's up projection with its activation, its down projection, add + LayerNorm. Each projection is a
 * few-row bfloat16 GEMM (bf16_linear_rows) or an int8 linear (quantize_rows, then int8_linear_rows), as
 * the Python layer computes it; the residual stream is bfloat16. The same kernels on the same inputs: the
 * output equals the layer computed call by call, bit for bit. One call instead of seven to eleven saves
 * the Python between them: a 10-token MiniLM query's forward spent ~35 % of its time outside the kernels
 * in bfloat16, ~55 % in int8 (argument checks, tensor allocations, module lookups; Zen 4, one thread). */
struct layer_gemm {
    const void *packed;  /* by pack_bf16_weights, or by pack_int8_weights (int8) */
    const float *bias;   /* float32, padded to 16; or NULL */
    const int32_t *compensation;               /* int8: the columns' compensation */
    const float *weight_scale, *input_scale;   /* int8: channel scales; SmoothQuant's input scale or NULL */
    int64_t k, n;
    int int8;
};

struct bert_layer {
    struct layer_gemm qkv, attention_out, up, down;
    const uint16_t *norm1_weight, *norm1_bias, *norm2_weight, *norm2_bias; /* bfloat16, hidden each */
    int64_t heads;
    float norm1_eps, norm2_eps, scale; /* scale: attention's, multiplying q k^T */
    int activation;                    /* the up projection's: bf16_linear_rows' code */
};

/* out (rows x g->n bfloat16) = g applied to x (rows x g->k bfloat16); quantized (rows x k bytes) and
 * token_scale (rows floats): an int8 linear's work. */
static void layer_gemm_rows(const struct layer_gemm *g, const uint16_t *x, int64_t rows, int activation, uint16_t *out,
                            uint8_t *quantized, float *token_scale) {
    if (g->int8) {
        quantize_rows(x, 1, g->input_scale, rows, g->k, (int8_t *)quantized, token_scale, 1);
        int8_linear_rows(quantized, rows, g->k, g->packed, g->compensation, g->n, token_scale, g->weight_scale,
                         g->bias, activation, out, 1);
    } else
        bf16_linear_rows(x, rows, g->k, g->packed, g->n, g->bias, activation, out);
}

/* x (rows x hidden bfloat16, dense) through `layer` into out (rows x hidden; not x). cu_seqlens: the packed
 * batch's `sequences` + 1 bounds, the longest sequence `longest` tokens. Returns 0, or -1 where its
 * buffers could not be allocated (nothing written then). */
int bert_layer_bf16(const uint16_t *x, int64_t rows, const int32_t *cu_seqlens, int64_t sequences, int64_t longest,
                    const struct bert_layer *layer, uint16_t *out) {
    int64_t hidden = layer->qkv.k, inner = layer->up.n, dim = hidden / layer->heads;
    int64_t qkv_bytes = round_up(rows * 3 * hidden * 2, ALIGN), row_bytes = round_up(rows * hidden * 2, ALIGN);
    int64_t inner_bytes = round_up(rows * inner * 2, ALIGN);
    int64_t quantized_bytes = round_up(rows * (inner > hidden ? inner : hidden), ALIGN);
    int64_t scale_bytes = round_up(rows * 4, ALIGN);
    int64_t norm_bytes = round_up(norm_work_floats(hidden) * 4, ALIGN);
    int64_t attention_bytes = round_up(attention_scratch_bytes(longest, dim), ALIGN);
    int64_t total = qkv_bytes + 3 * row_bytes + inner_bytes + quantized_bytes + scale_bytes + norm_bytes;
    char *work = aligned_alloc(ALIGN, total + attention_bytes);
    if (work == NULL)
        return -1;
    uint16_t *qkv = (uint16_t *)work, *context = (uint16_t *)(work + qkv_bytes);
    uint16_t *projected = (uint16_t *)(work + qkv_bytes + row_bytes);
    uint16_t *attended = (uint16_t *)(work + qkv_bytes + 2 * row_bytes);
    char *rest = work + qkv_bytes + 3 * row_bytes;
    uint16_t *hidden_inner = (uint16_t *)rest;
    uint8_t *quantized = (uint8_t *)(rest + inner_bytes);
    float *token_scale = (float *)(rest + inner_bytes + quantized_bytes);
    float *norm_work = (float *)(rest + inner_bytes + quantized_bytes + scale_bytes);
    void *attention_work = work + total;

    layer_gemm_rows(&layer->qkv, x, rows, 0, qkv, quantized, token_scale);
    /* q, k, v: (tokens, 3, heads, dim) views of the projection, as the Python layer reads them */
    attend_full_bf16(qkv, qkv + hidden, qkv + 2 * hidden, 3 * hidden, dim, context, cu_seqlens, sequences,
                     layer->heads, dim, layer->scale, attention_work);
    layer_gemm_rows(&layer->attention_out, context, rows, 0, projected, quantized, token_scale);
    add_layer_norm_bf16(projected, x, layer->norm1_weight, layer->norm1_bias, attended, rows, hidden,
                        layer->norm1_eps, norm_work);
    layer_gemm_rows(&layer->up, attended, rows, layer->activation, hidden_inner, quantized, token_scale);
    layer_gemm_rows(&layer->down, hidden_inner, rows, 0, projected, quantized, token_scale);
    add_layer_norm_bf16(projected, attended, layer->norm2_weight, layer->norm2_bias, out, rows, hidden,
                        layer->norm2_eps, norm_work);
    free(work);
    return 0;
}
