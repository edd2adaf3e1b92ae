// One row of x (a batch-1 decode step) times a 4-bit or int8 weight prepacked at load, on
// AVX512-VNNI. Read quant_w8a8.cpp's header and quant_w8a8_gemm.h first. Included once,
// inside namespace avx512vnni and its `#pragma GCC target` region, after the GEMM.
//
// The tiles (quant_w8a8_row512.h) read the weight as it is stored, row after row: each
// vpdpbusd sums 64 bytes of one row (2 int8 groups, 4 4-bit ones), and 8 rows' sums then
// need a tree of shuffles to become vectors of 8 group totals. With 4-bit weights that tree,
// the unpacking and the scales' transposes cost more instructions than the bytes take to
// arrive: the tiles ran at about the same speed with the weight in L2 as in memory.
//
// Here the weight is in the GEMM's layout already (prepack_w4a8 in linear_prepack.py does
// it once, when the model is loaded): a panel of PANEL (32) weight rows, group after group,
// each group as 4 words of 32 rows (word j of a row: bytes 4 j .. 4 j + 3 of its group,
// k = 32 g + 4 j .. + 3 in the low nibbles, k + 16 in the high ones), then the group's 32
// scales and 32 minimums (float32, or float16 as a GGUF stores them):
//
//     packed[panel][g] = w[j < 4][c < 32][4 bytes], s[c < 32], m[c < 32]
//
// An int8 weight's panel holds its scales first (s_groups x 32: one a row and scale
// group), then each group as 8 words of 32 rows, every byte w + 128 (unsigned):
//
//     packed[panel] = s[sg][c < 32], then w[g][j < 8][c < 32][4 bytes]
//
// One 64-byte load holds 4 k of 16 rows, and one vpdpbusd with 4 bytes of x broadcast
// adds them into each row's lane: after 8 of them (4-bit: 4 words x low and high nibbles;
// int8: 8 words) lane c
// holds I[c, g], the group's exact int32 sum, with no shuffle at all (int8: the weights are
// the unsigned operand as w + 128, x the signed one, broadcast; sum_k (w + 128) x =
// I + 128 sum_k x, and 128 sum_k x, one integer a group (p.shift, made once a call by
// w8a8_linear_prepacked), is subtracted). The rescale is the
// GEMM's (rescale_add, the ref's order), so the result is the ref's bits. A panel is one
// contiguous run of memory, and a thread's panels are one run: its bytes PREPACKED_AHEAD
// ahead are prefetched into L2 (into L1, as the tiles do on AMD, was 10-20% slower with
// the weight in memory on the Zen 4 EPYC of docs/kernels.md), up to the run's end.

constexpr int64_t PREPACKED_AHEAD = 16384;  // bytes ahead of the group being multiplied

// Prefetches [at, at + bytes) into L2, the part before `end`.
inline void prefetch_ahead(const uint8_t* at, int64_t bytes, const uint8_t* end) {
  for (int64_t b = 0; b < bytes && at + b < end; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(at + b), _MM_HINT_T1);
  }
}

static_assert(PANEL == PREPACKED_ROWS, "a prepacked panel is the GEMM's");

// 16 scales (or minimums) at `at` as float32: float16 widens exactly.
inline __m512 load_scales16(const uint8_t* at, bool half_scales) {
  return half_scales ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)))
                     : _mm512_loadu_ps(reinterpret_cast<const float*>(at));
}

// y[(pn - pn0) * PANEL + c] = row c of panel pn times the one row of x, for panels
// pn0 .. pn1 - 1 (rows past p.n are the packing's zeros: their lanes are dropped later).
void prepacked_one_row(const W8A8Problem& p, const uint8_t* packed, int64_t pn0, int64_t pn1,
                       float* y) {
  const int64_t gbytes = prepacked_group_bytes(p.half_scales);
  const int64_t sbytes = PANEL * (p.half_scales ? 2 : 4);  // a group's 32 scales
  const uint8_t* end = packed + pn1 * p.groups * gbytes;
  const __m512i nibble = _mm512_set1_epi8(15);
  int32_t x32[2 * 4];  // a group's x, 4 bytes a word: low nibbles' k, then high ones'
  for (int64_t pn = pn0; pn < pn1; ++pn) {
    const uint8_t* panel = packed + pn * p.groups * gbytes;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < p.groups; ++g) {
      const uint8_t* grp = panel + g * gbytes;
      prefetch_ahead(grp + PREPACKED_AHEAD, gbytes, end);
      std::memcpy(x32, p.qx + g * GROUP, GROUP);
      // Two sums a half (low and high nibbles): independent chains of 4 vpdpbusd.
      __m512i lo[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, hi[2] = {lo[0], lo[1]};
      for (int64_t j = 0; j < 4; ++j) {
        const __m512i xl = _mm512_set1_epi32(x32[j]), xh = _mm512_set1_epi32(x32[4 + j]);
        for (int64_t h = 0; h < 2; ++h) {  // rows 16 h .. 16 h + 15
          const __m512i v = _mm512_loadu_si512(grp + (j * PANEL + 16 * h) * 4);
          lo[h] = _mm512_dpbusd_epi32(lo[h], _mm512_and_si512(v, nibble), xl);
          hi[h] = _mm512_dpbusd_epi32(hi[h], _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                                      xh);
        }
      }
      const __m512 xs = _mm512_set1_ps(p.xs[g]);
      const uint8_t* scales = grp + 4 * PANEL * 4;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t at = h * sbytes / 2;  // rows 16 h ..: the second half of the 32
        const __m512 sw = load_scales16(scales + at, p.half_scales);
        const __m512 mw = load_scales16(scales + sbytes + at, p.half_scales);
        acc[h] = rescale_add<true>(p, acc[h], xs, sw, mw, _mm512_add_epi32(lo[h], hi[h]), 0, g);
      }
    }
    _mm512_storeu_ps(y + (pn - pn0) * PANEL, acc[0]);
    _mm512_storeu_ps(y + (pn - pn0) * PANEL + 16, acc[1]);
  }
}

// The same for an int8 weight (the layout above): y[(pn - pn0) * PANEL + c].
void prepacked_one_row_int8(const W8A8Problem& p, const uint8_t* packed, int64_t pn0,
                            int64_t pn1, float* y) {
  const int64_t sbytes = PANEL * (p.half_scales ? 2 : 4);  // one scale group's 32 scales
  const int64_t scale_block = p.s_groups * sbytes, gbytes = 8 * PANEL * 4;
  const int64_t panel_bytes = scale_block + p.groups * gbytes;
  const int64_t per_scale = p.groups / p.s_groups;  // groups a weight scale covers
  const uint8_t* end = packed + pn1 * panel_bytes;
  int32_t x32[8];  // a group's x, 4 bytes a word
  for (int64_t pn = pn0; pn < pn1; ++pn) {
    const uint8_t* panel = packed + pn * panel_bytes;
    const uint8_t* words = panel + scale_block;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 sw[2];
    for (int64_t g = 0, e = 0, sg = 0; g < p.groups; ++g, ++e) {
      const uint8_t* grp = words + g * gbytes;
      prefetch_ahead(grp + PREPACKED_AHEAD, gbytes, end);
      if (g == 0 || e == per_scale) {  // the next scale group (no division per group)
        if (g > 0) ++sg;
        e = 0;
        for (int64_t h = 0; h < 2; ++h) {
          sw[h] = load_scales16(panel + sg * sbytes + h * sbytes / 2, p.half_scales);
        }
      }
      std::memcpy(x32, p.qx + g * GROUP, GROUP);
      // Two chains a half (words 0-3 and 4-7) of 4 vpdpbusd each.
      __m512i lo[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, hi[2] = {lo[0], lo[1]};
      for (int64_t j = 0; j < 4; ++j) {
        const __m512i xl = _mm512_set1_epi32(x32[j]), xh = _mm512_set1_epi32(x32[4 + j]);
        for (int64_t h = 0; h < 2; ++h) {  // rows 16 h .. 16 h + 15
          lo[h] = _mm512_dpbusd_epi32(lo[h], _mm512_loadu_si512(grp + (j * PANEL + 16 * h) * 4), xl);
          hi[h] = _mm512_dpbusd_epi32(
              hi[h], _mm512_loadu_si512(grp + ((4 + j) * PANEL + 16 * h) * 4), xh);
        }
      }
      const __m512 xs = _mm512_set1_ps(p.xs[g]);
      const __m512i correction = _mm512_set1_epi32(p.shift[g]);  // 128 sum_k x
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(lo[h], hi[h]), correction);
        acc[h] = rescale_add<false>(p, acc[h], xs, sw[h], xs, sum, 0, g);
      }
    }
    _mm512_storeu_ps(y + (pn - pn0) * PANEL, acc[0]);
    _mm512_storeu_ps(y + (pn - pn0) * PANEL + 16, acc[1]);
  }
}
