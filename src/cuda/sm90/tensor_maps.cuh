// What the sm90 kernels share on the host and device side besides the instruction wrappers: the
// TMA tensor maps of operands (5-D: {cols, rows, up to three lead dims}) and how a kernel turns
// a lead index into a map's coordinates.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../device_problem.cuh"

namespace sdpa_math::cuda::sm90 {

// How a producer turns a lead index into a tensor map's coordinates on dims 2..4: coordinate k
// is (lead / div[k]) % mod[k] / group[k] (the output lead dim that map dim follows; GQA's group
// on the head dim), so no per-dim array is indexed at run time.
struct MapCoords {
  int n = 0;
  int64_t div[3] = {1, 1, 1}, mod[3] = {1, 1, 1}, group[3] = {1, 1, 1};
};

SDPA_MATH_D void map_coords(const MapCoords& mc, int64_t lead, int (&c)[3]) {
#pragma unroll
  for (int k = 0; k < 3; ++k) c[k] = static_cast<int>((lead / mc.div[k]) % mc.mod[k] / mc.group[k]);
}

// map_coords for lead indices below 2^31 (kernels whose launchers check num_lead): 32-bit
// divisions, where 64-bit ones are calls whose registers a producer limited to 40 cannot spare
// (the sm90 backward's spilled).
SDPA_MATH_D void map_coords32(const MapCoords& mc, int lead, int (&c)[3]) {
  const auto u = [](int64_t x) { return static_cast<uint32_t>(x); };
#pragma unroll
  for (int k = 0; k < 3; ++k) c[k] = static_cast<int>(static_cast<uint32_t>(lead) / u(mc.div[k]) % u(mc.mod[k]) / u(mc.group[k]));
}

// A 5-D map of one 16-bit operand with `rows` x `cols` per lead index: {cols, rows, up to three
// lead dims it does not broadcast over}, boxes of {64, box_rows} with the 128-byte swizzle, and
// the coordinates' recipe in `mc`. False when TMA cannot address it (strides or base not 16-byte
// aligned, a non-unit column stride, more than three distinct lead dims).
bool make_map(CUtensorMap* map, const DevProblem& p, const DevOperand& op, int64_t rows, int64_t cols, int box_rows,
              MapCoords& mc);

// A 5-D map {row_len, rows, 1, 1, 1} of a dense fp32 buffer, boxes of {box, 1}, no swizzle: for
// a workspace a kernel reads a row piece at a time through the TMA unit. False when TMA cannot
// address it.
bool make_rows_map_f32(CUtensorMap* map, const float* data, int64_t row_len, int64_t rows, int box);

// Head sizes are padded to one or two 64-element (128-byte) column blocks.
inline int64_t padded_head(int64_t e) { return e <= 64 ? 64 : 128; }

}  // namespace sdpa_math::cuda::sm90
