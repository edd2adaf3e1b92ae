// copy_blocks on a CPU: copy whole KV blocks src -> dst, for every layer's K and V, in one op.
//
// The copies of copy-on-write: block_mapping is (num_pairs, 2) int64 (src, dst) block ids.
// A block of one layer's K (or V) cache is block_size * H_kv * D contiguous elements, so a
// copy is one memcpy. The ref twin issues one torch copy per block, tensor and layer
// (2 * num_layers * num_pairs calls, each with its dispatch overhead); this op loops over
// all of them in C++, spread over threads. The pairs are independent (distinct
// destinations, none also a source: the Python wrapper checks), so any order is right.
#include "ops.h"

#include <vector>

namespace minivllm {

void copy_blocks(at::TensorList k_caches, at::TensorList v_caches,
                 const at::Tensor& block_mapping) {
  TORCH_CHECK(!k_caches.empty() && k_caches.size() == v_caches.size(),
              "k_caches and v_caches: one tensor per layer each");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 &&
                  block_mapping.size(1) == 2 && block_mapping.is_contiguous(),
              "block_mapping: (num_pairs, 2) contiguous int64");
  const at::Tensor& first = k_caches[0];
  TORCH_CHECK(first.dim() == 4, "caches: (num_blocks, block_size, H_kv, D)");
  const int64_t num_blocks = first.size(0);
  // One block's elements must be contiguous (the block stride itself may be anything).
  const int64_t block_numel = first.size(1) * first.size(2) * first.size(3);
  std::vector<char*> bases;  // every layer's K, then V, as raw bytes
  for (size_t l = 0; l < k_caches.size(); ++l) {
    for (const at::Tensor* t : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(t->sizes() == first.sizes() && t->strides() == first.strides() &&
                      t->scalar_type() == first.scalar_type(),
                  "every cache must share layer 0's shape, strides and dtype");
      TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == t->size(3) &&
                      t->stride(1) == t->size(2) * t->size(3),
                  "each block of a cache must be contiguous");
      bases.push_back(static_cast<char*>(t->data_ptr()));
    }
  }
  const int64_t elem = static_cast<int64_t>(first.element_size());
  const int64_t block_stride_bytes = first.stride(0) * elem;
  const int64_t block_bytes = block_numel * elem;
  const int64_t num_pairs = block_mapping.size(0);
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (int64_t p = 0; p < 2 * num_pairs; ++p) {  // a bad id would write outside the cache
    TORCH_CHECK(pairs[p] >= 0 && pairs[p] < num_blocks, "block id ", pairs[p],
                " outside [0, ", num_blocks, ")");
  }

  // One item per (tensor, pair): num_tensors * num_pairs memcpys of block_bytes each.
  const int64_t num_tensors = static_cast<int64_t>(bases.size());
  const int64_t grain = grain_for(block_numel);
  parallel_for(0, num_tensors * num_pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      char* base = bases[item / num_pairs];
      const int64_t p = item % num_pairs;
      std::memcpy(base + pairs[2 * p + 1] * block_stride_bytes,
                  base + pairs[2 * p] * block_stride_bytes, block_bytes);
    }
  });
}

}  // namespace minivllm
