// Per-token int8 quantization of activations inside jspec's native matmuls, bit for bit what
// `jspec.models.quant.quantize_rows` computes in XLA, so a model gives the same numbers through
// either kernel:
//
//   scale = max_k |x[m, k]| * (1 / 127) (1 where that is 0),
//   q[m, k] = clamp(round(x[m, k] * (1 / scale)), -127, 127)
//
// with each reciprocal rounded to float32 and multiplied (how XLA computes those divisions,
// spelled out in quantize_rows) and rounding half to even. Done here rather than in XLA because
// XLA:CPU runs the reduction, division and casts as several small loops per matmul (~7 ms of a
// speculative round of the 1.5B/0.5B pair).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace jspec {

// Rows x [M, K] -> q [M, K] int8 and scale [M].
inline void QuantizeRows(const float* x, int8_t* q, float* scale, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* qr = q + m * K;
    float amax = 0.0f;
    int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    float s = amax * (1.0f / 127.0f);
    if (s == 0.0f) s = 1.0f;
    scale[m] = s;
    const float inv = 1.0f / s;
    k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; k + 16 <= K; k += 16) {
      __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + k), vinv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      const __m128i bytes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k), bytes);
    }
#endif
    for (; k < K; ++k)  // nearbyint: the default rounding mode, to nearest even
      qr[k] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(xr[k] * inv))));
  }
}

}  // namespace jspec
