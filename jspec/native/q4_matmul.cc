// 4-bit weights x int8 activations -> float32 for CPU decoding, called from XLA through its FFI.
//
//   y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * (code[n, k] - 8)
//
// x: [M, K] int8 (activations quantized per token; the caller applies their scales), codes: [N,
// K / 2] uint8, two 4-bit codes a byte, groups of 32 inputs with one float scale each: [N, K / 32].
// A group's 16 bytes hold inputs i (low nibble) and i + 16 (high nibble). Half the bytes of int8
// weights, so a decode step streams half as much; the integer part of each group is exact and
// the float sums run in one fixed order per (m, n), so a token gets the same bits in a one-token
// step and in a verification block.
//
// AVX512-VNNI: vpdpbusd of the codes (uint8, 0..15) with x, started from -8 * (sum of x over each
// lane's 4 inputs), gives each lane its 4-input sum of x * (code - 8); lanes 0-7 belong to the
// first group of a 64-input block, 8-15 to the second; converted to float, scaled, accumulated.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

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
  const __m256i lo = _mm256_and_si256(v, nib);                         // [g0 0-15, g1 0-15]
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);   // [g0 16-31, g1 16-31]
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));    // [g0 lo, g0 hi, g1 lo, g1 hi]
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
      const float* s = o.scale + n * G + k / kGroup;
      scales[r] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(s[0])),
                                     _mm256_set1_ps(s[1]), 1);
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

void Rows(const Operands& o, int64_t n_begin, int64_t n_end) {
  const int64_t K = o.K, G = K / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m = 0; m < o.M; ++m) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t s = 0;
        const uint8_t* c = o.codes + n * (K / 2) + g * (kGroup / 2);
        const int8_t* x = o.x + m * K + g * kGroup;
        for (int64_t i = 0; i < kGroup / 2; ++i) {
          s += int32_t(x[i]) * (int32_t(c[i] & 0x0F) - 8);
          s += int32_t(x[i + kGroup / 2]) * (int32_t(c[i] >> 4) - 8);
        }
        acc += float(s) * o.scale[n * G + g];
      }
      o.y[m * o.N + n] = acc;
    }
  }
}

#endif

struct Work {
  Operands o;
  std::vector<int32_t> x_init;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks;

  void Run() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t begin = c * kChunkRows;
      Rows(o, begin, std::min(o.N, begin + kChunkRows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Q4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::U8> codes,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || xd[1] % kGroup != 0 ||
      cd[1] * 2 != xd[1] || sd[0] != cd[0] || sd[1] * kGroup != xd[1])
    return ffi::Error::InvalidArgument(
        "jspec_q4_matmul: x [M, K], codes [N, K / 2], scale [N, K / 32], K a multiple of 32");
  auto work = std::make_shared<Work>();
  Operands& o = work->o;
  o.x = x.typed_data();
  o.codes = codes.typed_data();
  o.scale = scale.typed_data();
  o.y = y->typed_data();
  o.M = xd[0], o.N = cd[0], o.K = xd[1];
  work->x_init.resize(o.M * (o.K / 4));
  for (int64_t i = 0; i < o.M * (o.K / 4); ++i)
    work->x_init[i] = -8 * (o.x[4 * i] + o.x[4 * i + 1] + o.x[4 * i + 2] + o.x[4 * i + 3]);
  o.x_init = work->x_init.data();
  work->chunks = (o.N + kChunkRows - 1) / kChunkRows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, work->chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
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
