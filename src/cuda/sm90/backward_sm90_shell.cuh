// What the Hopper backward kernel's roles share: its tiles and shared-memory layout, its
// arguments, the CTA's keys and the index helpers. backward_sm90.cuh describes the algorithm.
//
// Like every part of the kernel, these sit in an anonymous namespace, as in a single file: each of
// the two files that include backward_sm90.cuh instantiates only its own form.
#pragma once

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "../launch.cuh"
#include "../mma.cuh"
#include "hopper.cuh"
#include "sm90.cuh"
#include "tensor_maps.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

constexpr int kBM = 64;         // query rows per step
constexpr int kBN = 128;        // keys per CTA
// dQ's accumulators the CTAs running at once add into (the kernel's block order): a third of the
// H200's 50 MiB L2, so they stay there beside the Q tiles every key block reads.
constexpr int64_t kChunkDqBytes = 16LL << 20;

// Shared memory: K and V of the CTA's keys (D/64 column blocks of [128][64] each); a ring of
// stages, each one query tile's Q and dO ([64][64] blocks) and P and dP_ext ([64 rows][64 keys]
// blocks, block w = warpgroup w's keys) and delta of its rows; dS, double-buffered, one [64][64]
// block per warpgroup. The KL form keeps no V, and a stage holds only Q and the reference's tile
// (where dP_ext sits otherwise): half the bytes, so twice the stages fit, and the loads of four
// query tiles (six at D = 64) are in flight instead of two (three). That measured neutral
// (bench/NOTES.md): the KL backward does not wait on its loads.
template <int D, bool KL>
struct Tiles {
  static constexpr int kRowTileBytes = kBM * D * 2;  // Q or dO
  static constexpr int kMapTileBytes = kBM * kBN * 2;  // P or dP_ext
  static constexpr int kKVBytes = kBN * D * 2;       // K or V
  static constexpr int kKVTiles = KL ? 1 : 2;
  // Offsets in a stage: Q, dO, P, dP_ext (KL: Q, the reference).
  static constexpr int kDoAt = kRowTileBytes;
  static constexpr int kPAt = 2 * kRowTileBytes;
  static constexpr int kDpAt = KL ? kRowTileBytes : 2 * kRowTileBytes + kMapTileBytes;
  static constexpr int kStageBytes = KL ? kRowTileBytes + kMapTileBytes : 2 * kRowTileBytes + 2 * kMapTileBytes;
  static constexpr int kStages = KL ? (D == 64 ? 6 : 4) : (D == 64 ? 3 : 2);
  static constexpr int kDsBlockBytes = kBM * 64 * 2;
  static constexpr int kDeltaBytes = 3 * kBM * 4;  // per stage: the tile's delta (KL form: three row vectors)
  static constexpr int kBarriers = 2 * kStages + 1;
  static constexpr size_t kSmem = 1024 + kKVTiles * kKVBytes + kStages * kStageBytes + 4 * kDsBlockBytes +
                                  kStages * kDeltaBytes + 8 * kBarriers;
  static_assert(kSmem <= 227 * 1024, "the sm90 backward's shared memory exceeds what an SM gives a CTA");
  static_assert(kStageBytes % 1024 == 0 && kDpAt % 1024 == 0 && kKVBytes % 1024 == 0,
                "swizzled tiles must start on 1024-byte boundaries");
};

struct Args {
  MapCoords q, k, v, dout, p, dp;
  int64_t group;     // query heads per key head (GQA), else 1
  int64_t heads;     // query heads (the last lead dim; 1 without lead dims)
  int64_t kv_leads;  // num_lead / group
  int64_t chunk_heads;  // key heads a chunk of CTAs covers (block order, see the kernel)
  int64_t q_tiles;   // ceil(L / 64)
  bool has_do, has_dp;
  bool p_tma;        // P and dP_ext come through TMA (rows 16-byte aligned: S % 8 == 0), else the
                     // producer warpgroup's other warps copy them into the stage (copy_map_tile)
  int map_piece;     // without TMA: bytes a copy, 8 where every row of the maps allows it, else 4
  float scale;
  const float* delta;  // q_tiles * 64 floats per lead index (rows past L: 0)
  float* dq_acc;       // q_tiles * 64 * D floats per lead index, fragment order
  const float* unscale;  // KL form: 1 / f per key head (dK and dQ), else nullptr
  void* dk;          // contiguous gradients in the inputs' dtype, or nullptr when not wanted
  void* dv;
};

// The lead index of query head gi of key head `kv` (GQA groups consecutive query heads). kv comes
// from a grid index (< 2^31) and the key heads a batch are a dimension's extent, so the division
// is 32-bit: a 64-bit one is a call, whose registers made ptxas spill the sm90 backward's copy
// warps and, through values they share, the consumers' loop.
SDPA_MATH_HD int64_t query_lead(const Args& a, int64_t kv, int64_t gi) {
  if (a.group == 1) return kv;
  const uint32_t kv_heads = static_cast<uint32_t>(a.heads) / static_cast<uint32_t>(a.group), k = static_cast<uint32_t>(kv);
  return static_cast<int64_t>(k / kv_heads) * a.heads + static_cast<int64_t>(k % kv_heads) * a.group + gi;
}

// lead_off for a lead index and lead extents below 2^31, in 32-bit divisions only.
SDPA_MATH_D int64_t lead_off32(const DevProblem& p, const DevOperand& op, int lead) {
  int64_t off = 0;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    const int n = static_cast<int>(p.lead_shape[d]);
    int c = lead % n;
    lead /= n;
    if (d == p.lead_ndim - 1) c /= static_cast<int>(op.head_group);
    off += static_cast<int64_t>(c) * op.lead[d];
  }
  return off;
}

// The key head (index over kv_leads) that query lead index `lead` reads: query_lead's inverse.
SDPA_MATH_HD int64_t kv_of_lead(int64_t lead, int64_t group, int64_t heads) {
  if (group == 1) return lead;
  return (lead / heads) * (heads / group) + (lead % heads) / group;
}

// dst[0..3] += (a, b, c, d) in L2, keeping the line there (`policy`: evict-last).
SDPA_MATH_D void red_add4(float* dst, float a, float b, float c, float d, uint64_t policy) {
  asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "f"(a), "f"(b), "f"(c),
               "f"(d), "l"(policy)
               : "memory");
}

// The producer warpgroup's warps 1..3 copy maps TMA cannot address; warp 0's thread 0 issues the
// TMA loads. Separate loops: in one loop, the producer's registers did not hold both (ptxas
// spilled).
constexpr int kCopyWarps = 3;

// This CTA's key head (kv), first key (j0) and, causal, first query tile that sees its keys.
// Key heads in chunks of a.chunk_heads, every key block of a chunk's heads before the next chunk:
// the CTAs that run at once then add into the dQ accumulators of a chunk's heads only, which
// stay in L2, not into all of them (all of them at once, 32 MiB on prefill1k_d128, sent the
// reductions to DRAM; chunked, both forms ran faster: bench/NOTES.md). Inside a chunk, key
// blocks in order, each over the chunk's heads: causal blocks with the most query rows first.
// 32-bit: every count here is below the grid's size (< 2^31, grid_x). Each role calls it after
// its register change, not once at the kernel's entry: values live in both roles were spilled
// for the producer's few registers and reloaded from local memory in the consumers' loop.
struct CtaKeys {
  int kv, j0, t_first;
};
SDPA_MATH_D CtaKeys cta_keys(const DevProblem& p, const Args& a) {
  const int heads = static_cast<int>(a.chunk_heads), per_chunk = heads * static_cast<int>((p.S + kBN - 1) / kBN);
  const int chunk = static_cast<int>(blockIdx.x) / per_chunk, in_chunk = static_cast<int>(blockIdx.x) % per_chunk;
  const int chunk_size = min(heads, static_cast<int>(a.kv_leads) - chunk * heads);
  const int j0 = in_chunk / chunk_size * kBN;
  // Causal (top-left): rows i < j0 see none of these keys; their P is 0 here.
  return {chunk * heads + in_chunk % chunk_size, j0, p.causal ? j0 / kBM : 0};
}


// The kernel's shared memory, laid out as Tiles describes: K and V ([D/64][128 keys][64] each),
// the ring of stages, dS ([buffer][warpgroup][64][64]), the stages' row vectors ([stage][3][64])
// and the mbarriers (each stage's full and empty, then K and V's).
template <typename T, int D, bool KL>
struct Smem {
  using C = Tiles<D, KL>;
  T* k;
  T* v;
  unsigned char* stages;
  T* ds;
  float* delta;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* kv_full;
  SDPA_MATH_D explicit Smem(unsigned char* raw) {
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    k = reinterpret_cast<T*>(base);
    v = k + kBN * D;
    stages = base + C::kKVTiles * C::kKVBytes;
    ds = reinterpret_cast<T*>(stages + C::kStages * C::kStageBytes);
    delta = reinterpret_cast<float*>(ds + 4 * kBM * 64);
    full = reinterpret_cast<uint64_t*>(delta + C::kStages * 3 * kBM);
    empty = full + C::kStages;
    kv_full = empty + C::kStages;
  }
  // A stage's tiles: Q, dO, P and dP_ext (the KL form: Q and the reference, at dP_ext's place).
  SDPA_MATH_D T* q_tile(int st) const { return reinterpret_cast<T*>(stages + st * C::kStageBytes); }
  SDPA_MATH_D T* do_tile(int st) const { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kDoAt); }
  SDPA_MATH_D T* p_tile(int st) const { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kPAt); }
  SDPA_MATH_D T* dp_tile(int st) const { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kDpAt); }
};

}  // namespace
}  // namespace sdpa_math::cuda::sm90
