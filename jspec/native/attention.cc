// Decode attention over the stacked KV cache for int8 decoding on CPU, called from XLA's FFI.
//
//   out[b, t, h] = sum_s p[s] v[l, b, s, h / G],  p = softmax_s(q[b, t, h] . k[l, b, s, h / G] / sqrt(D))
//
// over the slots s that visible[b, t, s] marks, for one layer l of k, v [L, B, S, K, D] (read in
// place: no per-layer copy). Every sum runs in one fixed order that depends on nothing but the
// visible slots themselves: q . k in 16 lanes over D then a fixed pairwise reduction, the softmax
// sum and p . v in increasing slot order. So a token scores the same bits in a one-token step and
// in a verification block of any size, over a cache of any size (invisible slots are skipped, not
// added as zeros), which int8 decoding needs: its activations are re-quantized to int8, where a
// last-bit difference can become a whole quantization step. XLA's attention gets the same
// guarantee only by attending one token at a time in products summed by halving (slow).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;

// q . k over D in kLanes lanes, then lanes summed pairwise in a fixed order.
inline float Dot(const float* q, const float* k, int64_t D) {
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += q[d + j] * k[d + j];
  for (int64_t j = 0; d < D; ++d, ++j) lane[j] += q[d] * k[d];
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}

struct Operands {
  const float *q, *k, *v;
  const bool* visible;
  float* out;
  int64_t B, T, H, S, K, D, layer;
};

// One (b, t, KV head): the query heads that share the KV head, against its visible slots. Each key
// and value row is read once for all of them; each head's sums are the same as if it ran alone.
void Item(const Operands& o, int64_t item) {
  const int64_t H = o.H, T = o.T, S = o.S, K = o.K, D = o.D, G = H / K;
  const int64_t kh = item % K, t = (item / K) % T, b = item / (K * T);
  const float* q0 = o.q + ((b * T + t) * H + kh * G) * D;  // head kh * G + g at q0 + g * D
  const bool* vis = o.visible + (b * T + t) * S;
  const int64_t row = ((o.layer * o.B + b) * S) * K + kh;  // slot s at (row + s * K) * D
  const float scale = 1.0f / std::sqrt(float(D));
  thread_local std::vector<float> p;  // [G, visible slots]
  thread_local std::vector<int32_t> slots;
  slots.clear();
  for (int64_t s = 0; s < S; ++s)
    if (vis[s]) slots.push_back(int32_t(s));
  const int64_t n = int64_t(slots.size());
  p.resize(G * n);
  for (int64_t i = 0; i < n; ++i) {
    const float* ks = o.k + (row + slots[i] * K) * D;
    for (int64_t g = 0; g < G; ++g) p[g * n + i] = Dot(q0 + g * D, ks, D) * scale;
  }
  float* out0 = o.out + ((b * T + t) * H + kh * G) * D;
  std::fill(out0, out0 + G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p.data() + g * n;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, pg[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      pg[i] = std::exp(pg[i] - m);
      sum += pg[i];
    }
    for (int64_t i = 0; i < n; ++i) pg[i] /= sum;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* vs = o.v + (row + slots[i] * K) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * n + i];
      float* out = out0 + g * D;
      for (int64_t d = 0; d < D; ++d) out[d] += w * vs[d];
    }
  }
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> visible, int64_t layer,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();  // [B, T, H, D]
  const auto kd = k.dimensions();  // [L, B, S, K, D]
  const auto md = visible.dimensions();  // [B, T, S]
  const auto vd = v.dimensions();
  bool same_kv = vd.size() == kd.size();
  for (size_t i = 0; same_kv && i < kd.size(); ++i) same_kv = vd[i] == kd[i];
  if (qd.size() != 4 || kd.size() != 5 || md.size() != 3 || !same_kv ||
      kd[1] != qd[0] || kd[4] != qd[3] || md[0] != qd[0] || md[1] != qd[1] || md[2] != kd[2] ||
      qd[2] % kd[3] != 0 || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument(
        "jspec_attention: q [B, T, H, D], k and v [L, B, S, K, D], visible [B, T, S], 0 <= layer < L");
  Operands o;
  o.q = q.typed_data();
  o.k = k.typed_data();
  o.v = v.typed_data();
  o.visible = visible.typed_data();
  o.out = out->typed_data();
  o.B = qd[0], o.T = qd[1], o.H = qd[2], o.D = qd[3];
  o.S = kd[2], o.K = kd[3], o.layer = layer;
  jspec::ParallelFor(pool, o.B * o.T * o.K, [=](int64_t item) { Item(o, item); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());
