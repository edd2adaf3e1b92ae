// quant_w8a8_gemm.h's GEMM in 256-bit vectors, for AVX2 and AVX-VNNI (read that file first:
// the layout, the blocking and the exactness argument are the same). Included inside
// namespace avx2 and namespace avxvnni, after that instruction set's
//   __m256i dot_acc(__m256i acc, __m256i a, __m256i b)   // acc + dot_u8s8(a, b)
// and SIGN_TRICK, which says how int8 weights meet the unsigned operand:
// - AVX-VNNI (SIGN_TRICK false): x + 128, as the 512-bit GEMM, with the exact correction
//   128 sum_k w per column and group.
// - AVX2 (SIGN_TRICK true): vpmaddubsw sums pairs into int16, where (x + 128) w overflows
//   (2 x 255 x 127 > 32767). The tiles' trick works here too, because the broadcast puts
//   x[4 q + b] in byte b of every lane, beside weight 4 q + b of each column: |x| is the
//   unsigned operand and w * sign(x) the signed one, pairs at most 2 x 127 x 127.
// A panel is 16 weight rows (two vectors of 8 int32 lanes); a block is 4 rows of x, whose
// 8 int32 accumulators fill half the 16 registers, so the float32 sums live in L1.

constexpr int64_t PANEL = 16;     // weight rows (output columns) per panel
constexpr int64_t GEMM_ROWS = 4;  // rows of x per register block

struct PackedPanel {
  std::vector<uint8_t> w;       // [word of a row][c < 16][4 bytes]
  std::vector<int32_t> comp;    // [g][c]: 128 sum_{k in g} w[c][k] (int8 weights, x + 128)
  std::vector<float> sw, mw;    // [g][c]: s_w (or d) and m_w (4-bit weights only)
};

constexpr bool SHIFT_INT8_X = !SIGN_TRICK;  // int8 weights meet x + 128
#include "quant_w8a8_panels.h"

// r[i] lane j -> r[j] lane i, for 8 vectors of 8 int32 lanes (transpose8's shuffles).
inline void transpose8i(__m256i r[8]) {
  __m256 f[8];
  for (int i = 0; i < 8; ++i) f[i] = _mm256_castsi256_ps(r[i]);
  transpose8(f);
  for (int i = 0; i < 8; ++i) r[i] = _mm256_castps_si256(f[i]);
}

template <bool INT4>
void pack_panel(const W8A8Problem& p, int64_t n0, int64_t nb, PackedPanel& pp) {
  const int64_t groups = p.groups, row_words = p.row_bytes / 4;
  const uint8_t* row[PANEL];
  pack_scales<INT4>(p, n0, nb, pp, row);
  int32_t* w32 = reinterpret_cast<int32_t*>(pp.w.data());  // [word][c]
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t word = 0; word < row_words; word += 8) {
      const int64_t count = std::min<int64_t>(8, row_words - word);  // the last may be short
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const uint8_t* src = row[8 * half + i] + 4 * word;
        _mm_prefetch(reinterpret_cast<const char*>(src + 256), _MM_HINT_T0);
        r[i] = _mm256_maskload_epi32(reinterpret_cast<const int*>(src), valid);
      }
      transpose8i(r);
      for (int i = 0; i < count; ++i) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w32 + (word + i) * PANEL + 8 * half), r[i]);
      }
    }
  }
  if constexpr (!INT4 && SHIFT_INT8_X) {  // 128 * sum_k w: ones as the unsigned operand
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t half = 0; half < 2; ++half) {
        __m256i s = _mm256_setzero_si256();
        for (int64_t q = 0; q < 8; ++q) {
          s = dot_acc(s, ones, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                   w32 + (8 * g + q) * PANEL + 8 * half)));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp.comp.data() + g * PANEL + 8 * half),
                            _mm256_slli_epi32(s, 7));
      }
    }
  }
}

inline __m256i broadcast4(const uint8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  return _mm256_set1_epi32(x4);
}

template <bool INT4, int ROWS>
void gemm_block(const W8A8Problem& p, const PackedPanel& pp, const uint8_t* x, int64_t m0,
                int64_t n0, int64_t nb) {
  const int64_t k = p.k, groups = p.groups;
  alignas(32) float acc[ROWS][PANEL] = {};
  const int32_t* w32 = reinterpret_cast<const int32_t*>(pp.w.data());
  auto wvec = [&](int64_t word, int h) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w32 + word * PANEL + 8 * h));
  };
  for (int64_t g = 0; g < groups; ++g) {
    __m256i isum[ROWS][2];
    for (int r = 0; r < ROWS; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    if constexpr (INT4) {  // word j: k = 4 j .. (low nibbles) and 16 + 4 j .. (high)
      const __m256i nibble = _mm256_set1_epi8(15);
      for (int64_t j = 0; j < 4; ++j) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = wvec(4 * g + j, h);
          lo[h] = _mm256_and_si256(v, nibble);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        for (int r = 0; r < ROWS; ++r) {
          const uint8_t* xr = x + (m0 + r) * k + GROUP * g + 4 * j;
          const __m256i bl = broadcast4(xr), bh = broadcast4(xr + 16);
          for (int h = 0; h < 2; ++h) isum[r][h] = dot_acc(dot_acc(isum[r][h], lo[h], bl), hi[h], bh);
        }
      }
    } else {
      for (int64_t q = 0; q < 8; ++q) {
        const __m256i w[2] = {wvec(8 * g + q, 0), wvec(8 * g + q, 1)};
        for (int r = 0; r < ROWS; ++r) {
          const __m256i xb = broadcast4(x + (m0 + r) * k + GROUP * g + 4 * q);
          if constexpr (SIGN_TRICK) {  // |x| times w * sign(x)
            const __m256i ax = _mm256_sign_epi8(xb, xb);
            for (int h = 0; h < 2; ++h) isum[r][h] = dot_acc(isum[r][h], ax, _mm256_sign_epi8(w[h], xb));
          } else {  // x + 128 times w
            for (int h = 0; h < 2; ++h) isum[r][h] = dot_acc(isum[r][h], xb, w[h]);
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = _mm256_loadu_ps(pp.sw.data() + g * PANEL + 8 * h);
      __m256 mw = _mm256_setzero_ps();
      __m256i comp = _mm256_setzero_si256();
      if constexpr (INT4) {
        mw = _mm256_loadu_ps(pp.mw.data() + g * PANEL + 8 * h);
      } else if constexpr (SHIFT_INT8_X) {
        comp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pp.comp.data() + g * PANEL + 8 * h));
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xs = _mm256_set1_ps(p.xs[(m0 + r) * groups + g]);
        const __m256i i32 = (INT4 || !SHIFT_INT8_X) ? isum[r][h] : _mm256_sub_epi32(isum[r][h], comp);
        __m256 term = _mm256_mul_ps(_mm256_mul_ps(xs, sw), _mm256_cvtepi32_ps(i32));
        if constexpr (INT4) {
          term = _mm256_add_ps(term, _mm256_mul_ps(mw, _mm256_set1_ps(p.xsum[(m0 + r) * groups + g])));
        }
        _mm256_store_ps(acc[r] + 8 * h, _mm256_add_ps(_mm256_load_ps(acc[r] + 8 * h), term));
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    std::memcpy(p.y + (m0 + r) * p.n + n0, acc[r], sizeof(float) * nb);
  }
}
