// Paged attention on a CPU: decodes, prefills and chunked prefills in one op.
//
// The contract is minivllm.ref.attention's: the batch is a flat stream of query
// rows; sequence i owns rows query_start_loc[i] .. query_start_loc[i + 1], the
// last query_len of its seq_len tokens, and all seq_len keys/values are already
// in the paged cache. Row j of sequence i sits at position ctx + j
// (ctx = seq_len - query_len) and sees keys 0 .. ctx + j. GQA: query head h
// reads KV head h / (num_heads / num_kv_heads).
//
// How it differs from the ref, and why it is faster:
// - K/V are read in place through the block table, never gathered into a copy.
// - One work item is (sequence, a tile of query rows). For each tile of keys it
//   runs every KV head in turn: a token's heads are adjacent in the cache, so
//   the item reads whole contiguous rows rather than one head's slice of each
//   (a stride the hardware prefetcher cannot follow). Within a KV head, all
//   the query heads that share it (the GQA group) and all the rows of the tile
//   are scored against each key row while it sits in L1, so each K/V row is
//   read from memory once per item, not once per query head.
// - Keys are visited in tiles of KEY_TILE with an online softmax (running max
//   and running sum, rescaling the accumulator when the max grows), so no score
//   matrix is ever built and a block size of 1 costs no more than 16.
// - The next tile's K/V rows are prefetched while this one is scored, one key
//   at a time between the dot products: blocks sit anywhere in the cache
//   (hardware prefetchers stop at page boundaries) and decode is bound by these
//   loads. Spread out, the requests overlap the arithmetic; issued as one burst
//   per tile they stalled on the full miss queue (decode 2x slower).
// - p @ V accumulates MR query vectors x DC elements of head_dim in registers
//   (pv_block) and reads each V row once per block, instead of streaming the
//   accumulator through memory once per (key, query vector).
// - Items are spread over threads with parallel_for (thread_team.h), one contiguous run
//   of about equal work (keys x query vectors) per chunk, a few chunks per thread. A
//   batch of fewer items than threads (batch-1 decode: one) is cut by KV head instead,
//   so the second thread is not idle through every layer's attention.
// - A batch without GEMM-tiled items (decode) runs with parallel_for_revocable: a chunk
//   keeps its outputs in its own buffer and writes them at its end, so the caller can
//   rerun the chunk of a helper that another process has stopped instead of waiting
//   for it. Everything a chunk reads is held by value in a Job on the heap.
// - A quantized cache (int8 / fp8 e4m3 codes, a float32 scale per token and KV
//   head: kv_cache.h) is read as it is, 1 byte an element: each row's codes are
//   widened into an L1 buffer when it is used, never into a copy of the cache, and
//   the scales come out of the products: s_k (q . k) for a score, p s_v for the
//   weight of a value row (one multiply per key instead of one per element).
//   Decode reads a quarter of float32's bytes (half of bf16's), plus the scales.
#include "attention_rows.h"
#include "attention_tile.h"
#include "kv_cache.h"
#include "ops.h"

#include <algorithm>
#include <limits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

namespace minivllm {
namespace {

using namespace rows;  // KEY_TILE, MR, DC and the row loop's pieces (attention_rows.h)

constexpr int64_t MAX_TILE_QUERIES = 32;  // query vectors (rows x group heads) per item
constexpr int64_t GEMM_MIN_ROWS = 8;      // sequences with this many query rows: GEMM tiles
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// One work item: query rows [row_begin, row_end) of sequence seq, for KV heads
// [head_begin, head_end) (all of them, unless a small batch is split by head); `tiled`
// items (prefill chunks) run attention_tile.h's GEMM-shaped loop, the others this file's.
struct Item {
  int64_t seq, row_begin, row_end;
  bool tiled;
  int64_t head_begin, head_end;
};

// What every chunk reads, held by value: with parallel_for_revocable a late helper may
// still read after the call has returned, so the tensors behind the pointers live here.
template <typename scalar_t, typename cache_t>
struct Job {
  std::vector<at::Tensor> held;  // out, query, caches, their scales, the int32 inputs
  tile::Batch<scalar_t, cache_t> batch;
  const int32_t *qsl, *lens, *tables;
  int64_t table_stride, m_cap, tile_rows;
  std::vector<Item> items;
  std::vector<int64_t> bounds;  // chunk p runs items [bounds[p], bounds[p + 1])
};

template <typename scalar_t, typename cache_t>
void run_part(const Job<scalar_t, cache_t>& job, int64_t part_begin, int64_t part_end);

// scalar_t: the query's (and output's) dtype; cache_t: the cache's, scalar_t itself or
// a quantized code (int8_t, fp8_e4m3) with k_scale / v_scale (null for a float cache).
template <typename scalar_t, typename cache_t>
void attention_kernel(at::Tensor& out, const at::Tensor& query,
                      const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, float scale, bool gemm_prefill,
                      const std::optional<at::Tensor>& k_scales,
                      const std::optional<at::Tensor>& v_scales) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows_per_item = std::max<int64_t>(1, MAX_TILE_QUERIES / group);

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const cache_t* k_ptr = reinterpret_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = reinterpret_cast<const cache_t*>(v_cache.data_ptr());
  const int64_t q_st = query.stride(0), q_sh = query.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  // k_cache and v_cache share strides (checked in Python): block, slot, head.
  const int64_t c_sb = k_cache.stride(0), c_ss = k_cache.stride(1), c_sh = k_cache.stride(2);
  // The scales are contiguous (num_blocks, block_size, H_kv): slot s, head h at s * H_kv + h.
  const float* k_scale = k_scales ? k_scales->data_ptr<float>() : nullptr;
  const float* v_scale = v_scales ? v_scales->data_ptr<float>() : nullptr;

  const int64_t num_blocks = k_cache.size(0);
  const int64_t tile_rows = std::max<int64_t>(1, tile::TILE_M / group);
  auto job = std::make_shared<Job<scalar_t, cache_t>>(Job<scalar_t, cache_t>{
      {out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc},
      {q_ptr, k_ptr, v_ptr, o_ptr, k_scale, v_scale, q_st, q_sh, o_st, o_sh, c_sb, c_ss, c_sh,
       block_size, num_kv_heads, group, head_dim, scale},
      qsl, lens, tables, table_stride, 0, tile_rows, {}, {}});
  for (const auto* t : {&k_scales, &v_scales}) {
    if (t->has_value()) job->held.push_back(**t);
  }
  std::vector<Item>& items = job->items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(qsl[s + 1] - qsl[s] <= lens[s], "sequence ", s, ": query_len > seq_len");
    TORCH_CHECK((lens[s] + block_size - 1) / block_size <= block_tables.size(1),
                "sequence ", s, ": block table too short for seq_len ", lens[s]);
    for (int64_t b = 0; b * block_size < lens[s]; ++b) {  // a bad id would read outside
      const int32_t id = tables[s * table_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " outside [0, ", num_blocks, ")");
    }
    const int64_t query_len = qsl[s + 1] - qsl[s];
    const bool tiled = gemm_prefill && query_len >= GEMM_MIN_ROWS;
    const int64_t rows = tiled ? tile_rows : rows_per_item;
    for (int64_t r = 0; r < query_len; r += rows) {
      items.push_back({s, r, std::min<int64_t>(r + rows, query_len), tiled, 0, num_kv_heads});
    }
  }
  // Fewer items than threads (a decode step of one or a few sequences): one item per KV
  // head instead, so every thread has work. Heads are independent, so the results are
  // the same bits either way; an item then reads its head's part of each cached row.
  if (static_cast<int64_t>(items.size()) < team_threads() && num_kv_heads > 1) {
    std::vector<Item> by_head;
    for (const Item& it : items) {
      if (it.tiled) {
        by_head.push_back(it);
        continue;
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        by_head.push_back({it.seq, it.row_begin, it.row_end, false, h, h + 1});
      }
    }
    items.swap(by_head);
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t m_cap = (rows_per_item * group + MR - 1) / MR * MR;  // per KV head, padded
  job->m_cap = m_cap;

  // Work per item: keys x query vectors x head_dim.
  std::vector<int64_t> item_work(num_items);
  int64_t work = 0;
  for (int64_t w = 0; w < num_items; ++w) {
    const Item& it = items[w];
    const int64_t keys = lens[it.seq] - (qsl[it.seq + 1] - qsl[it.seq]) + it.row_end;
    item_work[w] = keys * (it.row_end - it.row_begin) * (it.head_end - it.head_begin) * group *
                   head_dim;
    work += item_work[w];
  }
  // Contiguous runs of items (CHUNKS_PER_THREAD a thread), cut where the cumulative
  // work crosses an equal share: cut by *count*, with sequences of different lengths
  // one thread would idle while the other finished. A late thread's runs are taken
  // by the thread that is running (thread_team.h). A tiny batch (a few short
  // sequences) stays on this thread.
  const int64_t parts =
      work <= GRAIN_ELEMENTS ? 1
                             : std::min<int64_t>(num_items, team_threads() * CHUNKS_PER_THREAD);
  std::vector<int64_t>& bounds = job->bounds;
  bounds.assign(parts + 1, num_items);
  bounds[0] = 0;
  int64_t done = 0;
  for (int64_t w = 0, p = 1; w < num_items && p < parts; ++w) {
    done += item_work[w];
    while (p < parts && done * parts >= work * p) bounds[p++] = w + 1;
  }
  // Revocable unless a GEMM-tiled item (a prefill chunk) writes its rows as it goes.
  const bool revocable =
      std::none_of(items.begin(), items.end(), [](const Item& it) { return it.tiled; });
  const auto chunk = [job](int64_t b, int64_t e) { run_part(*job, b, e); };
  if (revocable) {
    parallel_for_revocable(0, parts, 1, chunk);
  } else {
    parallel_for(0, parts, 1, chunk);
  }
}

// Items [bounds[part_begin], bounds[part_end]) of a job. A row item's outputs wait in
// `staged` until the chunk's end (chunk_commit_begin: the writes may be the caller's).
template <typename scalar_t, typename cache_t>
void run_part(const Job<scalar_t, cache_t>& job, int64_t part_begin, int64_t part_end) {
  const tile::Batch<scalar_t, cache_t>& batch = job.batch;
  const scalar_t* q_ptr = batch.q;
  const cache_t *k_ptr = batch.k, *v_ptr = batch.v;
  const float *k_scale = batch.k_s, *v_scale = batch.v_s;
  const int64_t q_st = batch.q_st, q_sh = batch.q_sh, o_st = batch.o_st, o_sh = batch.o_sh;
  const int64_t c_sb = batch.c_sb, c_ss = batch.c_ss, c_sh = batch.c_sh;
  const int64_t block_size = batch.block_size, num_kv_heads = batch.num_kv_heads;
  const int64_t group = batch.group, head_dim = batch.head_dim;
  const float scale = batch.scale;
  const int32_t *qsl = job.qsl, *lens = job.lens, *tables = job.tables;
  const int64_t table_stride = job.table_stride, m_cap = job.m_cap, tile_rows = job.tile_rows;
  const std::vector<Item>& items = job.items;
  const std::vector<int64_t>& bounds = job.bounds;
  // Scratch, reused by every item this thread runs, and kept by the thread for its next
  // chunks (a batch-1 decode step runs ~90 of them: allocating and zeroing these each time
  // cost ~0.07 of attention's 0.65 ms a step). KV head h owns the query vectors
  // [h * m_cap, (h + 1) * m_cap) of q_buf / acc / row_max / row_sum; every item sets what
  // it reads before reading it.
  static thread_local RowScratch<scalar_t> scratch;
  scratch.q_buf.resize(num_kv_heads * m_cap * head_dim);
  scratch.acc.resize(scratch.q_buf.size());
  scratch.row_max.resize(num_kv_heads * m_cap);
  scratch.row_sum.resize(scratch.row_max.size());
  scratch.scores.resize(m_cap * KEY_TILE);
  scratch.k_buf.resize(std::is_same_v<cache_t, float> ? 0 : KEY_TILE * head_dim);
  scratch.v_buf.resize(scratch.k_buf.size());
  scratch.pos.resize(m_cap);
  scratch.staged.clear();
  scratch.staged_to.clear();
  std::vector<float>&q_buf = scratch.q_buf, &acc = scratch.acc, &row_max = scratch.row_max,
                    &row_sum = scratch.row_sum, &scores = scratch.scores, &k_buf = scratch.k_buf,
                    &v_buf = scratch.v_buf;
  std::vector<int64_t>& pos = scratch.pos;
  std::vector<scalar_t>& staged = scratch.staged;
  std::vector<scalar_t*>& staged_to = scratch.staged_to;
  float k_scales_tile[KEY_TILE];  // a quantized tile's K scales (s_k (q . codes))
  const float* k_rows[KEY_TILE];
  float v_scales[KEY_TILE];  // a quantized tile's V scales (p s_v weighs each row)
  std::optional<tile::Scratch> tile_scratch;  // allocated by the first tiled item
  int64_t key_off[KEY_TILE];   // cache offset of each key of the tile, at KV head 0
  int64_t key_slot[KEY_TILE];  // its slot (the scales' index is slot * H_kv + head)
  int64_t next_off[KEY_TILE];  // the same for the next tile
  int64_t next_slot[KEY_TILE];
  const float* v_rows[KEY_TILE];

  for (int64_t w = bounds[part_begin]; w < bounds[part_end]; ++w) {
    if (chunk_cancelled()) return;  // the caller reruns this chunk: stop reading
    const Item& it = items[w];
    const int64_t query_len = qsl[it.seq + 1] - qsl[it.seq];
    const int64_t ctx = lens[it.seq] - query_len;  // keys already cached before this step
    const int32_t* table = tables + it.seq * table_stride;
    const int64_t m_count = (it.row_end - it.row_begin) * group;  // per KV head
    const int64_t m_pad = (m_count + MR - 1) / MR * MR;
    if (it.tiled) {
      if (!tile_scratch) {
        tile_scratch.emplace((tile_rows * group + tile::NR - 1) / tile::NR * tile::NR, head_dim);
      }
      tile::attend_rows(batch, table, qsl[it.seq], ctx, it.row_begin, it.row_end,
                        *tile_scratch);
      continue;
    }

    // Query vector m of KV head h = (row, head in the group), pre-scaled, as
    // float32; the padding up to a multiple of MR is zero and its results unused.
    for (int64_t m = 0; m < m_pad; ++m) pos[m] = m < m_count ? ctx + it.row_begin + m / group : -1;
    for (int64_t h = it.head_begin; h < it.head_end; ++h) {
      for (int64_t m = 0; m < m_pad; ++m) {
        float* qb = q_buf.data() + (h * m_cap + m) * head_dim;
        if (m < m_count) {
          const int64_t row = it.row_begin + m / group;
          const scalar_t* q = q_ptr + (qsl[it.seq] + row) * q_st + (h * group + m % group) * q_sh;
          for (int64_t d = 0; d < head_dim; ++d) qb[d] = static_cast<float>(q[d]) * scale;
        } else {
          std::fill(qb, qb + head_dim, 0.f);
        }
        row_max[h * m_cap + m] = NEG_INF;
        row_sum[h * m_cap + m] = 0.f;
      }
    }
    for (int64_t h = it.head_begin; h < it.head_end; ++h) {  // the vectors this item uses
      std::fill_n(acc.begin() + h * m_cap * head_dim, m_pad * head_dim, 0.f);
    }

    const int64_t num_keys = ctx + it.row_end;  // the last row sees this many
    for (int64_t t0 = 0; t0 < num_keys; t0 += KEY_TILE) {
      const int64_t kt = std::min(KEY_TILE, num_keys - t0);
      // Key t lives in block table[t / bs], slot t % bs: one division a tile, then the
      // slot steps along (a 64-bit division per key cost more than its dot products).
      locate_keys(table, t0, kt, block_size, c_sb, c_ss, key_slot, key_off);
      // Where the next tile's keys are, to prefetch them while this tile is scored: this
      // item's next tile, or after its last one the first tile of the next row item this
      // thread runs, if it reads the same KV heads (the prefetch below asks for this
      // item's heads; unprefetched, a decode item's first tile is a fifth of its reads).
      int64_t next_kt = std::clamp<int64_t>(num_keys - t0 - KEY_TILE, 0, KEY_TILE);
      const Item* after = w + 1 < bounds[part_end] ? &items[w + 1] : nullptr;
      if (next_kt > 0) {
        locate_keys(table, t0 + KEY_TILE, next_kt, block_size, c_sb, c_ss, next_slot, next_off);
      } else if (after != nullptr && !after->tiled && after->head_begin == it.head_begin &&
                 after->head_end == it.head_end) {
        const int64_t after_keys =
            lens[after->seq] - (qsl[after->seq + 1] - qsl[after->seq]) + after->row_end;
        next_kt = std::min(KEY_TILE, after_keys);
        locate_keys(tables + after->seq * table_stride, 0, next_kt, block_size, c_sb, c_ss,
                    next_slot, next_off);
      }
      // Every KV head of the tile while its rows are in cache: a token's heads are
      // adjacent in memory, so the item reads the cache as whole contiguous rows.
      for (int64_t h = it.head_begin; h < it.head_end; ++h) {
        const float* qh = q_buf.data() + h * m_cap * head_dim;
        float* acc_h = acc.data() + h * m_cap * head_dim;
        float* max_h = row_max.data() + h * m_cap;
        float* sum_h = row_sum.data() + h * m_cap;
        // The next tile's rows of this head: K's asked for while the scores are
        // computed, V's while p @ V is (and a quantized cache's scales now).
        Prefetch next_k, next_v;
        next_k.count = next_v.count = next_kt;
        next_k.row_bytes = next_v.row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
        for (int64_t j = 0; j < next_kt; ++j) {
          next_k.row[j] = reinterpret_cast<const char*>(k_ptr + next_off[j] + h * c_sh);
          next_v.row[j] = reinterpret_cast<const char*>(v_ptr + next_off[j] + h * c_sh);
          if constexpr (is_quantized_v<cache_t>) {
            if (h == it.head_begin) {
              __builtin_prefetch(k_scale + next_slot[j] * num_kv_heads);
              __builtin_prefetch(v_scale + next_slot[j] * num_kv_heads);
            }
          }
        }
        for (int64_t j = 0; j < kt; ++j) {
          const int64_t off = key_off[j] + h * c_sh;
          // K and V as float32: a float32 cache's rows in place, else one float32 copy
          // of the tile's rows (widened; a quantized row's codes, its scale kept aside).
          v_rows[j] = row_as_float(v_ptr + off, v_buf.data() + j * head_dim, head_dim);
          k_rows[j] = row_as_float(k_ptr + off, k_buf.data() + j * head_dim, head_dim);
          if constexpr (is_quantized_v<cache_t>) {
            k_scales_tile[j] = k_scale[key_slot[j] * num_kv_heads + h];
            v_scales[j] = v_scale[key_slot[j] * num_kv_heads + h];
          }
        }
        // Scores: every query vector against the tile's keys, 8 keys at a time.
        for (int64_t m = 0; m < m_count; ++m) {
          score_row(qh + m * head_dim, k_rows, kt, head_dim, scores.data() + m * KEY_TILE,
                    m == 0 ? &next_k : nullptr);
          if constexpr (is_quantized_v<cache_t>) {  // s_k (q . codes)
            for (int64_t j = 0; j < kt; ++j) scores[m * KEY_TILE + j] *= k_scales_tile[j];
          }
        }
        // Online softmax: mask, then fold this tile's scores into the running max and sum.
        for (int64_t m = 0; m < m_pad; ++m) {
          float* s = scores.data() + m * KEY_TILE;
          const int64_t visible = std::min(kt, pos[m] - t0 + 1);  // keys t0 .. pos[m]
          if (visible <= 0) {  // a padding vector, or every key is in this row's future
            std::fill(s, s + kt, 0.f);
            continue;
          }
          float tile_max = NEG_INF;
          for (int64_t j = 0; j < visible; ++j) tile_max = s[j] > tile_max ? s[j] : tile_max;
          const float new_max = std::max(max_h[m], tile_max);
          const float alpha = fast_exp(max_h[m] - new_max);  // 0 on the first tile
          // The exponentials in one loop with no sum in it, so it vectorises (a running
          // float sum would keep it scalar: its order is fixed); then the sum, in lanes.
          for (int64_t j = 0; j < visible; ++j) s[j] = fast_exp(s[j] - new_max);
          std::fill(s + visible, s + kt, 0.f);
          float lanes[LANES] = {0.f};
          for (int64_t j = 0; j < kt; ++j) lanes[j % LANES] += s[j];
          const float tile_sum = reduce_lanes(lanes);
          if constexpr (is_quantized_v<cache_t>) {  // weigh each V row's codes by p s_v
            for (int64_t j = 0; j < kt; ++j) s[j] *= v_scales[j];
          }
          sum_h[m] = sum_h[m] * alpha + tile_sum;
          max_h[m] = new_max;
          if (alpha != 1.f) {
            float* a = acc_h + m * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
          }
        }
        // acc += p @ V: MR query vectors x DC elements of head_dim per register block.
        for (int64_t m0 = 0; m0 < m_pad; m0 += MR) {
          float* a = acc_h + m0 * head_dim;
          const float* p = scores.data() + m0 * KEY_TILE;
          int64_t d0 = 0;
          for (; d0 + DC <= head_dim; d0 += DC) {
            pv_block(p, v_rows, kt, a, head_dim, d0, m0 == 0 && d0 == 0 ? &next_v : nullptr);
          }
          for (int64_t j = 0; j < kt && d0 < head_dim; ++j) {  // head_dim % DC tail
            for (int64_t r = 0; r < MR; ++r) {
              const float pr = p[r * KEY_TILE + j];
              for (int64_t d = d0; d < head_dim; ++d) a[r * head_dim + d] += pr * v_rows[j][d];
            }
          }
        }
      }
    }
    for (int64_t h = it.head_begin; h < it.head_end; ++h) {
      for (int64_t m = 0; m < m_count; ++m) {
        const int64_t row = it.row_begin + m / group;
        staged_to.push_back(batch.o + (qsl[it.seq] + row) * o_st + (h * group + m % group) * o_sh);
        const float inv = 1.f / row_sum[h * m_cap + m];
        const float* a = acc.data() + (h * m_cap + m) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) staged.push_back(static_cast<scalar_t>(a[d] * inv));
      }
    }
  }
  if (!chunk_commit_begin()) return;  // the caller ran this chunk itself
  for (size_t r = 0; r < staged_to.size(); ++r) {
    std::copy_n(staged.data() + r * head_dim, head_dim, staged_to[r]);
  }
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query,
                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, bool gemm_prefill,
                     const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: (T, H, D)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache/v_cache: (num_blocks, block_size, H_kv, D)");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache must share strides");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1,
              "head_dim must have unit stride");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "cache head_dim must equal query head_dim");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of H_kv");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "query and out must share a dtype, and so must the caches");
  cache_scales(k_cache, k_scale, v_scale);  // checks them
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1,
                "block_tables, seq_lens and query_start_loc must be int32, rows contiguous");
  }
  MINIVLLM_DISPATCH(query.scalar_type(), "paged_attention", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&](auto tag) {
      using cache_t = typename decltype(tag)::type;
      attention_kernel<scalar_t, cache_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                          query_start_loc, static_cast<float>(scale),
                                          gemm_prefill, k_scale, v_scale);
    });
  });
}

}  // namespace minivllm
