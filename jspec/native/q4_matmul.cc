// 4-bit weights x int8 activations -> float32 for CPU decoding, called from XLA through its FFI.
//
// Two forms of a group of 32 weights (ggml's Q4_0 and Q4_1 blocks), one handler each:
//
//   symmetric:  y[m, n] = x_scale[m] * sum_g scale[n, g] * sum_{k in g} xq[m, k] * (code[n, k] - 8)
//   offset:     y[m, n] = x_scale[m] * sum_g (scale[n, g] * sum_{k in g} xq[m, k] * code[n, k]
//                                             + offset[n, g] * sum_{k in g} xq[m, k])
//
// x: [M, K] float32, quantized per token here to xq int8 and x_scale (quantize.h, the bits of
// `quant.quantize_rows`); codes: [N, K / 2] uint8, two 4-bit codes a byte; scale and offset:
// [N, K / 32] float16, one per group of 32 inputs.
// Half the bytes of int8 weights (plus 1/16 for the scales, 1/8 with offsets): a decode step
// streams ~0.56 (~0.63) as much.
//
// Layout (made for one vector lane per group): a row's groups are taken 16 at a time (a superblock
// of 512 inputs; the last one holds the g = G mod 16 groups left when G is not a multiple of 16).
// A superblock of g groups starting at group g0 is 16 g bytes: 4 chunks c = 0..3 of 4 g bytes, and
// byte 4 l + i of chunk c (lane l < g, i < 4) holds input 32 (g0 + l) + 4 c + i in its low nibble
// and input 32 (g0 + l) + 16 + 4 c + i in its high nibble. So one 64-byte load, a mask and a shift
// give each of 16 lanes 4 inputs of its own group, vpdpbusd sums them into the lane, and after the
// superblock's 8 such steps each lane holds its group's whole integer sum: the float work (convert,
// scale, add) is once per 16 groups, not once per group, and the kernel stays memory-bound.
//
// Integer group sums are exact and every (m, n) adds its groups' float terms in one fixed order (by
// superblock, then a fixed reduction over the 16 lanes), whatever M or the thread split: a token
// gets the same bits in a one-token step and in a verification block.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "quantize.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define JSPEC_Q4_VNNI 1
#else
#define JSPEC_Q4_VNNI 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;      // inputs sharing one scale
constexpr int64_t kLanes = 16;      // groups in a superblock
constexpr int64_t kChunkRows = 32;  // output rows per unit of work handed to a thread
// How far ahead of its loads a thread prefetches codes. Rows of the small drafters are short (448
// bytes at K = 896) and the hardware prefetcher ramps up too late on them: prefetching the next
// row block only (1.8 KB ahead) left a 1-token step of the 0.5B drafter at ~10 ms, 32 KB ahead
// ~8 ms (bandwidth 20 -> 25 GB/s). Past the array's end a prefetch is a no-op.
constexpr int64_t kPrefetchBytes = 32768;

struct Operands {
  const int8_t* xp;       // [M, K] x in the codes' superblock order (`PermuteX`)
  const int32_t* x_sum;   // [M, S * 16]: each group's sum of x, lanes past a tail zero
  const uint8_t* codes;   // [N, K / 2]
  const uint16_t* scale;  // [N, G] float16 bits
  const uint16_t* offset; // [N, G] float16 bits, or null (symmetric)
  const float* x_scale;   // [M]
  float* y;               // [M, N]
  int64_t M, N, K, G, S;  // S: superblocks per row
};

// Groups in superblock s of a row of G groups.
inline int64_t LanesOf(int64_t s, int64_t G) { return std::min(kLanes, G - s * kLanes); }

// x rows in the order a superblock's steps read them: per superblock, per chunk c, the 4 g bytes
// that meet the chunk's low nibbles (inputs 32 l + 4 c + i), then the 4 g that meet its high ones.
void PermuteX(const int8_t* x, int8_t* xp, int32_t* x_sum, int64_t M, int64_t K, int64_t G,
              int64_t S) {
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xr = x + m * K;
    int8_t* out = xp + m * K;
    int32_t* sums = x_sum + m * S * kLanes;
    std::fill(sums, sums + S * kLanes, 0);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t g = LanesOf(s, G), g0 = s * kLanes;
      for (int64_t c = 0; c < 4; ++c)
        for (int64_t half = 0; half < 2; ++half)
          for (int64_t l = 0; l < g; ++l)
            for (int64_t i = 0; i < 4; ++i) *out++ = xr[kGroup * (g0 + l) + 16 * half + 4 * c + i];
      for (int64_t l = 0; l < g; ++l) {
        int32_t sum = 0;
        for (int64_t i = 0; i < kGroup; ++i) sum += xr[kGroup * (g0 + l) + i];
        sums[s * kLanes + l] = sum;
      }
    }
  }
}

#if JSPEC_Q4_VNNI

// Rows [n0, n0 + NR) of y for activation rows [m0, m0 + MR). Integer sums of a superblock in
// `dot`, float sums over superblocks in `acc`: NR * MR of each, so NR shrinks as MR grows to keep
// them all in the 32 vector registers. kOffset: codes unshifted, and each group adds
// offset * (its sum of x) after scale * dot, in that order.
template <bool kOffset, int NR, int MR>
inline void Block(const Operands& o, int64_t m0, int64_t n0) {
  const int64_t K = o.K, G = o.G, row_bytes = K / 2;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < o.S; ++s) {
    const int64_t g = LanesOf(s, G);
    const __mmask64 bytes = g == kLanes ? ~__mmask64(0) : (__mmask64(1) << (4 * g)) - 1;
    const __mmask16 lanes = __mmask16((1u << g) - 1);
    __m512i dot[NR][MR];
    for (int t = 0; t < MR; ++t) {  // symmetric: -8 * the group's sum of x pays for code - 8
      const __m512i init = kOffset ? _mm512_setzero_si512() : _mm512_mullo_epi32(
          _mm512_loadu_si512(o.x_sum + ((m0 + t) * o.S + s) * kLanes), _mm512_set1_epi32(-8));
      for (int r = 0; r < NR; ++r) dot[r][t] = init;
    }
    const uint8_t* codes[NR];
    for (int r = 0; r < NR; ++r) codes[r] = o.codes + (n0 + r) * row_bytes + s * 256;
    const int8_t* xs = o.xp + s * 512;
    for (int64_t c = 0; c < 4; ++c) {
      __m512i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(codes[r] + c * 4 * g + kPrefetchBytes),
                     _MM_HINT_T1);
        const __m512i v = _mm512_maskz_loadu_epi8(bytes, codes[r] + c * 4 * g);
        lo[r] = _mm512_and_si512(v, nib);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      for (int t = 0; t < MR; ++t) {
        const int8_t* xt = xs + (m0 + t) * K + c * 8 * g;
        const __m512i xl = _mm512_maskz_loadu_epi8(bytes, xt);
        const __m512i xh = _mm512_maskz_loadu_epi8(bytes, xt + 4 * g);
        for (int r = 0; r < NR; ++r) {
          dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[r], xl);
          dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[r], xh);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 scale = _mm512_cvtph_ps(
          _mm256_maskz_loadu_epi16(lanes, o.scale + (n0 + r) * G + s * kLanes));
      for (int t = 0; t < MR; ++t)
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), scale, acc[r][t]);
      if (kOffset) {
        const __m512 offset = _mm512_cvtph_ps(
            _mm256_maskz_loadu_epi16(lanes, o.offset + (n0 + r) * G + s * kLanes));
        for (int t = 0; t < MR; ++t)
          acc[r][t] = _mm512_fmadd_ps(  // the sum is exact in float: |sum| <= 32 * 127
              _mm512_cvtepi32_ps(_mm512_loadu_si512(o.x_sum + ((m0 + t) * o.S + s) * kLanes)),
              offset, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t)
      o.y[(m0 + t) * o.N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]) * o.x_scale[m0 + t];
}

constexpr int64_t kMaxTok = 5;

template <bool kOffset, int NR>
inline void BlockRows(const Operands& o, int64_t n0) {
  int64_t m0 = 0;
  for (; o.M - m0 > kMaxTok; m0 += 4) Block<kOffset, NR, 4>(o, m0, n0);
  switch (o.M - m0) {
    case 1: Block<kOffset, NR, 1>(o, m0, n0); break;
    case 2: Block<kOffset, NR, 2>(o, m0, n0); break;
    case 3: Block<kOffset, NR, 3>(o, m0, n0); break;
    case 4: Block<kOffset, NR, 4>(o, m0, n0); break;
    case 5: Block<kOffset, NR, 5>(o, m0, n0); break;
    default: break;
  }
}

template <bool kOffset>
void RowsOf(const Operands& o, int64_t n_begin, int64_t n_end) {
  // Four output rows share each x load where one or two tokens leave registers for them.
  int64_t n0 = n_begin;
  if (o.M <= 2)
    for (; n0 + 4 <= n_end; n0 += 4) BlockRows<kOffset, 4>(o, n0);
  for (; n0 + 2 <= n_end; n0 += 2) BlockRows<kOffset, 2>(o, n0);
  for (; n0 < n_end; ++n0) BlockRows<kOffset, 1>(o, n0);
}

void Rows(const Operands& o, int64_t n_begin, int64_t n_end) {
  if (o.offset)
    RowsOf<true>(o, n_begin, n_end);
  else
    RowsOf<false>(o, n_begin, n_end);
}

#else

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1F, frac = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (frac << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (frac << 13);
  } else if (frac == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    uint32_t e = 113, f = frac;
    while (!(f & 0x400)) f <<= 1, --e;
    bits = sign | (e << 23) | ((f & 0x3FF) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// The same sums in the same layout, one (m, n) at a time, lanes summed in a fixed order.
void Rows(const Operands& o, int64_t n_begin, int64_t n_end) {
  const int64_t K = o.K, G = o.G;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m = 0; m < o.M; ++m) {
      float acc[kLanes] = {};
      for (int64_t s = 0; s < o.S; ++s) {
        const int64_t g = LanesOf(s, G);
        const uint8_t* codes = o.codes + n * (K / 2) + s * 256;
        const int8_t* xs = o.xp + m * K + s * 512;
        for (int64_t l = 0; l < g; ++l) {
          const int32_t x_sum = o.x_sum[(m * o.S + s) * kLanes + l];
          int32_t dot = o.offset ? 0 : -8 * x_sum;
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t b = codes[c * 4 * g + 4 * l + i];
              dot += int32_t(b & 15) * xs[c * 8 * g + 4 * l + i];
              dot += int32_t(b >> 4) * xs[c * 8 * g + 4 * g + 4 * l + i];
            }
          acc[l] = std::fma(float(dot), HalfToFloat(o.scale[n * G + s * kLanes + l]), acc[l]);
          if (o.offset)
            acc[l] = std::fma(float(x_sum), HalfToFloat(o.offset[n * G + s * kLanes + l]),
                              acc[l]);
        }
      }
      for (int64_t width = kLanes / 2; width > 0; width /= 2)
        for (int64_t j = 0; j < width; ++j) acc[j] += acc[j + width];
      o.y[m * o.N + n] = acc[0] * o.x_scale[m];
    }
  }
}

#endif

// offset: null for the symmetric form, else [L, N, K / 32] float16 like scale.
ffi::Error Q4Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                 ffi::Buffer<ffi::F16> scale, const ffi::Buffer<ffi::F16>* offset,
                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 3 || xd[1] % kGroup != 0 ||
      cd[2] * 2 != xd[1] || sd[0] != cd[0] || sd[1] != cd[1] || sd[2] * kGroup != xd[1])
    return ffi::Error::InvalidArgument("jspec_q4_matmul: x [M, K], codes [L, N, K / 2], scale "
                                       "[L, N, K / 32], K a multiple of 32");
  if (offset) {
    const auto od = offset->dimensions();
    if (od.size() != 3 || od[0] != sd[0] || od[1] != sd[1] || od[2] != sd[2])
      return ffi::Error::InvalidArgument("jspec_q4_offset_matmul: offset [L, N, K / 32], the "
                                         "scale's shape");
  }
  const int64_t l = jspec::LayerOperand(layer, cd[0]);
  if (l < 0)
    return ffi::Error::InvalidArgument("jspec_q4_matmul: layer must be an int32 in [0, L)");
  Operands o;
  o.M = xd[0], o.N = cd[1], o.K = xd[1];
  o.G = o.K / kGroup, o.S = (o.G + kLanes - 1) / kLanes;
  // Per call O(M K) host work beside the O(N K) weights: negligible for a few tokens.
  std::vector<int8_t> xq(o.M * o.K), xp(o.M * o.K);
  std::vector<float> x_scale(o.M);
  std::vector<int32_t> x_sum(o.M * o.S * kLanes);
  jspec::QuantizeRows(x.typed_data(), xq.data(), x_scale.data(), o.M, o.K);
  PermuteX(xq.data(), xp.data(), x_sum.data(), o.M, o.K, o.G, o.S);
  o.x_scale = x_scale.data();
  o.xp = xp.data();
  o.x_sum = x_sum.data();
  o.codes = codes.typed_data() + l * o.N * (o.K / 2);
  o.scale = reinterpret_cast<const uint16_t*>(scale.typed_data()) + l * o.N * o.G;
  o.offset = offset ? reinterpret_cast<const uint16_t*>(offset->typed_data()) + l * o.N * o.G
                    : nullptr;
  o.y = y->typed_data();
  jspec::ParallelFor(pool, (o.N + kChunkRows - 1) / kChunkRows, [=](int64_t c) {
    Rows(o, c * kChunkRows, std::min(o.N, (c + 1) * kChunkRows));
  });
  return ffi::Error::Success();
}

ffi::Error Q4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                        ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> y) {
  return Q4Run(pool, x, codes, scale, nullptr, layer, y);
}

ffi::Error Q4OffsetMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> scale,
                              ffi::Buffer<ffi::F16> offset, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y) {
  return Q4Run(pool, x, codes, scale, &offset, layer, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecQ4Matmul, Q4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecQ4OffsetMatmul, Q4OffsetMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
