// float32 matmul for CPU decoding, called from XLA through its FFI.
//
//   jspec_f32_linear: y[m, n] = sum_k x[m, k] * w[n, k]   x: [M, K], w: [N, K], y: [M, N] float32
//
// Why not XLA's dot: at 2-8 rows (a verification block) XLA:CPU's float32 dot streams its weights
// at ~20 GB/s where its 1-row path reads ~31-44 (`benchmarks/issue20_f32_width_cpu.json`), so a
// block of 4 tokens cost 1.50 one-token steps on the default model: width ate what speculation won.
// Weights are stored output-major ([N, K], each output channel contiguous) as for the int8 kernel,
// and a pass of up to 8 activation rows reads each weight byte once.
//
// Every y[m, n] is summed in one fixed order: 16 lane partial sums over k (k mod 16 picks the
// lane, k ascending within a lane, fused multiply-adds), then a fixed reduction of the lanes. The
// order does not depend on M, on which rows share a pass or on the thread split, so a token gets
// the same bits in a one-token step and in a verification block: with the native attention
// (attention.cc) greedy chains are token-identical to autoregressive decoding by construction.
//
// Paths (chosen when the library is compiled, with -march=native): AVX-512; otherwise a loop over
// 16 explicit lanes that the compiler vectorizes (AVX2, NEON, ...) with the same per-lane order.
// Work is split over output-row chunks on XLA's intra-op thread pool (parallel.h); with many rows
// (a prefill) a chunk's weights stay in cache while every pass of 8 rows reads them.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define JSPEC_F32_AVX512 1
#else
#define JSPEC_F32_AVX512 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;      // partial sums per output
constexpr int64_t kMaxTok = 8;      // activation rows per pass over a weight row block
constexpr int64_t kChunkRows = 32;  // output rows per unit of work handed to a thread
// How far ahead a weight row is prefetched: 0, 2, 8 and 32 KB measured, 8 KB best at 8 rows
// (21 vs 15-19 GB/s), the rest within this VM's noise.
constexpr int64_t kPrefetchFloats = 8192 / 4;

#if JSPEC_F32_AVX512

// y[m0 + t, n0 + r] for t < MR, r < NR: NR weight rows loaded once per 16 inputs, shared by MR
// activation rows; NR * MR accumulators in registers.
template <int NR, int MR>
inline void Block(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m0,
                  int64_t n0) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + (n0 + r) * K;
  const float* xr[MR];
  for (int t = 0; t < MR; ++t) xr[t] = x + (m0 + t) * K;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) {
      // The same row of the next row block: rows are short (2.3 KB at K = 576) and the hardware
      // prefetcher ramps up too late on them.
      _mm_prefetch(reinterpret_cast<const char*>(wr[r] + kPrefetchFloats + k), _MM_HINT_T0);
      wv[r] = _mm512_loadu_ps(wr[r] + k);
    }
    for (int t = 0; t < MR; ++t) {
      const __m512 xv = _mm512_loadu_ps(xr[t] + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if (k < K) {  // lanes past K load as 0 in x and w
    const __mmask16 mask = __mmask16((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, wr[r] + k);
    for (int t = 0; t < MR; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[t] + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) y[(m0 + t) * N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#else

template <int NR, int MR>
inline void Block(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m0,
                  int64_t n0) {
  for (int r = 0; r < NR; ++r) {
    const float* wr = w + (n0 + r) * K;
    for (int t = 0; t < MR; ++t) {
      const float* xr = x + (m0 + t) * K;
      float lane[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes)
        for (int l = 0; l < kLanes; ++l) lane[l] += wr[k + l] * xr[k + l];
      for (int l = 0; k + l < K; ++l) lane[l] += wr[k + l] * xr[k + l];
      for (int width = kLanes / 2; width > 0; width /= 2)  // a fixed tree over the lanes
        for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
      y[(m0 + t) * N + n0 + r] = lane[0];
    }
  }
}

#endif

template <int NR>
inline void BlockRows(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t M,
                      int64_t n0) {
  int64_t m0 = 0;
  for (; M - m0 > kMaxTok; m0 += kMaxTok) Block<NR, kMaxTok>(x, w, y, N, K, m0, n0);
  switch (M - m0) {
    case 1: Block<NR, 1>(x, w, y, N, K, m0, n0); break;
    case 2: Block<NR, 2>(x, w, y, N, K, m0, n0); break;
    case 3: Block<NR, 3>(x, w, y, N, K, m0, n0); break;
    case 4: Block<NR, 4>(x, w, y, N, K, m0, n0); break;
    case 5: Block<NR, 5>(x, w, y, N, K, m0, n0); break;
    case 6: Block<NR, 6>(x, w, y, N, K, m0, n0); break;
    case 7: Block<NR, 7>(x, w, y, N, K, m0, n0); break;
    case 8: Block<NR, 8>(x, w, y, N, K, m0, n0); break;
    default: break;
  }
}

// Output rows [n_begin, n_end) for every activation row.
void Rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
          int64_t n_begin, int64_t n_end) {
  int64_t n0 = n_begin;
  if (M <= 4)
    for (; n0 + 4 <= n_end; n0 += 4) BlockRows<4>(x, w, y, N, K, M, n0);
  else
    for (; n0 + 3 <= n_end; n0 += 3) BlockRows<3>(x, w, y, N, K, M, n0);
  for (; n0 + 2 <= n_end; n0 += 2) BlockRows<2>(x, w, y, N, K, M, n0);
  for (; n0 < n_end; ++n0) BlockRows<1>(x, w, y, N, K, M, n0);
}

ffi::Error F32LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2])
    return ffi::Error::InvalidArgument("jspec_f32_linear: x must be [M, K] and w [L, N, K]");
  const int64_t l = jspec::LayerOperand(layer, wd[0]);
  if (l < 0)
    return ffi::Error::InvalidArgument("jspec_f32_linear: layer must be an int32 in [0, L)");
  const int64_t M = xd[0], N = wd[1], K = xd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + l * N * K;
  float* yp = y->typed_data();
  jspec::ParallelFor(pool, (N + kChunkRows - 1) / kChunkRows, [=](int64_t c) {
    Rows(xp, wp, yp, M, N, K, c * kChunkRows, std::min(N, (c + 1) * kChunkRows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecF32Linear, F32LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int JspecF32LinearPath() { return JSPEC_F32_AVX512 ? 1 : 0; }
