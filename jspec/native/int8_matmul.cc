// int8 x int8 matmuls for CPU decoding, called from XLA through its FFI.
//
//   jspec_int8_matmul: y[m, n] = sum_k x[m, k] * w[n, k]   x: [M, K] int8, w: [N, K] int8, y int32
//   jspec_int8_linear: the same sums for float32 x quantized per row here (quantize.h), returned as
//                      float32 y[m, n] = sum * x_scale[m] * w_scale[n]: what a model's projection
//                      needs, with no XLA work around the call.
//
// Weights are stored output-major ([N, K], each output channel's row contiguous), so a few rows of
// activations (a decode step: 1; a verification block: gamma + 1) stream every weight byte once,
// at memory speed: XLA:CPU's int8 dot reaches 3-13 GB/s at these shapes, this kernel is meant for
// the machine's read bandwidth. Integer sums are exact, so the result does not depend on the order
// of the additions, on M, or on how the rows are split among threads: a token scores the same bits
// in a one-token step and in a block (what greedy speculative identity needs).
//
// Paths (chosen when the library is compiled, with -march=native):
//   AVX512-VNNI: vpdpbusd on (w + 128) as uint8 times x as int8, corrected by 128 * sum_k x[m, k];
//   otherwise a plain loop the compiler vectorizes (AVX2, NEON, ...).
// Work is split over output-row chunks on XLA's intra-op thread pool (parallel.h).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "quantize.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define JSPEC_VNNI 1
#else
#define JSPEC_VNNI 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowBlock = 4;   // output rows sharing one pass over a row block of x
constexpr int64_t kChunkRows = 32; // output rows per unit of work handed to a thread

// Where results go: the exact int32 sums (`yi`), or float32 sums * x_scale[m] * w_scale[n] (`yf`,
// jspec_int8_linear: the product in the order `quant.einsum` takes it).
struct Out {
  int32_t* yi = nullptr;
  float* yf = nullptr;
  const float* x_scale = nullptr;
  const float* w_scale = nullptr;
  int64_t N = 0;
  void Set(int64_t m, int64_t n, int32_t v) const {
    if (yf)
      yf[m * N + n] = float(v) * x_scale[m] * w_scale[n];
    else
      yi[m * N + n] = v;
  }
};

#if JSPEC_VNNI

// Rows [n0, n0 + NR) of y for activation rows [m0, m0 + MR). vpdpbusd multiplies uint8 by int8, so
// the weights enter as w + 128 (a xor of the sign bit, once per loaded block, shared by every
// activation row) and y = (w + 128) . x - 128 * sum_k x, with the activation sums `x_sums`
// computed once per call. Fixed NR and MR keep every accumulator in a register.
template <int NR, int MR>
inline void Block(const int8_t* x, const int8_t* w, const Out& y, const int32_t* x_sums, int64_t K,
                  int64_t m0, int64_t n0) {
  __m512i acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) acc[r][t] = _mm512_setzero_si512();
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  const int8_t* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + (n0 + r) * K;
  const int8_t* xr[MR];
  for (int t = 0; t < MR; ++t) xr[t] = x + (m0 + t) * K;
  // Plain loops, no lambda over the accumulators: GCC kept a captured acc array in memory and
  // stored it every step, which halved the speed of a 5-token block.
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) {
      // The same row of the next block: the hardware prefetcher ramps up too late on short rows.
      _mm_prefetch(reinterpret_cast<const char*>(wr[r] + NR * K + k), _MM_HINT_T1);
      wv[r] = _mm512_xor_si512(_mm512_loadu_si512(wr[r] + k), sign);
    }
    for (int t = 0; t < MR; ++t) {
      const __m512i xv = _mm512_loadu_si512(xr[t] + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wv[r], xv);
    }
  }
  if (k < K) {  // lanes past K load as 0 in x and w, so they add nothing
    const __mmask64 mask = (__mmask64(1) << (K - k)) - 1;
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r)
      wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wr[r] + k), sign);
    for (int t = 0; t < MR; ++t) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, xr[t] + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wv[r], xv);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t)
      y.Set(m0 + t, n0 + r, _mm512_reduce_add_epi32(acc[r][t]) - 128 * x_sums[m0 + t]);
}

// Every activation row, in passes of at most kMaxTok rows (a verification block of gamma + 1 <= 8
// rows reads its weights once; with two output rows a block, 8 x 2 accumulators fit in registers).
constexpr int64_t kMaxTok = 8;

template <int NR>
inline void BlockRows(const int8_t* x, const int8_t* w, const Out& y, const int32_t* x_sums,
                      int64_t K, int64_t M, int64_t n0) {
  int64_t m0 = 0;
  for (; M - m0 > kMaxTok; m0 += kMaxTok) Block<NR, kMaxTok>(x, w, y, x_sums, K, m0, n0);
  switch (M - m0) {
    case 1: Block<NR, 1>(x, w, y, x_sums, K, m0, n0); break;
    case 2: Block<NR, 2>(x, w, y, x_sums, K, m0, n0); break;
    case 3: Block<NR, 3>(x, w, y, x_sums, K, m0, n0); break;
    case 4: Block<NR, 4>(x, w, y, x_sums, K, m0, n0); break;
    case 5: Block<NR, 5>(x, w, y, x_sums, K, m0, n0); break;
    case 6: Block<NR, 6>(x, w, y, x_sums, K, m0, n0); break;
    case 7: Block<NR, 7>(x, w, y, x_sums, K, m0, n0); break;
    case 8: Block<NR, 8>(x, w, y, x_sums, K, m0, n0); break;
    default: break;
  }
}

// Output rows [n_begin, n_end) for every activation row.
void Rows(const int8_t* x, const int8_t* w, const Out& y, const int32_t* x_sums, int64_t M,
          int64_t K, int64_t n_begin, int64_t n_end) {
  int64_t n0 = n_begin;
  if (M <= 2)  // four output rows share each x load; with more tokens, two leave registers free
    for (; n0 + kRowBlock <= n_end; n0 += kRowBlock)
      BlockRows<kRowBlock>(x, w, y, x_sums, K, M, n0);
  for (; n0 + 2 <= n_end; n0 += 2) BlockRows<2>(x, w, y, x_sums, K, M, n0);
  for (; n0 < n_end; ++n0) BlockRows<1>(x, w, y, x_sums, K, M, n0);
}

#else

void Rows(const int8_t* x, const int8_t* w, const Out& y, const int32_t*, int64_t M, int64_t K,
          int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* wr = w + n * K;
    for (int64_t t = 0; t < M; ++t) {
      const int8_t* xr = x + t * K;
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int32_t(xr[k]) * int32_t(wr[k]);
      y.Set(t, n, s);
    }
  }
}

#endif

// sum_k x[m, k] for the VNNI path's +128 correction.
std::vector<int32_t> RowSums(const int8_t* x, int64_t M, int64_t K) {
  std::vector<int32_t> sums(M, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) sums[m] += x[m * K + k];
  return sums;
}

void Run(ffi::ThreadPool& pool, const int8_t* x, const int8_t* w, const Out& y, int64_t M,
         int64_t N, int64_t K) {
  const std::vector<int32_t> x_sums = RowSums(x, M, K);
  const int32_t* sums = x_sums.data();
  jspec::ParallelFor(pool, (N + kChunkRows - 1) / kChunkRows, [=](int64_t c) {
    Rows(x, w, y, sums, M, K, c * kChunkRows, std::min(N, (c + 1) * kChunkRows));
  });
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                          ffi::ResultBuffer<ffi::S32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("jspec_int8_matmul: x must be [M, K] and w [N, K]");
  Out out;
  out.yi = y->typed_data();
  out.N = wd[0];
  Run(pool, x.typed_data(), w.typed_data(), out, xd[0], wd[0], xd[1]);
  return ffi::Error::Success();
}

// float32 x in, float32 y out: x quantized per row here (quantize.h), then the exact int8 sums
// scaled by x's and w's scales.
ffi::Error Int8LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = w_scale.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2] || sd.size() != 2 || sd[0] != wd[0] ||
      sd[1] != wd[1])
    return ffi::Error::InvalidArgument(
        "jspec_int8_linear: x must be [M, K], w [L, N, K] and w_scale [L, N]");
  const int64_t l = jspec::LayerOperand(layer, wd[0]);
  if (l < 0)
    return ffi::Error::InvalidArgument("jspec_int8_linear: layer must be an int32 in [0, L)");
  const int64_t M = xd[0], N = wd[1], K = xd[1];
  std::vector<int8_t> xq(M * K);
  std::vector<float> x_scale(M);
  jspec::QuantizeRows(x.typed_data(), xq.data(), x_scale.data(), M, K);
  Out out;
  out.yf = y->typed_data();
  out.x_scale = x_scale.data();
  out.w_scale = w_scale.typed_data() + l * N;
  out.N = N;
  Run(pool, xq.data(), w.typed_data() + l * N * K, out, M, N, K);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecInt8Linear, Int8LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int JspecInt8MatmulPath() { return JSPEC_VNNI ? 1 : 0; }
