// What the two W8A8 GEMMs share (quant_w8a8_gemm.h in 512-bit vectors, quant_w8a8_gemm256.h
// in 256-bit ones): the panel's scales, the prefetch, the loops over panels and rows of x.
// Included by each, inside its instruction set's namespace, after it defines PANEL,
// GEMM_ROWS, PackedPanel and SHIFT_INT8_X (true: int8 weights meet x + 128); it defines
// pack_panel and gemm_block after. Hence no include guard, on purpose.

template <bool INT4>
void pack_panel(const W8A8Problem& p, int64_t n0, int64_t nb, PackedPanel& pp);
template <bool INT4, int ROWS>
void gemm_block(const W8A8Problem& p, const PackedPanel& pp, const uint8_t* x, int64_t m0,
                int64_t n0, int64_t nb);

// The panel's buffers sized, its rows' addresses in `row` (rows past nb repeat the last;
// their lanes are dropped), and its scales and minimums transposed to [g][c].
template <bool INT4>
void pack_scales(const W8A8Problem& p, int64_t n0, int64_t nb, PackedPanel& pp,
                 const uint8_t* row[PANEL]) {
  const int64_t groups = p.groups;
  pp.w.resize(PANEL * p.row_bytes);
  pp.sw.resize(PANEL * groups);
  if constexpr (INT4) {
    pp.mw.resize(PANEL * groups);
  } else if constexpr (SHIFT_INT8_X) {
    pp.comp.resize(PANEL * groups);
  }
  for (int64_t c = 0; c < PANEL; ++c) {
    const int64_t r = tile_row(n0, nb, c);
    row[c] = p.w + r * p.row_bytes;
    const int64_t per_scale = groups / p.s_groups;  // (no division per group: ~25 cycles)
    for (int64_t gw = 0, g = 0; gw < p.s_groups; ++gw) {
      const float s = scale_at(p, p.s, r * p.s_groups + gw);
      for (int64_t e = 0; e < per_scale; ++e, ++g) pp.sw[g * PANEL + c] = s;
    }
    if constexpr (INT4) {
      for (int64_t g = 0; g < groups; ++g) pp.mw[g * PANEL + c] = scale_at(p, p.mn, r * groups + g);
    }
  }
}

// Weight rows n0 .. n0 + PANEL - 1 (their integers, scales and minimums are contiguous)
// into L2.
inline void prefetch_panel(const W8A8Problem& p, int64_t n0) {
  const int64_t rows = std::min<int64_t>(PANEL, p.n - n0);
  if (rows <= 0) return;
  const char* w = reinterpret_cast<const char*>(p.w + n0 * p.row_bytes);
  for (int64_t b = 0; b < rows * p.row_bytes; b += 64) _mm_prefetch(w + b, _MM_HINT_T1);
  const int64_t scale_bytes = p.half_scales ? 2 : 4;
  const char* s = scale_address(p, p.s, n0 * p.s_groups);
  for (int64_t b = 0; b < rows * p.s_groups * scale_bytes; b += 64) _mm_prefetch(s + b, _MM_HINT_T1);
  if (p.mn == nullptr) return;
  const char* mn = scale_address(p, p.mn, n0 * p.groups);
  for (int64_t b = 0; b < rows * p.groups * scale_bytes; b += 64) _mm_prefetch(mn + b, _MM_HINT_T1);
}

// Panels pn0 .. pn1 - 1 for every row of x, GEMM_ROWS rows at a time.
template <bool INT4>
void gemm_panels(const W8A8Problem& p, const uint8_t* x, int64_t pn0, int64_t pn1) {
  PackedPanel pp;
  for (int64_t pn = pn0; pn < pn1; ++pn) {
    const int64_t n0 = pn * PANEL, nb = std::min<int64_t>(PANEL, p.n - n0);
    pack_panel<INT4>(p, n0, nb, pp);
    prefetch_panel(p, n0 + PANEL);  // into L2 while this panel computes
    int64_t m0 = 0;
    for (; m0 + GEMM_ROWS <= p.m; m0 += GEMM_ROWS) gemm_block<INT4, GEMM_ROWS>(p, pp, x, m0, n0, nb);
    switch (p.m - m0) {
      case 3: gemm_block<INT4, 3>(p, pp, x, m0, n0, nb); break;
      case 2: gemm_block<INT4, 2>(p, pp, x, m0, n0, nb); break;
      case 1: gemm_block<INT4, 1>(p, pp, x, m0, n0, nb); break;
      default: break;
    }
  }
}

// The whole matmul: x made unsigned once where int8 weights need it (q_x + 128 as a byte:
// its sign bit flipped, 8 bytes at a time), then panels across threads.
template <bool INT4>
void gemm(const W8A8Problem& p) {
  std::vector<uint8_t> shifted;
  const uint8_t* x = reinterpret_cast<const uint8_t*>(p.qx);
  if constexpr (!INT4 && SHIFT_INT8_X) {
    const int64_t total = p.m * p.k;  // a multiple of 32
    shifted.resize(total);
    for (int64_t i = 0; i < total; i += 8) {
      uint64_t v;
      std::memcpy(&v, x + i, 8);
      v ^= 0x8080808080808080ull;
      std::memcpy(shifted.data() + i, &v, 8);
    }
    x = shifted.data();
  }
  const int64_t panels = (p.n + PANEL - 1) / PANEL;
  parallel_for(0, panels, grain_for(PANEL * p.k * p.m),
               [&](int64_t pn0, int64_t pn1) { gemm_panels<INT4>(p, x, pn0, pn1); });
}
