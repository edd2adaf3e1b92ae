// Structured outputs on a CPU: set the logits of the tokens a row's bitmask forbids to -inf.
//
// bitmask (B, ceil(V / 32)) int32: token t of row r is allowed when bit t % 32 of
// word t // 32 is set. Only the rows listed in `rows` are touched, so a batch
// with a few constrained requests pays for those rows alone. A word of all ones
// (32 allowed tokens, the common case inside a JSON string) is skipped whole, a
// word of zeros (the common case elsewhere) is a plain fill, and a mixed word is a
// branch-free select the compiler vectorises; the ref unpacks every bit into a
// (R, V) bool mask and rewrites the rows.
// Work items are (row, chunk of words), spread over threads.
#include "ops.h"

#include <limits>

namespace minivllm {

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "logits: (B, V) with unit column stride");
  const int64_t vocab = logits.size(1), words = (vocab + 31) / 32;
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.dim() == 2 && bitmask.size(0) == logits.size(0) &&
                  bitmask.size(1) == words,
              "bitmask: (B, ceil(V / 32)) int32, contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows: (R,) int64, contiguous, no duplicates");
  const int64_t num_rows = rows.size(0);
  constexpr int64_t CHUNK = 256;  // words (8192 tokens) per unit of parallel work
  const int64_t chunks = (words + CHUNK - 1) / CHUNK;
  MINIVLLM_DISPATCH(logits.scalar_type(), "apply_token_bitmask", [&] {
    scalar_t* out = logits.data_ptr<scalar_t>();
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
    const int64_t* row_ids = rows.data_ptr<int64_t>();
    const int64_t stride = logits.stride(0);
    const scalar_t neg_inf = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
    parallel_for(0, num_rows * chunks, grain_for(32 * CHUNK),
                     [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t r = row_ids[w / chunks];
        const int64_t k0 = (w % chunks) * CHUNK, k1 = std::min(k0 + CHUNK, words);
        scalar_t* dst = out + r * stride;
        const uint32_t* src = bits + r * words;
        for (int64_t k = k0; k < k1; ++k) {
          const uint32_t word = src[k];
          if (word == 0xFFFFFFFFu) continue;  // all 32 allowed: nothing to write
          scalar_t* d = dst + 32 * k;
          if (32 * k + 32 <= vocab) {
            if (word == 0) {  // all 32 forbidden (most words, in a tight state): a plain fill
              for (int j = 0; j < 32; ++j) d[j] = neg_inf;
              continue;
            }
            // A select, not a branch per bit: with a constant trip count the compiler
            // vectorises it (a variable shift per lane, then a blend).
            for (int j = 0; j < 32; ++j) d[j] = ((word >> j) & 1u) ? d[j] : neg_inf;
          } else {  // the last, partial word
            for (int64_t j = 0; j < vocab - 32 * k; ++j) {
              if (!((word >> j) & 1u)) d[j] = neg_inf;
            }
          }
        }
      }
    });
  });
}

}  // namespace minivllm
