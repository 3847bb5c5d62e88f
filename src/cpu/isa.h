// The CPU kernels are compiled once per x86-64 level and chosen at run time by the CPU's features
// (dispatch.cpp), so one build runs on any x86-64 CPU and uses AVX-512 where there is one. CMake
// compiles every kernel file once per level with SDPA_MATH_CPU_ISA = avx512 | avx2 | baseline and
// SDPA_MATH_CPU_LEVEL = 4 | 3 | 1 (the x86-64 micro-architecture levels).
//
// Each copy lives in its own namespace, sdpa_math::cpu::<level>, between SDPA_MATH_CPU_BEGIN and
// SDPA_MATH_CPU_END, and only that code carries the level's instruction set (`#pragma GCC
// target`). The files are compiled for the baseline: the standard library and the shared headers,
// included before SDPA_MATH_CPU_BEGIN, stay baseline code, so their out-of-line copies, which the
// linker merges across the three copies, run on every CPU; inlined into a kernel they take its
// instruction set. (Compiling whole files with -march=x86-64-v4 would let the linker keep an
// AVX-512 copy of, say, a std::vector member for the baseline kernels too.)
//
// The level's features are tested with SDPA_MATH_CPU_LEVEL, not __AVX512F__ and friends: GCC's
// target pragma does not redefine those in C++.
#pragma once

#if !defined(SDPA_MATH_CPU_ISA) || !defined(SDPA_MATH_CPU_LEVEL)
#error "the CPU kernels are compiled with SDPA_MATH_CPU_ISA and SDPA_MATH_CPU_LEVEL set (see CMakeLists.txt)"
#endif

#if SDPA_MATH_CPU_LEVEL >= 4
#define SDPA_MATH_CPU_TARGET_PUSH _Pragma("GCC push_options") _Pragma("GCC target(\"arch=x86-64-v4\")")
#define SDPA_MATH_CPU_TARGET_POP _Pragma("GCC pop_options")
#elif SDPA_MATH_CPU_LEVEL >= 3
#define SDPA_MATH_CPU_TARGET_PUSH _Pragma("GCC push_options") _Pragma("GCC target(\"arch=x86-64-v3\")")
#define SDPA_MATH_CPU_TARGET_POP _Pragma("GCC pop_options")
#else
#define SDPA_MATH_CPU_TARGET_PUSH
#define SDPA_MATH_CPU_TARGET_POP
#endif

#define SDPA_MATH_CPU_BEGIN namespace sdpa_math::cpu::SDPA_MATH_CPU_ISA { SDPA_MATH_CPU_TARGET_PUSH
#define SDPA_MATH_CPU_END SDPA_MATH_CPU_TARGET_POP }
