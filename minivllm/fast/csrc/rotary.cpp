// Rotary position embedding on a CPU, in place on query and key.
//
// Token t's features are rotated in pairs by the angles whose cosines and sines
// are in cos_sin_cache[positions[t]] = [cos | sin] (rotary_dim float32s). NeoX
// style pairs feature i with i + rotary_dim / 2; GPT-J style pairs 2i with
// 2i + 1. Features past rotary_dim are left alone. Unlike the ref (gather,
// split, upcast, rotate, concatenate: a dozen ops and two new tensors) it reads
// and writes each rotated element once, in place, and reads the token's cos/sin
// row once for all its heads. Tokens are spread over threads.
#include "ops.h"

namespace minivllm {

template <typename scalar_t>
inline void rotate_heads(scalar_t* x, int64_t num_heads, int64_t head_stride, const float* cos,
                         const float* sin, int64_t half, bool is_neox) {
  // Offsets of the two features of pair i: (i, i + half) or (2i, 2i + 1).
  const int64_t step = is_neox ? 1 : 2, second = is_neox ? half : 1;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* row = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(row[i * step]);
      const float x2 = static_cast<float>(row[i * step + second]);
      row[i * step] = static_cast<scalar_t>(x1 * cos[i] - x2 * sin[i]);
      row[i * step + second] = static_cast<scalar_t>(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key.size(0) == query.size(0),
              "query/key: (T, heads, D) with the same T");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "head_dim must have unit stride");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == query.size(0) && positions.stride(0) == 1,
              "positions: (T,) int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.stride(1) == 1 && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) <= std::min(query.size(2), key.size(2)),
              "cos_sin_cache: (max_position, rotary_dim) float32, rotary_dim even <= head_dim");
  const int64_t num_tokens = query.size(0), half = cos_sin_cache.size(1) / 2;
  const int64_t max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside [0, ", max_pos,
                ")");
  }
  MINIVLLM_DISPATCH(query.scalar_type(), "rotary_embedding", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    const float* cache = cos_sin_cache.data_ptr<float>();
    const int64_t cs = cos_sin_cache.stride(0);
    const int64_t per_token = (query.size(1) + key.size(1)) * half * 2;
    parallel_for(0, num_tokens, grain_for(per_token), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cache + pos[t] * cs;
        const float* sin = cos + half;
        rotate_heads(q + t * query.stride(0), query.size(1), query.stride(1), cos, sin, half,
                     is_neox);
        rotate_heads(k + t * key.stride(0), key.size(1), key.stride(1), cos, sin, half, is_neox);
      }
    });
  });
}

}  // namespace minivllm
