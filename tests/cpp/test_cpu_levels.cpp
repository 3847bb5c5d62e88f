// Which copy of the CPU kernels runs (src/cpu/isa.h, src/cpu/dispatch.cpp). That every copy
// computes the contract is shown by running the whole suite at each level: CTest runs it again
// with SDPA_MATH_CPU_ISA=avx2 and =baseline, and under QEMU as CPUs without AVX-512 and without AVX
// (CMakeLists.txt), where a stray instruction of a higher level would kill the process.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "sdpa_math/attention.h"

namespace sdpa_math {
namespace {

std::string first_level(const std::string& list) { return list.substr(0, list.find(',')); }

TEST(CpuLevels, BestAvailableByDefaultOrTheEnvironmentsChoice) {
  const std::string available = cpu_isas_available();
  ASSERT_FALSE(available.empty());
  // Every CPU runs the baseline, and it is the last (lowest) level listed.
  EXPECT_EQ(available.substr(available.size() - 8), "baseline") << available;
  const char* env = std::getenv("SDPA_MATH_CPU_ISA");
  EXPECT_EQ(std::string(cpu_isa()), env && *env ? std::string(env) : first_level(available));
}

TEST(CpuLevels, SetChoosesAnAvailableLevelAndRefusesOthers) {
  const std::string before = cpu_isa();
  set_cpu_isa("baseline");
  EXPECT_STREQ(cpu_isa(), "baseline");
  try {
    set_cpu_isa("avx1024");
    FAIL() << "an unknown level was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::BackendUnavailable);
    EXPECT_NE(std::string(e.what()).find("'avx1024'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(cpu_isas_available()), std::string::npos) << e.what();
  }
  EXPECT_STREQ(cpu_isa(), "baseline");  // a refused choice changes nothing
  set_cpu_isa(before);
  EXPECT_EQ(std::string(cpu_isa()), before);
}

}  // namespace
}  // namespace sdpa_math
