// The x86-64 kernels' shared pieces (qmv_x86.cpp: the small blocks and MLX's layout;
// qmv_x86_k.cpp: the K-quants), compiled once per instruction-set level (CMakeLists.txt):
//   LT_LEVEL=avx2    -mavx2 -mfma -mf16c: 16 int16 products per instruction (vpmaddwd)
//   LT_LEVEL=avx512  + AVX-512 F/BW/VL: 32 per instruction, a whole 32-value chunk
// Each chunk of 32 weights is decoded to integers u (one byte each), widened to int16
// and multiplied with the int16 activations; the int32 sums of each half of 16 are
// scaled by A * dx in float, and the offsets B enter through the activation sums m.
#pragma once

#include <immintrin.h>

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

// The K-quant kernels (qmv_x86_k.cpp)
void rows_q2k(const Matrix& w, const XRow& x, int r0, int r1, float* y);
void rows_q3k(const Matrix& w, const XRow& x, int r0, int r1, float* y);
void rows_q4k(const Matrix& w, const XRow& x, int r0, int r1, float* y);
void rows_q5k(const Matrix& w, const XRow& x, int r0, int r1, float* y);
void rows_q6k(const Matrix& w, const XRow& x, int r0, int r1, float* y);

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


template <int S>
inline float scale(const void* p, size_t i) {
  if (S == F32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return S == F16 ? _cvtsh_ss(h) : bf16_to_f32(h);
}

}  // namespace
}  // namespace LT_NS
}  // namespace lt
