// One row of x (a batch-1 decode step) on AVX512-VNNI: quant_w8a8_tiles.h's tiles in
// 512-bit registers. Read quant_w8a8.cpp's header and quant_w8a8_tiles.h first.
//
// At batch 1 the tiles stream the weights, but on a CPU whose memory is fast for its cores
// (or with 4-bit weights, half the bytes) they run out of instructions before bandwidth:
// a tile's group costs 8 dot products and a tree of 14 shuffles (sum_lanes8) to turn 8
// vectors of partial sums into one of 8 rows, and a 4-bit group 8 more to unpack. Here a
// register holds 64 bytes of a row: two int8 groups, or four 4-bit ones, so the dot
// products and the tree serve two (four) groups at once, at about half the shuffles per
// group (reduce_rows: 16 for two groups, 18 for four).
// - int8: AVX-512 has no vpsignb, so w * sign(x) is two masked instructions: w loaded
//   where x != 0 (zero elsewhere), then negated where x < 0.
// - 4-bit: bytes 16 g .. 16 g + 15 of a row hold group g's weights j (low nibble) and
//   j + 16 (high); four groups' low nibbles meet x's first halves, their high nibbles x's
//   second halves, rearranged once per call (RowX).
// Only the integer sums change hands: the float part is tiles()'s, group after group, so
// the bits are the same. Groups left over (a count not a multiple of 2 or 4) run as in
// tiles(), one at a time, in order.
// Included once, in quant_w8a8.cpp's avx512vnni namespace (after quant_w8a8_tiles.h).

// 8 rows' vectors of partial sums, each 128-bit lane of v[j] summing to row j's total of
// one group (lane l: group l): rows 0-3 and 4-7 as lane sums, in the lanes' groups.
inline void reduce_rows(const __m512i v[8], __m512i& rows03, __m512i& rows47) {
  // Per 128-bit lane, (a, b) -> [a0 + a2, b0 + b2, a1 + a3, b1 + b3], then two of those
  // -> [a, b, c, d]: each a whole lane's sum.
  const auto pairs = [](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  };
  const auto quads = [](__m512i s, __m512i t) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(s, t), _mm512_unpackhi_epi64(s, t));
  };
  rows03 = quads(pairs(v[0], v[1]), pairs(v[2], v[3]));
  rows47 = quads(pairs(v[4], v[5]), pairs(v[6], v[7]));
}

// [r03 lane a, r47 lane a] (rows 0-7 of one group), from lanes a and b of each: lane
// order (a, b) -> two 256-bit vectors, the first of group a, the second of group b.
inline void split_groups(__m512i both, __m256i& first, __m256i& second) {
  // both = [r03 a, r03 b, r47 a, r47 b] -> [r03 a, r47 a, r03 b, r47 b]
  const __m512i p = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
  first = _mm512_castsi512_si256(p);
  second = _mm512_extracti64x4_epi64(p, 1);
}

// x once per call, as the 512-bit loops read it: int8 weights, per pair of groups, |x| and
// the masks of x != 0 and x < 0; 4-bit weights, per four groups, each group's first 16
// activations (meeting the low nibbles) then its last 16 (the high ones).
struct RowX {
  std::vector<int8_t> bytes;  // int8: |x|, 64 a pair; 4-bit: 128 per four groups
  std::vector<__mmask64> nonzero, negative;
};

template <bool INT4>
RowX arrange_x(const W8A8Problem& p) {
  RowX r;
  if constexpr (INT4) {
    const int64_t quads = p.groups / 4;
    r.bytes.resize(quads * 128);
    for (int64_t q = 0; q < quads; ++q) {
      for (int64_t l = 0; l < 4; ++l) {
        const int8_t* x = p.qx + (4 * q + l) * GROUP;
        std::memcpy(&r.bytes[q * 128 + l * 16], x, 16);
        std::memcpy(&r.bytes[q * 128 + 64 + l * 16], x + 16, 16);
      }
    }
  } else {
    const int64_t pairs = p.groups / 2;
    r.bytes.resize(pairs * 64);
    for (int64_t q = 0; q < pairs; ++q) {
      const __m512i x = _mm512_loadu_si512(p.qx + q * 64);
      _mm512_storeu_si512(&r.bytes[q * 64], _mm512_abs_epi8(x));
      r.nonzero.push_back(_mm512_test_epi8_mask(x, x));
      r.negative.push_back(_mm512_movepi8_mask(x));
    }
  }
  return r;
}

// tiles() for p.m == 1, bit for bit.
template <bool INT4>
void tiles_one_row(const W8A8Problem& p, int64_t t0, int64_t t1) {
  constexpr int64_t PER = INT4 ? 4 : 2;              // groups in 64 bytes of a row
  constexpr int64_t GROUP_BYTES = INT4 ? GROUP / 2 : GROUP;
  const int64_t blocks = p.groups / PER;             // the rest: one group at a time
  const RowX x = arrange_x<INT4>(p);
  std::vector<float> sw(TILE * p.groups), mw(INT4 ? TILE * p.groups : 0);
  const int64_t ss = scale_stride(p), scale_bytes = p.half_scales ? 2 : 4;
  const __m512i nibble = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * TILE, nb = std::min<int64_t>(TILE, p.n - n0);
    transpose_scales_simd(p, n0, nb, sw.data(), INT4 ? mw.data() : nullptr);
    const uint8_t* w[TILE];
    for (int64_t j = 0; j < TILE; ++j) w[j] = p.w + tile_row(n0, nb, j) * p.row_bytes;
    // The next tile, as tiles() prefetches it: its rows (prefetch_next_tile), its scales into L1.
    const int64_t next_row = std::min<int64_t>(n0 + TILE, p.n - 1);
    const char* next = reinterpret_cast<const char*>(p.w + next_row * p.row_bytes);
    for (int64_t b = 0; b < TILE * p.s_groups * scale_bytes; b += 64) {
      _mm_prefetch(scale_address(p, p.s, next_row * p.s_groups) + b, _MM_HINT_T0);
      if constexpr (INT4) {
        _mm_prefetch(scale_address(p, p.mn, next_row * p.groups) + b, _MM_HINT_T0);
      }
    }
    __m256 acc = _mm256_setzero_ps();  // lane j: y[0, n0 + j]
    const auto fold = [&](int64_t g, __m256i isum) {  // tiles()'s float part (fold_group)
      acc = fold_group<INT4>(acc, isum, p.xs[g], &sw[g * ss], mw.data() + (INT4 ? g * TILE : 0),
                             INT4 ? p.xsum[g] : 0.f);
    };
    for (int64_t q = 0; q < blocks; ++q) {
      for (int64_t b = 0; b < TILE * PER * GROUP_BYTES; b += 64) {
        prefetch_next_tile(p, next + q * TILE * PER * GROUP_BYTES + b);
      }
      __m512i v[TILE];
      if constexpr (INT4) {
        const __m512i xlo = _mm512_loadu_si512(&x.bytes[q * 128]);
        const __m512i xhi = _mm512_loadu_si512(&x.bytes[q * 128 + 64]);
        for (int64_t j = 0; j < TILE; ++j) {
          const __m512i wb = _mm512_loadu_si512(w[j] + q * 64);
          const __m512i lo = _mm512_and_si512(wb, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wb, 4), nibble);
          v[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xlo), hi, xhi);
        }
      } else {
        const __m512i ax = _mm512_loadu_si512(&x.bytes[q * 64]);
        const __mmask64 nonzero = x.nonzero[q], negative = x.negative[q];
        for (int64_t j = 0; j < TILE; ++j) {
          const __m512i wv = _mm512_maskz_loadu_epi8(nonzero, w[j] + q * 64);  // 0: x = 0
          v[j] = _mm512_dpbusd_epi32(zero, ax, _mm512_mask_sub_epi8(wv, negative, zero, wv));
        }
      }
      __m512i r03, r47;
      reduce_rows(v, r03, r47);
      __m256i first, second;
      if constexpr (INT4) {  // lane l: group 4 q + l
        split_groups(_mm512_shuffle_i64x2(r03, r47, _MM_SHUFFLE(1, 0, 1, 0)), first, second);
        fold(4 * q, first);
        fold(4 * q + 1, second);
        split_groups(_mm512_shuffle_i64x2(r03, r47, _MM_SHUFFLE(3, 2, 3, 2)), first, second);
        fold(4 * q + 2, first);
        fold(4 * q + 3, second);
      } else {  // lanes 0-1: group 2 q, lanes 2-3: group 2 q + 1; each sums its two lanes
        const __m512i both = _mm512_add_epi32(
            _mm512_shuffle_i64x2(r03, r47, _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_i64x2(r03, r47, _MM_SHUFFLE(3, 1, 3, 1)));
        split_groups(both, first, second);
        fold(2 * q, first);
        fold(2 * q + 1, second);
      }
    }
    for (int64_t g = blocks * PER; g < p.groups; ++g) {  // the groups left, as tiles() does
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qx + g * GROUP));
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      __m256i v[TILE];
      for (int64_t j = 0; j < TILE; ++j) {
        if constexpr (INT4) {
          v[j] = dot_u8s8(unpack_group4(w[j], g), xv);
        } else {
          const __m256i wv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + g * GROUP));
          v[j] = dot_u8s8(ax, _mm256_sign_epi8(wv, xv));
        }
      }
      fold(g, sum_lanes8(v));
    }
    float lanes[TILE];
    _mm256_storeu_ps(lanes, acc);
    for (int64_t j = 0; j < nb; ++j) p.y[n0 + j] = lanes[j];
  }
}

// The avx512vnni entry's tiles: one row of x here, more as tiles() does.
template <bool INT4>
void tiles512(const W8A8Problem& p, int64_t t0, int64_t t1) {
  if (p.m == 1) {
    tiles_one_row<INT4>(p, t0, t1);
  } else {
    tiles<INT4>(p, t0, t1);
  }
}
