// A team of threads that tolerates a busy core: minivllm::parallel_for.
//
// at::parallel_for (OpenMP) gives each of its T threads one equal, fixed share of
// a loop and returns when every thread has finished its share. On a quiet machine
// that is ideal. On a laptop, where another process holds one of the two cores, the
// operating system runs our second thread only part of the time: each of the ~210
// loops of a decode step then waits for a thread that is not running, for as long
// as the scheduler gives the other process (milliseconds), and batch-1 decode
// falls to a third of its quiet speed.
//
// parallel_for here cuts a loop into more chunks than threads (CHUNKS_PER_THREAD
// each) and lets every thread of a persistent team take the next unclaimed chunk
// from one shared counter, the calling thread included. A thread that is late
// simply claims fewer chunks: the ones it would have run are taken by the thread
// that is running. The loop is over when every chunk is *done* (a count), not
// when every thread has *arrived*; so the caller waits at most for the chunk a
// preempted thread holds, and it waits asleep, which frees its core for that
// thread. thread_team.cpp has the team.
//
// The chunks taper: the first half of a loop goes in chunks of 1 / (threads x
// CHUNKS_PER_THREAD) of it, then each chunk is 1 / (2 x threads) of what is left,
// down to TAPER times smaller (never below the grain). The threads finish a loop
// together within one small chunk, where equal chunks left one of them idle for
// half a large one on average (a batch-1 decode's caller spun at the end of its loops
// in 6.0% of all samples, 1.5% tapered; the step's time did not move beyond the noise,
// its GEMVs being bound by memory: docs/kernels.md).
//
// When a helper keeps being late (another process holds its core), the jobs of the
// next moment run on the calling thread alone: one thread streams weights nearly as
// fast as two, and never waits (thread_team.cpp says when a job counts as late).
//
// A chunk's result must not depend on which thread runs it or on how the loop is
// cut (every kernel here computes each output element wholly inside one chunk), so
// the team's results are bit for bit at::parallel_for's. The op
// minivllm::cpu_parallel_mode picks "adaptive" (the default), "team" (never alone)
// or "openmp" (at::parallel_for), to compare them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace minivllm {

// Chunks a thread's share of a loop is cut into: more gives a late thread's work
// to the others in finer pieces; fewer costs fewer claims (a few ns each).
constexpr int64_t CHUNKS_PER_THREAD = 4;
// How much smaller than the first chunks the last ones get (see above).
constexpr int64_t TAPER = 8;

// Runs fn(ctx, c) for every chunk c in [0, chunks), on the team, and returns when
// every chunk is done. The first exception a chunk throws is rethrown here.
// `keep`: see parallel_for_revocable (nullptr: the job is not revocable).
using ChunkFn = void (*)(const void* ctx, int64_t chunk);
void team_run(int64_t chunks, ChunkFn fn, const void* ctx,
              std::shared_ptr<const void> keep = nullptr);

// Inside a chunk of a revocable loop: true once the caller has taken the chunk over
// (stop early: the result will be thrown away).
bool chunk_cancelled();
// Inside a chunk of a revocable loop, after computing and before the first write:
// false if the caller took the chunk over (write nothing), true if the writes are
// this thread's to make. Outside a revocable loop: always true.
bool chunk_commit_begin();

// Threads that run a loop: the team's (the caller included), or 1 inside a chunk.
int64_t team_threads();

// True if parallel_for goes to the team; false if to at::parallel_for (OpenMP).
bool team_enabled();

namespace detail {
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where a loop over [begin, end) is cut: chunk c is [bounds[c], bounds[c + 1]). Pieces
// of at least `grain` items, at most CHUNKS_PER_THREAD a thread in the first half of
// the loop, then tapering (see above). One chunk if the loop is no larger than a grain.
inline std::vector<int64_t> chunk_bounds(int64_t begin, int64_t end, int64_t grain) {
  const int64_t n = end - begin, threads = team_threads();
  grain = std::max<int64_t>(1, grain);
  const int64_t largest = std::max(grain, ceil_div(n, threads * CHUNKS_PER_THREAD));
  const int64_t smallest = std::max(grain, ceil_div(largest, TAPER));
  std::vector<int64_t> bounds{begin};
  for (int64_t at = begin; at < end;) {
    const int64_t size = std::clamp(ceil_div(end - at, 2 * threads), smallest, largest);
    at = std::min(end, at + size);
    bounds.push_back(at);
  }
  return bounds;
}

// A loop's chunks, and the function team_run calls for chunk c. Fn is how the loop
// holds f: a reference (parallel_for) or a copy (the revocable one).
template <typename Fn>
struct Loop {
  Fn f;
  std::vector<int64_t> bounds;
  int64_t chunks() const { return static_cast<int64_t>(bounds.size()) - 1; }
  static void run_chunk(const void* ctx, int64_t c) {
    const Loop& l = *static_cast<const Loop*>(ctx);
    l.f(l.bounds[c], l.bounds[c + 1]);
  }
};
}  // namespace detail

// f(b, e) over [begin, end) in pieces of at least `grain` items, as at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (!team_enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (n <= std::max<int64_t>(1, grain) || team_threads() == 1) {  // one piece (or in a chunk)
    f(begin, end);
    return;
  }
  const detail::Loop<std::reference_wrapper<const F>> loop{std::cref(f),
                                                           detail::chunk_bounds(begin, end, grain)};
  team_run(loop.chunks(), decltype(loop)::run_chunk, &loop);
}

// parallel_for whose chunks the caller may take over from a helper that is late.
//
// A helper whose core another process holds can be stopped in the middle of a
// chunk for milliseconds; parallel_for's caller then waits for it. Here the caller,
// once no chunk is left to claim, waits only a little (about two of its own chunks),
// then runs the late helper's chunk itself. The helper may wake up later and finish
// its copy: so f must compute first and write only after chunk_commit_begin() says
// the writes are its own (one of the two copies wins, the other writes nothing), and
// may look at chunk_cancelled() to stop early. A late helper can also still *read*
// after the call has returned: so f is copied to the heap, must hold everything it
// reads by value (tensors, shared buffers; no reference to the caller's frame), and
// the team keeps the copy until no helper can be inside it. Nothing waits for the
// late helper: the call returns as soon as every chunk is done by someone.
template <typename F>
void parallel_for_revocable(int64_t begin, int64_t end, int64_t grain, F f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (!team_enabled() || n <= std::max<int64_t>(1, grain) || team_threads() == 1) {
    parallel_for(begin, end, grain, f);
    return;
  }
  using Loop = detail::Loop<F>;
  auto loop = std::make_shared<const Loop>(Loop{std::move(f), detail::chunk_bounds(begin, end, grain)});
  const Loop* ctx = loop.get();
  team_run(ctx->chunks(), Loop::run_chunk, ctx, std::move(loop));
}

}  // namespace minivllm
