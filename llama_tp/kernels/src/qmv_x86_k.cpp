// x86-64 kernels of the K-quants (blocks of 256 in 8 chunks of 32); see qmv_x86.h.
#include <cstring>

#include "qmv_x86.h"

namespace lt {
namespace LT_NS {
namespace {

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

#ifdef LT_512
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
#endif

}  // namespace

#ifdef LT_512
void rows_q4k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k4_512<Q4_K>(w, x, r0, r1, y);
}
void rows_q5k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k4_512<Q5_K>(w, x, r0, r1, y);
}
void rows_q6k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_q6k_512(w, x, r0, r1, y);
}
#else
void rows_q4k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k4_256<Q4_K>(w, x, r0, r1, y);
}
void rows_q5k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k4_256<Q5_K>(w, x, r0, r1, y);
}
void rows_q6k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k<Q6_K>(w, x, r0, r1, y);
}
#endif
void rows_q2k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k<Q2_K>(w, x, r0, r1, y);
}
void rows_q3k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  rows_k<Q3_K>(w, x, r0, r1, y);
}

}  // namespace LT_NS
}  // namespace lt
