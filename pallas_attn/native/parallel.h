// Work shared between the calling thread and XLA's intra-op thread pool (the FFI ThreadPool).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace pallas_attn {

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Runs fn(begin, end) over [0, n) in chunks claimed from a counter by the calling thread and
// pool tasks; returns when every chunk is done. A task that starts after every chunk is claimed
// touches nothing of the caller's, so the call may return before such a task runs (the shared
// state stays alive through the shared_ptr). One thread when `parallel` is false.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, bool parallel, const F& fn) {
  const int64_t threads = parallel ? pool.num_threads() : 1;
  if (threads <= 1 || n < 2) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  struct Job {
    std::atomic<int64_t> next{0}, done{0};
    int64_t chunks = 0, per_chunk = 0, n = 0;
    const F* fn = nullptr;
    void work() {
      for (;;) {
        const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
        if (c >= chunks) return;
        const int64_t b = c * per_chunk, e = b + per_chunk < n ? b + per_chunk : n;
        (*fn)(b, e);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto job = std::make_shared<Job>();
  job->n = n;
  job->fn = &fn;
  job->chunks = n < 4 * threads ? n : 4 * threads;
  job->per_chunk = (n + job->chunks - 1) / job->chunks;
  job->chunks = (n + job->per_chunk - 1) / job->per_chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) relax();
}

}  // namespace pallas_attn
