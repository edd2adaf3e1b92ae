// The persistent thread team behind minivllm::parallel_for (thread_team.h).
//
// One loop at a time is a *job*: a function, a context and a number of chunks.
// The caller publishes it in one 64-bit word, `claim_` = (job << 42) | (chunks << 21)
// | next, wakes the helpers, and claims chunks like any helper: every thread runs
//
//     v = claim_.fetch_add(1); if (v's next < v's chunks) run chunk `next`, count it done
//
// until the chunks run out. Keeping the count of chunks in the same word as the
// counter means a helper that wakes late (after the job it was woken for has
// ended) can never run a chunk of the wrong job: its fetch_add either lands in an
// exhausted job and claims nothing, or in the next job, whose chunk it then runs
// as well as anyone. So no thread ever waits for a particular other thread. (The
// job's number is there for revocable jobs, below.)
//
// The caller returns when the count of finished chunks reaches the job's chunks.
// It spins for CALLER_SPIN first (past LATE_MIN: a sleeping caller takes long to
// wake), then sleeps (a condition variable), which frees its core for a helper
// preempted mid-chunk by another process. Idle helpers spin for HELPER_SPIN
// (the gaps between the ops of a decode step are microseconds), then sleep until
// the next job. A sleeper counts itself in `sleepers_` before it looks a last
// time; a waker changes the state, then looks at the count, and only then takes
// the lock to notify (both sides sequentially consistent, so one of them sees the
// other): no wake-up is lost, and none is paid for while everyone is awake.
//
// When is a second thread worth it? At batch 1 a decode step streams weights from
// memory, and one thread alone gets much of the bandwidth two would (85% on the
// EPYC of docs/kernels.md, half on its Xeon). With another process on the second
// core, the helper runs in slices between that process's, and every time it is
// preempted holding a chunk the caller waits for it (milliseconds), which costs
// more than the helper ever gives. So the team watches for that: a job whose
// caller waited for the others' last chunks more than LATE_MIN and more than
// LATE_FACTOR times its own chunks took is *late*. A second late job within
// LATE_WINDOW of the first (a quiet machine has a rare blip; a busy core makes
// them every few milliseconds) sends the jobs of the next SOLO_FOR to the caller
// alone (the helpers sleep); then the team tries again. On a quiet machine every
// job uses the whole team.
//
// A revocable job (parallel_for_revocable) waits for no one. Each chunk has a state,
// (job << 2) | CLAIMED / COMMITTING / STOLEN / DONE. The caller, out of chunks to
// claim, waits about two of its own chunks, then swaps every chunk still CLAIMED to
// STOLEN and runs it itself; the owner, waking, writes nothing (CLAIMED -> COMMITTING,
// chunk_commit_begin, is the right to write; a COMMITTING chunk is waited for). A
// claim counts only while `job_seq_` still publishes its job (2 J while job J runs,
// 2 J + 1 after), so a late owner never runs a later job's chunk; and the job's heap
// context, which it may still read, is freed only once no helper is inside a chunk
// (`active_`), as checked at a later job: never waited for.
#include "thread_team.h"

#include <ATen/core/Tensor.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
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
// How long the caller waits for the last chunks awake before it sleeps: past LATE_MIN,
// as waking it took ~200 us in a VM (the Xeon of docs/kernels.md; with 30 us here,
// quiet int8 decode paid that in many jobs, which then counted as late).
constexpr auto CALLER_SPIN = std::chrono::microseconds(300);
// A late job (see above) and how long the jobs after it run on the caller alone.
constexpr auto LATE_MIN = std::chrono::microseconds(200);
constexpr int64_t LATE_FACTOR = 4;
constexpr auto LATE_WINDOW = std::chrono::milliseconds(100);
constexpr auto SOLO_FOR = std::chrono::milliseconds(200);
// How long the caller of a revocable job waits for a helper's chunk before it takes
// the chunk over: STEAL_CHUNKS of its own chunks, at least STEAL_MIN (STEAL_BLIND if
// it ran none itself).
constexpr int64_t STEAL_CHUNKS = 2;
constexpr auto STEAL_MIN = std::chrono::microseconds(30);
constexpr auto STEAL_BLIND = std::chrono::microseconds(200);

// The claim word: (job << 42) | (chunks << 21) | next. next never passes chunks + the
// thread count, so chunks stay below 2^20.
constexpr int NEXT_BITS = 21, CHUNK_BITS = 21;
constexpr uint64_t FIELD_MASK = (uint64_t{1} << 21) - 1, JOB_MASK = (uint64_t{1} << 22) - 1;
constexpr int64_t MAX_CHUNKS = int64_t{1} << 20;
// A revocable chunk's state, in the low 2 bits of (job << 2) | state.
constexpr uint64_t CLAIMED = 0, COMMITTING = 1, STOLEN = 2, DONE = 3;
constexpr int64_t MAX_REVOCABLE = 256;  // chunks of a revocable job (more: not revocable)

// "adaptive" (the default): the team, and the caller alone for a while after a late
// job; "team": the team always; "openmp": at::parallel_for.
// "steal" (for the tests): the team always, and the caller of a revocable job takes
// over every chunk still running as soon as it has no chunk to claim.
enum class Mode { ADAPTIVE, TEAM, OPENMP, STEAL };
std::atomic<Mode> mode{Mode::ADAPTIVE};

// Jobs run by the team, jobs run by the caller alone, late jobs (cpu_team_stats).
std::atomic<int64_t> team_jobs{0}, solo_jobs{0}, late_jobs{0}, stolen_chunks{0};

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

// The revocable chunk this thread runs as its owner: its state word and the value
// that means "still mine" ((job << 2) | CLAIMED); nullptr otherwise (the writes are ours).
thread_local std::atomic<uint64_t>* chunk_state = nullptr;
thread_local uint64_t chunk_claimed = 0;

class Team {
 public:
  explicit Team(int64_t threads) : threads_(threads), active_(new Flag[threads]) {
    for (int64_t t = 1; t < threads; ++t) helpers_.emplace_back([this, t] { helper_main(t); });
  }

  ~Team() {  // only when the thread count changes: stop and join the helpers
    stop_.store(true);
    epoch_.fetch_add(1);
    wake();
    for (std::thread& h : helpers_) h.join();
  }

  int64_t threads() const { return threads_; }

  void run(int64_t chunks, ChunkFn fn, const void* ctx, Mode mode,
           std::shared_ptr<const void> keep) {
    const auto start = Clock::now();
    if (!retired_.empty() && no_helper_active()) retired_.clear();  // no late owner left
    if (mode == Mode::ADAPTIVE && start < solo_until_) {  // a job was late a moment ago
      solo_jobs.fetch_add(1, std::memory_order_relaxed);
      for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
      return;
    }
    const bool revocable = keep != nullptr && chunks <= MAX_REVOCABLE;
    team_jobs.fetch_add(1, std::memory_order_relaxed);
    // The last job's end (job_seq_ odd) is seen before any field of this one: a late
    // reader of the fields below then finds job_seq_ changed (a seqlock's writer).
    std::atomic_thread_fence(std::memory_order_release);
    ++job_;
    done_.store(0, std::memory_order_relaxed);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    revocable_.store(revocable, std::memory_order_relaxed);
    for (int64_t c = 0; revocable && c < chunks; ++c) states_[c].store((job_ << 2) | CLAIMED);
    error_ = nullptr;
    job_seq_.store(2 * job_);
    // Publish: the release store orders the fields above before any claim of this job.
    claim_.store(((job_ & JOB_MASK) << (NEXT_BITS + CHUNK_BITS)) |
                     (static_cast<uint64_t>(chunks) << NEXT_BITS),
                 std::memory_order_release);
    epoch_.fetch_add(1);  // sequentially consistent: see wake()
    wake();

    const int64_t mine = work(nullptr);
    const auto claimed = Clock::now();  // no chunk left to claim: wait for the others'
    const auto all_done = [&] { return done_.load() == chunks; };
    bool stole = false;
    if (revocable) {
      const auto patience = mode == Mode::STEAL ? Clock::duration::zero()
                            : mine == 0        ? Clock::duration(STEAL_BLIND)
                                               : std::max<Clock::duration>(
                                              STEAL_MIN, STEAL_CHUNKS * (claimed - start) / mine);
      if (!spin_until(all_done, patience)) stole = steal(chunks, fn, ctx);
    }
    if (!spin_until(all_done, CALLER_SPIN)) sleep_until(all_done);
    job_seq_.store(2 * job_ + 1);  // over: a late claim on it runs nothing
    if (stole) retired_.push_back(std::move(keep));  // its late owner may still read it
    const auto waited = Clock::now() - claimed;
    if (!revocable && mine > 0 && waited > LATE_MIN &&
        waited > LATE_FACTOR * (claimed - start) / mine) {
      late_jobs.fetch_add(1, std::memory_order_relaxed);
      const auto now = Clock::now();
      if (now - last_late_ < LATE_WINDOW) solo_until_ = now + SOLO_FOR;
      last_late_ = now;
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  struct alignas(64) Flag {
    std::atomic<bool> on{false};
  };

  // Claim and run chunks of whatever job is published, until none is left; how many
  // ran. `active`: this helper's flag (nullptr for the caller, whose job is current).
  int64_t work(std::atomic<bool>* active) {
    int64_t ran = 0;
    for (;;) {
      const uint64_t v = claim_.fetch_add(1, std::memory_order_acq_rel);
      const int64_t chunk = static_cast<int64_t>(v & FIELD_MASK);
      const int64_t chunks = static_cast<int64_t>((v >> NEXT_BITS) & FIELD_MASK);
      if (chunk >= chunks) return ran;
      if (active != nullptr) active->store(true);  // before looking at job_seq_: see run()
      const uint64_t seq = job_seq_.load();
      const bool current = (seq & 1) == 0 && ((seq >> 1) & JOB_MASK) == v >> (NEXT_BITS + CHUNK_BITS);
      const ChunkFn fn = fn_.load(std::memory_order_relaxed);
      const void* ctx = ctx_.load(std::memory_order_relaxed);
      const bool revocable = revocable_.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);  // the loads above, then the check
      // A claim on a job that is over (its chunks were taken over while this thread
      // was stopped), or a snapshot torn by the next job's publication: run nothing.
      if (current && job_seq_.load() == seq) {
        ran += run_chunk(chunk, chunks, fn, ctx, revocable ? &states_[chunk] : nullptr,
                         (seq >> 1) << 2);
      }
      if (active != nullptr) active->store(false);
    }
  }

  // Runs one claimed chunk as its owner; 1 if it counted it done, 0 if it was taken over.
  int64_t run_chunk(int64_t chunk, int64_t chunks, ChunkFn fn, const void* ctx,
                    std::atomic<uint64_t>* state, uint64_t mine) {
    if (state != nullptr && state->load() != (mine | CLAIMED)) return 0;  // taken already
    chunk_state = state;
    chunk_claimed = mine | CLAIMED;
    std::exception_ptr error;
    try {
      fn(ctx, chunk);
    } catch (...) {
      error = std::current_exception();
    }
    chunk_state = nullptr;
    if (state != nullptr) {  // done: from COMMITTING (it wrote) or CLAIMED (it had nothing to)
      uint64_t s = mine | COMMITTING;
      if (!state->compare_exchange_strong(s, mine | DONE)) {
        s = mine | CLAIMED;
        if (!state->compare_exchange_strong(s, mine | DONE)) return 0;  // the caller's now
      }
    }
    if (error) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = error;
    }
    if (done_.fetch_add(1) + 1 == chunks) wake();
    return 1;
  }

  // The caller of a revocable job, out of chunks to claim: runs every chunk still
  // CLAIMED by a helper itself. True if it took any.
  bool steal(int64_t chunks, ChunkFn fn, const void* ctx) {
    bool stole = false;
    for (int64_t c = 0; c < chunks; ++c) {
      uint64_t s = (job_ << 2) | CLAIMED;
      if (!states_[c].compare_exchange_strong(s, (job_ << 2) | STOLEN)) continue;
      stole = true;
      stolen_chunks.fetch_add(1, std::memory_order_relaxed);
      try {
        fn(ctx, c);  // chunk_state is nullptr here: the writes are the caller's
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      states_[c].store((job_ << 2) | DONE);
      done_.fetch_add(1);
    }
    return stole;
  }

  bool no_helper_active() const {
    for (int64_t t = 1; t < threads_; ++t)
      if (active_[t].on.load()) return false;
    return true;
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

  void helper_main(int64_t t) {
    in_team = true;
    // Not epoch_'s value now: a helper that starts late (after jobs, or after ~Team
    // has asked it to stop) must see that the epoch moved, not sleep through it.
    uint32_t seen = 0;
    for (;;) {
      const auto new_job = [&] { return epoch_.load() != seen; };
      if (!spin_until(new_job, HELPER_SPIN)) sleep_until(new_job);
      seen = epoch_.load();
      if (stop_.load()) return;
      work(&active_[t].on);
    }
  }

  const int64_t threads_;
  // Read and written by the caller only (one at a time: see `busy`).
  Clock::time_point solo_until_{};  // jobs before this run on the caller alone
  Clock::time_point last_late_{};   // the last late job's end
  uint64_t job_ = 0;                // the number of the last job published
  std::vector<std::shared_ptr<const void>> retired_;  // contexts a late owner may read
  std::unique_ptr<Flag[]> active_;  // per helper: inside a chunk (index 0 unused)
  std::unique_ptr<std::atomic<uint64_t>[]> states_{new std::atomic<uint64_t>[MAX_REVOCABLE]};
  alignas(64) std::atomic<uint64_t> job_seq_{1};  // 2 J while job J runs, 2 J + 1 after
  std::atomic<bool> revocable_{false};
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

bool chunk_cancelled() {
  return chunk_state != nullptr && chunk_state->load(std::memory_order_relaxed) != chunk_claimed;
}

bool chunk_commit_begin() {
  if (chunk_state == nullptr) return true;
  uint64_t s = chunk_claimed;
  return chunk_state->compare_exchange_strong(s, (chunk_claimed & ~uint64_t{3}) | COMMITTING);
}

void team_run(int64_t chunks, ChunkFn fn, const void* ctx, std::shared_ptr<const void> keep) {
  TORCH_CHECK(chunks >= 0 && chunks < MAX_CHUNKS, "team_run: ", chunks, " chunks");
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
  team->run(chunks, fn, ctx, mode.load(std::memory_order_relaxed), std::move(keep));
}

// "adaptive", "team" or "openmp": where parallel_for sends its loops; "" leaves it.
// Returns the mode before the call.
std::string cpu_parallel_mode(std::string_view name) {
  static constexpr std::string_view NAMES[] = {"adaptive", "team", "openmp", "steal"};
  const std::string old(NAMES[static_cast<int>(mode.load())]);
  if (name.empty()) return old;
  for (int m = 0; m < 4; ++m) {
    if (name == NAMES[m]) {
      mode.store(static_cast<Mode>(m));
      return old;
    }
  }
  TORCH_CHECK(false, "cpu_parallel_mode: mode must be 'adaptive', 'team', 'openmp' or 'steal', got '",
              std::string(name), "'");
}

// [jobs the team ran, jobs the caller ran alone, late jobs, chunks the caller took
// over] since the process started.
std::vector<int64_t> cpu_team_stats() {
  return {team_jobs.load(), solo_jobs.load(), late_jobs.load(), stolen_chunks.load()};
}

// For the tests: counts[i] += 1 for every i, through parallel_for in pieces of `grain`
// (a chunk run twice, or skipped, shows as a count other than 1); index `throw_at`
// raises inside its chunk, whichever thread runs it; a chunk run by any thread but
// the caller first sleeps `helper_delay_us` (a helper whose core another process
// holds), one run by the caller `caller_delay_us`. With `revocable`, through
// parallel_for_revocable: a chunk sleeps before it commits its writes, so the caller
// takes a sleeping helper's chunk over, and the helper, waking after the call has
// returned, must write nothing. Returns how many indices the calling thread wrote.
int64_t parallel_for_coverage(at::Tensor& counts, int64_t grain, int64_t throw_at,
                              int64_t helper_delay_us, int64_t caller_delay_us, bool revocable) {
  TORCH_CHECK(counts.dim() == 1 && counts.is_contiguous() && counts.scalar_type() == at::kInt,
              "counts: 1-D int32, contiguous");
  auto by_caller = std::make_shared<std::atomic<int64_t>>(0);
  const auto chunk = [counts, throw_at, helper_delay_us, caller_delay_us, by_caller,
                      caller = std::this_thread::get_id()](int64_t b, int64_t e) {
    const bool mine = std::this_thread::get_id() == caller;
    const int64_t delay_us = mine ? caller_delay_us : helper_delay_us;
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    for (int64_t i = b; i < e; ++i)
      TORCH_CHECK(i != throw_at, "parallel_for_coverage: index ", i, " raises, as asked");
    if (!chunk_commit_begin()) return;
    int32_t* c = counts.data_ptr<int32_t>();
    for (int64_t i = b; i < e; ++i) c[i] += 1;
    if (mine) by_caller->fetch_add(e - b);
  };
  if (revocable) {
    parallel_for_revocable(0, counts.numel(), grain, chunk);
  } else {
    parallel_for(0, counts.numel(), grain, chunk);
  }
  return by_caller->load();
}

}  // namespace minivllm
