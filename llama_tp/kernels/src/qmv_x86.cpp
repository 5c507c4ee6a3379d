// x86-64 kernels of the small blocks (Q4_0 ... Q8_0) and MLX's affine layout, and each
// instruction set's table of kernels; see qmv_x86.h.
#include <vector>

#include "qmv_x86.h"

namespace lt {
namespace LT_NS {
namespace {

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32, one scale (and offset) each.
template <int F>
void rows_small(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr bool MIN = F == Q4_1 || F == Q5_1, FIVE = F == Q5_0 || F == Q5_1;
  const int bytes = block_bytes(F), nb = w.k / 32;
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    Acc acc = acc_zero();
    float off = 0.f;
    for (int c = 0; c < nb; c++, blk += bytes) {
      float d = f16(blk);
      if (F == Q8_0) {
        __m256i u = _mm256_loadu_si256((const __m256i*)(blk + 2));
        acc = fma_same(chunk_dot<true>(u, x.q + 32 * c), d * x.d[c], acc);
        continue;
      }
      __m256i u = nibbles16(blk + (MIN ? 4 : 2) + (FIVE ? 4 : 0));
      if (FIVE) u = _mm256_or_si256(u, fifth_bits(blk + (MIN ? 4 : 2)));
      acc = fma_same(chunk_dot<false>(u, x.q + 32 * c), d * x.d[c], acc);
      float b = MIN ? f16(blk + 2) : -d * (FIVE ? 16.f : 8.f);
      off += b * (x.m[2 * c] + x.m[2 * c + 1]);
    }
    y[r - r0] = acc_sum(acc) + off;
  }
}

// MLX affine: 4 bits (16 bytes per 32 values, EVEN_ODD activations) or 8 bits. The
// activation sums of each group once per call, so that a row's offsets are one product
// per group; two accumulators (no chain of dependent adds).
template <int F, int S>
void rows_affine_t(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr int STEP = F == AFFINE4 ? 16 : 32;
  const int per_group = w.group_size / 32, ng = w.k / w.group_size;
  thread_local std::vector<float> msum_v;
  msum_v.resize(ng);
  float* msum = msum_v.data();  // a thread_local's address costs a call in a shared library
  for (int g = 0; g < ng; g++) {
    float t = 0.f;
    for (int c = g * per_group; c < (g + 1) * per_group; c++) t += x.dm[2 * c + 1];
    msum[g] = t;
  }
  for (int r = r0; r < r1; r++) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    size_t g0 = (size_t)r * w.groups;
    Acc acc0 = acc_zero(), acc1 = acc_zero();
    float off = 0.f;
    for (int g = 0, c = 0; g < ng; g++) {
      float a = scale<S>(w.scales, g0 + g);
      off += scale<S>(w.biases, g0 + g) * msum[g];
      for (int e = c + per_group; c < e; c++) {
        __m256i u = F == AFFINE4 ? nibbles16(row + STEP * c)
                                 : _mm256_loadu_si256((const __m256i*)(row + STEP * c));
        if (c & 1) {
          acc1 = fma_same(chunk_dot<false>(u, x.q + 32 * c), a * x.d[c], acc1);
        } else {
          acc0 = fma_same(chunk_dot<false>(u, x.q + 32 * c), a * x.d[c], acc0);
        }
      }
    }
    y[r - r0] = acc_sum(acc0) + acc_sum(acc1) + off;
  }
}

template <int F>
void rows_affine(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  switch (w.scale_type) {
    case F32: return rows_affine_t<F, F32>(w, x, r0, r1, y);
    case F16: return rows_affine_t<F, F16>(w, x, r0, r1, y);
    default: return rows_affine_t<F, BF16>(w, x, r0, r1, y);
  }
}

#ifdef LT_512
// Two blocks of 4-bit values per instruction (PAIRED activations): the 16 bytes of block
// c and of block c + 1, widened to words: low nibbles (values 0-15 of both), high ones.
inline void nibbles_pair(__m256i bytes, __m512i& lo, __m512i& hi) {
  __m512i w = _mm512_cvtepu8_epi16(bytes);
  lo = _mm512_and_si512(w, _mm512_set1_epi16(15));
  hi = _mm512_srli_epi16(w, 4);
}

inline __m256i two16(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                 _mm_loadu_si128((const __m128i*)b), 1);
}

// [A0, B0, A1, B1] (two blocks' scale and offset) times x.dm's [dx0, m0, dx1, m1]: the
// offsets go into `off` (lanes 1 and 3), the factors come back as 8 lanes of A0 dx0 and
// 8 of A1 dx1, the order of the pair's products.
inline __m512 pair_factors(__m128 ab, const float* dm, __m128& off) {
  __m128 p = _mm_mul_ps(ab, _mm_loadu_ps(dm));
  off = _mm_add_ps(off, p);
  const __m512i idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(p));
}

inline __m512 pair_dot(__m512i lo, __m512i hi, const int16_t* q) {
  __m512i p = _mm512_add_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512((const void*)q)),
                               _mm512_madd_epi16(hi, _mm512_loadu_si512((const void*)(q + 32))));
  return _mm512_cvtepi32_ps(p);
}

inline float off_sum(__m128 off) {
  return _mm_cvtss_f32(_mm_add_ss(_mm_shuffle_ps(off, off, 1), _mm_shuffle_ps(off, off, 3)));
}

template <int F>
void rows_small_paired(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr bool MIN = F == Q4_1 || F == Q5_1, FIVE = F == Q5_0 || F == Q5_1;
  constexpr int AT = (MIN ? 4 : 2) + (FIVE ? 4 : 0);  // where the nibbles start
  const int bytes = block_bytes(F), nc = w.k / 32;
  const __m128 offset = _mm_setr_ps(1.f, FIVE ? -16.f : -8.f, 1.f, FIVE ? -16.f : -8.f);
  const __m512i sixteen = _mm512_set1_epi16(16);
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    __m512 acc = _mm512_setzero_ps();
    __m128 off = _mm_setzero_ps();
    int c = 0;
    for (; c + 1 < nc; c += 2, blk += 2 * bytes) {
      const uint8_t* b1 = blk + bytes;
      __m512i lo, hi;
      nibbles_pair(two16(blk + AT, b1 + AT), lo, hi);
      if (FIVE) {  // bit i of a block's qh: value i's fifth bit
        uint32_t h0, h1;
        std::memcpy(&h0, blk + AT - 4, 4);
        std::memcpy(&h1, b1 + AT - 4, 4);
        lo = _mm512_mask_add_epi16(lo, (h0 & 0xFFFF) | (h1 << 16), lo, sixteen);
        hi = _mm512_mask_add_epi16(hi, (h0 >> 16) | (h1 & 0xFFFF0000u), hi, sixteen);
      }
      __m128 ab;
      if (MIN) {  // d, m of each block: 4 bytes at its start
        uint32_t a, b;
        std::memcpy(&a, blk, 4);
        std::memcpy(&b, b1, 4);
        ab = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)b, (int)a));
      } else {  // d of each block, offset -8 d (-16 d)
        uint32_t a = load_u16(blk), b = load_u16(b1);
        ab = _mm_mul_ps(_mm_cvtph_ps(_mm_set_epi32(0, 0, (int)(b | b << 16), (int)(a | a << 16))),
                        offset);
      }
      acc = _mm512_fmadd_ps(pair_dot(lo, hi, x.q + 32 * c), pair_factors(ab, x.dm + 2 * c, off),
                            acc);
    }
    float rest = 0.f;
    if (c < nc) {  // a last block on its own (activations in the base order)
      Acc one = acc_zero();
      __m256i u = nibbles16(blk + AT);
      if (FIVE) u = _mm256_or_si256(u, fifth_bits(blk + AT - 4));
      float d = f16(blk);
      one = fma_same(chunk_dot<false>(u, x.q + 32 * c), d * x.d[c], one);
      float b = MIN ? f16(blk + 2) : -d * (FIVE ? 16.f : 8.f);
      rest = acc_sum(one) + b * x.dm[2 * c + 1];
    }
    y[r - r0] = _mm512_reduce_add_ps(acc) + off_sum(off) + rest;
  }
}

// n scales of row `g0` on as floats
template <int S>
inline void scales_f32(const void* src, size_t g0, int n, float* out) {
  int i = 0;
  if (S == F16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + g0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
  } else if (S == BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + g0;
    for (; i + 16 <= n; i += 16) {
      __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s + i)));
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  }
  for (; i < n; i++) out[i] = scale<S>(src, g0 + i);
}

// MLX 4-bit, PAIRED activations. Per call (a chunk of rows): the pairs' activation scales
// as vectors [dx_c x8, dx_c+1 x8] and the activation sums of each group; per row its
// scales as floats, and its offsets as one dot product of its biases with those sums; then
// per pair of chunks (32 bytes) two multiply-adds, one conversion and one multiply-add by
// the pair's factors, alternating between two accumulators.
template <int S, int PER>  // PER: chunks per group (1, 2, 4: groups of 32, 64, 128)
void rows_affine4_paired(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  const int nc = w.k / 32, np = nc / 2, ng = w.k / w.group_size;
  thread_local std::vector<float> dxp_v, msum_v, as_v, bs_v;
  dxp_v.resize((size_t)16 * np);
  msum_v.resize(ng);
  as_v.resize(ng);
  bs_v.resize(ng);
  // plain pointers: a thread_local's address costs a call in a shared library
  float *dxp = dxp_v.data(), *msum = msum_v.data(), *as = as_v.data(), *bs = bs_v.data();
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int p = 0; p < np; p++) {
    __m128 d2 = _mm_castpd_ps(_mm_load_sd((const double*)(x.d + 2 * p)));
    _mm512_storeu_ps(dxp + 16 * p, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d2)));
  }
  for (int g = 0; g < ng; g++) {
    float t = 0.f;
    for (int c = g * PER; c < (g + 1) * PER; c++) t += x.dm[2 * c + 1];
    msum[g] = t;
  }
  for (int r = r0; r < r1; r++) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    size_t g0 = (size_t)r * w.groups;
    scales_f32<S>(w.scales, g0, ng, as);
    scales_f32<S>(w.biases, g0, ng, bs);
    float off = 0.f;
    {
      __m512 o = _mm512_setzero_ps();
      int g = 0;
      for (; g + 16 <= ng; g += 16)
        o = _mm512_fmadd_ps(_mm512_loadu_ps(bs + g), _mm512_loadu_ps(msum + g), o);
      off = _mm512_reduce_add_ps(o);
      for (; g < ng; g++) off += bs[g] * msum[g];
    }
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int c = 0;
    for (; c + 1 < nc; c += 2) {
      __m512i lo, hi;
      nibbles_pair(_mm256_loadu_si256((const __m256i*)(row + 16 * c)), lo, hi);
      __m512 a;
      if (PER == 1) {  // the pair's two groups: [a_c x8, a_c+1 x8]
        a = _mm512_permutexvar_ps(
            idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double*)(as + c)))));
      } else {
        a = _mm512_set1_ps(as[c / PER]);
      }
      __m512 f = _mm512_mul_ps(a, _mm512_loadu_ps(dxp + 8 * c));
      if (c & 2) {
        acc1 = _mm512_fmadd_ps(pair_dot(lo, hi, x.q + 32 * c), f, acc1);
      } else {
        acc0 = _mm512_fmadd_ps(pair_dot(lo, hi, x.q + 32 * c), f, acc0);
      }
    }
    float rest = 0.f;
    if (c < nc) {  // a last chunk on its own (groups of 32; activations in the base order)
      Acc one = fma_same(chunk_dot<false>(nibbles16(row + 16 * c), x.q + 32 * c),
                         as[c] * x.d[c], acc_zero());
      rest = acc_sum(one);
    }
    y[r - r0] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + off + rest;
  }
}

template <int S>
void rows_affine4_groups(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  switch (w.group_size) {
    case 32: return rows_affine4_paired<S, 1>(w, x, r0, r1, y);
    case 64: return rows_affine4_paired<S, 2>(w, x, r0, r1, y);
    default: return rows_affine4_paired<S, 4>(w, x, r0, r1, y);
  }
}

void rows_affine4_512(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  switch (w.scale_type) {
    case F32: return rows_affine4_groups<F32>(w, x, r0, r1, y);
    case F16: return rows_affine4_groups<F16>(w, x, r0, r1, y);
    default: return rows_affine4_groups<BF16>(w, x, r0, r1, y);
  }
}
#endif

}  // namespace

#ifdef LT_512
extern const Kernels kernels = {
    LT_STR(LT_LEVEL),
    {rows_small_paired<Q4_0>, rows_small_paired<Q4_1>, rows_small_paired<Q5_0>,
     rows_small_paired<Q5_1>, rows_small<Q8_0>, rows_q2k, rows_q3k, rows_q4k, rows_q5k, rows_q6k,
     rows_affine4_512, rows_affine<AFFINE8>},
    {1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0},
};
#else
extern const Kernels kernels = {
    LT_STR(LT_LEVEL),
    {rows_small<Q4_0>, rows_small<Q4_1>, rows_small<Q5_0>, rows_small<Q5_1>, rows_small<Q8_0>,
     rows_q2k, rows_q3k, rows_q4k, rows_q5k, rows_q6k, rows_affine<AFFINE4>, rows_affine<AFFINE8>},
};
#endif

}  // namespace LT_NS
}  // namespace lt
