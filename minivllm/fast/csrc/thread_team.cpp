// The persistent thread team behind minivllm::parallel_for (thread_team.h).
//
// One loop at a time is a *job*: a function, a context and a number of chunks.
// The caller publishes it in one 64-bit word, `claim_` = (chunks << 32) | next,
// wakes the helpers, and claims chunks like any helper: every thread runs
//
//     v = claim_.fetch_add(1); if (v's next < v's chunks) run chunk `next`, count it done
//
// until the chunks run out. Keeping the count of chunks in the same word as the
// counter means a helper that wakes late (after the job it was woken for has
// ended) can never run a chunk of the wrong job: its fetch_add either lands in an
// exhausted job and claims nothing, or in the next job, whose chunk it then runs
// as well as anyone. So no thread ever waits for a particular other thread.
//
// The caller returns when the count of finished chunks reaches the job's chunks.
// It spins for CALLER_SPIN first (a running helper finishes a chunk in
// microseconds), then sleeps (a condition variable): a helper preempted mid-chunk
// by another process is then moved by the scheduler onto the core the caller
// freed, instead of waiting for its own core. Idle helpers spin for HELPER_SPIN
// (the gaps between the ops of a decode step are microseconds), then sleep until
// the next job. A sleeper counts itself in `sleepers_` before it looks a last
// time; a waker changes the state, then looks at the count, and only then takes
// the lock to notify (both sides sequentially consistent, so one of them sees the
// other): no wake-up is lost, and none is paid for while everyone is awake.
//
// When is a second thread worth it? At batch 1 a decode step streams weights from
// memory, and one thread alone gets most of the bandwidth two would (about 85% on
// the 2-core machine of docs/threads.md). With another process on the second
// core, the helper runs in slices between that process's, and every time it is
// preempted holding a chunk the caller waits for it (milliseconds), which costs
// more than the helper ever gives. So the team watches for that: a job whose
// caller waited for the others' last chunks more than LATE_MIN and more than
// LATE_FACTOR times its own chunks took is *late*. A second late job within
// LATE_WINDOW of the first (a quiet machine has a rare blip; a busy core makes
// them every few milliseconds) sends the jobs of the next SOLO_FOR to the caller
// alone (the helpers sleep); then the team tries again. On a quiet machine every
// job uses the whole team.
#include "thread_team.h"

#include <ATen/core/Tensor.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace minivllm {
namespace {

using Clock = std::chrono::steady_clock;
// How long an idle helper looks for the next job before it sleeps.
constexpr auto HELPER_SPIN = std::chrono::microseconds(100);
// How long the caller waits for the last chunks awake before it sleeps.
constexpr auto CALLER_SPIN = std::chrono::microseconds(30);
// A late job (see above) and how long the jobs after it run on the caller alone.
constexpr auto LATE_MIN = std::chrono::microseconds(200);
constexpr int64_t LATE_FACTOR = 4;
constexpr auto LATE_WINDOW = std::chrono::milliseconds(100);
constexpr auto SOLO_FOR = std::chrono::milliseconds(200);

// "adaptive" (the default): the team, and the caller alone for a while after a late
// job; "team": the team always; "openmp": at::parallel_for.
enum class Mode { ADAPTIVE, TEAM, OPENMP };
std::atomic<Mode> mode{Mode::ADAPTIVE};

// Jobs run by the team, jobs run by the caller alone, late jobs (cpu_team_stats).
std::atomic<int64_t> team_jobs{0}, solo_jobs{0}, late_jobs{0};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spin until pred() or `budget` has passed; true if pred() came true.
template <typename Pred>
bool spin_until(Pred pred, Clock::duration budget) {
  const auto deadline = Clock::now() + budget;
  for (int i = 1;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if (i % 64 == 0 && Clock::now() > deadline) return pred();
  }
}

// Inside a chunk (or on a helper thread): a nested parallel_for runs inline.
thread_local bool in_team = false;

class Team {
 public:
  explicit Team(int64_t threads) : threads_(threads) {
    for (int64_t t = 1; t < threads; ++t) helpers_.emplace_back([this] { helper_main(); });
  }

  ~Team() {  // only when the thread count changes: stop and join the helpers
    stop_.store(true);
    epoch_.fetch_add(1);
    wake();
    for (std::thread& h : helpers_) h.join();
  }

  int64_t threads() const { return threads_; }

  void run(int64_t chunks, ChunkFn fn, const void* ctx, bool adaptive) {
    const auto start = Clock::now();
    if (adaptive && start < solo_until_) {  // a job was late a moment ago: run alone
      solo_jobs.fetch_add(1, std::memory_order_relaxed);
      for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
      return;
    }
    team_jobs.fetch_add(1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    error_ = nullptr;
    // Publish: the release store orders the fields above before any claim of this job.
    claim_.store(static_cast<uint64_t>(chunks) << 32, std::memory_order_release);
    epoch_.fetch_add(1);  // sequentially consistent: see wake()
    wake();

    const int64_t mine = work();
    const auto claimed = Clock::now();  // no chunk left to claim: wait for the others'
    const auto all_done = [&] { return done_.load() == chunks; };
    if (!spin_until(all_done, CALLER_SPIN)) sleep_until(all_done);
    const auto waited = Clock::now() - claimed;
    if (mine > 0 && waited > LATE_MIN && waited > LATE_FACTOR * (claimed - start) / mine) {
      late_jobs.fetch_add(1, std::memory_order_relaxed);
      const auto now = Clock::now();
      if (now - last_late_ < LATE_WINDOW) solo_until_ = now + SOLO_FOR;
      last_late_ = now;
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Claim and run chunks of whatever job is published, until none is left; how many.
  int64_t work() {
    for (int64_t ran = 0;; ++ran) {
      const uint64_t v = claim_.fetch_add(1, std::memory_order_acq_rel);
      const int64_t chunk = static_cast<int64_t>(v & 0xffffffffu);
      const int64_t chunks = static_cast<int64_t>(v >> 32);
      if (chunk >= chunks) return ran;
      try {
        fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), chunk);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1) + 1 == chunks) wake();
    }
  }

  // Sleep until pred() (a look at the atomics that wake() is called after changing).
  template <typename Pred>
  void sleep_until(Pred pred) {
    sleepers_.fetch_add(1);
    {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      wake_.wait(lock, pred);
    }
    sleepers_.fetch_sub(1);
  }

  // After changing what a sleeper waits for: wake every sleeper, if there is one.
  void wake() {
    if (sleepers_.load() == 0) return;
    { std::lock_guard<std::mutex> lock(sleep_mutex_); }  // a sleeper is in wait() or sees it
    wake_.notify_all();
  }

  void helper_main() {
    in_team = true;
    // Not epoch_'s value now: a helper that starts late (after jobs, or after ~Team
    // has asked it to stop) must see that the epoch moved, not sleep through it.
    uint32_t seen = 0;
    for (;;) {
      const auto new_job = [&] { return epoch_.load() != seen; };
      if (!spin_until(new_job, HELPER_SPIN)) sleep_until(new_job);
      seen = epoch_.load();
      if (stop_.load()) return;
      work();
    }
  }

  const int64_t threads_;
  // Read and written by the caller only (one at a time: see `busy`).
  Clock::time_point solo_until_{};  // jobs before this run on the caller alone
  Clock::time_point last_late_{};   // the last late job's end
  std::vector<std::thread> helpers_;
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<uint32_t> epoch_{0};  // bumped once a job: wakes the helpers
  alignas(64) std::atomic<uint64_t> claim_{0};  // (chunks << 32) | next unclaimed chunk
  alignas(64) std::atomic<int32_t> done_{0};    // chunks finished
  alignas(64) std::atomic<int32_t> sleepers_{0};  // threads in sleep_until
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

Team* team = nullptr;                 // sized to at::get_num_threads(); made on first use
std::atomic_flag busy = ATOMIC_FLAG_INIT;  // a caller holds the team

// A forked child has none of the parent's threads: it makes a team of its own.
void forget_team_in_child() {
  team = nullptr;  // leaked: its threads do not exist here
  busy.clear();
}

}  // namespace

int64_t team_threads() { return in_team ? 1 : at::get_num_threads(); }

bool team_enabled() { return mode.load(std::memory_order_relaxed) != Mode::OPENMP; }

void team_run(int64_t chunks, ChunkFn fn, const void* ctx) {
  TORCH_CHECK(chunks >= 0 && chunks < (int64_t{1} << 30), "team_run: ", chunks, " chunks");
  // Another thread holds the team (two Python threads calling ops): run here, in order.
  if (in_team || busy.test_and_set(std::memory_order_acquire)) {
    for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
    return;
  }
  struct Release {
    ~Release() {
      in_team = false;
      busy.clear(std::memory_order_release);
    }
  } release;
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, forget_team_in_child) == 0; }();
  (void)registered;
  const int64_t threads = at::get_num_threads();
  if (team == nullptr || team->threads() != threads) {
    delete team;
    team = new Team(threads);
  }
  in_team = true;
  team->run(chunks, fn, ctx, mode.load(std::memory_order_relaxed) == Mode::ADAPTIVE);
}

// "adaptive", "team" or "openmp": where parallel_for sends its loops; "" leaves it.
// Returns the mode before the call.
std::string cpu_parallel_mode(std::string_view name) {
  static constexpr std::string_view NAMES[] = {"adaptive", "team", "openmp"};
  const std::string old(NAMES[static_cast<int>(mode.load())]);
  if (name.empty()) return old;
  for (int m = 0; m < 3; ++m) {
    if (name == NAMES[m]) {
      mode.store(static_cast<Mode>(m));
      return old;
    }
  }
  TORCH_CHECK(false, "cpu_parallel_mode: mode must be 'adaptive', 'team' or 'openmp', got '",
              std::string(name), "'");
}

// [jobs the team ran, jobs the caller ran alone, late jobs] since the process started.
std::vector<int64_t> cpu_team_stats() {
  return {team_jobs.load(), solo_jobs.load(), late_jobs.load()};
}

// For the tests: counts[i] += 1 for every i, through parallel_for in pieces of `grain`
// (a chunk run twice, or skipped, shows as a count other than 1); index `throw_at`
// raises inside its chunk, whichever thread runs it; a chunk run by any thread but
// the caller first sleeps `helper_delay_us` (a helper whose core another process
// holds), one run by the caller `caller_delay_us`. Returns how many indices the
// calling thread ran itself.
int64_t parallel_for_coverage(at::Tensor& counts, int64_t grain, int64_t throw_at,
                              int64_t helper_delay_us, int64_t caller_delay_us) {
  TORCH_CHECK(counts.dim() == 1 && counts.is_contiguous() && counts.scalar_type() == at::kInt,
              "counts: 1-D int32, contiguous");
  int32_t* c = counts.data_ptr<int32_t>();
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int64_t> by_caller{0};
  parallel_for(0, counts.numel(), grain, [&](int64_t b, int64_t e) {
    const bool mine = std::this_thread::get_id() == caller;
    if (mine) by_caller.fetch_add(e - b);
    const int64_t delay_us = mine ? caller_delay_us : helper_delay_us;
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    for (int64_t i = b; i < e; ++i) {
      TORCH_CHECK(i != throw_at, "parallel_for_coverage: index ", i, " raises, as asked");
      c[i] += 1;
    }
  });
  return by_caller.load();
}

}  // namespace minivllm
