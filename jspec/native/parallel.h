// Work split over XLA's intra-op thread pool, shared by jspec's native kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jspec {

// Runs body(i) for every i in [0, count) on the calling thread and the pool's threads, handing
// items out by an atomic counter, and returns when all are done. The calling thread takes items
// too, so it finishes even when no pool thread is free. The state is shared: a pool task that
// starts after the call returned finds no item left and touches nothing else.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, Body body) {
  struct State {
    explicit State(Body b) : body(std::move(b)) {}
    Body body;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t count = 0;
    void Run() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
        body(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(body));
  state->count = count;
  // One helper fewer than the pool has threads: with the calling thread that fills the cores.
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->Run(); });
  state->Run();
  while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

// The layer a call reads out of weights stacked on a leading [L] axis (stacked layers run as one
// loop whose layer index is a traced scalar; unstacked weights come as [1, ...] with layer 0).
// -1 when the operand is not an int32 scalar in [0, L).
inline int64_t LayerOperand(xla::ffi::Buffer<xla::ffi::S32> layer, int64_t L) {
  if (layer.dimensions().size() != 0) return -1;
  const int64_t l = layer.typed_data()[0];
  return 0 <= l && l < L ? l : -1;
}

}  // namespace jspec
