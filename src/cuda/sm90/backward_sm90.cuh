// The Hopper backward's main kernel (fp16/bf16, sm_90a), both of its forms, with what the two
// host sides share: the tiles, the kernel's arguments, the dQ conversion and the launch.
// backward_sm90.cu runs it from the forward's saved P, kl_backward_sm90.cu in the KL form.
//
// The backward from the saved P, without dropout. With dP_total = dO Vᵀ + dP_ext and
// delta_i = Σ_j P_ij dP_total,ij = dO_i · O_i + Σ_j P_ij dP_ext,ij:
//   dS = P ∘ (dP_total − delta),  dV = Pᵀ dO,  dK = scale · dSᵀ Q,  dQ = scale · dS K,
// four products of L·S·E each; P is read, never recomputed, so masks and causality are already in
// it (hidden entries are 0) and only decide which tiles can be skipped.
//
// Kernels, in order:
//   1. delta_rows: delta per query row, one warp per row (one pass over P and dP_ext when dP is
//      given, which the key-major main kernel cannot fold in: it needs whole rows);
//   2. backward_sm90: per CTA 128 keys of one key head (consumer warpgroup w owns keys 64w..64w+63)
//      and every query head of its GQA group. The producer warpgroup's one thread loads K and V
//      once and then, per 64-row query tile, Q, dO, P and dP_ext through TMA into a ring of stages
//      (P and dP_ext whose rows TMA cannot address, S % 8 != 0: the warpgroup's other three warps
//      copy them with cp.async into the same stages, completing on the same barriers).
//      Per tile each consumer warpgroup forms dPᵀ-free products in its own 64 keys:
//        dP_w = dO V_wᵀ (both operands in shared memory), dV_w += P_wᵀ dO (P read MN-major),
//        dS_w = P_w ∘ (dP_w + dP_ext,w − delta) to shared memory in the inputs' dtype,
//        dK_w += dS_wᵀ Q (dS MN-major),
//      and, once both warpgroups' dS are in shared memory, dQ over all 128 keys for its half of the
//      head's columns, added to an fp32 accumulator with 16-byte reductions (red.global.add.v4).
//      dK and dV live in registers for the whole sweep and are stored once: no atomics, and GQA's
//      sum over the group happens in the loop;
//   3. dq_from_fragments: dQ's accumulator (kept in the products' fragment order, so the
//      reductions are contiguous) times scale, to the gradient.
// dQ's reductions make its low bits depend on the order the CTAs finish (like FlashAttention's);
// dK and dV are deterministic.
//
// The KL form (kl_to's gradient, docs/statistics.md) runs the same kernel without a saved P: for
// the loss Σ_i g_i KL(r_i ‖ P_i) the gradient to the logits is dS = g (R P − r) with R_i = Σ_j r_ij,
// so per tile the first product is S_w = Q K_wᵀ instead of dP_w = dO V_wᵀ, P = exp2(S·scale·log2 e
// − lse·log2 e) is recomputed in fp32 from the saved lse, the reference's tile comes where dP_ext
// does, and there is no dV. The stage's row slot holds three vectors per row (lse·log2 e, g R f,
// g f, made by kl_rows_prep), f a power of two per key head that keeps fp16's dS out of the
// subnormal range (1 for bf16), undone in fp32 on dK and dQ. No mask (causality only).
#pragma once

#include "backward_sm90_consumer.cuh"
#include "backward_sm90_producer.cuh"
#include "backward_sm90_shell.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

// The register split: the producer warpgroup's copy warps (their index math and two maps' row
// pointers) spilled at the forward's 40 registers; the consumers fit 224 without spills.
// 128 x 56 + 256 x 224 = 64,512 of the SM's 65,536.
constexpr int kBackwardProducerRegs = 56;
constexpr int kBackwardConsumerRegs = 224;

// HAS_DO: dO given (a compile-time choice: a run-time branch around the dP and dV products makes
// ptxas serialise every wgmma of the kernel). KL: the KL form (no P, no dO, no dV; see the top).
template <typename T, int D, bool HAS_DO, bool KL>
__global__ void __launch_bounds__(kThreads, 1)
    backward_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                  const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                  const __grid_constant__ CUtensorMap tm_p, const __grid_constant__ CUtensorMap tm_dp,
                  const __grid_constant__ CUtensorMap tm_delta, const DevProblem p, const Args a) {
  using C = Tiles<D, KL>;
  extern __shared__ unsigned char smem_raw[];
  const Smem<T, D, KL> s(smem_raw);
  if (threadIdx.x == 0) {
    // A stage is full after the TMA thread's arrival (and its bytes) and, where the copy warps
    // copy the maps, once each of their threads' copies have landed.
    for (int st = 0; st < C::kStages; ++st) {
      mbar_init(&s.full[st], a.p_tma ? 1 : 1 + 32 * kCopyWarps);
      mbar_init(&s.empty[st], 32 * kConsumerWarps);  // every consumer thread arrives
    }
    mbar_init(s.kv_full, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {  // the producer warpgroup
    regs_release<kBackwardProducerRegs>();
    // Each role finds its keys after its register change (cta_keys).
    const CtaKeys ck = cta_keys(p, a);
    if (threadIdx.x >= 32 && !a.p_tma) copy_maps<T, D, KL>(p, a, s, ck);
    else if (threadIdx.x == 0) load_stages<T, D, KL>(&tm_q, &tm_k, &tm_v, &tm_do, &tm_p, &tm_dp, &tm_delta, p, a, s, ck);
    return;
  }
  regs_claim<kBackwardConsumerRegs>();
  consume<T, D, HAS_DO, KL>(p, a, s);
}

// dQ = scale times the accumulator, one 64-row tile a block: the tile's accumulators (fragment
// order, contiguous) into shared memory row by row, then out in 16-byte chunks of the gradient's
// rows (E is a multiple of 8), so both reads and writes are coalesced.
template <typename T, int D>
__global__ void __launch_bounds__(256) dq_from_fragments(const DevProblem p, const float* acc, T* dq, float scale,
                                                         int64_t q_tiles, const float* unscale, int64_t group,
                                                         int64_t heads) {
  constexpr int kLd = D + 4;  // floats a shared row (the padding spreads a column's banks)
  constexpr int kGroups = D / 16;  // 4-float groups per thread and warpgroup half
  __shared__ float tile[kBM * kLd];
  const int64_t lead = blockIdx.x / q_tiles, i0 = (blockIdx.x % q_tiles) * kBM;
  if (unscale) scale *= unscale[kv_of_lead(lead, group, heads)];
  const float4* src = reinterpret_cast<const float4*>(acc) + static_cast<int64_t>(blockIdx.x) * (kBM * D / 4);
  for (int x = threadIdx.x; x < kBM * D / 4; x += 256) {
    const float4 v = src[x];
    const int tid = x % 128, rest = x / 128, f = rest % kGroups, half = rest / kGroups;
    const int warp = tid / 32, g = (tid % 32) >> 2, t = tid & 3;
    const int r = warp * 16 + g, col = half * (D / 2) + 8 * f + 2 * t;
    tile[r * kLd + col] = v.x;
    tile[r * kLd + col + 1] = v.y;
    tile[(r + 8) * kLd + col] = v.z;
    tile[(r + 8) * kLd + col + 1] = v.w;
  }
  __syncthreads();
  T* base = dq + dense_lead_off(p, p.q, lead);
  for (int x = threadIdx.x; x < kBM * D / 8; x += 256) {
    const int r = x / (D / 8), col = (x % (D / 8)) * 8;
    if (i0 + r >= p.L || col >= p.E) continue;
    const float* f = tile + r * kLd + col;
    const uint4 out = make_uint4(pack2<T>(f[0] * scale, f[1] * scale), pack2<T>(f[2] * scale, f[3] * scale),
                                 pack2<T>(f[4] * scale, f[5] * scale), pack2<T>(f[6] * scale, f[7] * scale));
    *reinterpret_cast<uint4*>(base + (i0 + r) * p.q.dense_row + col) = out;
  }
}

template <typename T, int D, bool KL>
void launch(const CUtensorMap (&maps)[7], const DevProblem& p, Args a, const BackwardTargets& out,
            cudaStream_t stream) {
  const int64_t key_blocks = (p.S + kBN - 1) / kBN;
  const int64_t blocks = key_blocks * a.kv_leads;
  // Chunks of key heads whose dQ accumulators (a group's query tiles times D floats each) take at
  // most kChunkDqBytes of L2 together (at least one head a chunk).
  const int64_t dq_bytes = a.group * a.q_tiles * kBM * D * 4;
  a.chunk_heads = std::max<int64_t>(1, std::min<int64_t>(a.kv_leads, kChunkDqBytes / dq_bytes));
  // Both grids first, so an oversized problem is refused before either kernel runs; the kernel
  // indexes a group's query tiles with an int.
  const unsigned grid = grid_x(blocks, "sm90 backward");
  const unsigned dq_grid = grid_x(out.dq ? p.num_lead * a.q_tiles : 0, "sm90 dQ conversion");
  if (a.group * a.q_tiles > 2147483647LL)
    throw Error(ErrorCode::CudaFailure, "too many query tiles in one GQA group for the sm90 backward");
  // Only this form's kernels are named, so each file instantiates its own.
  const auto kernel = [&] {
    if constexpr (KL) return &backward_sm90<T, D, false, true>;
    else return a.has_do ? &backward_sm90<T, D, true, false> : &backward_sm90<T, D, false, false>;
  }();
  set_smem_limit(reinterpret_cast<const void*>(kernel), Tiles<D, KL>::kSmem);
  kernel<<<grid, kThreads, Tiles<D, KL>::kSmem, stream>>>(maps[0], maps[1], maps[2], maps[3], maps[4], maps[5], maps[6], p,
                                                     a);
  check_launch("sm90 backward");
  if (out.dq) {
    dq_from_fragments<T, D><<<dq_grid, 256, 0, stream>>>(p, a.dq_acc, static_cast<T*>(out.dq), a.scale, a.q_tiles,
                                                         a.unscale, a.group, a.heads);
    check_launch("sm90 dQ conversion");
  }
}

// q and k as both backwards take them: unit column stride, not broadcast over lead dims other
// than GQA's group (the gradients are stored, not summed over broadcast dims).
inline bool qk_stored_per_head(const DevProblem& p) {
  if (p.lead_ndim == 0 && p.k.head_group != 1) return false;
  for (int d = 0; d < p.lead_ndim; ++d) {
    if (p.lead_shape[d] == 1) continue;
    if (p.q.dense_lead[d] == 0 || p.k.dense_lead[d] == 0) return false;
  }
  return p.q.dense_col == 1 && p.k.dense_col == 1;
}

}  // namespace
}  // namespace sdpa_math::cuda::sm90
