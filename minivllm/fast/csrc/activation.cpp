// SiLU-and-mul on a CPU: out = silu(gate) * up for rows [gate | up].
//
// One pass: reads gate and up once and writes the output once, in float32 with
// a single rounding at the end (the ref's ``F.silu(gate) * up`` writes and
// re-reads a silu intermediate). The exponential is fast_exp (ops.h), so the
// loop vectorises. Rows, and chunks of long rows, are spread over threads.
#include "ops.h"

namespace minivllm {

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1 && input.size(1) % 2 == 0,
              "input: (rows, 2 * I) with unit column stride");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == input.size(0) &&
                  out.size(1) == input.size(1) / 2 && out.is_contiguous() &&
                  out.scalar_type() == input.scalar_type(),
              "out: (rows, I), contiguous, input's dtype");
  const int64_t rows = input.size(0), inter = out.size(1);
  constexpr int64_t CHUNK = 1024;  // features per unit of parallel work
  const int64_t chunks = (inter + CHUNK - 1) / CHUNK;
  MINIVLLM_DISPATCH(input.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0);
    const int64_t grain = grain_for(std::min(CHUNK, inter));
    parallel_for(0, rows * chunks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t r = w / chunks, i0 = (w % chunks) * CHUNK;
        const int64_t i1 = std::min(i0 + CHUNK, inter);
        const scalar_t* gate = x + r * xs;
        const scalar_t* up = gate + inter;
        scalar_t* dst = o + r * inter;
        // BEGIN SOLUTION
        for (int64_t i = i0; i < i1; ++i) {
          const float g = static_cast<float>(gate[i]);
          dst[i] = static_cast<scalar_t>(g / (1.f + fast_exp(-g)) * static_cast<float>(up[i]));
        }
        // END SOLUTION
      }
    });
  });
}

}  // namespace minivllm
