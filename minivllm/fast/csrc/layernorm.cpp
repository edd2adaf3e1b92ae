// RMSNorm and residual-add + RMSNorm on a CPU, one pass over each row.
//
// rms_norm(x) = x / sqrt(mean(x^2) + eps) * weight, with the ref's rounding:
// the mean of squares and the scaling in float32, the normed row rounded to the
// input dtype, then multiplied by the weight in float32 and rounded once (the
// product of two 16-bit floats is exact in float32, so this matches the ref's
// ``weight * normed`` bit for bit).
//
// The fused op follows the fast twin's contract: ``residual`` becomes
// ``x + residual`` (rounded to the dtype) and ``input`` is overwritten by the
// normed output, so the decoder layer's add + norm reads two rows and writes two
// rows (the minimum) and allocates nothing. Rows are spread over threads.
#include "ops.h"

namespace minivllm {

// out = rms_norm(x) for one row (out may alias x).
template <typename scalar_t>
inline void norm_row(scalar_t* out, const scalar_t* x, const scalar_t* weight, int64_t hidden,
                     float eps) {
  const float inv_rms = 1.f / std::sqrt(sum_of_squares(x, hidden) / hidden + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * inv_rms);
    out[i] = static_cast<scalar_t>(static_cast<float>(normed) * static_cast<float>(weight[i]));
  }
}

static void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "input: (rows, hidden) with unit column stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight: (hidden,)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "input and weight must share a dtype");
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double eps) {
  check(input, weight);
  TORCH_CHECK(out.sizes() == input.sizes() && out.stride(1) == 1 &&
                  out.scalar_type() == input.scalar_type(),
              "out must match input");
  const int64_t rows = input.size(0), hidden = input.size(1);
  MINIVLLM_DISPATCH(input.scalar_type(), "rms_norm", [&] {
    const scalar_t* x = input.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), os = out.stride(0);
    parallel_for(0, rows, grain_for(hidden), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        norm_row(o + r * os, x + r * xs, w, hidden, static_cast<float>(eps));
      }
    });
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  check(input, weight);
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == input.scalar_type(),
              "residual must match input");
  const int64_t rows = input.size(0), hidden = input.size(1);
  MINIVLLM_DISPATCH(input.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), rs = residual.stride(0);
    parallel_for(0, rows, grain_for(hidden), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* xr = x + r * xs;
        scalar_t* rr = res + r * rs;
        for (int64_t i = 0; i < hidden; ++i) {  // the sum is rounded, as ``x + residual`` is
          rr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        }
        norm_row(xr, rr, w, hidden, static_cast<float>(eps));  // normed output into x
      }
    });
  });
}

}  // namespace minivllm
