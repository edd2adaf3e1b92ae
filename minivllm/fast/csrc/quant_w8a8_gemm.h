// The AVX512-VNNI GEMM of quant_w8a8.cpp (read its header first: the maths), for many rows
// of x (a batched decode step, a prefill). Included once, inside namespace avx512vnni and
// its `#pragma GCC target` region.
//
// The tiles of quant_w8a8_tiles.h take one row of x at a time: each vpdpbusd multiplies 32
// weights of 8 rows by the same 32 activations, and the 8 rows' partial sums then need a
// horizontal add (sum_lanes8) for every group and every row of x. With many rows of x the
// arithmetic is the cost, and that reduction is a third of it. Here the weights are laid out
// the way vpdpbusd reads them (VNNI's layout), so no reduction is needed:
//
// - A panel is 32 weight rows (output columns n0 .. n0 + 31: two vectors of 16 int32 lanes).
//   Its bytes are repacked once per call (pack_panel), 4 consecutive k of one column to a
//   32-bit lane: packed[g][q][c] holds w[n0 + c][32 g + 4 q .. 32 g + 4 q + 3]. One 64-byte
//   load then holds 16 columns x 4 k, and one vpdpbusd with 4 bytes of x broadcast to every
//   lane adds x[4 q .. 4 q + 3] . w[c][4 q .. 4 q + 3] into column c's lane: after the
//   group's 8 steps, lane c holds I[m, n0 + c, g], the group's exact int32 sum.
// - Register blocking: GEMM_ROWS (4) rows of x times 32 columns = 8 int32 accumulators
//   and 8 float32 ones; each weight vector loaded is used 4 times, each broadcast twice.
// - vpdpbusd multiplies unsigned bytes by signed ones. 4-bit weights (0..15) are the
//   unsigned operand, as in the tiles. int8 weights are signed, so x is made unsigned:
//   x + 128 (1..255, since |q_x| <= 127), and sum_k (x + 128) w = I + 128 sum_k w. The
//   correction 128 sum_k w per column and group is computed while packing and subtracted
//   from the int32 sum before it is converted: exact, so the result is the ref's bits.
// - The rescale is the ref's, one output column per lane, group after group:
//   term = (s_x s_w) * float(I) [+ m_w sum_x], acc = acc + term; fp-contract is off.
// - The repack costs about one pass over the panel's weights with 16 x 16 transposes in
//   registers, against 32 * K * M / 64 vpdpbusd: about a tenth at M = 64, less above.

constexpr int64_t PANEL = 32;     // weight rows (output columns) per panel
constexpr int64_t GEMM_ROWS = 4;  // rows of x per register block

// A panel in VNNI's layout, with its per-group constants transposed to vectors of 32.
struct PackedPanel {
  std::vector<uint8_t> w;       // [word of a row][c < 32][4 bytes] (pack_panel)
  std::vector<int32_t> comp;    // [g][c]: 128 * sum_{k in g} w[c][k] (int8 weights only)
  std::vector<float> sw, mw;    // [g][c]: s_w (or d) and m_w (4-bit weights only)
};

constexpr bool SHIFT_INT8_X = true;  // int8 weights meet x + 128
#include "quant_w8a8_panels.h"

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 int32 lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // within each 128-bit lane: pairs of rows
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], lane L: column 4 L + c of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather 128-bit lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i s0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Weight rows n0 .. n0 + nb - 1 into `pp` (rows past nb repeat the last; their lanes are
// dropped), with their scales, minimums and int8 corrections. A row's bytes are moved as
// they are, 4 at a time: an int8 row's word 8 g + q holds k = 32 g + 4 q .. + 3; a 4-bit
// row's word 4 g + j holds k = 32 g + 4 j .. + 3 in its low nibbles and the same k + 16 in
// its high ones (the storage order: byte l of a group holds weights l and l + 16), which
// gemm_block separates with a mask and a shift.
template <bool INT4>
void pack_panel(const W8A8Problem& p, int64_t n0, int64_t nb, PackedPanel& pp) {
  const int64_t groups = p.groups, row_words = p.row_bytes / 4;
  const uint8_t* row[PANEL];
  pack_scales<INT4>(p, n0, nb, pp, row);
  int32_t* w32 = reinterpret_cast<int32_t*>(pp.w.data());  // [word][c]
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t word = 0; word < row_words; word += 16) {
      const int64_t count = std::min<int64_t>(16, row_words - word);  // the last may be short
      const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {  // 16 rows read side by side: prefetched 4 lines ahead
        _mm_prefetch(reinterpret_cast<const char*>(row[16 * half + i] + 4 * word + 256),
                     _MM_HINT_T0);
        r[i] = _mm512_maskz_loadu_epi32(valid, row[16 * half + i] + 4 * word);
      }
      transpose16(r);
      for (int i = 0; i < count; ++i) {
        _mm512_storeu_si512(w32 + (word + i) * PANEL + 16 * half, r[i]);
      }
    }
  }
  if constexpr (!INT4) {  // 128 * sum_k w, by vpdpbusd with ones as the unsigned operand
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t half = 0; half < 2; ++half) {
        __m512i s = _mm512_setzero_si512();
        for (int64_t q = 0; q < 8; ++q) {
          s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(w32 + (8 * g + q) * PANEL + 16 * half));
        }
        _mm512_storeu_si512(pp.comp.data() + g * PANEL + 16 * half, _mm512_slli_epi32(s, 7));
      }
    }
  }
}

// The ref's rescale of one group's int32 sums for row m of x, 16 columns a vector, added
// to that row's float32 sums: acc + ((s_x s_w) * float(I) [+ m_w sum_x]).
template <bool INT4>
inline __m512 rescale_add(const W8A8Problem& p, __m512 acc, __m512 xs, __m512 sw, __m512 mw,
                          __m512i i32, int64_t m, int64_t g) {
  __m512 term = _mm512_mul_ps(_mm512_mul_ps(xs, sw), _mm512_cvtepi32_ps(i32));
  if constexpr (INT4) {
    const __m512 xsum = _mm512_set1_ps(p.xsum[m * p.groups + g]);
    term = _mm512_add_ps(term, _mm512_mul_ps(mw, xsum));
  }
  return _mm512_add_ps(acc, term);
}

// y[m, n0 .. n0 + nb - 1] from a panel row's two vectors of sums (columns past nb dropped).
inline void store_row(const W8A8Problem& p, const __m512 acc[2], int64_t m, int64_t n0,
                      int64_t nb) {
  const __mmask16 lo = nb >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nb) - 1);
  const __mmask16 hi = nb >= 32 ? 0xFFFF : (nb <= 16 ? 0 : static_cast<__mmask16>((1u << (nb - 16)) - 1));
  float* y = p.y + m * p.n + n0;
  _mm512_mask_storeu_ps(y, lo, acc[0]);
  _mm512_mask_storeu_ps(y + 16, hi, acc[1]);
}

// Rows m0 .. m0 + ROWS - 1 of x times the panel: y[m, n0 .. n0 + nb - 1]. `x` is q_x, or
// q_x + 128 as unsigned bytes for int8 weights.
template <bool INT4, int ROWS>
void gemm_block(const W8A8Problem& p, const PackedPanel& pp, const uint8_t* x, int64_t m0,
                int64_t n0, int64_t nb) {
  const int64_t k = p.k, groups = p.groups;
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* w32 = reinterpret_cast<const int32_t*>(pp.w.data());
  for (int64_t g = 0; g < groups; ++g) {
    __m512i isum[ROWS][2];
    for (int r = 0; r < ROWS; ++r) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
    if constexpr (INT4) {  // word j: k = 4 j .. (low nibbles) and 16 + 4 j .. (high)
      const __m512i nibble = _mm512_set1_epi8(15);
      for (int64_t j = 0; j < 4; ++j) {
        const __m512i v0 = _mm512_loadu_si512(w32 + (4 * g + j) * PANEL);
        const __m512i v1 = _mm512_loadu_si512(w32 + (4 * g + j) * PANEL + 16);
        const __m512i lo0 = _mm512_and_si512(v0, nibble), lo1 = _mm512_and_si512(v1, nibble);
        const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble);
        const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble);
        for (int r = 0; r < ROWS; ++r) {  // the weights are the unsigned operand
          int32_t xl, xh;
          std::memcpy(&xl, x + (m0 + r) * k + GROUP * g + 4 * j, 4);
          std::memcpy(&xh, x + (m0 + r) * k + GROUP * g + 16 + 4 * j, 4);
          const __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
          isum[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][0], lo0, bl), hi0, bh);
          isum[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r][1], lo1, bl), hi1, bh);
        }
      }
    } else {
      for (int64_t q = 0; q < 8; ++q) {
        const __m512i w0 = _mm512_loadu_si512(w32 + (8 * g + q) * PANEL);
        const __m512i w1 = _mm512_loadu_si512(w32 + (8 * g + q) * PANEL + 16);
        for (int r = 0; r < ROWS; ++r) {  // x + 128 is the unsigned operand
          int32_t x4;
          std::memcpy(&x4, x + (m0 + r) * k + GROUP * g + 4 * q, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], xb, w0);
          isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], xb, w1);
        }
      }
    }
    const __m512 sw[2] = {_mm512_loadu_ps(pp.sw.data() + g * PANEL),
                          _mm512_loadu_ps(pp.sw.data() + g * PANEL + 16)};
    __m512i comp[2];
    __m512 mw[2];
    if constexpr (INT4) {
      mw[0] = _mm512_loadu_ps(pp.mw.data() + g * PANEL);
      mw[1] = _mm512_loadu_ps(pp.mw.data() + g * PANEL + 16);
    } else {
      comp[0] = _mm512_loadu_si512(pp.comp.data() + g * PANEL);
      comp[1] = _mm512_loadu_si512(pp.comp.data() + g * PANEL + 16);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xs = _mm512_set1_ps(p.xs[(m0 + r) * groups + g]);
      for (int h = 0; h < 2; ++h) {
        const __m512i i32 = INT4 ? isum[r][h] : _mm512_sub_epi32(isum[r][h], comp[h]);
        acc[r][h] = rescale_add<INT4>(p, acc[r][h], xs, sw[h], INT4 ? mw[h] : xs, i32, m0 + r, g);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) store_row(p, acc[r], m0 + r, n0, nb);
}
