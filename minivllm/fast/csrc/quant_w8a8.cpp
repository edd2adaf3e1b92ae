// W8A8 on a CPU: int8 activations times int8 or 4-bit weights, with integer dot products.
//
// The maths is minivllm/ref/quantization.py's W8A8 section (read it first):
//   activations, per token and group of 32 input features (llama.cpp's Q8_0 / Q8_1):
//     s_x = max |x| / 127,  q_x = round(x * (1 / s_x)) (ties to even),  sum_x = s_x * sum(q_x)
//   the matmul, per group g of 32 input features:
//     I[m, n, g] = sum_{k in g} q_x[m, k] q_w[n, k]                          int32, exact
//     int8 weights:  y[m, n] = sum_g (s_x[m, g] s_w[n, g]) I[m, n, g]
//     4-bit weights: y[m, n] = sum_g ((s_x[m, g] d[n, g]) I[m, n, g] + m_w[n, g] sum_x[m, g])
//   in float32, group after group (g = 0, 1, ...), every product and sum rounded as written.
//
// Why integers: widening weights to float (quant.cpp, W8A16) costs three instructions per 8
// weights (load, sign-extend, convert) before the FMA, for every row of x. An integer dot
// product multiplies 32 int8 pairs per instruction: AVX2's _mm256_maddubs_epi16 (u8 x s8,
// pairs summed into int16) then _mm256_madd_epi16 by ones (into int32); AVX-VNNI and
// AVX512-VNNI's vpdpbusd do both in one. At batch 1 the step is bound by reading the
// weights, so that saves little; at batch 64 the arithmetic is the bottleneck, and there
// it saves about half the instructions.
//
// - maddubs multiplies an unsigned byte by a signed one. For int8 weights, llama.cpp's trick:
//   |x| is the unsigned operand and w * sign(x) the signed one (_mm256_sign_epi8), whose
//   product is x * w. Neither may be -128 (quantize_activations and quantize_int8 clamp to
//   +-127), and a pair's sum, at most 2 * 127 * 127 = 32258, fits in int16. 4-bit weights
//   (0..15) are unsigned already: q_w is the unsigned operand, q_x the signed one.
// - Exactly the ref's bits. The integer sums are exact in any order; the float part is done
//   in the ref's order, one output column per lane: a tile of 8 weight rows turns its 8
//   per-row int32 vectors into one vector of 8 group sums (sum_lanes8), and the rescale
//   multiplies and adds lane by lane, 8 outputs at a time. The compiler must not fuse a
//   multiply and an add into an FMA (one rounding instead of two; GCC does by default):
//   this file is compiled with fp-contract off.
// - A tile is 8 weight rows and every row of x. Its rows are read from memory once (the
//   next tile is prefetched while the first row of x runs), and stay in L1 for the other
//   rows of x. 4-bit rows are unpacked to a byte a weight once per tile; the tile's scales
//   (and minimums) are transposed once, to a vector of 8 per group.
// - The instruction set is chosen at run time (w8a8_isas()): AMX-INT8 (its GEMM from 32 rows
//   of x, the rest as AVX512-VNNI), else AVX512-VNNI, else AVX-VNNI, else AVX2, else a plain
//   loop (portable, the same maths). The SIMD tiles are written once (quant_w8a8_tiles.h)
//   and compiled per instruction set, each in its own namespace; AVX512-VNNI runs one row
//   of x in 512-bit registers (quant_w8a8_row512.h).
// - Scales and minimums stored in float16 (a GGUF's blocks hold them so) are widened to
//   float32 as a tile transposes them (F16C's vcvtph2ps): exact, so the bits are those of
//   the same scales in float32, and a batch-1 step reads 2 bytes a group less per row.
// - Threads take whole tiles (parallel_for_revocable, thread_team.h: the caller may rerun
//   a late helper's chunk), so each weight byte is read once (twice for a chunk rerun).
// - One row of x in the C++ layer stack, on AVX512-VNNI: the weight's copy prepacked at load
//   in the GEMM's layout (quant_w8a8_prepacked.h), which needs no horizontal adds either.
// - From GEMM_MIN_ROWS rows of x (a batched decode step, a prefill) a GEMM replaces the
//   tiles: weights repacked per call to VNNI's layout, no horizontal adds
//   (quant_w8a8_gemm.h for AVX512-VNNI, quant_w8a8_gemm256.h for AVX-VNNI and AVX2; on a
//   CPU with AMX-INT8, quant_w8a8_amx.h's tiles of 16 x 16 int32 sums).
#include "ops.h"

#include <ATen/ops/empty.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define MINIVLLM_W8A8_X86 1
#else
#define MINIVLLM_W8A8_X86 0
#endif
// AMX-INT8 (quant_w8a8_amx.h): Linux (the permission to use it is asked with arch_prctl),
// and a compiler that knows AMX's intrinsics (GCC 11, clang 12).
#if MINIVLLM_W8A8_X86 && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <sys/syscall.h>
#include <unistd.h>
#define MINIVLLM_W8A8_AMX 1
#else
#define MINIVLLM_W8A8_AMX 0
#endif

// Every multiply and add below is rounded on its own, as the ref's torch ops are.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace minivllm {
namespace {

constexpr int64_t GROUP = ACT_GROUP_SIZE;  // input features per activation scale (ops.h)
constexpr int64_t TILE = 8;    // weight rows per tile (the lanes of a float vector)
// Rows of x from which an ISA's GEMM (weights repacked to VNNI's layout) replaces the tiles.
constexpr int64_t GEMM_MIN_ROWS = 8;
// Weight rows a panel of a prepacked weight holds (prepack_w8a8 / prepack_w4a8 in
// fast/linear_prepack.py; the GEMM's PANEL), and the bytes of one 4-bit group of a panel:
// its words, then its scales and minimums (quant_w8a8_prepacked.h).
constexpr int64_t PREPACKED_ROWS = 32;
constexpr int64_t prepacked_group_bytes(bool half_scales) {
  return 4 * PREPACKED_ROWS * 4 + 2 * PREPACKED_ROWS * (half_scales ? 2 : 4);
}

#include "quant_w8a8_problem.h"  // W8A8Problem, its scales, a tile's rows

// A 4-bit row as one byte a weight, in order (byte j of a group holds weights j and j + 16).
void unpack_row4(const uint8_t* src, int64_t k, uint8_t* dst) {
  for (int64_t g = 0; g < k / GROUP; ++g) {
    for (int64_t l = 0; l < GROUP / 2; ++l) {
      const uint8_t b = src[g * GROUP / 2 + l];
      dst[g * GROUP + l] = b & 15;
      dst[g * GROUP + GROUP / 2 + l] = b >> 4;
    }
  }
}

#include "quant_w8a8_portable.h"  // the portable loop: quantize_group_portable, portable_tiles

using TilesFn = void (*)(const W8A8Problem&, int64_t, int64_t);
using GemmFn = void (*)(const W8A8Problem&);
// One row of x times panels pn0 .. pn1 - 1 of a prepacked int8 or 4-bit weight, into y.
using PrepackedFn = void (*)(const W8A8Problem&, const uint8_t*, int64_t, int64_t, float*);
using QuantizeGroupFn = int32_t (*)(const float*, int8_t*, float*);

// ------------------------------------------------------------------ the SIMD tiles
#if MINIVLLM_W8A8_X86
// dot_u8s8(a, b): 8 int32 lanes, lane i = sum of a[4i + c] * b[4i + c] (c < 4), a unsigned.
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
inline __m256i dot_u8s8(__m256i a, __m256i b) {
  // maddubs: 16 int16 sums of pairs; madd by ones: 8 int32 sums of 4.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
inline __m256i dot_acc(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, dot_u8s8(a, b));
}
constexpr bool SIGN_TRICK = true;  // int8 weights in the GEMM: |x| times w * sign(x)
#include "quant_w8a8_tiles.h"
#include "quant_w8a8_gemm256.h"
#pragma GCC pop_options
}  // namespace avx2

namespace avxvnni {
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avxvnni")
inline __m256i dot_u8s8(__m256i a, __m256i b) {  // vpdpbusd (VEX): the same, in one
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
}
inline __m256i dot_acc(__m256i acc, __m256i a, __m256i b) {
  return _mm256_dpbusd_avx_epi32(acc, a, b);
}
constexpr bool SIGN_TRICK = false;  // int8 weights in the GEMM: x + 128 times w
#include "quant_w8a8_tiles.h"
#include "quant_w8a8_gemm256.h"
#pragma GCC pop_options
}  // namespace avxvnni

namespace avx512vnni {
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
inline __m256i dot_u8s8(__m256i a, __m256i b) {  // vpdpbusd (EVEX, 256-bit)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
}
#include "quant_w8a8_tiles.h"
#include "quant_w8a8_gemm.h"
#include "quant_w8a8_row512.h"  // tiles512: one row of x in 512-bit registers
#include "quant_w8a8_prepacked.h"  // one row of x, a weight prepacked in the GEMM's layout
#pragma GCC pop_options
}  // namespace avx512vnni

#if MINIVLLM_W8A8_AMX
namespace amx {
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#include "quant_w8a8_amx.h"
#pragma GCC pop_options
}  // namespace amx

// Whether this process may use AMX: the CPU has AMX-INT8, and Linux grants the tile data
// state (a process must ask once, with arch_prctl; the permission covers all its threads).
bool amx_usable() {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif
#endif

// ------------------------------------------------------------------ choosing
struct IsaEntry {
  const char* name;
  TilesFn int8_tiles, int4_tiles;
  QuantizeGroupFn quantize_group;
  GemmFn int8_gemm = nullptr, int4_gemm = nullptr;  // many rows of x, where the ISA has one
  PrepackedFn int8_prepacked = nullptr, int4_prepacked = nullptr;  // one row of x, a prepacked
                                                                    // weight (AVX512-VNNI)
};

#include "quant_w8a8_isas.h"  // available_isas(): what this build and CPU run

const std::vector<IsaEntry>& isas() {
  static const std::vector<IsaEntry> table = available_isas();  // the CPU does not change
  return table;
}

const IsaEntry& find_isa(std::string_view name) {
  const auto& table = isas();
  if (name == "auto") return table.back();
  for (const IsaEntry& e : table) {
    if (name == e.name) return e;
  }
  std::string have;
  for (const IsaEntry& e : table) have += std::string(" ") + e.name;
  TORCH_CHECK(false, "isa must be 'auto' or one this CPU runs:", have, "; got '",
              std::string(name), "'");
}

// Weight rows in units of `unit` rows (a tile, a panel) across threads, run revocably
// (thread_team.h: the caller may rerun a late helper's chunk): a chunk computes rows
// n0 .. n0 + width - 1 for every row of x into its own buffer, y[m * width + j] (room for
// whole units: a kernel may write its padded rows), with compute(p, u0, u1, y), and copies
// that into p.y only if the chunk is still its. `keep`: the tensors behind p's pointers,
// which a late helper may still read after this call has returned; compute holds by value
// whatever else it reads. `shift`: where given, p.shift's values, which the job then owns.
template <typename Compute>
void run_revocable(const W8A8Problem& p, int64_t unit, std::vector<at::Tensor> keep,
                   Compute compute, std::vector<int32_t> shift = {}) {
  if (p.m == 0 || p.n == 0) return;
  struct Job {
    W8A8Problem p;
    Compute compute;
    std::vector<at::Tensor> keep;
    std::vector<int32_t> shift;
  };
  auto job = std::make_shared<Job>(Job{p, std::move(compute), std::move(keep), std::move(shift)});
  if (!job->shift.empty()) job->p.shift = job->shift.data();
  const int64_t units = (p.n + unit - 1) / unit;
  parallel_for_revocable(0, units, grain_for(unit * p.k * p.m), [job, unit](int64_t u0, int64_t u1) {
    const W8A8Problem& p = job->p;
    const int64_t n0 = u0 * unit, width = std::min(p.n, u1 * unit) - n0;
    std::vector<float> y(p.m * (u1 - u0) * unit);
    job->compute(p, u0, u1, y.data());
    if (!chunk_commit_begin()) return;  // the caller ran this chunk itself
    for (int64_t m = 0; m < p.m; ++m)
      std::memcpy(p.y + m * p.n + n0, y.data() + m * width, sizeof(float) * width);
  });
}

// y = the problem's product: the GEMM for many rows of x, else tiles of TILE weight rows,
// each chunk's rows as a problem of its own (run_revocable).
void run(const W8A8Problem& p, TilesFn tiles, GemmFn gemm, std::vector<at::Tensor> keep) {
  if (p.m == 0 || p.n == 0) return;
  if (gemm != nullptr && p.m >= GEMM_MIN_ROWS) {
    gemm(p);
    return;
  }
  W8A8Problem q = p;
  // One row of x: a tile prefetches the next into L1 where prefetch_into_l1 says (ops.h).
  q.next_into_l1 = p.m == 1 && prefetch_into_l1(2 * TILE * p.row_bytes);
  run_revocable(q, TILE, std::move(keep), [tiles](const W8A8Problem& p, int64_t t0, int64_t t1,
                                                   float* y) {
    const int64_t n0 = t0 * TILE;
    W8A8Problem rows = p;  // weight rows n0 .. n0 + width - 1, as rows 0 .. width - 1
    rows.w = p.w + n0 * p.row_bytes;
    rows.s = scale_address(p, p.s, n0 * p.s_groups);
    if (p.mn != nullptr) rows.mn = scale_address(p, p.mn, n0 * p.groups);
    rows.n = std::min(p.n, t1 * TILE) - n0;
    rows.y = y;
    tiles(rows, 0, t1 - t0);
  });
}

// y = one row of x times a prepacked weight (panels of PREPACKED_ROWS rows).
void run_prepacked(const W8A8Problem& p, PrepackedFn one_row, const at::Tensor& packed,
                   std::vector<at::Tensor> keep, std::vector<int32_t> shift = {}) {
  TORCH_CHECK(one_row != nullptr, "a prepacked W8A8 / W4A8 weight needs AVX512-VNNI");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  run_revocable(
      p, PREPACKED_ROWS, std::move(keep),
      [one_row, w](const W8A8Problem& p, int64_t p0, int64_t p1, float* y) {
        one_row(p, w, p0, p1, y);
      },
      std::move(shift));
}

void check_activations(const at::Tensor& qx, const at::Tensor& xs, const at::Tensor* xsum) {
  TORCH_CHECK(qx.dim() == 2 && qx.is_contiguous() && qx.scalar_type() == at::kChar &&
                  qx.size(1) % GROUP == 0,
              "qx: (M, K) int8, contiguous, K a multiple of 32");
  for (const at::Tensor* t : {&xs, xsum}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->dim() == 2 && t->size(0) == qx.size(0) && t->size(1) == qx.size(1) / GROUP &&
                    t->is_contiguous() && t->scalar_type() == at::kFloat,
                "x_scales and x_sums: (M, K / 32) float32, contiguous");
  }
}

// A weight's scales (and minimums): float32, or float16 as a GGUF's blocks hold them.
bool is_scale_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf;
}

void check_out(const at::Tensor& out, int64_t m, int64_t n) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "out: (M, N) float32, contiguous");
}

}  // namespace

std::vector<std::string> w8a8_isas() {
  std::vector<std::string> names;
  for (const IsaEntry& e : isas()) names.emplace_back(e.name);
  return names;
}

void quantize_activations_int8(at::Tensor& q, at::Tensor& scales, at::Tensor& sums,
                               const at::Tensor& x, std::string_view isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % GROUP == 0, "x: (M, K) with K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  TORCH_CHECK(q.sizes() == x.sizes() && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q: (M, K) int8, contiguous");
  for (const at::Tensor* t : {&scales, &sums}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == m && t->size(1) == groups &&
                    t->is_contiguous() && t->scalar_type() == at::kFloat,
                "scales and sums: (M, K / 32) float32, contiguous");
  }
  const at::Tensor xc = x.contiguous();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* sump = sums.data_ptr<float>();
  const QuantizeGroupFn quantize_group = find_isa(isa).quantize_group;
  MINIVLLM_DISPATCH(xc.scalar_type(), "quantize_activations_int8", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    parallel_for(0, m * groups, grain_for(GROUP), [&](int64_t begin, int64_t end) {
      float widened[GROUP];  // a group in float32 (exact from bf16 / fp16): x.to(float)'s bits
      for (int64_t i = begin; i < end; ++i) {
        const float* g = reinterpret_cast<const float*>(xp + i * GROUP);  // float32: in place
        if constexpr (!std::is_same_v<scalar_t, float>) {
          for (int64_t c = 0; c < GROUP; ++c) widened[c] = static_cast<float>(xp[i * GROUP + c]);
          g = widened;
        }
        const int32_t total = quantize_group(g, qp + i * GROUP, sp + i);
        sump[i] = sp[i] * static_cast<float>(total);
      }
    });
  });
}

void w8a8_linear(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                 const at::Tensor& qweight, const at::Tensor& scales, std::string_view isa) {
  check_activations(qx, x_scales, nullptr);
  const int64_t m = qx.size(0), k = qx.size(1), groups = k / GROUP;
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == k && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kChar,
              "qweight: (N, K) int8, contiguous, K = ", k);
  const int64_t n = qweight.size(0);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) > 0 &&
                  groups % scales.size(1) == 0 && scales.is_contiguous() &&
                  is_scale_dtype(scales),
              "scales: (N, G) float32 or float16, contiguous, groups of a multiple of 32");
  check_out(out, m, n);
  const W8A8Problem p{qx.data_ptr<int8_t>(), x_scales.data_ptr<float>(), nullptr, m, k, groups,
                      reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), k,
                      scales.data_ptr(), nullptr, scales.size(1), n,
                      out.data_ptr<float>(), scales.scalar_type() == at::kHalf};
  const IsaEntry& e = find_isa(isa);
  run(p, e.int8_tiles, e.int8_gemm, {qx, x_scales, qweight, scales, out});
}

void w4a8_linear(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                 const at::Tensor& x_sums, const at::Tensor& qweight, const at::Tensor& scales,
                 const at::Tensor& mins, std::string_view isa) {
  check_activations(qx, x_scales, &x_sums);
  const int64_t m = qx.size(0), k = qx.size(1), groups = k / GROUP;
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * 2 == k && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte,
              "qweight: (N, K / 2) uint8, contiguous, K = ", k);
  const int64_t n = qweight.size(0);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == groups &&
                    t->is_contiguous() && is_scale_dtype(*t) &&
                    t->scalar_type() == scales.scalar_type(),
                "scales and mins: (N, K / 32), both float32 or both float16, contiguous");
  }
  check_out(out, m, n);
  const W8A8Problem p{qx.data_ptr<int8_t>(), x_scales.data_ptr<float>(),
                      x_sums.data_ptr<float>(), m, k, groups, qweight.data_ptr<uint8_t>(), k / 2,
                      scales.data_ptr(), mins.data_ptr(), groups, n,
                      out.data_ptr<float>(), scales.scalar_type() == at::kHalf};
  const IsaEntry& e = find_isa(isa);
  run(p, e.int4_tiles, e.int4_gemm, {qx, x_scales, x_sums, qweight, scales, mins, out});
}

bool w8a8_prepacked_available() {
  const IsaEntry& e = find_isa("auto");
  return e.int8_prepacked != nullptr && e.int4_prepacked != nullptr;
}

void w8a8_linear_prepacked(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                           const at::Tensor& packed, const at::Tensor& scales) {
  check_activations(qx, x_scales, nullptr);
  TORCH_CHECK(qx.size(0) == 1, "w8a8_linear_prepacked: one row of x");
  const int64_t k = qx.size(1), groups = k / GROUP, n = out.size(-1);
  check_out(out, 1, n);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) > 0 &&
                  groups % scales.size(1) == 0 && is_scale_dtype(scales),
              "scales: the weight's (N, G), float32 or float16, groups of a multiple of 32");
  const int64_t s_groups = scales.size(1), sb = scales.scalar_type() == at::kHalf ? 2 : 4;
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == (n + PREPACKED_ROWS - 1) / PREPACKED_ROWS &&
                  packed.size(1) == PREPACKED_ROWS * (s_groups * sb + k) &&
                  packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed: (ceil(N / 32), 32 (G x scale bytes + K)) uint8, contiguous (prepack_w8a8)");
  // The weights meet x as w + 128: 128 sum_k q_x a group comes back out (exact). A vector
  // the job owns, not a tensor: at batch 1 a step makes 121 of these (at::empty cost more).
  std::vector<int32_t> shift(groups);
  const int8_t* q = qx.data_ptr<int8_t>();
  for (int64_t g = 0; g < groups; ++g) {
    int32_t total = 0;
    for (int64_t i = 0; i < GROUP; ++i) total += q[g * GROUP + i];
    shift[g] = 128 * total;
  }
  W8A8Problem p{q, x_scales.data_ptr<float>(), nullptr, 1, k, groups, nullptr, k, nullptr,
                nullptr, s_groups, n, out.data_ptr<float>(), sb == 2};
  run_prepacked(p, find_isa("auto").int8_prepacked, packed, {qx, x_scales, packed, out},
                std::move(shift));
}

void w4a8_linear_prepacked(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                           const at::Tensor& x_sums, const at::Tensor& packed) {
  check_activations(qx, x_scales, &x_sums);
  TORCH_CHECK(qx.size(0) == 1, "w4a8_linear_prepacked: one row of x");
  const int64_t k = qx.size(1), groups = k / GROUP, n = out.size(-1);
  check_out(out, 1, n);
  const int64_t group_bytes = packed.dim() == 3 ? packed.size(2) : 0;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == (n + PREPACKED_ROWS - 1) / PREPACKED_ROWS &&
                  packed.size(1) == groups &&
                  (group_bytes == prepacked_group_bytes(true) ||
                   group_bytes == prepacked_group_bytes(false)) &&
                  packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed: (ceil(N / 32), K / 32, 640 or 768) uint8, contiguous (prepack_w4a8)");
  const W8A8Problem p{qx.data_ptr<int8_t>(), x_scales.data_ptr<float>(), x_sums.data_ptr<float>(),
                      1, k, groups, nullptr, k / 2, nullptr, nullptr, groups, n,
                      out.data_ptr<float>(), group_bytes == prepacked_group_bytes(true)};
  run_prepacked(p, find_isa("auto").int4_prepacked, packed, {qx, x_scales, x_sums, packed, out});
}

}  // namespace minivllm
