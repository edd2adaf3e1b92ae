// Registers the CPU kernels as torch operators: torch.ops.minivllm.<name>.
//
// TORCH_LIBRARY declares each op's schema (its signature in TorchScript's
// schema language). ``Tensor(a!)`` marks an argument the op writes in place,
// which torch.compile needs to know (it functionalises the graph around it) and
// which the profiler shows. TORCH_LIBRARY_IMPL then gives the CPU
// implementation; a CUDA build could register its own under the same names.
#include "ops.h"

#include <torch/library.h>

TORCH_LIBRARY(minivllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "bool gemm_prefill=True, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // k_scale / v_scale: the scales of an int8 / fp8 cache (kv_cache.h), written beside it.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  // Whole blocks src -> dst for every layer's K and V (copy-on-write), in one call.
  m.def("copy_blocks(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor block_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) "
      "-> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def(
      "linear_small_m(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias, "
      "bool portable) -> ()");
  // No tensors: a plain function, the same on every device.
  m.def("gemv_has_avx512_bf16() -> bool", &minivllm::gemv_has_avx512_bf16);
  // float32 x @ W^T + b on W packed as (P, K, width) panels; width 0: not in this build.
  m.def("gemm_panels_width() -> int", &minivllm::gemm_panels_width);
  m.def("gemm_panels(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  // portable=True: the plain loop even where the AVX2 tiles exist (for tests).
  m.def(
      "int8_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, "
      "bool portable=False) -> ()");
  m.def(
      "int4_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor mins, "
      "bool portable=False) -> ()");
  // W8A8 (quant_w8a8.cpp). isa: 'auto' (the best this CPU runs) or one of w8a8_isas().
  m.def("w8a8_isas() -> str[]", &minivllm::w8a8_isas);
  m.def(
      "quantize_activations_int8(Tensor(a!) q, Tensor(b!) scales, Tensor(c!) sums, Tensor x, "
      "str isa='auto') -> ()");
  m.def(
      "w8a8_linear(Tensor(a!) out, Tensor qx, Tensor x_scales, Tensor qweight, Tensor scales, "
      "str isa='auto') -> ()");
  m.def(
      "w4a8_linear(Tensor(a!) out, Tensor qx, Tensor x_scales, Tensor x_sums, Tensor qweight, "
      "Tensor scales, Tensor mins, str isa='auto') -> ()");
  m.def("w8a8_prepacked_available() -> bool", &minivllm::w8a8_prepacked_available);
  m.def(
      "w8a8_linear_prepacked(Tensor(a!) out, Tensor qx, Tensor x_scales, Tensor packed, "
      "Tensor scales) -> ()");
  m.def(
      "w4a8_linear_prepacked(Tensor(a!) out, Tensor qx, Tensor x_scales, Tensor x_sums, "
      "Tensor packed) -> ()");
  m.def("dequantize_int8(Tensor(a!) out, Tensor qweight, Tensor scales) -> ()");
  m.def("dequantize_int4(Tensor(a!) out, Tensor qweight, Tensor scales, Tensor mins) -> ()");
  // decode_layers and its LayerStackArgs are registered in layer_stack.cpp.
  // decode_layers' projection kinds by name, index = the number `kinds` holds; the
  // activation group of W8A8 / W4A8; the float GEMV's most rows (all three checked
  // against minivllm/fast/linear_kernel.py).
  m.def("decode_layers_kinds() -> str[]", &minivllm::decode_layers_kinds);
  m.def("act_group_size() -> int", &minivllm::act_group_size);
  m.def("float_gemv_max_rows() -> int", &minivllm::float_gemv_max_rows);
  // Structured outputs: -inf where a row's token bitmask forbids (token_bitmask.cpp).
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  // The greedy pick: each row's argmax, as torch.argmax(dim=-1) (argmax.cpp).
  m.def("argmax_rows(Tensor logits) -> Tensor");
  // Each token's own LoRA adapter delta, tokens grouped by adapter slot (lora.cpp).
  m.def(
      "add_lora(Tensor(a!) y, Tensor x, Tensor[] lora_a, Tensor[] lora_b, Tensor[] scalings, "
      "Tensor sorted_tokens, Tensor seg_starts, Tensor seg_slots, int[] output_slices) -> ()");
  // Where the kernels' loops run (thread_team.h): "adaptive" (the default), "team",
  // "openmp" (at::parallel_for) or "steal" (for the tests: revocable chunks taken over
  // at once); "" only reads it. Returns the mode before the call.
  m.def("cpu_parallel_mode(str mode='') -> str", &minivllm::cpu_parallel_mode);
  // [jobs the team ran, jobs the caller ran alone, late jobs, chunks the caller took
  // over] since the process started.
  m.def("cpu_team_stats() -> int[]", &minivllm::cpu_team_stats);
  // For the tests: counts[i] += 1 for each i through parallel_for; index throw_at raises;
  // helpers sleep helper_delay_us a chunk, the caller caller_delay_us. Returns the
  // indices the caller ran.
  m.def(
      "parallel_for_coverage(Tensor(a!) counts, int grain, int throw_at=-1, "
      "int helper_delay_us=0, int caller_delay_us=0, bool revocable=False) -> int");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("paged_attention", &minivllm::paged_attention);
  m.impl("reshape_and_cache", &minivllm::reshape_and_cache);
  m.impl("copy_blocks", &minivllm::copy_blocks);
  m.impl("rms_norm", &minivllm::rms_norm);
  m.impl("fused_add_rms_norm", &minivllm::fused_add_rms_norm);
  m.impl("silu_and_mul", &minivllm::silu_and_mul);
  m.impl("rotary_embedding", &minivllm::rotary_embedding);
  m.impl("linear_small_m", &minivllm::linear_small_m);
  m.impl("gemm_panels", &minivllm::gemm_panels);
  m.impl("int8_linear", &minivllm::int8_linear);
  m.impl("int4_linear", &minivllm::int4_linear);
  m.impl("quantize_activations_int8", &minivllm::quantize_activations_int8);
  m.impl("w8a8_linear", &minivllm::w8a8_linear);
  m.impl("w4a8_linear", &minivllm::w4a8_linear);
  m.impl("w8a8_linear_prepacked", &minivllm::w8a8_linear_prepacked);
  m.impl("w4a8_linear_prepacked", &minivllm::w4a8_linear_prepacked);
  m.impl("dequantize_int8", &minivllm::dequantize_int8);
  m.impl("dequantize_int4", &minivllm::dequantize_int4);
  m.impl("apply_token_bitmask", &minivllm::apply_token_bitmask);
  m.impl("argmax_rows", &minivllm::argmax_rows);
  m.impl("add_lora", &minivllm::add_lora);
  m.impl("parallel_for_coverage", &minivllm::parallel_for_coverage);
}
