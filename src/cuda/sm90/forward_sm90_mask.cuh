// The Hopper forward's masks: a mask's pairs of elements and how they change logits (MaskPair),
// the mask plan of a float mask (which key tiles leave a warp's logits as they are, built once
// per mask by build_mask_plan), and the bool mask's scan for trailing key tiles hidden from
// every row of a CTA.
#pragma once

#include <type_traits>

#include "../mma.cuh"
#include "forward_sm90_shell.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// Two neighbouring mask elements (keys j, j + 1) as one load, and element e of them applied to
// a scaled score x (BASE2: x in base-2 units, a float mask's value times log2 e).
template <typename T, MaskKind M, bool BASE2>
struct MaskPair {
  using Raw = std::conditional_t<M == MaskKind::Bool, uint16_t, std::conditional_t<M == MaskKind::Same, uint32_t, float2>>;
  static constexpr int kBytes = M == MaskKind::Bool ? 1 : M == MaskKind::Same ? 2 : 4;  // per element
  // A bool mask selects -inf for a hidden key instead of adding it, so a NaN score there (a NaN
  // key) takes no part in the row (contract §13); adding would give NaN + -inf = NaN, a NaN row.
  // A float mask is added, as the math op adds it.
  static SDPA_MATH_D float apply(float x, const Raw& raw, int e) {
    if constexpr (M == MaskKind::Bool) {
      return ((raw >> (8 * e)) & 0xFF) ? x : -INFINITY;
    } else {
      float v;
      if constexpr (M == MaskKind::Same) v = to_float<T>(reinterpret_cast<const T*>(&raw)[e]);
      else v = e ? raw.y : raw.x;
      return BASE2 ? fmaf(v, 1.4426950408889634f, x) : x + v;
    }
  }
  // Folds a pair into acc, which starts at kNeutralStart; neutral(acc): every pair folded leaves
  // its logits as they are (bool: both keys visible; float: both +0 or -0). Bool bytes are 0 or
  // 1 in torch, and a byte without its low bit only makes the test fail, so a tile is never
  // taken for visible when it is not. A NaN or any nonzero float fails the test too.
  using Acc = uint32_t;
  static constexpr Acc kNeutralStart = M == MaskKind::Bool ? 0xFFFFFFFFu : 0u;
  static SDPA_MATH_D Acc fold_in(Acc acc, const Raw& raw) {
    if constexpr (M == MaskKind::Bool) return acc & raw;
    else if constexpr (M == MaskKind::Same) return acc | raw;
    else return acc | __float_as_uint(raw.x) | __float_as_uint(raw.y);
  }
  // A pair that is neutral (both keys visible, both values 0), for the plan's padding.
  static SDPA_MATH_D Raw neutral_raw() {
    if constexpr (M == MaskKind::Bool) return Raw(0x0101u);
    else return Raw{};
  }
  static SDPA_MATH_D bool neutral(Acc acc) {
    if constexpr (M == MaskKind::Bool) return (acc & 0x0101u) == 0x0101u;
    else if constexpr (M == MaskKind::Same) return (acc & 0x7FFF7FFFu) == 0;
    else return (acc & 0x7FFFFFFFu) == 0;
  }
};

// The mask plan's lead index of a forward lead index: the mask's lead coordinates with a nonzero
// stride, numbered row-major (the broadcast ones dropped, so every head sharing a (B, 1, L, S)
// mask shares its plan).
SDPA_MATH_HD int64_t plan_lead(const DevProblem& p, int64_t lead) {
  int64_t idx = 0, mult = 1;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    int64_t n = p.lead_shape[d], c = lead % n;
    lead /= n;
    if (d == p.lead_ndim - 1) {
      c /= p.mask.head_group;
      n /= p.mask.head_group;
    }
    if (p.mask.lead[d] != 0) {
      idx += c * mult;
      mult *= n;
    }
  }
  return idx;
}
// How many plan leads there are: the last lead index has every coordinate at its largest.
inline int64_t plan_leads(const DevProblem& p) { return plan_lead(p, p.num_lead - 1) + 1; }
// The mask's element offset of plan lead index idx (the inverse numbering of plan_lead).
SDPA_MATH_D int64_t plan_mask_offset(const DevProblem& p, int64_t idx) {
  int64_t off = 0;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    if (p.mask.lead[d] == 0) continue;
    const int64_t n = d == p.lead_ndim - 1 ? p.lead_shape[d] / p.mask.head_group : p.lead_shape[d];
    off += (idx % n) * p.mask.lead[d];
    idx /= n;
  }
  return off;
}

// The mask plan of a float mask: for each plan lead, group of 16 rows (one consumer warp's,
// groups of 16 from row 0; one group when the mask is broadcast over rows) and key tile, a bit
// set when every pair of the tile's keys (< S) in the group's rows (< L) is neutral
// (MaskPair::neutral: the bool kernels' vote, taken once per mask instead of once per head and
// pass). A (B, 1, L, S) mask is read once here, and the forward's warps load no pairs of a
// neutral tile. One warp per (plan lead, group, tile): 16 rows x 64 pairs, 32 loads a lane
// issued together. The plan starts zeroed (no tile neutral), so a tile this kernel did not
// reach is masked, never wrongly left out.
template <typename T, MaskKind M>
__global__ void __launch_bounds__(128) build_mask_plan(const DevProblem p, uint32_t* plan, int64_t groups, int words,
                                                       int64_t items) {
  using Mask = MaskPair<T, M, false>;
  const int lane = threadIdx.x % 32;
  const int64_t n_tiles = (p.S + kBN - 1) / kBN;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * 128 + threadIdx.x) / 32; item < items;
       item += static_cast<int64_t>(gridDim.x) * 4) {
    const int64_t tile = item % n_tiles, group = (item / n_tiles) % groups, lead = item / (n_tiles * groups);
    const char* m0 = p.mask.data + (plan_mask_offset(p, lead) + group * 16 * p.mask.row) * Mask::kBytes;
    const int64_t j0 = tile * kBN;
    // Rows of the group: one for a mask broadcast over rows (not groups == 1: L <= 16 has one
    // group of rows of its own, all of which count).
    const int rows = p.mask.row == 0 ? 1 : static_cast<int>(p.L - group * 16 < 16 ? p.L - group * 16 : 16);
    const int pairs = static_cast<int>((p.S - j0 < kBN ? p.S - j0 : kBN) / 2);  // S is even (a mask's rows are pair-aligned: inputs_apply)
    typename Mask::Raw raw[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {  // pair lane + 32 (i % 2) of row i / 2
      const int r = i / 2, c = lane + 32 * (i % 2);
      raw[i] = Mask::neutral_raw();
      if (r < rows && c < pairs)
        raw[i] = *reinterpret_cast<const typename Mask::Raw*>(m0 + (r * p.mask.row + j0 + 2 * c) * Mask::kBytes);
    }
    typename Mask::Acc acc = Mask::kNeutralStart;
#pragma unroll
    for (int i = 0; i < 32; ++i) acc = Mask::fold_in(acc, raw[i]);
    const bool neutral = __all_sync(0xffffffffu, Mask::neutral(acc));
    if (lane == 0 && neutral) atomicOr(plan + (lead * groups + group) * words + tile / 32, 1u << (tile % 32));
  }
}

// The key tiles a bool mask leaves a CTA: n_tiles less the trailing tiles the mask hides from
// every row of the CTA (all threads of the CTA take part). Those contribute nothing to O, l or
// the max, so they are neither loaded nor multiplied: the CTA stops before them, and the causal
// tail's fill writes their P (0, or NaN in a NaN row, as for keys right of the diagonal; a NaN
// at a hidden key is ignored: docs/contract.md §13). (The statistics form keeps every tile: its
// column pass counts the tiles each CTA covers.)
SDPA_MATH_D int bool_mask_live_tiles(const DevProblem& p, const Args& a, int64_t lead, int64_t i0, int64_t j_end,
                                     int n_tiles) {
  const uint8_t* m0 = reinterpret_cast<const uint8_t*>(p.mask.data) + lead_off(p, p.mask, lead);
  if (p.mask.row == 0) {
    // A key-padding mask (broadcast over rows: (B, 1, 1, S)): the threads scan its row from the
    // last tile, a key pair each, and stop at the first tile with a visible pair. (The same scan
    // over 128 rows, 2-byte loads one after another, cost a tenth of the forward, and Q issued
    // before the scan made it slower still.)
    while (n_tiles > 0) {
      const int64_t j0 = static_cast<int64_t>(n_tiles - 1) * kBN;
      const int pairs = static_cast<int>((j_end - j0 + 1) / 2);  // S is even (a mask's rows are pair-aligned: inputs_apply)
      bool seen = false;
      for (int c = threadIdx.x; c < pairs; c += blockDim.x)
        seen |= *reinterpret_cast<const uint16_t*>(m0 + j0 + 2 * c) != 0;
      if (__syncthreads_or(seen)) break;
      --n_tiles;
    }
  } else if (a.mask_vec16) {
    // A mask with rows of its own (Hugging Face's (B, 1, L, S): causal and padding in one),
    // 16-byte aligned: the CTA's rows of two tiles a step (2048 16-byte chunks, 6 a thread),
    // every thread's loads issued together, so a step costs about one L2 round trip. A causal
    // mask's upper triangle is then skipped as the causal kernel skips it.
    const int64_t rows = p.L - i0 < kBM ? p.L - i0 : kBM;
    const uint8_t* mr = m0 + i0 * p.mask.row;
    constexpr int kPerThread = (2 * kBM * kBN / 16 + kThreads - 1) / kThreads;
    while (n_tiles > 0) {
      // Tiles t_hi - 1 and t_hi (t_hi alone when it is tile 0): keys j_lo .. j_hi - 1.
      const int t_hi = n_tiles - 1;
      const int64_t j_lo = static_cast<int64_t>(t_hi > 0 ? t_hi - 1 : 0) * kBN;
      const int64_t j_hi = j_end < static_cast<int64_t>(t_hi + 1) * kBN ? j_end : static_cast<int64_t>(t_hi + 1) * kBN;
      const int chunks_row = static_cast<int>((j_hi - j_lo) / 16);  // S % 16 == 0 (mask_vec16)
      const int chunks = static_cast<int>(rows) * chunks_row;     // at most 2048
      Own<uint4[kPerThread]> v_;  // (Own: see forward_sm90_shell.cuh)
      uint4 (&v)[kPerThread] = v_.v;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        v[i] = idx < chunks ? *reinterpret_cast<const uint4*>(mr + (idx / chunks_row) * p.mask.row + j_lo +
                                                               (idx % chunks_row) * 16)
                            : make_uint4(0, 0, 0, 0);
      }
      bool seen_hi = false, seen_lo = false;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        const bool any = (v[i].x | v[i].y | v[i].z | v[i].w) != 0;
        if (j_lo + (idx % chunks_row) * 16 >= static_cast<int64_t>(t_hi) * kBN) seen_hi |= any;
        else seen_lo |= any;
      }
      if (__syncthreads_or(seen_hi)) break;
      const bool lo = __syncthreads_or(seen_lo);
      n_tiles = t_hi;  // tile t_hi hidden
      if (lo) break;
      if (n_tiles > 0) --n_tiles;  // tile t_hi - 1 hidden as well
    }
  }
  return n_tiles;
}

}  // namespace sdpa_math::cuda::sm90::fwd
