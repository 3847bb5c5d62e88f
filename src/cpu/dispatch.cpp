// Which copy of the CPU kernels runs (isa.h): the best level that is compiled in and that this CPU
// supports, checked once; and the thread count the kernels use. Compiled for the baseline.
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "kernels.h"
#include "sdpa_math/attention.h"

namespace sdpa_math {
namespace {

enum class Level { Baseline, Avx2, Avx512 };
constexpr Level kLevels[] = {Level::Avx512, Level::Avx2, Level::Baseline};  // best first

const char* level_name(Level l) {
  switch (l) {
    case Level::Avx512: return "avx512";
    case Level::Avx2: return "avx2";
    case Level::Baseline: return "baseline";
  }
  return "unknown";
}

// Compiled in (CMake defines SDPA_MATH_CPU_HAS_<LEVEL> for each copy it builds) and supported by
// this CPU and its operating system (__builtin_cpu_supports checks the OS saves the registers).
bool usable(Level l) {
  switch (l) {
    case Level::Avx512:
#if defined(SDPA_MATH_CPU_HAS_AVX512)
      return __builtin_cpu_supports("x86-64-v4");
#else
      return false;
#endif
    case Level::Avx2:
#if defined(SDPA_MATH_CPU_HAS_AVX2)
      return __builtin_cpu_supports("x86-64-v3");
#else
      return false;
#endif
    case Level::Baseline: return true;
  }
  return false;
}

Level parse(const std::string& name) {
  for (Level l : kLevels)
    if (name == level_name(l) && usable(l)) return l;
  throw Error(ErrorCode::BackendUnavailable, "CPU kernel level '" + name + "' is not available here; this build and CPU have: " +
                                                 cpu_isas_available());
}

std::atomic<Level> g_level{Level::Baseline};
std::once_flag g_level_chosen;

Level level() {
  std::call_once(g_level_chosen, [] {
    Level best = Level::Baseline;
    for (Level l : kLevels)
      if (usable(l)) { best = l; break; }
    // A bad value in the environment is an error at the first CPU call, not a silent default.
    if (const char* env = std::getenv("SDPA_MATH_CPU_ISA"); env && *env) best = parse(env);
    g_level = best;
  });
  return g_level.load();
}

std::atomic<int> g_cpu_threads{0};

}  // namespace

const char* cpu_isa() { return level_name(level()); }

std::string cpu_isas_available() {
  std::string out;
  for (Level l : kLevels)
    if (usable(l)) out += std::string(out.empty() ? "" : ", ") + level_name(l);
  return out;
}

void set_cpu_isa(const std::string& name) {
  level();  // the environment's choice is made first, so it cannot undo this one later
  g_level = parse(name);
}

void set_cpu_threads(int n) { g_cpu_threads = n < 0 ? 0 : n; }
int cpu_threads() {
  int n = g_cpu_threads.load();
  return n > 0 ? n : omp_get_max_threads();
}

namespace cpu {

void forward(const core::Problem& p, const ForwardOutputs& out) {
  switch (level()) {
#if defined(SDPA_MATH_CPU_HAS_AVX512)
    case Level::Avx512: return avx512::forward(p, out);
#endif
#if defined(SDPA_MATH_CPU_HAS_AVX2)
    case Level::Avx2: return avx2::forward(p, out);
#endif
    default: return baseline::forward(p, out);
  }
}

void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out) {
  switch (level()) {
#if defined(SDPA_MATH_CPU_HAS_AVX512)
    case Level::Avx512: return avx512::backward(p, args, out);
#endif
#if defined(SDPA_MATH_CPU_HAS_AVX2)
    case Level::Avx2: return avx2::backward(p, args, out);
#endif
    default: return baseline::backward(p, args, out);
  }
}

void forward_stats(const core::Problem& p, const StatsOutputs& out) {
  switch (level()) {
#if defined(SDPA_MATH_CPU_HAS_AVX512)
    case Level::Avx512: return avx512::forward_stats(p, out);
#endif
#if defined(SDPA_MATH_CPU_HAS_AVX2)
    case Level::Avx2: return avx2::forward_stats(p, out);
#endif
    default: return baseline::forward_stats(p, out);
  }
}

}  // namespace cpu
}  // namespace sdpa_math
