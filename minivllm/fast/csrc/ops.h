// The C++ CPU kernels of minivllm: declarations and the small helpers they share.
//
// Every kernel works on float32, float16 and bfloat16 tensors and accumulates in
// float32. The loops are written so that the compiler can vectorise them at -O3
// (no intrinsics): element-wise loops over contiguous rows, and reductions that
// keep LANES partial sums side by side instead of one running sum (a single sum
// is a dependency chain the compiler may not reorder without -ffast-math).
// Work is split over threads with minivllm::parallel_for (thread_team.h): a team
// that tolerates a busy core, with at::parallel_for's arguments.
#pragma once

// Only the headers the kernels need (not <torch/all.h>): it halves the build time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "thread_team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // sysconf: the L1's size (prefetch_into_l1)
#endif

namespace minivllm {

// Input features per activation scale of W8A8 / W4A8 (quant_w8a8.cpp quantizes with it,
// layer_stack.cpp sizes its buffers by it); act_group_size() lets a test check it against
// the ref's ACT_GROUP_SIZE.
constexpr int64_t ACT_GROUP_SIZE = 32;

// Rows up to which a float projection runs the GEMV (gemv.cpp); above it, the panel GEMM
// where the weight has panels. Python's minivllm.fast.linear_kernel.FLOAT_GEMV_MAX_ROWS;
// float_gemv_max_rows() lets a test check that the two agree.
constexpr int64_t FLOAT_GEMV_MAX_ROWS = 16;

// Partial sums kept side by side in a reduction: one 512-bit vector of floats.
constexpr int LANES = 16;

// Elements of work below which a loop stays on the calling thread (ATen's own
// threshold): waking the thread pool costs more than small memory-bound loops
// gain from it, and far more when the machine is oversubscribed.
constexpr int64_t GRAIN_ELEMENTS = 32768;

// The parallel_for grain for items of `per_item` elements each.
inline int64_t grain_for(int64_t per_item) {
  return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, per_item));
}

// Where a kernel that streams weights prefetches a block ahead: into L2 (_MM_HINT_T1), or
// into L1 (_MM_HINT_T0) where this returns true: on an AMD CPU, for a block and the next
// together of `bytes`, if they fit in half of the core's L1 data cache (the vendor and
// L1's size are read once). The W8A8 tiles at one row of x ask it (quant_w8a8.cpp). On
// the Xeon a prefetch into L1 held one of the core's few L1 fill buffers until memory
// answered, and L2 read a core's int8 rows at 88% of its read bandwidth against 75%; on a Zen 4
// EPYC L1 made a batch-1 gguf step about 10% faster, and int8's down projection (two
// tiles of 1536-byte rows: 24 KB of its 32 KB L1) 15% slower (docs/kernels.md, "The
// decode-shaped linear").
inline bool prefetch_into_l1(int64_t bytes) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && defined(_SC_LEVEL1_DCACHE_SIZE)
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  static const int64_t l1 = [] {
    const long size = sysconf(_SC_LEVEL1_DCACHE_SIZE);  // 0 where the system does not say
    return size > 0 ? static_cast<int64_t>(size) : int64_t{32 * 1024};
  }();
  return amd && bytes <= l1 / 2;
#else
  (void)bytes;
  return false;
#endif
}

// Dispatch on float32 / float16 / bfloat16 (scalar_t inside the lambda).
#define MINIVLLM_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// Sum of LANES partial sums as a tree (8 + 8, 4 + 4, ...): each step is an
// element-wise add the compiler vectorises; a plain loop would be 16 serial adds.
// The steps are spelled out with constant bounds: written as a loop over the
// width, GCC kept it a scalar loop through the stack, which cost decode
// attention (one reduction per key and query head) half its time.
inline float reduce_lanes(float* acc) {
  static_assert(LANES == 16, "the tree below is written for 16 lanes");
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
  for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
  for (int l = 0; l < 2; ++l) acc[l] += acc[l + 2];
  return acc[0] + acc[1];
}

// sum_i a[i] * b[i] over n floats, with LANES independent partial sums.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];  // the tail
  return reduce_lanes(acc);
}

// sum_i x[i]^2 over n elements of any dtype, in float32.
template <typename scalar_t>
inline float sum_of_squares(const scalar_t* __restrict x, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; ++l) {
      const float v = static_cast<float>(x[i + l]);
      acc[l] += v * v;
    }
  }
  for (int l = 0; i + l < n; ++l) {  // the tail
    const float v = static_cast<float>(x[i + l]);
    acc[l] += v * v;
  }
  return reduce_lanes(acc);
}

// e^x for float32 in plain arithmetic (Cody-Waite range reduction + a degree-6
// polynomial, relative error ~2e-7), so loops calling it vectorise; std::exp is
// an opaque library call that keeps a loop scalar, and so are std::floor and
// std::fmax without -ffast-math, hence the ternaries and the rounding trick.
// Returns 0 for x <= -87 (and for -inf).
inline float fast_exp(float x) {
  const bool underflow = x <= -87.0f;
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // k = round(x / ln 2): adding 1.5 * 2^23 pushes the fraction bits out.
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;  // x - k ln 2
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;  // e^r for |r| <= ln2 / 2
  // Multiply by 2^k by building the float's exponent bits directly.
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

// The ops, as registered in torch_bindings.cpp (schemas there).
void paged_attention(at::Tensor& out, const at::Tensor& query,
                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, bool gemm_prefill,
                     const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale);
void copy_blocks(at::TensorList k_caches, at::TensorList v_caches,
                 const at::Tensor& block_mapping);
void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double eps);
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual,
                        const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& input);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_sin_cache, bool is_neox);
void linear_small_m(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool portable);
bool gemv_has_avx512_bf16();
// float32 GEMM over weight panels packed at load (gemm_panels.cpp); width 0: not built.
int64_t gemm_panels_width();
void gemm_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                 const std::optional<at::Tensor>& bias);
void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& scales, bool portable);
void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& scales, const at::Tensor& mins, bool portable);
// W8A8 (quant_w8a8.cpp): int8 activations per token and group of 32, integer dot products.
std::vector<std::string> w8a8_isas();
void quantize_activations_int8(at::Tensor& q, at::Tensor& scales, at::Tensor& sums,
                               const at::Tensor& x, std::string_view isa);
void w8a8_linear(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                 const at::Tensor& qweight, const at::Tensor& scales, std::string_view isa);
void w4a8_linear(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                 const at::Tensor& x_sums, const at::Tensor& qweight, const at::Tensor& scales,
                 const at::Tensor& mins, std::string_view isa);
// One row of x times an int8 or 4-bit weight prepacked at load (quant_w8a8_prepacked.h),
// where the CPU has AVX512-VNNI (w8a8_prepacked_available). `scales`: the weight's own.
bool w8a8_prepacked_available();
void w8a8_linear_prepacked(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                           const at::Tensor& packed, const at::Tensor& scales);
void w4a8_linear_prepacked(at::Tensor& out, const at::Tensor& qx, const at::Tensor& x_scales,
                           const at::Tensor& x_sums, const at::Tensor& packed);
void dequantize_int8(at::Tensor& out, const at::Tensor& qweight, const at::Tensor& scales);
void dequantize_int4(at::Tensor& out, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& mins);
void add_lora(at::Tensor& y, const at::Tensor& x, at::TensorList lora_a, at::TensorList lora_b,
              at::TensorList scalings, const at::Tensor& sorted_tokens,
              const at::Tensor& seg_starts, const at::Tensor& seg_slots,
              at::IntArrayRef output_slices);
// The projection kinds decode_layers takes, in the order of their numbers.
std::vector<std::string> decode_layers_kinds();
int64_t act_group_size();
int64_t float_gemv_max_rows();
std::string cpu_parallel_mode(std::string_view name);
std::vector<int64_t> cpu_team_stats();
int64_t parallel_for_coverage(at::Tensor& counts, int64_t grain, int64_t throw_at,
                              int64_t helper_delay_us, int64_t caller_delay_us, bool revocable);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
// Each row's argmax, as torch.argmax(dim=-1): (N, V) float32 -> (N,) int64 (argmax.cpp).
at::Tensor argmax_rows(const at::Tensor& logits);

}  // namespace minivllm
