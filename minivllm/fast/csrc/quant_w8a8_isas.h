// Which W8A8 instruction sets this build and this CPU run (available_isas), worst first.
// Read quant_w8a8.cpp's header first. Included once, in quant_w8a8.cpp's anonymous
// namespace, after every instruction set's namespace and IsaEntry.

// Built for another CPU (MINIVLLM_CPU_ARCH, cpu_ops.py): an instruction set counts only if
// that CPU has it too, as -march says (native: the run-time check alone decides).
#if !defined(MINIVLLM_FOREIGN_ARCH) || (defined(__AVX2__) && defined(__F16C__))
constexpr bool TARGET_AVX2 = true;
#else
constexpr bool TARGET_AVX2 = false;
#endif
#if !defined(MINIVLLM_FOREIGN_ARCH) || defined(__AVXVNNI__)
constexpr bool TARGET_AVXVNNI = true;
#else
constexpr bool TARGET_AVXVNNI = false;
#endif
#if !defined(MINIVLLM_FOREIGN_ARCH) || \
    (defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__))
constexpr bool TARGET_AVX512VNNI = true;
#else
constexpr bool TARGET_AVX512VNNI = false;
#endif
#if !defined(MINIVLLM_FOREIGN_ARCH) || defined(__AMX_INT8__)
constexpr bool TARGET_AMX = true;
#else
constexpr bool TARGET_AMX = false;
#endif

// Every instruction set this CPU runs, worst first (the portable loop always).
std::vector<IsaEntry> available_isas() {
  std::vector<IsaEntry> out{{"portable", portable_tiles<false>, portable_tiles<true>,
                                  quantize_group_portable}};
#if MINIVLLM_W8A8_X86
  __builtin_cpu_init();
  if (TARGET_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    out.push_back({"avx2", avx2::tiles<false>, avx2::tiles<true>, avx2::quantize_group,
                   avx2::gemm<false>, avx2::gemm<true>});
    if (TARGET_AVXVNNI && __builtin_cpu_supports("avxvnni")) {
      out.push_back({"avxvnni", avxvnni::tiles<false>, avxvnni::tiles<true>,
                     avxvnni::quantize_group, avxvnni::gemm<false>, avxvnni::gemm<true>});
    }
    if (TARGET_AVX512VNNI && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
      out.push_back({"avx512vnni", avx512vnni::tiles512<false>, avx512vnni::tiles512<true>,
                     avx512vnni::quantize_group, avx512vnni::gemm<false>,
                     avx512vnni::gemm<true>, avx512vnni::prepacked_one_row_int8,
                     avx512vnni::prepacked_one_row});
#if MINIVLLM_W8A8_AMX
      if (TARGET_AMX && amx_usable()) {  // the GEMM on AMX; one row of x as avx512vnni
        out.push_back({"amx", avx512vnni::tiles512<false>, avx512vnni::tiles512<true>,
                       avx512vnni::quantize_group, amx::gemm<false>, amx::gemm<true>,
                       avx512vnni::prepacked_one_row_int8, avx512vnni::prepacked_one_row});
      }
#endif
    }
  }
#endif
  return out;
}
