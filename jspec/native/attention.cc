// Decode attention over the stacked KV cache for int8 decoding on CPU, called from XLA's FFI.
//
//   out[b, t, h] = sum_s p[s] v[l, b, s, h / G],  p = softmax_s(q[b, t, h] . k[l, b, s, h / G] / sqrt(D))
//
// over the slots s that visible[b, t, s] marks, for one layer l of k, v [L, B, S, K, D] (read in
// place: no per-layer copy). Every sum runs in one fixed order that depends on nothing but the
// visible slots themselves: q . k in 16 lanes over D then a fixed pairwise reduction, the softmax
// sum by rank among the visible slots, p . v in increasing slot order; e^x is computed lane-wise
// (AVX-512: a polynomial, `Exp`). So a token scores the same bits in a one-token step and
// in a verification block of any size, over a cache of any size (invisible slots are skipped, not
// added as zeros), which int8 decoding needs: its activations are re-quantized to int8, where a
// last-bit difference can become a whole quantization step. XLA's attention gets the same
// guarantee only by attending one token at a time in products summed by halving (slow).
//
// JspecAttentionMass also writes mass[b, t, s, kh] = (sum over the G query heads g of kh, in g
// order, of p_g[s]) / G, 0 where s is not visible: what attention-scored KV eviction adds up
// (`jspec.models.attention.attention_mass`), with the same bits for a token in any block, over
// any cache size, at no cost beyond the writes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxGroup = 64;  // query heads per KV head

struct Operands {
  const float *q, *k, *v;
  const bool* visible;
  float* out;
  float* mass;  // [B, T, S, K] or null
  int64_t B, T, H, S, K, D, layer;
};

// Item `item` = (b, t, KV head kh): its G query heads (head g's query at q + g * D, its output at
// out + g * D) and the key and value rows of the n slots it sees, in slot order. The row lists
// are the calling thread's and hold until its next call.
struct ItemRows {
  const float* q;
  float* out;
  int64_t G, n;
  const float* const* keys;
  const float* const* values;
  const int64_t* slots;  // the visible slots' indices, in order
};

inline ItemRows VisibleRows(const Operands& o, int64_t item) {
  const int64_t H = o.H, T = o.T, S = o.S, K = o.K, D = o.D, G = H / K;
  const int64_t kh = item % K, t = (item / K) % T, b = item / (K * T);
  const bool* vis = o.visible + (b * T + t) * S;
  const int64_t row = ((o.layer * o.B + b) * S) * K + kh;  // slot s at (row + s * K) * D
  thread_local std::vector<const float*> keys, values;
  thread_local std::vector<int64_t> slots;
  keys.clear(), values.clear(), slots.clear();
  for (int64_t s = 0; s < S; ++s)
    if (vis[s]) {
      keys.push_back(o.k + (row + s * K) * D);
      values.push_back(o.v + (row + s * K) * D);
      slots.push_back(s);
    }
  const int64_t first = ((b * T + t) * H + kh * G) * D;
  return {o.q + first, o.out + first, G, int64_t(keys.size()), keys.data(), values.data(),
          slots.data()};
}

// The item's row of mass (see the top): p_g[i] = e[g * n + i] * inv[g] of its visible slot i,
// summed over g in order, divided by G; the slots it does not see get 0.
inline void WriteMass(const Operands& o, int64_t item, const ItemRows& r, const float* e,
                      const float* inv) {
  const int64_t K = o.K, S = o.S, kh = item % K, bt = item / K;
  float* row = o.mass + bt * S * K + kh;  // slot s at row[s * K]
  for (int64_t s = 0; s < S; ++s) row[s * K] = 0.0f;
  for (int64_t i = 0; i < r.n; ++i) {
    float sum = 0.0f;
    for (int64_t g = 0; g < r.G; ++g) sum += e[g * r.n + i] * inv[g];
    row[r.slots[i] * K] = sum / float(r.G);
  }
}

#if defined(__AVX512F__)

// e^x in each lane (x <= 0 here: scores less their maximum): x = n ln2 + r with |r| <= ln2 / 2,
// e^r = 1 + r + r^2 P(r) (Cephes' expf polynomial, ~1 ulp), times 2^n by scalef, so very
// negative x gives 0 and NaN stays NaN. Lane-wise: a value's bits depend on nothing else.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Lanes of the 16-float chunk at d that lie below D.
inline __mmask16 Tail(int64_t d, int64_t D) {
  return D - d >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(D - d, 0)) - 1);
}

// q . k over D: 16 lanes of fused products in d order, then _mm512_reduce_add_ps's fixed halving.
template <int NS>
inline void Dots(const float* q, const float* const* k, int64_t D, float scale, float* out) {
  __m512 acc[NS];
  for (int j = 0; j < NS; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes) {
    const __mmask16 m = Tail(d, D);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
    for (int j = 0; j < NS; ++j)
      acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k[j] + d), acc[j]);
  }
  for (int j = 0; j < NS; ++j) out[j] = _mm512_reduce_add_ps(acc[j]) * scale;
}

constexpr int64_t kBlockSlots = 32;  // value rows a p . v pass keeps in L1 (16 KB at D = 128)
constexpr int64_t kMaxChunks = 8;    // 16-float chunks of one head's outputs held in registers

// acc[d0 + j] += sum_i w[i] v_i[d0 + j] for the NC chunks at d0 (masked past D), over `count`
// value rows in order.
template <int NC>
inline void PvTile(const float* const* values, const float* w, int64_t count, int64_t d0,
                   int64_t D, float* acc) {
  __mmask16 lanes[NC];
  __m512 a[NC];
  for (int c = 0; c < NC; ++c) {
    lanes[c] = Tail(d0 + c * kLanes, D);
    a[c] = _mm512_maskz_loadu_ps(lanes[c], acc + c * kLanes);
  }
  for (int64_t i = 0; i < count; ++i) {
    const __m512 wi = _mm512_set1_ps(w[i]);
    const float* v = values[i] + d0;
    for (int c = 0; c < NC; ++c)
      a[c] = _mm512_fmadd_ps(wi, _mm512_maskz_loadu_ps(lanes[c], v + c * kLanes), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_mask_storeu_ps(acc + c * kLanes, lanes[c], a[c]);
}

// One (b, t, KV head): the G query heads that share the KV head, against its n visible slots.
// Scores run 4 slots at a time with the heads inside and p . v over blocks of 32 slots, so each
// key and value row comes from memory once and is re-read by the other heads from L1 (re-read
// per head from L2 it was slower than the scalar loop this replaced). Each head's score of a slot
// is computed the same way whatever n or the slot's rank (4 slots share the loads, each with its
// own sum); the softmax normaliser sums exponentials in 16 lanes by rank among the
// visible slots; p . v sums over the visible slots in slot order. So a token's result depends
// only on its query and its visible slots.
void Item(const Operands& o, int64_t item) {
  const ItemRows r = VisibleRows(o, item);
  const int64_t G = r.G, n = r.n, D = o.D;
  const float scale = 1.0f / std::sqrt(float(D));
  thread_local std::vector<float> p, acc;  // [G, n]: scores, then exponentials; [G, D] sums
  p.resize(G * n);
  acc.assign(G * D, 0.0f);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int64_t g = 0; g < G; ++g) Dots<4>(r.q + g * D, r.keys + i, D, scale, &p[g * n + i]);
  for (; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) Dots<1>(r.q + g * D, r.keys + i, D, scale, &p[g * n + i]);
  float inv[kMaxGroup];  // 1 / each head's softmax normaliser
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p.data() + g * n;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (i = 0; i < n; i += kLanes)
      top = _mm512_mask_max_ps(top, Tail(i, n), top, _mm512_maskz_loadu_ps(Tail(i, n), pg + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (i = 0; i < n; i += kLanes) {
      const __mmask16 lanes = Tail(i, n);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, pg + i), m);
      const __m512 e = _mm512_maskz_mov_ps(lanes, Exp(x));
      _mm512_mask_storeu_ps(pg + i, lanes, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[g] = n > 0 ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;  // no visible slot: zeros
  }
  if (o.mass) WriteMass(o, item, r, p.data(), inv);
  // p . v over blocks of slots whose value rows stay in L1, the sums of one head's 16 x NC
  // outputs in registers across a block.
  for (int64_t i0 = 0; i0 < n; i0 += kBlockSlots) {
    const int64_t count = std::min(kBlockSlots, n - i0);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += kMaxChunks * kLanes) {
        const float* w = p.data() + g * n + i0;
        float* a = acc.data() + g * D + d0;
        switch (std::min<int64_t>(kMaxChunks, (D - d0 + kLanes - 1) / kLanes)) {
          case 1: PvTile<1>(r.values + i0, w, count, d0, D, a); break;
          case 2: PvTile<2>(r.values + i0, w, count, d0, D, a); break;
          case 3: PvTile<3>(r.values + i0, w, count, d0, D, a); break;
          case 4: PvTile<4>(r.values + i0, w, count, d0, D, a); break;
          case 5: PvTile<5>(r.values + i0, w, count, d0, D, a); break;
          case 6: PvTile<6>(r.values + i0, w, count, d0, D, a); break;
          case 7: PvTile<7>(r.values + i0, w, count, d0, D, a); break;
          default: PvTile<8>(r.values + i0, w, count, d0, D, a); break;
        }
      }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += kLanes) {
      const __mmask16 lanes = Tail(d, D);
      _mm512_mask_storeu_ps(r.out + g * D + d, lanes, _mm512_mul_ps(
          _mm512_maskz_loadu_ps(lanes, acc.data() + g * D + d), _mm512_set1_ps(inv[g])));
    }
}

#else

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

// One (b, t, KV head): the query heads that share the KV head, against its visible slots. Each key
// and value row is read once for all of them; each head's sums are the same as if it ran alone.
void Item(const Operands& o, int64_t item) {
  const ItemRows r = VisibleRows(o, item);
  const int64_t G = r.G, n = r.n, D = o.D;
  const float scale = 1.0f / std::sqrt(float(D));
  thread_local std::vector<float> p;  // [G, visible slots]
  p.resize(G * n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) p[g * n + i] = Dot(r.q + g * D, r.keys[i], D) * scale;
  std::fill(r.out, r.out + G * D, 0.0f);
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
  if (o.mass) {
    float ones[kMaxGroup];
    std::fill(ones, ones + G, 1.0f);
    WriteMass(o, item, r, p.data(), ones);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* vs = r.values[i];
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * n + i];
      float* out = r.out + g * D;
      for (int64_t d = 0; d < D; ++d) out[d] += w * vs[d];
    }
  }
}

#endif

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> visible,
                  ffi::Buffer<ffi::S32> layer_operand, ffi::ResultBuffer<ffi::F32> out,
                  float* mass) {
  const auto qd = q.dimensions();  // [B, T, H, D]
  const auto kd = k.dimensions();  // [L, B, S, K, D]
  const auto md = visible.dimensions();  // [B, T, S]
  const auto vd = v.dimensions();
  bool same_kv = vd.size() == kd.size();
  const int64_t layer = kd.size() == 5 ? jspec::LayerOperand(layer_operand, kd[0]) : -1;
  for (size_t i = 0; same_kv && i < kd.size(); ++i) same_kv = vd[i] == kd[i];
  if (qd.size() != 4 || kd.size() != 5 || md.size() != 3 || !same_kv ||
      kd[1] != qd[0] || kd[4] != qd[3] || md[0] != qd[0] || md[1] != qd[1] || md[2] != kd[2] ||
      qd[2] % kd[3] != 0 || qd[2] / kd[3] > kMaxGroup || layer < 0)
    return ffi::Error::InvalidArgument(
        "jspec_attention: q [B, T, H, D], k and v [L, B, S, K, D], visible [B, T, S], "
        "0 <= layer < L, at most 64 query heads per KV head");
  Operands o;
  o.q = q.typed_data();
  o.k = k.typed_data();
  o.v = v.typed_data();
  o.visible = visible.typed_data();
  o.out = out->typed_data();
  o.mass = mass;
  o.B = qd[0], o.T = qd[1], o.H = qd[2], o.D = qd[3];
  o.S = kd[2], o.K = kd[3], o.layer = layer;
  jspec::ParallelFor(pool, o.B * o.T * o.K, [=](int64_t item) { Item(o, item); });
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> visible,
                         ffi::Buffer<ffi::S32> layer_operand, ffi::ResultBuffer<ffi::F32> out) {
  return Attend(pool, q, k, v, visible, layer_operand, out, nullptr);
}

ffi::Error AttentionMassImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::S32> layer_operand,
                             ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> mass) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mass->dimensions();
  if (md.size() != 4 || qd.size() != 4 || kd.size() != 5 || md[0] != qd[0] || md[1] != qd[1] ||
      md[2] != kd[2] || md[3] != kd[3])
    return ffi::Error::InvalidArgument("jspec_attention_mass: mass [B, T, S, K]");
  return Attend(pool, q, k, v, visible, layer_operand, out, mass->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecAttentionMass, AttentionMassImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
