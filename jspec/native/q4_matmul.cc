// 4-bit weights x int8 activations -> float32 for CPU decoding, called from XLA through its FFI.
//
//   y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * (code[n, k] - 8)
//
// x: [M, K] int8 (activations quantized per token; the caller applies their scales), codes: [N,
// K / 2] uint8, two 4-bit codes a byte, groups of 32 inputs with one float scale each: [N, K / 32].
// Each block of 64 inputs is 32 bytes, byte j holding input j (low nibble) and input j + 32 (high
// nibble), so one load, two masks and one insert give its 64 codes in input order; a trailing
// group of 32 is 16 bytes, byte j holding inputs j and j + 16. Half the bytes of int8
// weights, so a decode step streams half as much; the integer part of each group is exact and
// the float sums run in one fixed order per (m, n), so a token gets the same bits in a one-token
// step and in a verification block.
//
// AVX512-VNNI: vpdpbusd of the codes (uint8, 0..15) with x, started from -8 * (sum of x over each
// lane's 4 inputs), gives each lane its 4-input sum of x * (code - 8); lanes 0-7 belong to the
// first group of a 64-input block, 8-15 to the second; converted to float, scaled, accumulated.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define JSPEC_Q4_VNNI 1
#else
#define JSPEC_Q4_VNNI 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 4;
constexpr int64_t kChunkRows = 32;

struct Operands {
  const int8_t* x;
  const uint8_t* codes;
  const float* scale;
  float* y;
  const int32_t* x_init;  // [M, K / 4]: -8 * sum of each 4 consecutive x (VNNI path)
  int64_t M, N, K;
};

#if JSPEC_Q4_VNNI

// Codes of one 64-input block (32 bytes: two groups) as 64 bytes in input order.
inline __m512i Unpack64(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib);                        // inputs 0-31
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);  // inputs 32-63
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// The two groups' scales of a 64-input block, lanes 0-7 and 8-15.
inline __m512 Scales(const float* s) {
  const __m512i which = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  return _mm512_permutexvar_ps(which, _mm512_castps128_ps512(two));
}

// A trailing single group (16 bytes) as 32 bytes in input order, upper half zero.
inline __m512i Unpack32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, nib);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
  return _mm512_castsi256_si512(_mm256_set_m128i(hi, lo));
}

template <int NR, int MR>
inline void Block(const Operands& o, int64_t m0, int64_t n0) {
  const int64_t K = o.K, G = K / kGroup;
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512i codes[NR];
    __m512 scales[NR];
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      codes[r] = Unpack64(o.codes + n * (K / 2) + k / 2);
      scales[r] = Scales(o.scale + n * G + k / kGroup);
    }
    for (int t = 0; t < MR; ++t) {
      const __m512i xv = _mm512_loadu_si512(o.x + (m0 + t) * K + k);
      const __m512i init = _mm512_loadu_si512(o.x_init + (m0 + t) * (K / 4) + k / 4);
      for (int r = 0; r < NR; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(init, codes[r], xv);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scales[r], acc[r][t]);
      }
    }
  }
  if (k < K) {  // one group of 32 left: lanes 8-15 stay zero (codes, x and init masked)
    __m512i codes[NR];
    __m512 scales[NR];
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      codes[r] = Unpack32(o.codes + n * (K / 2) + k / 2);
      scales[r] = _mm512_set1_ps(o.scale[n * G + k / kGroup]);
    }
    for (int t = 0; t < MR; ++t) {
      const __m512i xv = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, o.x + (m0 + t) * K + k);
      const __m512i init = _mm512_maskz_loadu_epi32(0x00FF, o.x_init + (m0 + t) * (K / 4) + k / 4);
      for (int r = 0; r < NR; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(init, codes[r], xv);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scales[r], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) o.y[(m0 + t) * o.N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

constexpr int64_t kMaxTok = 5;

template <int NR>
inline void BlockRows(const Operands& o, int64_t n0) {
  int64_t m0 = 0;
  for (; o.M - m0 > kMaxTok; m0 += 4) Block<NR, 4>(o, m0, n0);
  switch (o.M - m0) {
    case 1: Block<NR, 1>(o, m0, n0); break;
    case 2: Block<NR, 2>(o, m0, n0); break;
    case 3: Block<NR, 3>(o, m0, n0); break;
    case 4: Block<NR, 4>(o, m0, n0); break;
    case 5: Block<NR, 5>(o, m0, n0); break;
    default: break;
  }
}

void Rows(const Operands& o, int64_t n_begin, int64_t n_end) {
  int64_t n0 = n_begin;
  for (; n0 + kRowBlock <= n_end; n0 += kRowBlock) BlockRows<kRowBlock>(o, n0);
  for (; n0 < n_end; ++n0) BlockRows<1>(o, n0);
}

#else

// Code of input i (0 <= i < K) in a row's packed bytes.
inline int32_t Code(const uint8_t* row, int64_t K, int64_t i) {
  const int64_t block = i / 64, full = K / 64;
  if (block < full) {
    const int64_t j = i % 64;
    const uint8_t b = row[block * 32 + j % 32];
    return j < 32 ? b & 0x0F : b >> 4;
  }
  const int64_t j = i - full * 64;  // the trailing group of 32
  const uint8_t b = row[full * 32 + j % 16];
  return j < 16 ? b & 0x0F : b >> 4;
}

void Rows(const Operands& o, int64_t n_begin, int64_t n_end) {
  const int64_t K = o.K, G = K / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = o.codes + n * (K / 2);
    for (int64_t m = 0; m < o.M; ++m) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t s = 0;
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i)
          s += int32_t(o.x[m * K + i]) * (Code(row, K, i) - 8);
        acc += float(s) * o.scale[n * G + g];
      }
      o.y[m * o.N + n] = acc;
    }
  }
}

#endif

ffi::Error Q4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::U8> codes,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || xd[1] % kGroup != 0 ||
      cd[1] * 2 != xd[1] || sd[0] != cd[0] || sd[1] * kGroup != xd[1])
    return ffi::Error::InvalidArgument(
        "jspec_q4_matmul: x [M, K], codes [N, K / 2], scale [N, K / 32], K a multiple of 32");
  Operands o;
  o.x = x.typed_data();
  o.codes = codes.typed_data();
  o.scale = scale.typed_data();
  o.y = y->typed_data();
  o.M = xd[0], o.N = cd[0], o.K = xd[1];
  std::vector<int32_t> x_init(o.M * (o.K / 4));
  for (int64_t i = 0; i < o.M * (o.K / 4); ++i)
    x_init[i] = -8 * (o.x[4 * i] + o.x[4 * i + 1] + o.x[4 * i + 2] + o.x[4 * i + 3]);
  o.x_init = x_init.data();
  jspec::ParallelFor(pool, (o.N + kChunkRows - 1) / kChunkRows, [=](int64_t c) {
    Rows(o, c * kChunkRows, std::min(o.N, (c + 1) * kChunkRows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecQ4Matmul, Q4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
