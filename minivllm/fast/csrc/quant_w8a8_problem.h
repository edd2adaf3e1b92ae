// One W8A8 matmul's problem (W8A8Problem) and the helpers every tile reads it with: its
// scales as float32, the rows of a tile, the tile's scales transposed. Read
// quant_w8a8.cpp's header first. Included once, in quant_w8a8.cpp's anonymous namespace
// (after GROUP and TILE), before the tiles of each instruction set.

// One W8A8 matmul: what every tile reads and writes.
struct W8A8Problem {
  const int8_t* qx;      // (m, k) int8 activations
  const float* xs;       // (m, groups) s_x
  const float* xsum;     // (m, groups) sum_x (4-bit weights only)
  int64_t m, k, groups;  // groups = k / 32
  const uint8_t* w;      // the weight's integers: row r at w + r * row_bytes
  int64_t row_bytes;     // k (int8) or k / 2 (4-bit)
  const void* s;         // (n, s_groups) s_w or d: float32, or float16 (half_scales)
  const void* mn;        // (n, groups) m_w (4-bit weights only), the same dtype
  int64_t s_groups;      // scales per weight row (int8: one per 32 * (groups / s_groups))
  int64_t n;
  float* y;              // (m, n) float32
  bool half_scales;      // s and mn are float16, as a GGUF's blocks store them
  bool next_into_l1 = false;  // a tile prefetches the next one into L1, not L2 (run())
  const int32_t* shift = nullptr;  // a prepacked int8 weight: 128 sum_k q_x, a group
};

// Scale (or minimum) i of `base` as a float32: a float16 converts exactly, so a weight
// whose scales are stored in float16 gives the bits of the same scales in float32.
inline float scale_at(const W8A8Problem& p, const void* base, int64_t i) {
  return p.half_scales ? static_cast<float>(static_cast<const at::Half*>(base)[i])
                       : static_cast<const float*>(base)[i];
}

// Where scale (or minimum) i of `base` is, for a prefetch.
inline const char* scale_address(const W8A8Problem& p, const void* base, int64_t i) {
  return static_cast<const char*>(base) + i * (p.half_scales ? 2 : 4);
}

// The weight rows of a tile: n0 .. n0 + nb - 1, padded to TILE by repeating the last (its
// lanes are computed and dropped).
inline int64_t tile_row(int64_t n0, int64_t nb, int64_t j) {
  return n0 + std::min<int64_t>(j, nb - 1);
}

// The tile's scales, transposed: sw[g * TILE + j] is row j's scale for activation group g,
// mw the same for the minimums. A weight with one scale a row (int8 per channel) stores
// one vector (scale_stride() = 0: every group reads it).
void transpose_scales(const W8A8Problem& p, int64_t n0, int64_t nb, float* sw, float* mw) {
  const int64_t per_scale = p.groups / p.s_groups;  // activation groups per weight scale
  for (int64_t j = 0; j < TILE; ++j) {
    const int64_t r = tile_row(n0, nb, j);
    if (p.s_groups == 1) {
      sw[j] = scale_at(p, p.s, r);
    } else {  // (no division by per_scale per element: an integer division costs ~40 cycles)
      for (int64_t gw = 0; gw < p.s_groups; ++gw) {
        const float s = scale_at(p, p.s, r * p.s_groups + gw);
        for (int64_t c = 0; c < per_scale; ++c) sw[(gw * per_scale + c) * TILE + j] = s;
      }
    }
    if (mw != nullptr) {
      for (int64_t g = 0; g < p.groups; ++g) mw[g * TILE + j] = scale_at(p, p.mn, r * p.groups + g);
    }
  }
}

// Floats between one group's vector of transposed scales and the next.
inline int64_t scale_stride(const W8A8Problem& p) { return p.s_groups == 1 ? 0 : TILE; }
