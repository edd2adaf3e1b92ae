// The decoder's layer stack for a decode step, in one C++ call.
//
// At batch 1 a SmolLM2 decode step runs 30 layers of 10 kernels each, and most
// kernels are microseconds of work. Calling them one by one from Python
// (the model's own forward, minivllm/model/llama.py) costs a few microseconds each in the
// interpreter and the dispatcher, which on a 30-layer model adds up to
// milliseconds a step: more than the kernels of a small model. A GPU replays a
// recorded CUDA graph to skip that; a CPU can simply run the same loop in C++.
//
// decode_layers is that loop, calling the very C++ functions the Python loop
// calls through torch.ops (declared in ops.h), on the same inputs, in the same
// order, so the result is bit for bit the Python loop's:
//
//   for each layer:
//     hidden = rms_norm(residual)              (layer 0; later: residual += hidden first)
//     qkv = hidden W_qkv^T ; rope(q, k) ; write k, v into the paged cache (quantized
//                                              into an int8 / fp8 cache, with its scales)
//     attn = paged_attention(q, cache) ; hidden = attn W_o^T
//     residual += hidden ; hidden = rms_norm(residual)
//     hidden = silu_and_mul(hidden W_gate_up^T) W_down^T
//
// With LoRA adapters (minivllm/lora/layers.py) each of the four projections adds, right after
// its base matmul, every token's own adapter delta: add_lora (lora.cpp, the op the model's
// ProjectionLoRA calls) on the layer's stacks, which are bound once (the manager fills their
// slots in place), and the step's token -> slot map (sorted_tokens, seg_starts, seg_slots;
// None: no token has an adapter in this step).
//
// A projection is float (the small-M GEMV, gemv.cpp; for a float32 weight with panels, the
// panel GEMM above its rows, gemm_panels.cpp) or quantized (int8 / int4 weights,
// quant.cpp; or W8A8 / W4A8, quant_w8a8.cpp: the activations quantized per token first);
// the Python side (fast/model_runner.py) calls this only where every
// projection would take one of those ops anyway (few rows, no bias, one rank),
// and passes which kind each one is. Buffers for q/k/v, the attention output,
// gate/up and the activation are allocated once per call and reused by every
// layer.
//
// Around the layers, the call also does what the model's forward and its compute_logits
// do, where Python binds them: the embedding lookup (a row copy, as F.embedding; None:
// the caller filled `residual`), the final norm, and the LM head on the rows to sample
// (logits_indices), as float32 logits. Each of those was a Python call of its own, and
// after a step's 540 MB of weights every Python call runs from cold caches: at batch 1
// in float32 they cost ~0.35 ms a step (docs/kernels.md, "The host between two C++ calls").
#include "layer_stack_clock.h"
#include "ops.h"

#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <iterator>
#include <optional>

namespace minivllm {
namespace {

// Projection kinds. This table is the only numbering: Python reads the names in this
// order (decode_layers_kinds()) and passes each projection's index
// (fast/linear_kernel.py decides the kind, fast/model_runner.py packs it).
enum Kind : int64_t {
  FLOAT_WEIGHT,  // "float": weight (N, K) float32 / bf16; then its gemm_panels panels
                 // (P, K, width) where it has them, else the weight again
  INT8_WEIGHT,   // "w8a16": qweight int8 (N, K), scales (N, G)
  INT4_WEIGHT,   // "w4a16": qweight uint8 (N, K / 2), scales and mins (N, K / 32)
  INT8_W8A8,     // "w8a8": w8a16's tensors; int8 activations; then its prepacked copy
                 // (prepack_w8a8: one row of x reads it) where it has one, else qweight
  INT4_W4A8,     // "w4a8": w4a16's tensors; int8 activations; then its copy (prepack_w4a8)
  NUM_KINDS
};
constexpr const char* KIND_NAMES[NUM_KINDS] = {"float", "w8a16", "w4a16", "w8a8", "w4a8"};
constexpr int64_t TENSORS_PER_PROJECTION = 4;  // weight or qweight, scales, mins, packed
constexpr int64_t PROJECTIONS_PER_LAYER = 4;   // qkv, o, gate_up, down

// A quantized projection's buffers, made at its first layer and reused by the others (every
// layer's projection p has the same shapes): the activations as int8 with their scales and
// sums (W8A8 / W4A8), and a float32 output where y is bf16 / fp16. At batch 1 a step runs
// 120 projections of a few microseconds of work each; making these per call cost ~8% of it.
struct Scratch {
  at::Tensor qx, xs, xsum, out;
};

// y = out, rounded to y's dtype as y.copy_(out) does (to nearest even), without the
// dispatcher's microsecond a call.
void store_rounded(at::Tensor& y, const at::Tensor& out) {
  const float* src = out.data_ptr<float>();
  MINIVLLM_DISPATCH(y.scalar_type(), "decode_layers", [&] {
    scalar_t* dst = y.data_ptr<scalar_t>();
    for (int64_t i = 0; i < y.numel(); ++i) dst[i] = static_cast<scalar_t>(src[i]);
  });
}

// y (M, N) = x (M, K) W^T through the op the Python path uses for a few rows. A
// quantized op writes float32; like quantized_linear's .to(x.dtype), a bf16 y gets a
// rounded copy.
void project(at::Tensor& y, const at::Tensor& x, int64_t kind, const at::Tensor* t, Scratch& s) {
  if (kind == FLOAT_WEIGHT) {  // the linear forward's rule: the GEMV, then the panels
    if (x.size(0) > FLOAT_GEMV_MAX_ROWS && t[1].dim() == 3) {
      gemm_panels(y, x, t[1], std::nullopt);
    } else {
      linear_small_m(y, x, t[0], std::nullopt, false);
    }
    return;
  }
  TORCH_CHECK(kind > FLOAT_WEIGHT && kind < NUM_KINDS, "decode_layers: unknown kind ", kind);
  const bool float_out = y.scalar_type() == at::kFloat;
  if (!float_out && !s.out.defined()) {
    s.out = at::empty(y.sizes(), y.options().dtype(at::kFloat));
  }
  at::Tensor& out = float_out ? y : s.out;
  if (kind == INT8_WEIGHT) {
    int8_linear(out, x, t[0], t[1], /*portable=*/false);
  } else if (kind == INT4_WEIGHT) {
    int4_linear(out, x, t[0], t[1], t[2], /*portable=*/false);
  } else {  // W8A8 / W4A8: x to int8 per token and group, as quantize_activations does
    if (!s.qx.defined()) {
      const int64_t m = x.size(0), groups = x.size(1) / ACT_GROUP_SIZE;
      s.qx = at::empty(x.sizes(), x.options().dtype(at::kChar));
      s.xs = at::empty({m, groups}, x.options().dtype(at::kFloat));
      s.xsum = at::empty({m, groups}, x.options().dtype(at::kFloat));
    }
    quantize_activations_int8(s.qx, s.xs, s.xsum, x, "auto");
    const bool prepacked = x.size(0) == 1 && !t[3].is_same(t[0]);  // a copy made at load
    if (prepacked && kind == INT8_W8A8) {
      w8a8_linear_prepacked(out, s.qx, s.xs, t[3], t[1]);
    } else if (prepacked) {
      w4a8_linear_prepacked(out, s.qx, s.xs, s.xsum, t[3]);
    } else if (kind == INT8_W8A8) {
      w8a8_linear(out, s.qx, s.xs, t[0], t[1], "auto");
    } else {
      w4a8_linear(out, s.qx, s.xs, s.xsum, t[0], t[1], t[2], "auto");
    }
  }
  if (!float_out) store_rounded(y, out);
}

// The step's adapters, if any: y += each token's delta (add_lora) for projection p, whose
// output slices are lora_a/lora_b/lora_scalings[first[p] : first[p] + lora_slices[p]].
struct LoRA {
  at::TensorList a, b, scalings;
  at::IntArrayRef slices;
  at::IntArrayRef first;  // per projection, its first slice
  const at::Tensor *sorted_tokens = nullptr, *seg_starts = nullptr, *seg_slots = nullptr;

  void add(at::Tensor& y, const at::Tensor& x, int64_t p) const {
    if (sorted_tokens == nullptr || slices.empty()) return;
    const int64_t n = slices[p], f = first[p];
    std::vector<int64_t> widths(n);  // each slice's columns of y
    for (int64_t i = 0; i < n; ++i) widths[i] = b[f + i].size(2);
    add_lora(y, x, a.slice(f, n), b.slice(f, n), scalings.slice(f, n), *sorted_tokens,
             *seg_starts, *seg_slots, widths);
  }
};

// dst[i] = src[rows[i]] for i < n: whole rows of two contiguous 2-D tensors of one dtype.
void copy_rows(at::Tensor& dst, const at::Tensor& src, const int64_t* rows, int64_t n) {
  const auto bytes = static_cast<size_t>(src.size(1) * src.element_size());
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(to + i * bytes, from + rows[i] * bytes, bytes);
}

// residual (T, hidden) = the embedding's rows input_ids, as F.embedding copies them.
void embed(at::Tensor& residual, const at::Tensor& input_ids, const at::Tensor& table) {
  const int64_t T = residual.size(0), width = residual.size(1), vocab = table.size(0);
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.dim() == 1 &&
                  input_ids.size(0) == T && input_ids.is_contiguous(),
              "decode_layers: input_ids: (T,) int64, contiguous");
  TORCH_CHECK(table.dim() == 2 && table.size(1) == width && table.is_contiguous() &&
                  table.scalar_type() == residual.scalar_type(),
              "decode_layers: embedding: contiguous (vocab, hidden) in the activations' dtype");
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "decode_layers: token id ", ids[t],
                " outside the vocabulary [0, ", vocab, ")");
  }
  copy_rows(residual, table, ids, T);
}

// logits (n, V) float32 = hidden[rows] W^T, through the op the LM head's linear forward
// takes for n rows (project), then widened from the activations' dtype, as the model's
// compute_logits does with .float() (exact).
void lm_head_logits(at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& rows,
                    at::TensorList lm_head, int64_t kind) {
  const int64_t n = rows.size(0), T = hidden.size(0);  // lm_head: checked by LayerStackArgs
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "decode_layers: logits_indices: (n,) int64, contiguous");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.dim() == 2 && logits.size(0) == n,
              "decode_layers: logits: contiguous (n, V) float32, a row per logits index");
  const int64_t* idx = rows.data_ptr<int64_t>();
  bool all_rows = n == T;  // the common decode step: every row, in order
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < T, "decode_layers: logits index ", idx[i],
                " outside [0, ", T, ")");
    all_rows = all_rows && idx[i] == i;
  }
  at::Tensor x = all_rows ? hidden : at::empty({n, hidden.size(1)}, hidden.options());
  if (!all_rows) copy_rows(x, hidden, idx, n);
  Scratch scratch;
  if (hidden.scalar_type() == at::kFloat) {
    project(logits, x, kind, lm_head.data(), scratch);
    return;
  }
  at::Tensor y = at::empty(logits.sizes(), hidden.options());
  project(y, x, kind, lm_head.data(), scratch);
  float* dst = logits.data_ptr<float>();
  MINIVLLM_DISPATCH(y.scalar_type(), "decode_layers", [&] {
    const scalar_t* src = y.data_ptr<scalar_t>();
    for (int64_t i = 0; i < y.numel(); ++i) dst[i] = static_cast<float>(src[i]);
  });
}

}  // namespace

// What a model's layer stack binds once (fast/model_runner.py's LayerStack builds it at
// start-up): everything decode_layers reads that does not change from step to step. Passed
// as one object, a step's call converts none of its ~500 tensors (the dispatcher's list
// conversion cost ~40 us a call warm, more after a step's weights have swept the caches).
// Its lists are checked once, here.
struct LayerStackArgs : torch::CustomClassHolder {
  at::Tensor cos_sin_cache;
  bool is_neox;
  std::vector<at::Tensor> norms;  // input and post-attention norm of each layer
  std::vector<double> eps;
  std::vector<at::Tensor> weights;  // TENSORS_PER_PROJECTION a projection, 4 a layer
  std::vector<int64_t> kinds;       // each projection's Kind
  std::vector<at::Tensor> k_caches, v_caches;
  int64_t num_heads, num_kv_heads, head_dim;
  double scale;
  std::vector<at::Tensor> k_scales, v_scales;  // an int8 / fp8 cache's; none for a float one
  std::vector<at::Tensor> lora_a, lora_b, lora_scalings;  // every projection's slices
  std::vector<int64_t> lora_slices, lora_first;  // per projection: slices, its first one
  std::optional<at::Tensor> embedding;            // None: the caller fills `residual`
  at::Tensor final_norm;
  double final_eps;
  std::vector<at::Tensor> lm_head;  // none, or its projection's 4 tensors
  int64_t lm_head_kind;

  LayerStackArgs(at::Tensor cos_sin_cache_, bool is_neox_, std::vector<at::Tensor> norms_,
                 std::vector<double> eps_, std::vector<at::Tensor> weights_,
                 std::vector<int64_t> kinds_, std::vector<at::Tensor> k_caches_,
                 std::vector<at::Tensor> v_caches_, int64_t num_heads_, int64_t num_kv_heads_,
                 int64_t head_dim_, double scale_, std::vector<at::Tensor> k_scales_,
                 std::vector<at::Tensor> v_scales_, std::vector<at::Tensor> lora_a_,
                 std::vector<at::Tensor> lora_b_, std::vector<at::Tensor> lora_scalings_,
                 std::vector<int64_t> lora_slices_, std::optional<at::Tensor> embedding_,
                 at::Tensor final_norm_, double final_eps_, std::vector<at::Tensor> lm_head_,
                 int64_t lm_head_kind_);
};

std::vector<std::string> decode_layers_kinds() {
  return std::vector<std::string>(std::begin(KIND_NAMES), std::end(KIND_NAMES));
}

int64_t act_group_size() { return ACT_GROUP_SIZE; }

int64_t float_gemv_max_rows() { return FLOAT_GEMV_MAX_ROWS; }

LayerStackArgs::LayerStackArgs(
    at::Tensor cos_sin_cache_, bool is_neox_, std::vector<at::Tensor> norms_,
    std::vector<double> eps_, std::vector<at::Tensor> weights_, std::vector<int64_t> kinds_,
    std::vector<at::Tensor> k_caches_, std::vector<at::Tensor> v_caches_, int64_t num_heads_,
    int64_t num_kv_heads_, int64_t head_dim_, double scale_, std::vector<at::Tensor> k_scales_,
    std::vector<at::Tensor> v_scales_, std::vector<at::Tensor> lora_a_,
    std::vector<at::Tensor> lora_b_, std::vector<at::Tensor> lora_scalings_,
    std::vector<int64_t> lora_slices_, std::optional<at::Tensor> embedding_,
    at::Tensor final_norm_, double final_eps_, std::vector<at::Tensor> lm_head_,
    int64_t lm_head_kind_)
    : cos_sin_cache(std::move(cos_sin_cache_)), is_neox(is_neox_), norms(std::move(norms_)),
      eps(std::move(eps_)), weights(std::move(weights_)), kinds(std::move(kinds_)),
      k_caches(std::move(k_caches_)), v_caches(std::move(v_caches_)), num_heads(num_heads_),
      num_kv_heads(num_kv_heads_), head_dim(head_dim_), scale(scale_),
      k_scales(std::move(k_scales_)), v_scales(std::move(v_scales_)), lora_a(std::move(lora_a_)),
      lora_b(std::move(lora_b_)), lora_scalings(std::move(lora_scalings_)),
      lora_slices(std::move(lora_slices_)), embedding(std::move(embedding_)),
      final_norm(std::move(final_norm_)), final_eps(final_eps_), lm_head(std::move(lm_head_)),
      lm_head_kind(lm_head_kind_) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L, "decode_layers: one V cache a layer");
  // A quantized cache (int8 / fp8) has its scales beside it, one pair a layer; a float none.
  TORCH_CHECK(v_scales.size() == k_scales.size() &&
                  (k_scales.empty() || static_cast<int64_t>(k_scales.size()) == L),
              "decode_layers: k_scales and v_scales: one a layer (a quantized cache) or none");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(eps.size()) == 2 * L,
              "decode_layers: norms and eps: 2 per layer (input, post-attention)");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == PROJECTIONS_PER_LAYER * L &&
                  static_cast<int64_t>(weights.size()) ==
                      TENSORS_PER_PROJECTION * PROJECTIONS_PER_LAYER * L,
              "decode_layers: 4 projections a layer, 4 tensors each");
  TORCH_CHECK(lm_head.empty() || (lm_head.size() == TENSORS_PER_PROJECTION &&
                                  lm_head_kind >= 0 && lm_head_kind < NUM_KINDS),
              "decode_layers: lm_head: none, or 4 tensors and a kind");
  if (!lora_slices.empty()) {  // stacks bound: one entry a projection, its slices in order
    TORCH_CHECK(static_cast<int64_t>(lora_slices.size()) == PROJECTIONS_PER_LAYER * L,
                "decode_layers: lora_slices: 4 per layer");
    int64_t total = 0;
    for (const int64_t n : lora_slices) {
      lora_first.push_back(total);
      total += n;
    }
    TORCH_CHECK(static_cast<int64_t>(lora_a.size()) == total &&
                    static_cast<int64_t>(lora_b.size()) == total &&
                    static_cast<int64_t>(lora_scalings.size()) == total,
                "decode_layers: lora_a, lora_b, lora_scalings: one per slice");
  }
}

void decode_layers(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& input_ids,
                   const at::Tensor& positions, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc,
                   const c10::intrusive_ptr<LayerStackArgs>& stack,
                   const std::optional<at::Tensor>& sorted_tokens,
                   const std::optional<at::Tensor>& seg_starts,
                   const std::optional<at::Tensor>& seg_slots, std::optional<at::Tensor> logits,
                   const at::Tensor& logits_indices) {
  const LayerStackArgs& a = *stack;
  const at::TensorList norms = a.norms, weights = a.weights, k_caches = a.k_caches,
                       v_caches = a.v_caches, k_scales = a.k_scales, v_scales = a.v_scales;
  const at::ArrayRef<double> eps = a.eps;
  const at::IntArrayRef kinds = a.kinds;
  const at::Tensor& cos_sin_cache = a.cos_sin_cache;
  const bool is_neox = a.is_neox;
  const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, head_dim = a.head_dim;
  const double scale = a.scale;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const bool quantized_cache = !k_scales.empty();
  TORCH_CHECK(hidden.dim() == 2 && hidden.sizes() == residual.sizes() && hidden.is_contiguous() &&
                  residual.is_contiguous(),
              "decode_layers: hidden and residual: (T, hidden), contiguous");
  LoRA lora{a.lora_a, a.lora_b, a.lora_scalings, a.lora_slices, a.lora_first};
  TORCH_CHECK(sorted_tokens.has_value() == seg_starts.has_value() &&
                  seg_starts.has_value() == seg_slots.has_value() &&
                  (!sorted_tokens.has_value() || !a.lora_slices.empty()),
              "decode_layers: a LoRA mapping needs all three tensors and the stacks");
  TORCH_CHECK(!logits.has_value() || !a.lm_head.empty(),
              "decode_layers: logits asked of a stack bound without its LM head");
  if (sorted_tokens.has_value()) {
    lora.sorted_tokens = &*sorted_tokens;
    lora.seg_starts = &*seg_starts;
    lora.seg_slots = &*seg_slots;
  }
  const int64_t T = hidden.size(0);
  using namespace stack_clock;
  Clock clock;  // off unless decode_layers_timing turned it on (layer_stack_clock.h)
  if (a.embedding.has_value()) embed(residual, input_ids, *a.embedding);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto opts = hidden.options();
  // Sizes from layer 0's weights (kind-aware: int4 packs two weights a byte).
  auto out_features = [&](int64_t p) { return weights[TENSORS_PER_PROJECTION * p].size(0); };
  const int64_t qkv_n = out_features(0), gate_up_n = out_features(2);
  TORCH_CHECK(qkv_n == q_size + 2 * kv_size, "decode_layers: qkv weight has ", qkv_n,
              " rows, expected (H + 2 H_kv) D = ", q_size + 2 * kv_size);
  at::Tensor qkv = at::empty({T, qkv_n}, opts);
  at::Tensor attn_out = at::empty({T, num_heads, head_dim}, opts);
  at::Tensor gate_up = at::empty({T, gate_up_n}, opts);
  at::Tensor act = at::empty({T, gate_up_n / 2}, opts);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  const at::Tensor attn_rows = attn_out.view({T, q_size});
  Scratch scratch[PROJECTIONS_PER_LAYER];  // per projection: its buffers (project)

  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + TENSORS_PER_PROJECTION * PROJECTIONS_PER_LAYER * i;
    const int64_t* kind = kinds.data() + PROJECTIONS_PER_LAYER * i;
    const int64_t p = PROJECTIONS_PER_LAYER * i;  // this layer's first projection
    if (i == 0) {  // the embeddings are the residual stream
      rms_norm(hidden, residual, norms[0], eps[0]);
    } else {  // residual += hidden; hidden = norm(residual), both in place
      fused_add_rms_norm(hidden, residual, norms[2 * i], eps[2 * i]);
    }
    clock.tick(NORM);
    project(qkv, hidden, kind[0], w, scratch[0]);
    lora.add(qkv, hidden, p);
    clock.tick(QKV);
    rotary_embedding(positions, q, k, cos_sin_cache, is_neox);
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    std::optional<at::Tensor> k_scale, v_scale;
    if (quantized_cache) {
      k_scale = k_scales[i];
      v_scale = v_scales[i];
    }
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
    clock.tick(ROPE_CACHE);
    paged_attention(attn_out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                    scale, /*gemm_prefill=*/true, k_scale, v_scale);
    clock.tick(ATTENTION);
    project(hidden, attn_rows, kind[1], w + TENSORS_PER_PROJECTION, scratch[1]);
    lora.add(hidden, attn_rows, p + 1);
    clock.tick(O_PROJ);
    fused_add_rms_norm(hidden, residual, norms[2 * i + 1], eps[2 * i + 1]);
    clock.tick(POST_NORM);
    project(gate_up, hidden, kind[2], w + 2 * TENSORS_PER_PROJECTION, scratch[2]);
    lora.add(gate_up, hidden, p + 2);
    clock.tick(GATE_UP);
    silu_and_mul(act, gate_up);
    clock.tick(ACT);
    project(hidden, act, kind[3], w + 3 * TENSORS_PER_PROJECTION, scratch[3]);
    lora.add(hidden, act, p + 3);
    clock.tick(DOWN);
  }
  fused_add_rms_norm(hidden, residual, a.final_norm, a.final_eps);  // the final norm
  clock.tick(FINAL_NORM);
  if (logits.has_value()) {
    lm_head_logits(*logits, hidden, logits_indices, a.lm_head, a.lm_head_kind);
  }
  clock.tick(LM_HEAD);
}

// The class and the op that takes it, registered here (the class before the schema that
// names it; torch_bindings.cpp has the others).
TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.class_<LayerStackArgs>("LayerStackArgs")
      .def(torch::init<at::Tensor, bool, std::vector<at::Tensor>, std::vector<double>,
                       std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, int64_t, int64_t, int64_t, double,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                       std::optional<at::Tensor>, at::Tensor, double, std::vector<at::Tensor>,
                       int64_t>());
  // The whole decoder layer stack of a step, LoRA deltas included; with `logits`, the LM
  // head's float32 logits of the rows logits_indices too. Writes the bound KV caches.
  m.def(
      "decode_layers(Tensor(a!) hidden, Tensor(b!) residual, Tensor input_ids, "
      "Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, __torch__.torch.classes.minivllm.LayerStackArgs stack, "
      "Tensor? sorted_tokens, Tensor? seg_starts, Tensor? seg_slots, Tensor(g!)? logits, "
      "Tensor logits_indices) -> ()");
  // The phases of decode_layers by name, and [calls, seconds of each phase] since the last
  // read, timing then turned on or off (layer_stack_clock.h).
  m.def("decode_layers_phases() -> str[]", &decode_layers_phases);
  m.def("decode_layers_timing(bool enable) -> float[]", &decode_layers_timing);
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("decode_layers", &decode_layers); }

}  // namespace minivllm
