// The Hopper forward kernel (forward_sm90) and its launch function, put together from the parts
// in forward_sm90_*.cuh. Included only by the instantiation files (forward_sm90_<dtype>_d<head>.cu),
// each of which instantiates one (dtype, head) group of launch functions and thereby compiles
// those kernels; the host launcher (forward_sm90.cu) sees the launch functions' declarations only.
#pragma once

#include "../launch.cuh"
#include "forward_sm90_consumer.cuh"
#include "forward_sm90_mainloop.cuh"
#include "forward_sm90_mask.cuh"
#include "forward_sm90_p_store.cuh"
#include "forward_sm90_shell.cuh"
#include "forward_sm90_stats.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// A consumer warpgroup's thread, from Q's arrival to the stores of O, P's tail and the
// statistics. The Consumer's arrays are locals here (see Consumer).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void consume(const CUtensorMap& tm_p, const DevProblem& p, const Args& a, const StatsArgs& st,
                         const Smem<T, D, STATS>& sm, TraceState& tr, int cw, int64_t tiles, int64_t lead,
                         int64_t row_tile, int64_t i0, int n_tiles, bool one_pass) {
  using Cons = Consumer<T, D, MASK, STATS, P_COPY>;
  // The Consumer's arrays, each in an object of its own (Own: see forward_sm90_shell.cuh).
  Own<int64_t[2]> row;
  Own<bool[2]> row_ok;
  Own<T* [2]> p_row{{nullptr, nullptr}};
  Own<const char* [2]> m_row{{nullptr, nullptr}};
  Own<int[3]> cp{{0, 0, 0}};
  // (mask_pairs: no other part of the kernel has an array of its type to share its object with)
  typename Cons::Mask::Raw mask_pairs[Cons::kMaskGroups][2] = {};
  Own<float[2]> m{{Cons::kNegInf, Cons::kNegInf}}, l{{0.0f, 0.0f}}, inv_l{{0.0f, 0.0f}}, run_max, h;
  Own<uint32_t[4]> p_addr;
  Own<float[D / 2]> o;
  Cons c(tm_p, p, a, st, sm, tr, cw, tiles, lead, row_tile, i0, n_tiles, one_pass, row.v, row_ok.v, p_row.v, m_row.v,
         cp.v, mask_pairs, m.v, l.v, inv_l.v, run_max.v, h.v, p_addr.v, o.v);
  c.load_mask(0);  // the first tile's pairs, for pass 1 (or pass 2 of a one-pass CTA)
  mbar_wait(sm.q_full, 0);
  FWD_STAMP(trace::kStart);
  c.pass1();
  if (!one_pass) c.finish_rows();
  c.prepare_pass2();
  if constexpr (Cons::kOverlap) c.pass2_overlapped();
  else c.pass2();
  if constexpr (!STATS && !P_COPY) {
    if (c.p_leader) bulk_wait_read<0>();  // shared memory outlives the last store's reads
  }
  if (one_pass) c.finish_rows();
  c.store_o();

  FWD_STAMP(trace::kEnd);
#ifdef SDPA_MATH_FWD_TRACE
  if constexpr (!STATS) {
    if (threadIdx.x == 128) trace::cta_info(2);
  }
#endif
  if constexpr (STATS) c.stats_epilogue();
  else c.fill_tail();
}

// One CTA: 128 query rows (row tile `tiles - 1 - blockIdx.x / leads`, the longest causal row
// blocks first) of one head (lead a.lead0 + blockIdx.x % leads). Warpgroup 0 produces (TMA
// loads), warpgroups 1 and 2 consume (Consumer: two passes over the key tiles, P and O out).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY = false>
__global__ void __launch_bounds__(kThreads, 1)
    forward_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                 const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_p, const DevProblem p,
                 const Args a, const StatsArgs st, const int64_t tiles) {
  static_assert(!(STATS && P_COPY), "the statistics kernel writes no P tile");
  extern __shared__ unsigned char smem_raw[];
  const Smem<T, D, STATS> sm(smem_raw);

  const int64_t lead = a.lead0 + blockIdx.x % a.leads;
  const int64_t row_tile = tiles - 1 - blockIdx.x / a.leads;
  const int64_t i0 = row_tile * kBM;
  const int64_t j_end = p.causal ? (i0 + kBM < p.S ? i0 + kBM : p.S) : p.S;
  int n_tiles = static_cast<int>((j_end + kBN - 1) / kBN);  // less the tiles a bool mask hides (below)
  bool one_pass = false;
  if constexpr (STATS) one_pass = stats_one_pass(p, st, i0);

  if (threadIdx.x == 0) sm.init_barriers();
  __syncthreads();
  if constexpr (MASK == MaskKind::Bool && !STATS) n_tiles = bool_mask_live_tiles(p, a, lead, i0, j_end, n_tiles);
  TraceState tr;
#ifdef SDPA_MATH_FWD_TRACE
  if constexpr (!STATS) {
    if (threadIdx.x == 0) trace::cta_info(1);
  }
#endif

  const int wg = threadIdx.x / 128;  // warpgroup: 0 the producer, 1 + cw consumer cw
  if (wg == 0) {
    produce<T, D, STATS>(tm_q, tm_k, tm_v, a, sm, tr, lead, i0, n_tiles, one_pass);
    return;
  }

  regs_claim<kConsumerRegs>();
  consume<T, D, MASK, STATS, P_COPY>(tm_p, p, a, st, sm, tr, wg - 1, tiles, lead, row_tile, i0, n_tiles, one_pass);
}

template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
void launch(const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& pm,
            const DevProblem& p, const Args& a, const StatsArgs& st, cudaStream_t stream) {
  const int64_t tiles = (p.L + kBM - 1) / kBM;
  const int64_t blocks = tiles * a.leads;
  const char* what = STATS ? "sm90 statistics" : "sm90 forward";
  const unsigned grid = grid_x(blocks, what);
  const auto kernel = &forward_sm90<T, D, MASK, STATS, P_COPY>;
  set_smem_limit(reinterpret_cast<const void*>(kernel), Tiles<D, STATS>::kSmem);
#ifdef SDPA_MATH_FWD_TRACE
  if (!STATS) trace::clear(stream);
#endif
  kernel<<<grid, kThreads, Tiles<D, STATS>::kSmem, stream>>>(q, k, v, pm, p, a, st, tiles);
  check_launch(what);
#ifdef SDPA_MATH_FWD_TRACE
  if (!STATS) trace::write(stream, grid);
#endif
}

}  // namespace sdpa_math::cuda::sm90::fwd
