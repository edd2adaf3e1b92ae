// The AMX-INT8 GEMM of quant_w8a8.cpp (read its header first: the maths,
// and quant_w8a8_gemm.h: the panels). Included once, inside namespace amx and its
// `#pragma GCC target` region, after namespace avx512vnni, whose panels it reuses.
//
// AMX adds eight tile registers of up to 16 rows x 64 bytes to the core, and one
// instruction, tdpbssd, that multiplies a 16 x 4K tile of signed bytes by a K x 16 tile of
// signed bytes stored in VNNI's layout (4 consecutive k of one column to a 32-bit word) into
// a 16 x 16 tile of int32 sums: 16 x 16 x 32 = 8192 multiply-adds for one group of 32 k,
// where AVX512-VNNI needs 128 vpdpbusd.
//
// - The B tiles are avx512vnni's packed panels as they are: a panel's words
//   [8 g + q][c] for q < 8 are 8 rows of 128 bytes (32 columns), so the tile of columns
//   16 h .. 16 h + 15 is 8 rows of 64 bytes at stride 128.
// - The A tile is 16 rows of x's group g, read in place at stride K (a last block of fewer
//   rows is copied into 16 zeroed rows first).
// - int8 weights: signed times signed (tdpbssd), so no x + 128 and no correction
//   (avx512vnni's pack_panel still computes its correction: one vpdpbusd per 64 weight
//   bytes, unused). 4-bit weights: signed x times unsigned weights (tdpbsud), after the
//   packed panel's nibbles are split into bytes once per panel (unpack_nibbles): word j of
//   a group holds k = 4 j .. in its low nibbles and k = 16 + 4 j .. in its high ones.
// - Per group: two dot-product instructions (the panel's two halves), the two 16 x 16
//   int32 tiles stored to L1, and the ref's rescale, one output column per lane, group
//   after group, as in gemm_block: term = (s_x s_w) * float(I) [+ m_w sum_x],
//   acc = acc + term (fp-contract is off).
// - Each thread loads the tile configuration for its run of panels and releases the tiles
//   after. The kernel lets a process use AMX only once asked (arch_prctl
//   ARCH_REQ_XCOMP_PERM, amx_usable()); where it refuses, "amx" is not offered.

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t AMX_ROWS = 16;  // rows of x per block: a tile's rows

// Tiles 0 and 1: the int32 sums of columns 0-15 and 16-31; 2: x's group; 3 and 4: the
// panel's halves of the group.
inline void load_tile_config() {
  TileConfig cfg;
  for (int t : {0, 1}) {
    cfg.rows[t] = AMX_ROWS;
    cfg.colsb[t] = 64;
  }
  cfg.rows[2] = AMX_ROWS;
  cfg.colsb[2] = GROUP;
  for (int t : {3, 4}) {
    cfg.rows[t] = GROUP / 4;
    cfg.colsb[t] = 64;
  }
  // Not GCC 12's _tile_loadconfig(&cfg): its asm names only the first 8 bytes of the
  // configuration as read, so GCC moved the stores of the rest after the ldtilecfg, which
  // then loaded garbage and faulted (SIGSEGV). Naming the whole struct keeps the order.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// A packed 4-bit panel's words (quant_w8a8_gemm.h's pack_panel) as bytes, in the int8
// panel's order: words [8 g + q][c] hold k = 32 g + 4 q .. + 3 of column c, one byte each.
void unpack_nibbles(const avx512vnni::PackedPanel& pp, int64_t groups, std::vector<uint8_t>& out) {
  using avx512vnni::PANEL;
  out.resize(groups * 8 * PANEL * 4);
  const __m512i nibble = _mm512_set1_epi8(15);
  const uint8_t* src = pp.w.data();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = 0; j < 4; ++j) {
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(src + ((4 * g + j) * PANEL + 16 * h) * 4);
        _mm512_storeu_si512(out.data() + ((8 * g + j) * PANEL + 16 * h) * 4,
                            _mm512_and_si512(v, nibble));
        _mm512_storeu_si512(out.data() + ((8 * g + 4 + j) * PANEL + 16 * h) * 4,
                            _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
      }
    }
  }
}

// Rows m0 .. m0 + rows - 1 of x (x: AMX_ROWS rows at stride k from `xa`) times the panel,
// whose bytes `w` are [8 g + q][c][4] (int8 weights, or 4-bit ones unpacked).
template <bool INT4>
void amx_block(const W8A8Problem& p, const avx512vnni::PackedPanel& pp, const uint8_t* w,
               const int8_t* xa, int64_t m0, int64_t rows, int64_t n0, int64_t nb) {
  using avx512vnni::PANEL;
  const int64_t k = p.k, groups = p.groups;
  alignas(64) int32_t sums[2][AMX_ROWS][16];
  __m512 acc[AMX_ROWS][2];
  for (int64_t r = 0; r < AMX_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, xa + GROUP * g, k);
    _tile_loadd(3, w + 8 * g * PANEL * 4, PANEL * 4);
    _tile_loadd(4, w + (8 * g * PANEL + 16) * 4, PANEL * 4);
    if constexpr (INT4) {  // signed x, unsigned weights
      _tile_dpbsud(0, 2, 3);
      _tile_dpbsud(1, 2, 4);
    } else {  // signed x signed
      _tile_dpbssd(0, 2, 3);
      _tile_dpbssd(1, 2, 4);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    const __m512 sw[2] = {_mm512_loadu_ps(pp.sw.data() + g * PANEL),
                          _mm512_loadu_ps(pp.sw.data() + g * PANEL + 16)};
    __m512 mw[2];
    if constexpr (INT4) {
      mw[0] = _mm512_loadu_ps(pp.mw.data() + g * PANEL);
      mw[1] = _mm512_loadu_ps(pp.mw.data() + g * PANEL + 16);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 xs = _mm512_set1_ps(p.xs[(m0 + r) * groups + g]);
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = avx512vnni::rescale_add<INT4>(p, acc[r][h], xs, sw[h], INT4 ? mw[h] : xs,
                                                  _mm512_load_si512(sums[h][r]), m0 + r, g);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) avx512vnni::store_row(p, acc[r], m0 + r, n0, nb);
}

// Panels pn0 .. pn1 - 1 for every row of x, 16 rows at a time.
template <bool INT4>
void amx_panels(const W8A8Problem& p, int64_t pn0, int64_t pn1) {
  using avx512vnni::PANEL;
  load_tile_config();
  avx512vnni::PackedPanel pp;
  std::vector<uint8_t> bytes;  // a 4-bit panel, a byte a weight
  const int64_t full = p.m / AMX_ROWS * AMX_ROWS, tail = p.m - full;
  std::vector<int8_t> last(tail > 0 ? AMX_ROWS * p.k : 0, 0);  // the last rows, zero-padded
  if (tail > 0) std::memcpy(last.data(), p.qx + full * p.k, tail * p.k);
  for (int64_t pn = pn0; pn < pn1; ++pn) {
    const int64_t n0 = pn * PANEL, nb = std::min<int64_t>(PANEL, p.n - n0);
    avx512vnni::pack_panel<INT4>(p, n0, nb, pp);
    avx512vnni::prefetch_panel(p, n0 + PANEL);  // into L2 while this panel computes
    const uint8_t* w = pp.w.data();
    if constexpr (INT4) {
      unpack_nibbles(pp, p.groups, bytes);
      w = bytes.data();
    }
    for (int64_t m0 = 0; m0 < full; m0 += AMX_ROWS) {
      amx_block<INT4>(p, pp, w, p.qx + m0 * p.k, m0, AMX_ROWS, n0, nb);
    }
    if (tail > 0) amx_block<INT4>(p, pp, w, last.data(), full, tail, n0, nb);
  }
  _tile_release();
}

// Rows of x from which AMX beats avx512vnni's GEMM: below, padding x to 16-row blocks and
// (4-bit) unpacking each panel cost more than the tiles save (measured on the Xeon, one
// thread, 3072 x 576: level at 12-16 rows for int8 and behind up to 24 for 4-bit; from
// 32 rows AMX is 1.05-1.2x ahead).
constexpr int64_t AMX_MIN_ROWS = 32;

// The whole matmul: panels across threads.
template <bool INT4>
void gemm(const W8A8Problem& p) {
  if (p.m < AMX_MIN_ROWS) {
    avx512vnni::gemm<INT4>(p);
    return;
  }
  const int64_t panels = (p.n + avx512vnni::PANEL - 1) / avx512vnni::PANEL;
  parallel_for(0, panels, grain_for(avx512vnni::PANEL * p.k * p.m),
               [&](int64_t pn0, int64_t pn1) { amx_panels<INT4>(p, pn0, pn1); });
}
