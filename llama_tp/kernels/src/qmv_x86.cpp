// x86-64 kernels, compiled once per instruction-set level (CMakeLists.txt):
//   LT_LEVEL=avx2    -mavx2 -mfma -mf16c: 16 int16 products per instruction (vpmaddwd)
//   LT_LEVEL=avx512  + AVX-512 F/BW/VL: 32 per instruction, a whole 32-value chunk
// Each chunk of 32 weights is decoded to integers u (one byte each), widened to int16
// and multiplied with the int16 activations; the int32 sums of each half of 16 are
// scaled by A * dx in float, and the offsets B enter through the activation sums m.
#include <immintrin.h>

#include <vector>

#include "formats.h"

#ifndef LT_LEVEL
#error "compile with -DLT_LEVEL=avx2 or avx512"
#endif
#define LT_CAT2(a, b) a##b
#define LT_CAT(a, b) LT_CAT2(a, b)
#define LT_NS LT_CAT(x86_, LT_LEVEL)
#define LT_STR2(a) #a
#define LT_STR(a) LT_STR2(a)

namespace lt {
namespace LT_NS {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LT_512 1
// Accumulator of one row: 16 float lanes, lanes 0-7 from values 0-15 of a chunk.
typedef __m512 Acc;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
// u (32 bytes, values 0..31; signed for Q8_0) . q (32 int16) -> 16 int32 (two halves)
template <bool SIGNED>
inline __m512i chunk_dot(__m256i u, const int16_t* q) {
  __m512i w = SIGNED ? _mm512_cvtepi8_epi16(u) : _mm512_cvtepu8_epi16(u);
  return _mm512_madd_epi16(w, _mm512_loadu_si512((const void*)q));
}
inline Acc fma_same(__m512i p, float s, Acc acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(s), acc);
}
inline Acc fma_halves(__m512i p, float s0, float s1, Acc acc) {
  __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc);
}
#else
typedef __m256 Acc;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
struct Halves {
  __m256i p0, p1;  // 8 int32 each: values 0-15, 16-31
};
template <bool SIGNED>
inline Halves chunk_dot(__m256i u, const int16_t* q) {
  __m128i a = _mm256_castsi256_si128(u), b = _mm256_extracti128_si256(u, 1);
  __m256i w0 = SIGNED ? _mm256_cvtepi8_epi16(a) : _mm256_cvtepu8_epi16(a);
  __m256i w1 = SIGNED ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
  return {_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)q)),
          _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(q + 16)))};
}
inline Acc fma_same(Halves p, float s, Acc acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p.p0, p.p1)), _mm256_set1_ps(s),
                         acc);
}
inline Acc fma_halves(Halves p, float s0, float s1, Acc acc) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.p0), _mm256_set1_ps(s0), acc);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.p1), _mm256_set1_ps(s1), acc);
}
#endif

inline float f16(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// 16 bytes -> 32 values: the low nibbles (values 0-15), then the high ones (16-31).
inline __m256i nibbles16(const uint8_t* p) {
  __m128i b = _mm_loadu_si128((const __m128i*)p);
  __m128i m4 = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}

// 32 bits -> 32 bytes, 16 where the bit is set (Q5_0/Q5_1's fifth bits; ggml's trick).
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
                          _mm256_set1_epi8(16));
}

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

// The K-quants: blocks of 256 in 8 chunks of 32.
template <int F>
void rows_k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  const int bytes = block_bytes(F), nb = w.k / 256;
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    Acc acc = acc_zero();
    float off = 0.f;
    for (int b = 0; b < nb; b++, blk += bytes) {
      const int16_t* q = x.q + 256 * b;
      const float* dx = x.d + 8 * b;
      const float* mx = x.m + 16 * b;
      if (F == Q4_K || F == Q5_K) {
        uint8_t sc[8], mn[8];
        k4_scale_min(blk + 4, sc, mn);
        float d = f16(blk), dmin = f16(blk + 2);
        const uint8_t* qs = blk + (F == Q5_K ? 48 : 16);
        __m256i qh = F == Q5_K ? _mm256_loadu_si256((const __m256i*)(blk + 16)) : m1;
        for (int j = 0; j < 8; j++) {
          __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * (j / 2)));
          __m256i u = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bits, 4) : bits, m4);
          if (F == Q5_K) {
            __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), m1);
            u = _mm256_or_si256(u, _mm256_slli_epi16(h, 4));
          }
          acc = fma_same(chunk_dot<false>(u, q + 32 * j), d * sc[j] * dx[j], acc);
          off -= dmin * mn[j] * (mx[2 * j] + mx[2 * j + 1]);
        }
      } else if (F == Q6_K) {
        const int8_t* sc = (const int8_t*)(blk + 192);
        float d = f16(blk + 208);
        for (int hh = 0; hh < 2; hh++) {
          __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * hh));
          __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * hh + 32));
          __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * hh));
          __m256i u[4] = {
              _mm256_or_si256(_mm256_and_si256(l0, m4),
                              _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
              _mm256_or_si256(_mm256_and_si256(l1, m4),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)),
          };
          for (int jj = 0; jj < 4; jj++) {
            int j = 4 * hh + jj;
            float a0 = d * sc[2 * j], a1 = d * sc[2 * j + 1];
            acc = fma_halves(chunk_dot<false>(u[jj], q + 32 * j), a0 * dx[j], a1 * dx[j], acc);
            off -= 32.f * (a0 * mx[2 * j] + a1 * mx[2 * j + 1]);
          }
        }
      } else if (F == Q3_K) {
        int sc[16];
        k3_scales(blk + 96, sc);
        float d = f16(blk + 108);
        __m256i hm = _mm256_loadu_si256((const __m256i*)blk);
        for (int hh = 0; hh < 2; hh++) {
          __m256i qs = _mm256_loadu_si256((const __m256i*)(blk + 32 + 32 * hh));
          for (int jj = 0; jj < 4; jj++) {
            int j = 4 * hh + jj;
            __m256i lo = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * jj)), m3);
            __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(j)), m1);
            __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 2));
            float a0 = d * sc[2 * j], a1 = d * sc[2 * j + 1];
            acc = fma_halves(chunk_dot<false>(u, q + 32 * j), a0 * dx[j], a1 * dx[j], acc);
            off -= 4.f * (a0 * mx[2 * j] + a1 * mx[2 * j + 1]);
          }
        }
      } else {  // Q2_K
        const uint8_t* sc = blk;
        float d = f16(blk + 80), dmin = f16(blk + 82);
        for (int hh = 0; hh < 2; hh++) {
          __m256i qs = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * hh));
          for (int jj = 0; jj < 4; jj++) {
            int j = 4 * hh + jj;
            __m256i u = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * jj)), m3);
            float a0 = d * (sc[2 * j] & 15), a1 = d * (sc[2 * j + 1] & 15);
            acc = fma_halves(chunk_dot<false>(u, q + 32 * j), a0 * dx[j], a1 * dx[j], acc);
            off -= dmin * ((sc[2 * j] >> 4) * mx[2 * j] + (sc[2 * j + 1] >> 4) * mx[2 * j + 1]);
          }
        }
      }
    }
    y[r - r0] = acc_sum(acc) + off;
  }
}

// Q4_K / Q5_K's twelve bytes of 6-bit scales and mins -> sc[0..7] in bytes 0-7, mn[0..7]
// in bytes 8-15 (llama.cpp's unpacking, ggml-cpu/arch/x86/quants.c).
inline __m128i k4_unpack(const uint8_t* s) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins;
  u[0] &= m1;
  return _mm_loadu_si128((const __m128i*)u);
}

#ifndef LT_512
// Q4_K, Q5_K with 256-bit vectors: as rows_k4_512 below, each chunk two 16-value
// multiply-adds; the factors [d sc_j dx_j, dmin mn_j M_j] of chunks 0-3 and 4-7 in two
// vectors.
template <int F>
void rows_k4_256(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr bool FIVE = F == Q5_K;
  const int bytes = block_bytes(F), nb = w.k / 256;
  const __m256i m4 = _mm256_set1_epi8(15), m1 = _mm256_set1_epi8(1);
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    __m256 off = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, blk += bytes) {
      const int16_t* q = x.q + 256 * b;
      __m128i sm = k4_unpack(blk + 4);
      __m128i il = _mm_unpacklo_epi8(sm, _mm_srli_si128(sm, 8));
      uint32_t dd;
      std::memcpy(&dd, blk, 4);  // d, dmin
      __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));
      __m256 dmul = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(d2)));
      __m256 p[2];
      for (int i = 0; i < 2; i++) {
        __m256 ab = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(i ? _mm_srli_si128(il, 8) : il));
        p[i] = _mm256_mul_ps(_mm256_mul_ps(ab, dmul), _mm256_loadu_ps(x.dm + 16 * b + 8 * i));
        off = _mm256_add_ps(off, _mm256_blend_ps(_mm256_setzero_ps(), p[i], 0xAA));
      }
      const uint8_t* qs = blk + (FIVE ? 48 : 16);
      __m256i qh = FIVE ? _mm256_loadu_si256((const __m256i*)(blk + 16)) : m1;
#pragma GCC unroll 4
      for (int h = 0; h < 4; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * h));
        __m256i u[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
        for (int e = 0; e < 2; e++) {
          int j = 2 * h + e;
          if (FIVE) {
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, j), m1);
            u[e] = _mm256_or_si256(u[e], _mm256_slli_epi16(hb, 4));
          }
          Halves d = chunk_dot<false>(u[e], q + 32 * j);
          __m256 f = _mm256_permutevar8x32_ps(p[j / 4], _mm256_set1_epi32(2 * (j % 4)));
          acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d.p0, d.p1)), f, acc[h]);
        }
      }
    }
    __m256 a = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    y[r - r0] = acc_sum(a) - acc_sum(off);
  }
}

#endif

template <int S>
inline float scale(const void* p, size_t i) {
  if (S == F32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return S == F16 ? _cvtsh_ss(h) : bf16_to_f32(h);
}

// MLX affine: 4 bits (16 bytes per 32 values, EVEN_ODD activations) or 8 bits.
template <int F, int S>
void rows_affine_t(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr int STEP = F == AFFINE4 ? 16 : 32;
  const int per_group = w.group_size / 32, ng = w.k / w.group_size;
  for (int r = r0; r < r1; r++) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    size_t g0 = (size_t)r * w.groups;
    Acc acc = acc_zero();
    float off = 0.f;
    for (int g = 0, c = 0; g < ng; g++) {
      float a = scale<S>(w.scales, g0 + g), b = scale<S>(w.biases, g0 + g);
      for (int e = c + per_group; c < e; c++) {
        __m256i u = F == AFFINE4 ? nibbles16(row + STEP * c)
                                 : _mm256_loadu_si256((const __m256i*)(row + STEP * c));
        acc = fma_same(chunk_dot<false>(u, x.q + 32 * c), a * x.d[c], acc);
        off += b * (x.m[2 * c] + x.m[2 * c + 1]);
      }
    }
    y[r - r0] = acc_sum(acc) + off;
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

// Q4_K, Q5_K: per block of 256, one vector of [d sc_j dx_j, dmin mn_j M_j] for its eight
// chunks (x.dm holds [dx_j, M_j]); then per 32 bytes of nibbles two chunks (the low
// nibbles are chunk 2p, the high ones 2p + 1), each one 32-value multiply-add, one
// conversion and one multiply-add by its broadcast factor, in four accumulators (no
// chain of dependent adds); the offsets gather in the odd lanes of one vector.
template <int F>
void rows_k4_512(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr bool FIVE = F == Q5_K;
  const int bytes = block_bytes(F), nb = w.k / 256;
  const __m512i m4 = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __m512 off = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, blk += bytes) {
      const int16_t* q = x.q + 256 * b;
      __m128i sm = k4_unpack(blk + 4);
      __m512 ab = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sm, _mm_srli_si128(sm, 8))));
      uint32_t dd;
      std::memcpy(&dd, blk, 4);  // d, dmin
      __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));
      __m512 dmul = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(d2)));
      __m512 p = _mm512_mul_ps(_mm512_mul_ps(ab, dmul), _mm512_loadu_ps(x.dm + 16 * b));
      off = _mm512_mask_add_ps(off, 0xAAAA, off, p);
      const uint8_t* qs = blk + (FIVE ? 48 : 16);
      __m512i qh;
      if (FIVE) qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(blk + 16)));
#pragma GCC unroll 4
      for (int h = 0; h < 4; h++) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qs + 32 * h)));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_srli_epi16(v, 4);
        if (FIVE) {
          lo = _mm512_mask_add_epi16(lo, _mm512_test_epi16_mask(qh, _mm512_set1_epi16(1 << (2 * h))),
                                     lo, sixteen);
          hi = _mm512_mask_add_epi16(
              hi, _mm512_test_epi16_mask(qh, _mm512_set1_epi16(2 << (2 * h))), hi, sixteen);
        }
        __m512 s0 = _mm512_cvtepi32_ps(_mm512_madd_epi16(lo, _mm512_loadu_si512(q + 64 * h)));
        __m512 s1 = _mm512_cvtepi32_ps(_mm512_madd_epi16(hi, _mm512_loadu_si512(q + 64 * h + 32)));
        __m512 f0 = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * h), p);
        __m512 f1 = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * h + 2), p);
        acc[h] = _mm512_fmadd_ps(s0, f0, acc[h]);
        acc[h] = _mm512_fmadd_ps(s1, f1, acc[h]);
      }
    }
    __m512 a = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    y[r - r0] = _mm512_reduce_add_ps(a) - _mm512_reduce_add_ps(off);
  }
}

// Q6_K: per block the sixteen factors d sc_h dx (one per 16 values) in one vector, and the
// offsets -32 d sc_h m_h as one multiply-add of vectors; per chunk one 32-value
// multiply-add, one conversion and one multiply-add by [its two factors x8], in four
// accumulators.
void rows_q6k_512(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  const int nb = w.k / 256;
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  const __m512i halves = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  __m512i idx[8];
  for (int j = 0; j < 8; j++)
    idx[j] = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * j), _mm512_set1_epi32(2 * j + 1));
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __m512 off = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, blk += 210) {
      const int16_t* q = x.q + 256 * b;
      __m512 a = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192)))),
          _mm512_set1_ps(f16(blk + 208)));
      off = _mm512_fmadd_ps(a, _mm512_loadu_ps(x.m + 16 * b), off);
      __m512 f = _mm512_mul_ps(
          a, _mm512_permutexvar_ps(halves, _mm512_castps256_ps512(_mm256_loadu_ps(x.d + 8 * b))));
#pragma GCC unroll 2
      for (int hh = 0; hh < 2; hh++) {
        __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * hh));
        __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * hh + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * hh));
        __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4),
                            _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)),
        };
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; jj++) {
          int j = 4 * hh + jj;
          __m512 s = _mm512_cvtepi32_ps(chunk_dot<false>(u[jj], q + 32 * j));
          acc[jj] = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(idx[j], f), acc[jj]);
        }
      }
    }
    __m512 t = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    y[r - r0] = _mm512_reduce_add_ps(t) - 32.f * _mm512_reduce_add_ps(off);
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
     rows_small_paired<Q5_1>, rows_small<Q8_0>, rows_k<Q2_K>, rows_k<Q3_K>, rows_k4_512<Q4_K>,
     rows_k4_512<Q5_K>, rows_q6k_512, rows_affine4_512, rows_affine<AFFINE8>},
    {1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0},
};
#else
extern const Kernels kernels = {
    LT_STR(LT_LEVEL),
    {rows_small<Q4_0>, rows_small<Q4_1>, rows_small<Q5_0>, rows_small<Q5_1>, rows_small<Q8_0>,
     rows_k<Q2_K>, rows_k<Q3_K>, rows_k4_256<Q4_K>, rows_k4_256<Q5_K>, rows_k<Q6_K>,
     rows_affine<AFFINE4>, rows_affine<AFFINE8>},
};
#endif

}  // namespace LT_NS
}  // namespace lt
