// Segmented LoRA on a CPU (Punica's SGMV): y[t, slice] += scale * (x[t] A^T) B^T, each token
// with its own adapter, the tokens grouped by adapter slot.
//
// The ref twin (minivllm/ref/lora.py) takes one token at a time: for each token it reads its
// adapter's A (r x in) and B^T (r x out) again and does two matrix-vector products. Here the
// step's tokens arrive grouped by slot (LoRAMapping: sorted_tokens, seg_starts, seg_slots,
// computed once per step and shared by every layer), so a work item is up to TB = 8 tokens of
// ONE slot and ONE output slice, and both products are small register-blocked GEMMs in which
// every weight vector loaded is used for several tokens:
//
// 1. gather the tokens' x rows into a float32 buffer (TB x in);
// 2. shrink, h = scale * x A^T (TB x r): blocks of 2 tokens x 4 rows of A, 8 vectors of
//    8 float32 partial sums in registers, 2 + 4 loads per 8 fused multiply-adds (the same
//    register block as csrc/gemv.cpp's portable path);
// 3. expand, y += h B^T: for each 8 consecutive outputs, one accumulator vector per token
//    stays in registers while the r rows of B^T stream past (B is stored transposed for this:
//    contiguous along the output), one load per TB multiply-adds; then y is read, added to
//    and rounded once into its dtype.
//
// A decode step (one token per adapter) is the gathered GEMV (BGMV): items of one token, the
// 1-token variants of the same blocks. The vectors are GCC/Clang vector extensions, compiled
// for the native instruction set of the build (AVX2 + FMA here; AVX-512 or NEON elsewhere):
// no intrinsics, so this same source is the portable fallback on any other CPU. bf16 weights
// are widened to float32 in registers (a 16-bit shift), fp16 ones element by element. Rank
// rows whose h is zero for every token of the item (a lower-rank adapter's zero padding) are
// skipped in the expand; a slot with scale 0 (an adapter that leaves this slice alone) is
// skipped whole. Work items are spread over threads with parallel_for (thread_team.h); two items never
// write the same elements of y (a token is in one segment; an item owns one slice's columns).
#include "ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <vector>

namespace minivllm {
namespace {

constexpr int64_t TB = 8;  // tokens per work item
constexpr int VL = 8;      // floats per vector
typedef float vecf __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t vecu16 __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t vecu32 __attribute__((vector_size(VL * sizeof(uint32_t))));

struct Item {
  int64_t slice;  // which output slice (its A, B^T, scale and columns of y)
  int64_t slot;   // which adapter slot
  int64_t first;  // its tokens are sorted_tokens[first : first + count]
  int64_t count;
};

// VL consecutive values as float32 (unaligned loads).
inline vecf load_vec(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vecf load_vec(const c10::BFloat16* p) {  // bf16 is float32's top half: zero-extend, shift
  vecu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vecu32 u = __builtin_convertvector(h, vecu32) << 16;
  vecf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
template <typename T>  // fp16 (and float64, which the dispatch macro also instantiates)
inline vecf load_vec(const T* p) {
  vecf v;
  for (int l = 0; l < VL; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
inline float hsum(vecf a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// out[i][j] = x_i . a_j over K floats for TT token rows and 4 rows of A (a short group repeats
// its last row; the caller drops the copies). noinline keeps the 8 accumulators in registers
// (see csrc/gemv.cpp's dot_block).
template <int TT>
__attribute__((noinline)) void shrink_block(const float* const* xr, const float* const* ar,
                                            int64_t K, float out[TT][4]) {
  vecf acc[TT][4] = {};
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vecf xv[TT];
    for (int i = 0; i < TT; ++i) xv[i] = load_vec(xr[i] + k);
    for (int j = 0; j < 4; ++j) {
      const vecf av = load_vec(ar[j] + k);
      for (int i = 0; i < TT; ++i) acc[i][j] += xv[i] * av;  // contracted to FMAs
    }
  }
  for (int i = 0; i < TT; ++i) {
    for (int j = 0; j < 4; ++j) {
      float tail = 0.f;  // the K % VL last elements
      for (int64_t t = k; t < K; ++t) tail += xr[i][t] * ar[j][t];
      out[i][j] = hsum(acc[i][j]) + tail;
    }
  }
}

// acc[t][0:VL] = sum over the listed rank rows j of h[t][j] * bt[j][0:VL], for NT tokens, then
// y_t[0:VL] += acc[t] (rounded once). h is NT x R, zero for padding tokens (never stored).
template <int NT, typename scalar_t>
inline void expand_chunk(const float* h, int64_t R, const int64_t* js, int64_t nj,
                         const scalar_t* bt, int64_t N, scalar_t* const* yr, int64_t n) {
  vecf acc[NT] = {};
  for (int64_t q = 0; q < nj; ++q) {
    const int64_t j = js[q];
    const vecf b = load_vec(bt + j * N);
    for (int t = 0; t < NT; ++t) acc[t] += h[t * R + j] * b;
  }
  for (int64_t t = 0; t < n; ++t)
    for (int l = 0; l < VL; ++l)
      yr[t][l] = static_cast<scalar_t>(static_cast<float>(yr[t][l]) + acc[t][l]);
}

template <int NT, typename scalar_t>
void expand(const float* h, int64_t R, const int64_t* js, int64_t nj, const scalar_t* Bt,
            int64_t N, scalar_t* const* yrow, int64_t n) {
  int64_t o = 0;
  scalar_t* yr[NT];
  for (; o + VL <= N; o += VL) {
    for (int64_t t = 0; t < n; ++t) yr[t] = yrow[t] + o;
    expand_chunk<NT>(h, R, js, nj, Bt + o, N, yr, n);
  }
  for (; o < N; ++o) {  // the N % VL last outputs
    for (int64_t t = 0; t < n; ++t) {
      float acc = 0.f;
      for (int64_t q = 0; q < nj; ++q) acc += h[t * R + js[q]] * static_cast<float>(Bt[js[q] * N + o]);
      yrow[t][o] = static_cast<scalar_t>(static_cast<float>(yrow[t][o]) + acc);
    }
  }
}

template <typename scalar_t>
void lora_item(const Item& it, scalar_t* y, int64_t y_st, int64_t col0, const scalar_t* x,
               int64_t x_st, const scalar_t* a, const scalar_t* bt, float scale, int64_t K,
               int64_t R, int64_t N, const int64_t* tokens, float* xs, float* h, float* abuf,
               int64_t* js) {
  const int64_t n = it.count;
  const scalar_t* A = a + it.slot * R * K;    // (R, K)
  const scalar_t* Bt = bt + it.slot * R * N;  // (R, N): B transposed
  for (int64_t t = 0; t < n; ++t) {  // 1. gather
    const scalar_t* xr = x + tokens[t] * x_st;
    for (int64_t k = 0; k < K; ++k) xs[t * K + k] = static_cast<float>(xr[k]);
  }
  std::fill(h, h + TB * R, 0.f);
  for (int64_t j0 = 0; j0 < R; j0 += 4) {  // 2. shrink, 4 rows of A at a time
    const int64_t rows = std::min<int64_t>(4, R - j0);
    const float* ar[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t jj = j0 + std::min(j, rows - 1);  // a short group repeats its last row
      if constexpr (std::is_same_v<scalar_t, float>) {
        ar[j] = A + jj * K;
      } else {
        float* dst = abuf + j * K;
        if (j < rows) {
          for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(A[jj * K + k]);
        }
        ar[j] = j < rows ? dst : ar[j - 1];
      }
    }
    for (int64_t t0 = 0; t0 < n; t0 += 2) {
      float r2[2][4];
      if (t0 + 1 < n) {
        const float* xr[2] = {xs + t0 * K, xs + (t0 + 1) * K};
        shrink_block<2>(xr, ar, K, r2);
      } else {
        const float* xr[1] = {xs + t0 * K};
        shrink_block<1>(xr, ar, K, r2);
      }
      for (int64_t i = 0; i < std::min<int64_t>(2, n - t0); ++i)
        for (int64_t j = 0; j < rows; ++j) h[(t0 + i) * R + j0 + j] = scale * r2[i][j];
    }
  }
  int64_t nj = 0;  // rank rows that add anything (a padded adapter's zero rows do not)
  for (int64_t j = 0; j < R; ++j) {
    bool any = false;
    for (int64_t t = 0; t < n; ++t) any = any || h[t * R + j] != 0.f;
    if (any) js[nj++] = j;
  }
  if (nj == 0) return;
  scalar_t* yrow[TB];
  for (int64_t t = 0; t < n; ++t) yrow[t] = y + tokens[t] * y_st + col0;
  // 3. expand, with the token count rounded up to 1, 2, 4 or 8 (padding rows of h are 0)
  if (n == 1) {
    expand<1>(h, R, js, nj, Bt, N, yrow, n);
  } else if (n == 2) {
    expand<2>(h, R, js, nj, Bt, N, yrow, n);
  } else if (n <= 4) {
    expand<4>(h, R, js, nj, Bt, N, yrow, n);
  } else {
    expand<8>(h, R, js, nj, Bt, N, yrow, n);
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
  int64_t col = 0, R = 0;
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
    parallel_for(0, num_items, grain_for(work / num_items), [&](int64_t b, int64_t e) {
      std::vector<float> xs(TB * K), h(TB * R), abuf(4 * K);
      std::vector<int64_t> js(R);
      for (int64_t w = b; w < e; ++w) {
        const Item& it = items[w];
        const int64_t i = it.slice;
        lora_item<scalar_t>(it, y.data_ptr<scalar_t>(), y.stride(0), cols[i],
                            x.data_ptr<scalar_t>(), x.stride(0), lora_a[i].data_ptr<scalar_t>(),
                            lora_b[i].data_ptr<scalar_t>(),
                            scalings[i].data_ptr<float>()[it.slot], K, lora_a[i].size(1),
                            output_slices[i], tokens + it.first, xs.data(), h.data(), abuf.data(),
                            js.data());
      }
    });
  });
}

}  // namespace minivllm
