// The portable W8A8 loop of quant_w8a8.cpp (read its header first: the maths): the oracle
// the SIMD tiles are checked against, and what a CPU without AVX2 runs. Included once,
// inside quant_w8a8.cpp's anonymous namespace, after W8A8Problem, transpose_scales and
// unpack_row4. Hence no include guard, on purpose.

// The portable loop is plain scalar C, never vectorised by the compiler. With
// -march=native on an AVX512-VNNI CPU, GCC 12 turns its signed x signed int8 dot product
// into vpdpbusd, which reads one operand as unsigned bytes: wrong sums (a negative weight
// counts as w + 256). The scalar loop is the oracle the SIMD tiles are checked against on
// a CPU without AVX2, so it must hold whatever flags the library is built with
// (tests/test_w8a8.py compiles this file for an AVX512-VNNI target and reads its assembly).
#if defined(__clang__)
#define MINIVLLM_SCALAR_LOOP
#define MINIVLLM_NO_VECTORIZE _Pragma("clang loop vectorize(disable) interleave(disable)")
#elif defined(__GNUC__)
#define MINIVLLM_SCALAR_LOOP __attribute__((optimize("no-tree-vectorize", "no-tree-slp-vectorize")))
#define MINIVLLM_NO_VECTORIZE
#else
#define MINIVLLM_SCALAR_LOOP
#define MINIVLLM_NO_VECTORIZE
#endif

// One group of 32 activations: q = round(x * (1 / s)), s = max |x| / 127; returns sum(q).
// The portable loop; the SIMD one (quant_w8a8_tiles.h) gives the same bits.
MINIVLLM_SCALAR_LOOP int32_t quantize_group_portable(const float* x, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t l = 0; l < GROUP; ++l) {
    const float a = std::fabs(x[l]);
    amax = a > amax ? a : amax;
  }
  const float s = amax / 127.f;
  const float inv = s > 0.f ? 1.f / s : 0.f;  // an all-zero group: q = 0
  int32_t total = 0;
  for (int64_t l = 0; l < GROUP; ++l) {
    float r = std::nearbyint(x[l] * inv);  // the default rounding mode: ties to even
    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
    q[l] = static_cast<int8_t>(r);
    total += static_cast<int32_t>(r);
  }
  *scale = s;
  return total;
}

// ------------------------------------------------------------------ the portable loop
// The ref's sums written out: an int32 dot product per group, then the rescale.
template <bool INT4>
MINIVLLM_SCALAR_LOOP void portable_tiles(const W8A8Problem& p, int64_t t0, int64_t t1) {
  std::vector<uint8_t> row4(INT4 ? p.k : 0);
  std::vector<float> sw(TILE * p.groups), mw(INT4 ? TILE * p.groups : 0);
  const int64_t ss = scale_stride(p);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * TILE, nb = std::min<int64_t>(TILE, p.n - n0);
    transpose_scales(p, n0, nb, sw.data(), INT4 ? mw.data() : nullptr);
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* row = p.w + (n0 + j) * p.row_bytes;
      if constexpr (INT4) {
        unpack_row4(row, p.k, row4.data());
        row = row4.data();
      }
      for (int64_t m = 0; m < p.m; ++m) {
        const int8_t* x = p.qx + m * p.k;
        float acc = 0.f;
        for (int64_t g = 0; g < p.groups; ++g) {
          int32_t isum = 0;
          MINIVLLM_NO_VECTORIZE
          for (int64_t i = g * GROUP; i < (g + 1) * GROUP; ++i) {
            const int32_t w = INT4 ? static_cast<int32_t>(row[i])
                                   : static_cast<int32_t>(static_cast<int8_t>(row[i]));
            isum += static_cast<int32_t>(x[i]) * w;
          }
          float term = (p.xs[m * p.groups + g] * sw[g * ss + j]) * static_cast<float>(isum);
          if constexpr (INT4) term = term + mw[g * TILE + j] * p.xsum[m * p.groups + g];
          acc = acc + term;
        }
        p.y[m * p.n + n0 + j] = acc;
      }
    }
  }
}
