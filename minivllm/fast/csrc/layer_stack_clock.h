// Where a step's time goes inside decode_layers, phase by phase: `minivllm bench latency`
// prints it ("inside the layer stack"), from decode_layers_timing(). A batch-1 step is one
// C++ call, so neither torch's profiler nor an op range sees into it.
//
// Off by default. When on, each phase boundary reads the steady clock (~20 ns; ~11 a
// layer) and adds the time since the previous boundary to the phase just ended; the
// call's totals are added to the process's at its end. The phases run their kernels
// exactly as when it is off, so the results are the same bits.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace minivllm {
namespace stack_clock {

enum Phase : int {
  NORM,           // the embedding lookup, then each layer's input norm (residual add)
  QKV,            // the qkv projection (its LoRA delta included, as for every projection)
  ROPE_CACHE,     // rotary embedding, K and V written into the paged cache
  ATTENTION,      // paged attention
  O_PROJ,         // the output projection
  POST_NORM,      // residual add + post-attention norm
  GATE_UP,        // the gate and up projections
  ACT,            // silu_and_mul
  DOWN,           // the down projection
  FINAL_NORM,     // the final norm
  LM_HEAD,        // the LM head on the rows to sample
  NUM_PHASES
};
constexpr const char* PHASE_NAMES[NUM_PHASES] = {
    "norm", "qkv", "rope + cache write", "attention", "o", "post-attention norm",
    "gate_up", "silu_and_mul", "down", "final norm", "lm head"};

struct Totals {
  std::atomic<bool> on{false};  // read without the lock: every decode step asks it
  std::mutex mutex;             // the sums below
  int64_t calls = 0;
  std::array<double, NUM_PHASES> seconds{};
};

inline Totals& totals() {
  static Totals t;
  return t;
}

// One call's clock: tick(p) ends phase p. Does nothing unless timing was on at its start.
class Clock {
 public:
  Clock() : on_(totals().on.load(std::memory_order_relaxed)) {
    if (on_) last_ = now();
  }
  void tick(Phase p) {
    if (!on_) return;
    const double t = now();
    seconds_[p] += t - last_;
    last_ = t;
  }
  ~Clock() {
    if (!on_) return;
    Totals& t = totals();
    std::lock_guard<std::mutex> lock(t.mutex);
    ++t.calls;
    for (int p = 0; p < NUM_PHASES; ++p) t.seconds[p] += seconds_[p];
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  bool on_ = false;
  double last_ = 0.0;
  std::array<double, NUM_PHASES> seconds_{};
};

}  // namespace stack_clock

// [calls, seconds of each phase...] since the last read; then timing on or off (`enable`)
// and the totals cleared.
inline std::vector<double> decode_layers_timing(bool enable) {
  stack_clock::Totals& t = stack_clock::totals();
  std::lock_guard<std::mutex> lock(t.mutex);
  std::vector<double> out{static_cast<double>(t.calls)};
  out.insert(out.end(), t.seconds.begin(), t.seconds.end());
  t.on.store(enable, std::memory_order_relaxed);
  t.calls = 0;
  t.seconds.fill(0.0);
  return out;
}

inline std::vector<std::string> decode_layers_phases() {
  return {std::begin(stack_clock::PHASE_NAMES), std::end(stack_clock::PHASE_NAMES)};
}

}  // namespace minivllm
