// The KV cache's element types on a CPU: a float cache, or a quantized one (int8 or
// float8 e4m3) with one float32 scale per (token, KV head) row beside it.
//
// The format and the formula are minivllm/kv_quant.py's (read its docstring):
//
//   write:  s = max|x| / QMAX  (127 for int8, 448 for e4m3),  q = round(x / s)
//   read:   x' = q * s
//
// in float32, x / s a true division, ties to even, so the codes, the scales and
// the dequantized rows here are the ref's bit for bit. The kernels never make a
// dequantized copy of the cache: a row is widened (and scaled) into a small float32
// buffer in L1 when it is used, so the cache is read in its own 1 byte an element.
#pragma once

#include "ops.h"

#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <type_traits>

namespace minivllm {

using fp8_e4m3 = c10::Float8_e4m3fn;

// True for the quantized element types (a cache with scales).
template <typename cache_t>
constexpr bool is_quantized_v = std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, fp8_e4m3>;

// The largest code: s = max|x| / qmax.
template <typename cache_t>
constexpr float qmax_v = std::is_same_v<cache_t, int8_t> ? 127.f : 448.f;

// Every e4m3 byte as a float32 (256 entries, 1 KiB: stays in L1). c10's conversion
// decodes bit fields with branches per element; a table lookup is one load.
inline const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(fp8_e4m3(static_cast<uint8_t>(i), fp8_e4m3::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// dst[i] = row[i] as float32: a quantized row's codes times its scale (x' = q * s),
// any other row widened (scale unused).
template <typename cache_t>
inline void dequantize_row(const cache_t* __restrict row, float scale, float* __restrict dst,
                           int64_t n) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(row[i]) * scale;
  } else if constexpr (std::is_same_v<cache_t, fp8_e4m3>) {
    const float* table = fp8_e4m3_table();
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(row);
    for (int64_t i = 0; i < n; ++i) dst[i] = table[bits[i]] * scale;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(row[i]);
  }
}

// A cached row as float32: a float32 cache's row itself, read in place; any other
// dequantized (or widened) into buf.
template <typename cache_t>
inline const float* row_as_float(const cache_t* row, float scale, float* buf, int64_t n) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else {
    dequantize_row(row, scale, buf, n);
    return buf;
  }
}

// Quantize one row of n values into codes q; returns its scale s = max|x| / qmax
// (0 for a row of zeros, whose codes are 0).
template <typename cache_t, typename scalar_t>
inline float quantize_row(const scalar_t* __restrict x, cache_t* __restrict q, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
  const float scale = amax / qmax_v<cache_t>;
  const float div = scale > 0.f ? scale : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(x[i]) / div;  // a true division, as the ref's x / s
    if constexpr (std::is_same_v<cache_t, int8_t>) {
      // nearbyint rounds ties to even (the default rounding mode), as torch.round.
      q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.f, 127.f));
    } else {
      q[i] = fp8_e4m3(y);  // c10's conversion: what torch's .to(float8_e4m3fn) calls
    }
  }
  return scale;
}

// Calls f(tag) with decltype(tag)::type the cache's element type: int8_t, fp8_e4m3,
// or (a float cache) scalar_t, the query's dtype, which a float cache must share.
template <typename T>
struct TypeTag {
  using type = T;
};

template <typename scalar_t, typename F>
inline void with_cache_type(at::ScalarType cache, F&& f) {
  if (cache == at::kChar) {
    f(TypeTag<int8_t>{});
  } else if (cache == at::kFloat8_e4m3fn) {
    f(TypeTag<fp8_e4m3>{});
  } else {
    TORCH_CHECK(cache == c10::CppTypeToScalarType<scalar_t>::value,
                "a float cache must have the activations' dtype, got ", cache);
    f(TypeTag<scalar_t>{});
  }
}

// The scale tensors of a quantized cache: both given, float32 (num_blocks, block_size,
// H_kv), contiguous; a float cache has none. Returns the two pointers (null for none).
inline std::pair<float*, float*> cache_scales(
    const at::Tensor& k_cache, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const bool quantized =
      k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_scale.has_value() == quantized && v_scale.has_value() == quantized,
              quantized ? "an int8 / fp8 cache needs k_scale and v_scale"
                        : "k_scale / v_scale are for an int8 / fp8 cache only");
  if (!quantized) return {nullptr, nullptr};
  for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
                    s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) &&
                    s->size(2) == k_cache.size(2),
                "k_scale / v_scale: contiguous float32 (num_blocks, block_size, H_kv)");
  }
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}

}  // namespace minivllm
