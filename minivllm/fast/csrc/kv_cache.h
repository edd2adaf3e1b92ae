// The KV cache's element types on a CPU: a float cache, or a quantized one (int8 or
// float8 e4m3) with one float32 scale per (token, KV head) row beside it.
//
// The format and the formula are minivllm/kv_quant.py's (read its docstring):
//
//   write:  s = max|x| / QMAX  (127 for int8, 448 for e4m3),  q = round(x / s)
//   read:   x' = q * s
//
// in float32, x / s a true division, ties to even, so the codes and the scales
// here are the ref's bit for bit, and so are the rows dequantize_row makes. The
// kernels never make a dequantized copy of the cache: a row is widened into a small
// float32 buffer in L1 when it is used, so the cache is read in its own 1 byte an
// element, and decode takes the scale out of the dot products (one multiply per key,
// not per element: s (q . k) for the score, p s for the value's weight).
#pragma once

#include "ops.h"

#include <c10/util/Float8_e4m3fn.h>

#include <type_traits>

namespace minivllm {

using fp8_e4m3 = c10::Float8_e4m3fn;

// True for the quantized element types (a cache with scales).
template <typename cache_t>
constexpr bool is_quantized_v = std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, fp8_e4m3>;

// The largest code: s = max|x| / qmax.
template <typename cache_t>
constexpr float qmax_v = std::is_same_v<cache_t, int8_t> ? 127.f : 448.f;

// An e4m3 byte as the float32 it stands for, in integer and float arithmetic that
// vectorises (c10's conversion branches per element; a 256-entry table is a gather
// per element, which made fp8 decode slower than float32). |x|'s 7 bits moved into a
// float's exponent and mantissa fields, the exponent rebiased (7 -> 127), for normal
// codes; a subnormal code (exponent field 0) is m * 2^-9. The NaN codes (0x7F, 0xFF)
// decode as +-480: the cache write never makes one.
inline float fp8_e4m3_to_float(uint8_t byte) {
  const uint32_t mag = byte & 0x7Fu;
  const uint32_t bits = (mag << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float subnormal = static_cast<float>(static_cast<int32_t>(mag)) * 0.001953125f;
  const float x = mag < 8 ? subnormal : normal;
  return (byte & 0x80u) ? -x : x;
}

// dst[i] = row[i] as float32: the codes of a quantized row (its scale not applied),
// any other row widened.
template <typename cache_t>
inline void widen_row(const cache_t* __restrict row, float* __restrict dst, int64_t n) {
  if constexpr (std::is_same_v<cache_t, fp8_e4m3>) {
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(row);
    for (int64_t i = 0; i < n; ++i) dst[i] = fp8_e4m3_to_float(bits[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(row[i]);
  }
}

// dst[i] = row[i] as float32: a quantized row's codes times its scale (x' = q * s,
// the ref's value bit for bit), any other row widened (scale unused).
template <typename cache_t>
inline void dequantize_row(const cache_t* __restrict row, float scale, float* __restrict dst,
                           int64_t n) {
  widen_row(row, dst, n);
  if constexpr (is_quantized_v<cache_t>) {
    for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
  }
}

// A cached row as float32 (a quantized row's codes, unscaled): a float32 cache's row
// itself, read in place; any other widened into buf.
template <typename cache_t>
inline const float* row_as_float(const cache_t* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else {
    widen_row(row, buf, n);
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
