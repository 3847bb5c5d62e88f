// The Hopper backward's producer warpgroup: its thread 0 loads K and V once and then each stage's
// tiles through TMA; where TMA cannot address P and dP_ext (or the KL form's reference), its warps
// 1..3 copy those tiles into the same stages with cp.async.
#pragma once

#include "backward_sm90_shell.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

// One stage's [64 rows][128 keys] tile of a map TMA cannot address (P, dP_ext or the KL form's
// reference; rows 4- or 8-byte aligned, not 16) copied with cp.async by copy warp `cwp`, into the
// layout TMA would give it: two [64][64] blocks, 128-byte rows, 16-byte chunks swizzled by the
// row (chunk c of row r at c ^ (r % 8)). A warp copies 32 consecutive pieces of N bytes of a row
// at a time. Rows past L and keys past S arrive as zeros (a piece is in or out whole: S is a
// multiple of N / 2). `tile`: the tile's row 0, key 0. Before, the consumers loaded these tiles
// themselves, 4 bytes a load, only once the stage's other tiles had arrived, nothing ahead, which
// made S % 8 != 0 much slower than the nearest S % 8 == 0 (bench/NOTES.md).
template <typename T, int N>
SDPA_MATH_D void copy_map_tile(uint32_t dst, const T* tile, int64_t row_stride, int rows_left, int keys_left, int cwp,
                               int lane) {
  constexpr int kPer = N / 2;             // elements a piece
  constexpr int kSegs = kBN / kPer / 32;  // a warp's 32 pieces a segment: 1 (N = 8) or 2 (N = 4) a row
  const T* row = tile + cwp * row_stride;
#pragma unroll 1
  for (int r = cwp; r < kBM; r += kCopyWarps, row += kCopyWarps * row_stride) {
#pragma unroll
    for (int sg = 0; sg < kSegs; ++sg) {
      const int key = (sg * 32 + lane) * kPer;
      const uint32_t byte = (key % 64) * 2;  // in the block's 128-byte row
      const uint32_t at = (key / 64) * (kBM * 128) + r * 128 + ((((byte >> 4) ^ (r & 7)) << 4) | (byte & 15));
      const bool in = r < rows_left && key < keys_left;
      cp_async<N>(dst + at, in ? row + key : tile, in);  // tile: row i0 < L, key j0 < S, a valid address
    }
  }
}

// Copy warps: the maps TMA cannot address, in the TMA thread's order of stages.
template <typename T, int D, bool KL>
SDPA_MATH_D void copy_maps(const DevProblem& p, const Args& a, const Smem<T, D, KL>& s, const CtaKeys& ck) {
  using C = Tiles<D, KL>;
  const int cwp = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
  const bool copy_p = !KL, copy_dp = KL || a.has_dp;
  // 32-bit index math without division calls (num_lead < 2^31: backward_declines and
  // kl_conditions_decline): 64-bit divisions are calls, whose registers made ptxas spill.
  const int kv32 = ck.kv, j32 = ck.j0;
  const int keys_left = min(static_cast<int>(p.S) - j32, kBN);
  int use = 0;
  for (int gi = 0; gi < static_cast<int>(a.group); ++gi) {
    const int lead = static_cast<int>(query_lead(a, kv32, gi));
    const T* p_rows = copy_p ? reinterpret_cast<const T*>(p.probs.data) + lead_off32(p, p.probs, lead) : nullptr;
    const T* dp_rows = copy_dp ? reinterpret_cast<const T*>(p.grad_probs.data) + lead_off32(p, p.grad_probs, lead) : nullptr;
    for (int qt = ck.t_first; qt < static_cast<int>(a.q_tiles); ++qt, ++use) {
      const int st = use % C::kStages;
      mbar_wait(&s.empty[st], ((use / C::kStages) & 1) ^ 1);
      const int i0 = qt * kBM;
      const int rows_left = min(static_cast<int>(p.L) - i0, kBM);
      auto copy = [&](T* dst, const T* rows, int64_t row_stride) {
        const T* tile = rows + i0 * row_stride + j32;
        if (a.map_piece == 8) copy_map_tile<T, 8>(smem_u32(dst), tile, row_stride, rows_left, keys_left, cwp, lane);
        else copy_map_tile<T, 4>(smem_u32(dst), tile, row_stride, rows_left, keys_left, cwp, lane);
      };
      if (copy_p) copy(s.p_tile(st), p_rows, p.probs.row);
      if (copy_dp) copy(s.dp_tile(st), dp_rows, p.grad_probs.row);
      cp_async_arrive_on(&s.full[st]);
    }
  }
  cp_async_wait_all();  // no thread leaves with copies in flight
}

// The TMA thread: K and V (the KL form: K), then per query tile of each query head of the group a
// stage's row vectors, Q and dO, and P and dP_ext where TMA can address them.
template <typename T, int D, bool KL>
SDPA_MATH_D void load_stages(const CUtensorMap* tm_q, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                             const CUtensorMap* tm_do, const CUtensorMap* tm_p, const CUtensorMap* tm_dp,
                             const CUtensorMap* tm_delta, const DevProblem& p, const Args& a, const Smem<T, D, KL>& s,
                             const CtaKeys& ck) {
  using C = Tiles<D, KL>;
  prefetch_tensor_map(tm_q);
  prefetch_tensor_map(tm_p);
  int c[3];
  map_coords32(a.k, static_cast<int>(query_lead(a, ck.kv, 0)), c);
  mbar_arrive_expect_tx(s.kv_full, C::kKVTiles * C::kKVBytes);  // the KL form reads no V
#pragma unroll
  for (int b = 0; b < D / 64; ++b) tma_load_5d(s.k + b * kBN * 64, tm_k, s.kv_full, b * 64, ck.j0, c[0], c[1], c[2]);
  if constexpr (!KL) {
    map_coords32(a.v, static_cast<int>(query_lead(a, ck.kv, 0)), c);
#pragma unroll
    for (int b = 0; b < D / 64; ++b)
      tma_load_5d(s.v + b * kBN * 64, tm_v, s.kv_full, b * 64, ck.j0, c[0], c[1], c[2]);
  }
  // KL: three row vectors, Q and the reference's tile; else delta, Q, dO, P and dP_ext.
  const uint32_t bytes = KL ? 3 * kBM * 4 + C::kRowTileBytes + (a.p_tma ? C::kMapTileBytes : 0)
                            : kBM * 4 + C::kRowTileBytes * (a.has_do ? 2 : 1) +
                                  (a.p_tma ? C::kMapTileBytes * (a.has_dp ? 2 : 1) : 0);
  // P and dP_ext are read once (this CTA's keys of each row): they should not push dQ's
  // accumulator and the Q and dO tiles (read by every key block) out of L2.
  const uint64_t stream_once = l2_policy_evict_first();
  int use = 0;
  for (int gi = 0; gi < static_cast<int>(a.group); ++gi) {
    const int lead = static_cast<int>(query_lead(a, ck.kv, gi));
    int cq[3], cdo[3], cp[3], cdp[3];
    map_coords32(a.q, lead, cq);
    map_coords32(a.dout, lead, cdo);
    map_coords32(a.p, lead, cp);
    map_coords32(a.dp, lead, cdp);
    for (int qt = ck.t_first; qt < static_cast<int>(a.q_tiles); ++qt, ++use) {
      const int st = use % C::kStages;
      mbar_wait(&s.empty[st], ((use / C::kStages) & 1) ^ 1);  // the first use finds it free
      mbar_arrive_expect_tx(&s.full[st], bytes);
      const int i0 = qt * kBM;
      // delta through a tensor map like every other tile of the stage (a plain bulk copy works
      // too, but compute-sanitizer's racecheck does not see the stage's mbarriers order it).
      if constexpr (KL) {  // rows 0..n-1 of the map: lse, then g R f, then g f of every lead index
#pragma unroll
        for (int c = 0; c < 3; ++c)
          tma_load_5d(s.delta + (st * 3 + c) * kBM, tm_delta, &s.full[st], i0, c * static_cast<int>(p.num_lead) + lead, 0,
                      0, 0);
      } else {
        tma_load_5d(s.delta + st * 3 * kBM, tm_delta, &s.full[st], i0, lead, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < D / 64; ++b) {
        tma_load_5d(s.q_tile(st) + b * kBM * 64, tm_q, &s.full[st], b * 64, i0, cq[0], cq[1], cq[2]);
        if (a.has_do) tma_load_5d(s.do_tile(st) + b * kBM * 64, tm_do, &s.full[st], b * 64, i0, cdo[0], cdo[1], cdo[2]);
      }
      if (!a.p_tma) continue;
#pragma unroll
      for (int b = 0; b < kBN / 64; ++b) {
        const int jb = ck.j0 + b * 64;
        if (!KL) tma_load_5d(s.p_tile(st) + b * kBM * 64, tm_p, &s.full[st], jb, i0, cp[0], cp[1], cp[2], stream_once);
        if (KL || a.has_dp)
          tma_load_5d(s.dp_tile(st) + b * kBM * 64, tm_dp, &s.full[st], jb, i0, cdp[0], cdp[1], cdp[2], stream_once);
      }
    }
  }
}

}  // namespace
}  // namespace sdpa_math::cuda::sm90
