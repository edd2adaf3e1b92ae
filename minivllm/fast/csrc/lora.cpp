// Segmented LoRA on a CPU (Punica's SGMV): y[t, slice] += scale * (x[t] A^T) B^T, each token
// with its own adapter, the tokens grouped by adapter slot.
//
// The ref twin (minivllm/ref/lora.py) takes one token at a time: for each token it reads its
// adapter's A (r x in) and B^T (r x out) again and does two matrix-vector products. Here the
// step's tokens arrive grouped by slot (LoRAMapping: sorted_tokens, seg_starts, seg_slots,
// computed once per step and shared by every layer), so a work item is up to TB tokens of ONE
// slot and ONE output slice, and each row of A and B^T it reads is used for all TB tokens while
// it sits in L1:
//
// 1. gather the tokens' x rows into a float32 buffer (TB x in);
// 2. shrink: h[t][j] = scale * (x_t . A_j) for the r rows of A: dot products along `in`
//    with 16 partial sums (ops.h `dot`), which the compiler vectorises;
// 3. expand: acc[t] += h[t][j] * (B^T)_j for the r rows of B^T: an axpy along `out`, front to
//    back, vectorised the same way (B is stored transposed for exactly this);
// 4. y[t] += acc[t], rounding once into y's dtype.
//
// A decode step (one token per adapter) is the gathered GEMV (BGMV): items of one token. The
// loops are plain C++ that GCC/Clang vectorise at -O3 with the native instruction set the
// build uses (AVX2 + FMA here, AVX-512 or NEON elsewhere), so there are no intrinsics and no
// separate portable path: the same source is the fallback on any other CPU. bf16/fp16 weights
// are widened one row at a time into a float32 row buffer. Rows of h that are zero (a
// lower-rank adapter's padding) skip their expand row; a slot with scale 0 (an adapter that
// leaves this slice alone) is skipped whole. Work items are spread over threads with
// at::parallel_for; two items never write the same elements of y (a token is in one segment,
// and each item owns one slice's columns).
#include "ops.h"

#include <type_traits>
#include <vector>

namespace minivllm {
namespace {

constexpr int64_t TB = 8;  // tokens per work item: each weight row read is used TB times

struct Item {
  int64_t slice;  // which output slice (its A, B^T, scale and columns of y)
  int64_t slot;   // which adapter slot
  int64_t first;  // its tokens are sorted_tokens[first : first + count]
  int64_t count;
};

// A row of n weights as float32: in place for float32, widened into `buf` otherwise.
template <typename scalar_t>
inline const float* float_row(const scalar_t* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

template <typename scalar_t>
void lora_item(const Item& it, scalar_t* y, int64_t y_st, int64_t col0, const scalar_t* x,
               int64_t x_st, const scalar_t* a, const scalar_t* bt, float scale, int64_t K,
               int64_t R, int64_t N, const int64_t* tokens, float* xs, float* h, float* acc,
               float* row) {
  const int64_t n = it.count;
  const scalar_t* A = a + it.slot * R * K;    // (R, K)
  const scalar_t* Bt = bt + it.slot * R * N;  // (R, N): B transposed
  for (int64_t t = 0; t < n; ++t) {  // 1. gather
    const scalar_t* xr = x + tokens[t] * x_st;
    for (int64_t k = 0; k < K; ++k) xs[t * K + k] = static_cast<float>(xr[k]);
  }
  for (int64_t j = 0; j < R; ++j) {  // 2. shrink
    const float* aj = float_row(A + j * K, K, row);
    for (int64_t t = 0; t < n; ++t) h[t * R + j] = scale * dot(xs + t * K, aj, K);
  }
  std::fill(acc, acc + n * N, 0.f);
  for (int64_t j = 0; j < R; ++j) {  // 3. expand
    bool any = false;
    for (int64_t t = 0; t < n; ++t) any = any || h[t * R + j] != 0.f;
    if (!any) continue;  // a zero-padded rank row (or x orthogonal to it): nothing to add
    const float* bj = float_row(Bt + j * N, N, row);
    for (int64_t t = 0; t < n; ++t) {
      const float c = h[t * R + j];
      float* __restrict at = acc + t * N;
      for (int64_t o = 0; o < N; ++o) at[o] += c * bj[o];
    }
  }
  for (int64_t t = 0; t < n; ++t) {  // 4. one rounding into y
    scalar_t* yr = y + tokens[t] * y_st + col0;
    const float* at = acc + t * N;
    for (int64_t o = 0; o < N; ++o) yr[o] = static_cast<scalar_t>(static_cast<float>(yr[o]) + at[o]);
  }
}

}  // namespace

void add_lora(at::Tensor& y, const at::Tensor& x, at::TensorList lora_a, at::TensorList lora_b,
              at::TensorList scalings, const at::Tensor& sorted_tokens,
              const at::Tensor& seg_starts, const at::Tensor& seg_slots,
              at::IntArrayRef output_slices) {
  const int64_t num_slices = static_cast<int64_t>(output_slices.size());
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x (T, in), y (T, out)");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y rows must have unit stride");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(static_cast<int64_t>(lora_a.size()) == num_slices &&
                  static_cast<int64_t>(lora_b.size()) == num_slices &&
                  static_cast<int64_t>(scalings.size()) == num_slices,
              "one lora_a, lora_b and scalings per output slice");
  TORCH_CHECK(sorted_tokens.scalar_type() == at::kLong && seg_starts.scalar_type() == at::kLong &&
                  seg_slots.scalar_type() == at::kLong && sorted_tokens.is_contiguous() &&
                  seg_starts.is_contiguous() && seg_slots.is_contiguous(),
              "the mapping's tensors must be contiguous int64");
  const int64_t K = x.size(1), S = seg_slots.size(0);
  TORCH_CHECK(seg_starts.size(0) == S + 1, "seg_starts must have one entry more than seg_slots");
  int64_t col = 0, width_max = 0, R = 0;
  std::vector<int64_t> cols(num_slices);
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t N = output_slices[i];
    TORCH_CHECK(lora_a[i].dim() == 3 && lora_a[i].size(2) == K && lora_a[i].is_contiguous(),
                "lora_a[i] must be contiguous (max_loras, max_rank, in)");
    TORCH_CHECK(lora_b[i].dim() == 3 && lora_b[i].size(0) == lora_a[i].size(0) &&
                    lora_b[i].size(1) == lora_a[i].size(1) && lora_b[i].size(2) == N &&
                    lora_b[i].is_contiguous(),
                "lora_b[i] must be contiguous (max_loras, max_rank, out_i)");
    TORCH_CHECK(lora_a[i].scalar_type() == x.scalar_type() &&
                    lora_b[i].scalar_type() == x.scalar_type(),
                "the LoRA weights must have x's dtype");
    TORCH_CHECK(scalings[i].scalar_type() == at::kFloat && scalings[i].is_contiguous() &&
                    scalings[i].numel() == lora_a[i].size(0),
                "scalings[i] must be contiguous float32 (max_loras,)");
    cols[i] = col;
    col += N;
    width_max = std::max(width_max, N);
    R = std::max(R, lora_a[i].size(1));
  }
  TORCH_CHECK(col == y.size(1), "y must have sum(output_slices) columns");

  const int64_t* starts = seg_starts.data_ptr<int64_t>();
  const int64_t* slots = seg_slots.data_ptr<int64_t>();
  std::vector<Item> items;
  int64_t work = 0;  // multiply-adds, to size the parallel grain
  for (int64_t i = 0; i < num_slices; ++i) {
    const float* scale = scalings[i].data_ptr<float>();
    const int64_t max_loras = lora_a[i].size(0);
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(slots[s] >= 0 && slots[s] < max_loras, "seg_slots out of range");
      if (scale[slots[s]] == 0.f) continue;  // the adapter leaves this slice alone
      for (int64_t first = starts[s]; first < starts[s + 1]; first += TB) {
        const int64_t count = std::min(TB, starts[s + 1] - first);
        items.push_back({i, slots[s], first, count});
        work += count * lora_a[i].size(1) * (K + output_slices[i]);
      }
    }
  }
  if (items.empty()) return;
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t* tokens = sorted_tokens.data_ptr<int64_t>();

  MINIVLLM_DISPATCH(x.scalar_type(), "add_lora", [&] {
    at::parallel_for(0, num_items, grain_for(work / num_items), [&](int64_t b, int64_t e) {
      std::vector<float> xs(TB * K), h(TB * R), acc(TB * width_max),
          row(std::max(K, width_max));
      for (int64_t w = b; w < e; ++w) {
        const Item& it = items[w];
        const int64_t i = it.slice;
        lora_item<scalar_t>(it, y.data_ptr<scalar_t>(), y.stride(0), cols[i],
                            x.data_ptr<scalar_t>(), x.stride(0), lora_a[i].data_ptr<scalar_t>(),
                            lora_b[i].data_ptr<scalar_t>(),
                            scalings[i].data_ptr<float>()[it.slot], K, lora_a[i].size(1),
                            output_slices[i], tokens + it.first, xs.data(), h.data(), acc.data(),
                            row.data());
      }
    });
  });
}

}  // namespace minivllm
