// reshape_and_cache on a CPU: scatter each token's K/V rows into its cache slot.
//
// Token t writes its (H_kv, D) key and value rows to slot slot_mapping[t]
// (block slot / block_size, offset slot % block_size); slot -1 is padding and
// is skipped. Unlike the ref (boolean mask, compacted copies, then an indexed
// assignment) it reads each element once and writes it once, with no
// temporaries, and tokens are copied in parallel.
//
// A quantized cache (int8 / fp8 e4m3, kv_cache.h): each (token, KV head) row is
// quantized on its way in, its codes to the cache slot and its float32 scale to
// the same slot of k_scale / v_scale, in the same pass.
#include "kv_cache.h"
#include "ops.h"

namespace minivllm {

template <typename scalar_t>
void cache_write_kernel(const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k_src = key.data_ptr<scalar_t>();
  const scalar_t* v_src = value.data_ptr<scalar_t>();
  scalar_t* k_dst = k_cache.data_ptr<scalar_t>();
  scalar_t* v_dst = v_cache.data_ptr<scalar_t>();
  const int64_t k_st = key.stride(0), k_sh = key.stride(1);
  const int64_t v_st = value.stride(0), v_sh = value.stride(1);
  const int64_t c_sb = k_cache.stride(0), c_ss = k_cache.stride(1), c_sh = k_cache.stride(2);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {  // a bad slot would write outside the cache
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the cache's ", num_slots);
  }

  const int64_t grain = grain_for(2 * num_kv_heads * head_dim);
  parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding row
      const int64_t base = (slot / block_size) * c_sb + (slot % block_size) * c_ss;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::memcpy(k_dst + base + h * c_sh, k_src + t * k_st + h * k_sh, row_bytes);
        std::memcpy(v_dst + base + h * c_sh, v_src + t * v_st + h * v_sh, row_bytes);
      }
    }
  });
}

// The same scatter into a quantized cache: each row quantized on the way (kv_cache.h).
template <typename scalar_t, typename cache_t>
void cache_write_quantized_kernel(const at::Tensor& key, const at::Tensor& value,
                                  at::Tensor& k_cache, at::Tensor& v_cache,
                                  const at::Tensor& slot_mapping, float* k_scale,
                                  float* v_scale) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k_src = key.data_ptr<scalar_t>();
  const scalar_t* v_src = value.data_ptr<scalar_t>();
  cache_t* k_dst = reinterpret_cast<cache_t*>(k_cache.data_ptr());
  cache_t* v_dst = reinterpret_cast<cache_t*>(v_cache.data_ptr());
  const int64_t k_st = key.stride(0), k_sh = key.stride(1);
  const int64_t v_st = value.stride(0), v_sh = value.stride(1);
  const int64_t c_sb = k_cache.stride(0), c_ss = k_cache.stride(1), c_sh = k_cache.stride(2);
  const int64_t num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {  // a bad slot would write outside the cache
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the cache's ", num_slots);
  }

  const int64_t grain = grain_for(2 * num_kv_heads * head_dim);
  parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding row
      const int64_t base = (slot / block_size) * c_sb + (slot % block_size) * c_ss;
      for (int64_t h = 0; h < num_kv_heads; ++h) {  // scales: (num_slots, H_kv), contiguous
        k_scale[slot * num_kv_heads + h] =
            quantize_row(k_src + t * k_st + h * k_sh, k_dst + base + h * c_sh, head_dim);
        v_scale[slot * num_kv_heads + h] =
            quantize_row(v_src + t * v_st + h * v_sh, v_dst + base + h * c_sh, head_dim);
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value: (T, H_kv, D)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.strides() == v_cache.strides(),
              "k_cache/v_cache: (num_blocks, block_size, H_kv, D) with shared strides");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "cache heads/head_dim must match key's");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1,
              "head_dim must have unit stride");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.stride(0) == 1,
              "slot_mapping: (T,) int64");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "key and value must share a dtype, and so must the caches");
  const auto [ks, vs] = cache_scales(k_cache, k_scale, v_scale);
  if (ks == nullptr) {
    TORCH_CHECK(key.scalar_type() == k_cache.scalar_type(),
                "key, value and a float cache must share a dtype");
    MINIVLLM_DISPATCH(key.scalar_type(), "reshape_and_cache", [&] {
      cache_write_kernel<scalar_t>(key, value, k_cache, v_cache, slot_mapping);
    });
    return;
  }
  MINIVLLM_DISPATCH(key.scalar_type(), "reshape_and_cache", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&](auto tag) {
      using cache_t = typename decltype(tag)::type;
      if constexpr (is_quantized_v<cache_t>) {
        cache_write_quantized_kernel<scalar_t, cache_t>(key, value, k_cache, v_cache,
                                                        slot_mapping, ks, vs);
      }
    });
  });
}

}  // namespace minivllm
