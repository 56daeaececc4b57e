// Helpers the native CPU kernels share (included by attention.cc and matmul.cc; native_build.py keys
// each build on this header too).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

// Tells the core this thread is spin-waiting (on another thread's share of a call's work).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// body(i) for every i in [0, n), on this thread and up to threads - 1 helpers on XLA's own CPU thread pool
// (starting threads per call cost more than a small call's work). Items are handed out from a shared
// counter. This thread works too and, once the counter runs dry, waits only for items others have taken: a
// helper the pool starts late (its threads busy with another op) finds nothing left and returns without
// calling body, so waiting never depends on the pool having a free thread.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t threads, const Body& body) {
  struct State {
    Body body;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(const Body& b, int64_t count) : body(b), n(count) {}
    void drain() {
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        body(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (n <= 0) return;
  auto state = std::make_shared<State>(body, n);  // outlives this call for helpers that start late
  for (int64_t i = 1; i < std::min(threads, n); ++i) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->done.load(std::memory_order_acquire) < n) spin_pause();
}
