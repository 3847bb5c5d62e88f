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
//      once and then, per 64-row query tile, Q, dO, P and dP_ext through TMA into a ring of stages.
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
#pragma once

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "../launch.cuh"
#include "../mma.cuh"
#include "hopper.cuh"
#include "sm90.cuh"
#include "tensor_maps.cuh"

// The kernels and what they take sit in an anonymous namespace, as in a single file: each of the
// two files that include this one instantiates only its own form.
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
                     // consumers load them as 4-byte pairs and put P into the stage themselves
  float scale;
  const float* delta;  // q_tiles * 64 floats per lead index (rows past L: 0)
  float* dq_acc;       // q_tiles * 64 * D floats per lead index, fragment order
  const float* unscale;  // KL form: 1 / f per key head (dK and dQ), else nullptr
  void* dk;          // contiguous gradients in the inputs' dtype, or nullptr when not wanted
  void* dv;
};

// The lead index of query head gi of key head `kv` (GQA groups consecutive query heads).
SDPA_MATH_HD int64_t query_lead(const Args& a, int64_t kv, int64_t gi) {
  if (a.group == 1) return kv;
  const int64_t kv_heads = a.heads / a.group;
  return (kv / kv_heads) * a.heads + (kv % kv_heads) * a.group + gi;
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
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sK = reinterpret_cast<T*>(base);
  T* sV = sK + kBN * D;
  unsigned char* stages = base + C::kKVTiles * C::kKVBytes;
  T* sDS = reinterpret_cast<T*>(stages + C::kStages * C::kStageBytes);  // [buffer][warpgroup][64][64]
  float* sDelta = reinterpret_cast<float*>(sDS + 4 * kBM * 64);  // [stage][3][64]
  uint64_t* full = reinterpret_cast<uint64_t*>(sDelta + C::kStages * 3 * kBM);
  uint64_t* empty = full + C::kStages;
  uint64_t* kv_full = empty + C::kStages;
  auto stage_q = [&](int st) { return reinterpret_cast<T*>(stages + st * C::kStageBytes); };
  auto stage_do = [&](int st) { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kDoAt); };
  auto stage_p = [&](int st) { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kPAt); };
  auto stage_dp = [&](int st) { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kDpAt); };

  // Key heads in chunks of a.chunk_heads, every key block of a chunk's heads before the next chunk:
  // the CTAs that run at once then add into the dQ accumulators of a chunk's heads only, which
  // stay in L2, not into all of them (all of them at once, 32 MiB on prefill1k_d128, sent the
  // reductions to DRAM; chunked, both forms ran faster: bench/NOTES.md). Inside a chunk, key
  // blocks in order, each over the chunk's heads: causal blocks with the most query rows first.
  // 32-bit: every count here is below the grid's size (< 2^31, grid_x).
  const int heads = static_cast<int>(a.chunk_heads), per_chunk = heads * static_cast<int>((p.S + kBN - 1) / kBN);
  const int chunk = static_cast<int>(blockIdx.x) / per_chunk, in_chunk = static_cast<int>(blockIdx.x) % per_chunk;
  const int chunk_size = min(heads, static_cast<int>(a.kv_leads) - chunk * heads);
  const int64_t kv = chunk * heads + in_chunk % chunk_size;
  const int64_t j0 = static_cast<int64_t>(in_chunk / chunk_size) * kBN;
  // Causal (top-left): rows i < j0 see none of these keys; their P is 0 here.
  const int64_t t_first = p.causal ? j0 / kBM : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    mbar_init(kv_full, 1);
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // producer
    regs_release<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_p);
      int c[3];
      map_coords(a.k, query_lead(a, kv, 0), c);
      mbar_arrive_expect_tx(kv_full, C::kKVTiles * C::kKVBytes);  // the KL form reads no V
#pragma unroll
      for (int b = 0; b < D / 64; ++b) tma_load_5d(sK + b * kBN * 64, &tm_k, kv_full, b * 64, static_cast<int>(j0), c[0], c[1], c[2]);
      if constexpr (!KL) {
        map_coords(a.v, query_lead(a, kv, 0), c);
#pragma unroll
        for (int b = 0; b < D / 64; ++b)
          tma_load_5d(sV + b * kBN * 64, &tm_v, kv_full, b * 64, static_cast<int>(j0), c[0], c[1], c[2]);
      }
      // KL: three row vectors, Q and the reference's tile; else delta, Q, dO, P and dP_ext.
      const uint32_t bytes = KL ? 3 * kBM * 4 + C::kRowTileBytes + (a.p_tma ? C::kMapTileBytes : 0)
                                : kBM * 4 + C::kRowTileBytes * (a.has_do ? 2 : 1) +
                                      (a.p_tma ? C::kMapTileBytes * (a.has_dp ? 2 : 1) : 0);
      // P and dP_ext are read once (this CTA's keys of each row): they should not push dQ's
      // accumulator and the Q and dO tiles (read by every key block) out of L2.
      const uint64_t stream_once = l2_policy_evict_first();
      int use = 0;
      for (int64_t gi = 0; gi < a.group; ++gi) {
        const int64_t lead = query_lead(a, kv, gi);
        int cq[3], cdo[3], cp[3], cdp[3];
        map_coords(a.q, lead, cq);
        map_coords(a.dout, lead, cdo);
        map_coords(a.p, lead, cp);
        map_coords(a.dp, lead, cdp);
        for (int64_t qt = t_first; qt < a.q_tiles; ++qt, ++use) {
          const int st = use % C::kStages;
          mbar_wait(&empty[st], ((use / C::kStages) & 1) ^ 1);  // the first use finds it free
          mbar_arrive_expect_tx(&full[st], bytes);
          const int i0 = static_cast<int>(qt * kBM);
          // delta through a tensor map like every other tile of the stage (a plain bulk copy works
          // too, but compute-sanitizer's racecheck does not see the stage's mbarriers order it).
          if constexpr (KL) {  // rows 0..n-1 of the map: lse, then g R f, then g f of every lead index
#pragma unroll
            for (int c = 0; c < 3; ++c)
              tma_load_5d(sDelta + (st * 3 + c) * kBM, &tm_delta, &full[st], i0, static_cast<int>(c * p.num_lead + lead), 0,
                          0, 0);
          } else {
            tma_load_5d(sDelta + st * 3 * kBM, &tm_delta, &full[st], i0, static_cast<int>(lead), 0, 0, 0);
          }
#pragma unroll
          for (int b = 0; b < D / 64; ++b) {
            tma_load_5d(stage_q(st) + b * kBM * 64, &tm_q, &full[st], b * 64, i0, cq[0], cq[1], cq[2]);
            if (a.has_do) tma_load_5d(stage_do(st) + b * kBM * 64, &tm_do, &full[st], b * 64, i0, cdo[0], cdo[1], cdo[2]);
          }
          if (!a.p_tma) continue;
#pragma unroll
          for (int b = 0; b < kBN / 64; ++b) {
            const int jb = static_cast<int>(j0) + b * 64;
            if (!KL) tma_load_5d(stage_p(st) + b * kBM * 64, &tm_p, &full[st], jb, i0, cp[0], cp[1], cp[2], stream_once);
            if (KL || a.has_dp)
              tma_load_5d(stage_dp(st) + b * kBM * 64, &tm_dp, &full[st], jb, i0, cdp[0], cdp[1], cdp[2], stream_once);
          }
        }
      }
    }
    return;
  }

  // Consumers: warpgroup cw owns keys j0 + 64 cw .. + 63. In its 64 x 64 (query, key) tiles this
  // thread holds rows warp*16 + g and + 8, keys 8n + 2t and + 1 (n < 8); in its dK and dV tiles
  // (key, column) keys warp*16 + g and + 8 of its 64, columns 8n + 2t and + 1.
  regs_claim<kConsumerRegs>();
  const int cw = wg - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  float dk[D / 2], dv[KL ? 1 : D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < (KL ? 1 : D / 2); ++i) dv[i] = 0.0f;
  const T* v_rows = sV + cw * 64 * 64;  // this warpgroup's 64 keys of each V column block
  const T* k_rows = sK + cw * 64 * 64;  // and of each K column block (the KL form's S = Q Kᵀ)
  const float scale_log2 = a.scale * 1.4426950408889634f;
  // dQ: this warpgroup's half of the columns (for D = 64 a half of the one 64-element block).
  const T* k_cols = D == 128 ? sK + cw * kBN * 64 : sK + cw * 32;
  constexpr int kDq = D / 4;  // dQ accumulators per thread: 64 rows x D/2 columns
  mbar_wait(kv_full, 0);

  // Steps in the producer's order: query head gi of the group, then its query tiles (32-bit
  // counts: steps = group * tiles < 2^31, checked by the launcher).
  const int t_count = static_cast<int>(a.q_tiles > t_first ? a.q_tiles - t_first : 0);
  const int steps = static_cast<int>(a.group) * t_count;
  int64_t gi = 0, qt = t_first, lead = query_lead(a, kv, 0);
  for (int step = 0; step < steps; ++step) {
    const int use = step;
    float* dq_lead = a.dq_acc + lead * a.q_tiles * kBM * D;
    const int st = use % C::kStages;
    const int64_t i0 = qt * kBM;
    mbar_wait(&full[st], (use / C::kStages) & 1);
    // Row vectors of this thread's rows: delta; KL: lse·log2 e, g R f, g f.
    // Shared memory through 32-bit shared-window addresses (LDS / STS): generic pointers compiled
    // to generic loads and stores (LD.E / ST.E) with 64-bit address arithmetic (see the notes).
    const uint32_t rv = smem_u32(sDelta + st * 3 * kBM + warp * 16 + g);
    auto row_at = [&](int k) { return __uint_as_float(lds32(rv + 4 * k)); };
    const float dl[2] = {row_at(0), row_at(8)};
    const T* sQ = stage_q(st);
    const T* sDO = stage_do(st);
    T* p_blk = stage_p(st) + cw * kBM * 64;
    const T* dp_blk = stage_dp(st) + cw * kBM * 64;
    T* ds_buf = sDS + (use & 1) * 2 * kBM * 64;  // both warpgroups' blocks of this step
    T* ds_blk = ds_buf + cw * kBM * 64;

    // This thread's pairs (rows warp * 16 + g + 8r, keys 8n + 2t..) in a warpgroup's swizzled
    // [64][64] block, as TMA writes it (swizzled_row_at; the blocks are 1024-byte aligned).
    const uint32_t at_in_blk = swizzled_row_at(warp * 16 + g, t);
    auto pair = [&](uint32_t at, int n, int r) { return swizzled_chunk(at, n) + r * 1024; };
    const uint32_t p_at = smem_u32(p_blk) + at_in_blk, dp_at = smem_u32(dp_blk) + at_in_blk,
                   ds_at = smem_u32(ds_blk) + at_in_blk;
    uint32_t p_raw[8][2], x_raw[8][2];

    // dP_w = dO V_wᵀ, then dV_w += P_wᵀ dO; dS needs only the first. The KL form's first product
    // is S_w = Q K_wᵀ instead: the same shape, both operands in shared memory.
    float dpv[32];
    if constexpr (KL || HAS_DO) {
      const T* a_rows = KL ? sQ : sDO;
      const T* b_rows = KL ? k_rows : v_rows;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int b = kk / 4, off = (kk % 4) * 16;
        Wgmma<T, 64>::template ss<0, 0>(dpv, desc_sw128(a_rows + b * kBM * 64 + off, 16, 1024),
                                        desc_sw128(b_rows + b * kBN * 64 + off, 16, 1024), kk > 0);
      }
      wgmma_commit();
    }
    if (KL && !a.p_tma) {  // the reference's pairs from global memory (rows not 16-byte aligned) while S runs
      const int64_t x_off = lead_off(p, p.grad_probs, lead);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = i0 + warp * 16 + g + 8 * r;
        const T* x_row = reinterpret_cast<const T*>(p.grad_probs.data) + x_off + i * p.grad_probs.row;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int64_t j = j0 + cw * 64 + 8 * n + 2 * t;  // S is even: a pair is in or out whole
          x_raw[n][r] = i < p.L && j < p.S ? load32(x_row + j) : 0u;
        }
      }
    }
    if (!KL && !a.p_tma) {  // P and dP_ext from global memory while dP runs; P into the stage for dV
      const int64_t p_off = lead_off(p, p.probs, lead), x_off = a.has_dp ? lead_off(p, p.grad_probs, lead) : 0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = i0 + warp * 16 + g + 8 * r;
        const T* p_row = reinterpret_cast<const T*>(p.probs.data) + p_off + i * p.probs.row;
        const T* x_row = reinterpret_cast<const T*>(p.grad_probs.data) + x_off + i * p.grad_probs.row;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int64_t j = j0 + cw * 64 + 8 * n + 2 * t;  // S is even: a pair is in or out whole
          const bool in = i < p.L && j < p.S;
          p_raw[n][r] = in ? load32(p_row + j) : 0u;
          x_raw[n][r] = in && a.has_dp ? load32(x_row + j) : 0u;
          sts32(pair(p_at, n, r), p_raw[n][r]);
        }
      }
      fence_proxy_async();
      named_barrier(1 + cw, 128);
    }
    if constexpr (KL) {
      wgmma_wait<0>();
      fence_regs(dpv);
    } else if constexpr (HAS_DO) {
      fence_regs(dv);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBM / 16; ++kk)
        Wgmma<T, D>::template ss<1, 1>(dv, desc_sw128(p_blk + kk * 16 * 64, kBM * 128, 1024),
                                       desc_sw128(sDO + kk * 16 * 64, kBM * 128, 1024), 1);
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(dpv);
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) dpv[i] = 0.0f;
    }
    if (a.p_tma) {  // the stage's pairs into registers here: one branch, not one an element below
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (!KL) p_raw[n][r] = lds32(pair(p_at, n, r));
          x_raw[n][r] = KL || a.has_dp ? lds32(pair(dp_at, n, r)) : 0u;
        }
    }

    if constexpr (KL) {
      // dS_w = g R f · P − g f · r, P = exp2(S scale log2 e − lse log2 e) where the key exists and
      // causality shows it (rows past L: lse = +inf and g = 0, so 0).
      const float lse2[2] = {row_at(0), row_at(8)}, gr[2] = {row_at(kBM), row_at(kBM + 8)},
                  gf[2] = {row_at(2 * kBM), row_at(2 * kBM + 8)};
      // Keys this thread's rows see: the warpgroup's columns < seen[r] (past S and, causal, right
      // of the row's diagonal hidden), so an element costs one 32-bit compare, not two 64-bit ones.
      int seen[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t jw = j0 + cw * 64, i = i0 + warp * 16 + g + 8 * r;
        int64_t lim = p.S - jw < 64 ? p.S - jw : 64;
        if (p.causal && i - jw + 1 < lim) lim = i - jw + 1;
        seen[r] = static_cast<int>(lim > 0 ? lim : 0);
      }
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float2 ref = unpack2<T>(x_raw[n][r]);
          float pr[2];
#pragma unroll
          for (int e = 0; e < 2; ++e)
            pr[e] = 8 * n + 2 * t + e < seen[r] ? fast_exp2(fmaf(dpv[4 * n + 2 * r + e], scale_log2, -lse2[r])) : 0.0f;
          sts32(pair(ds_at, n, r),
                pack2<T>(fmaf(gr[r], pr[0], -gf[r] * ref.x), fmaf(gr[r], pr[1], -gf[r] * ref.y)));
        }
    } else {
      // dS_w = P ∘ (dP + dP_ext − delta) into shared memory in the same swizzled layout.
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float2 pv = unpack2<T>(p_raw[n][r]), ext = unpack2<T>(x_raw[n][r]);
          const float d0 = dpv[4 * n + 2 * r] + ext.x - dl[r], d1 = dpv[4 * n + 2 * r + 1] + ext.y - dl[r];
          sts32(pair(ds_at, n, r), pack2<T>(pv.x * d0, pv.y * d1));
        }
    }
    fence_proxy_async();  // the generic-proxy stores before the products' async-proxy reads
    named_barrier(1 + cw, 128);

    // dK_w += dS_wᵀ Q.
    fence_regs(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<T, D>::template ss<1, 1>(dk, desc_sw128(ds_blk + kk * 16 * 64, kBM * 128, 1024),
                                     desc_sw128(sQ + kk * 16 * 64, kBM * 128, 1024), 1);
    wgmma_commit();

    // dQ(:, half cw) = dS K over all 128 keys, once the other warpgroup's dS is there too. The
    // buffer is rewritten two steps later, after both warpgroups passed this barrier again.
    named_barrier(3, 256);
    float dq[kDq];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const int b = kk / 4, off = (kk % 4) * 16;
      Wgmma<T, D / 2>::template ss<0, 1>(dq, desc_sw128(ds_buf + b * kBM * 64 + off, 16, 1024),
                                         desc_sw128(k_cols + kk * 16 * 64, kBN * 128, 1024), kk > 0);
    }
    wgmma_commit();
    // dK (and before it dV) done: the stage can be refilled while dQ's product still runs.
    wgmma_wait<1>();
    if (lane == 0) mbar_arrive(&empty[st]);
    wgmma_wait<0>();
    fence_regs(dq);
    fence_regs(dk);
    if constexpr (!KL) fence_regs(dv);

    float* dq_tile = dq_lead + qt * kBM * D + cw * (kBM * D / 2);
#pragma unroll
    for (int f = 0; f < kDq / 4; ++f)
      red_add4(dq_tile + (f * 128 + tid) * 4, dq[4 * f], dq[4 * f + 1], dq[4 * f + 2], dq[4 * f + 3], l2_policy_evict_last());
    if (++qt == a.q_tiles) {
      qt = t_first;
      lead = query_lead(a, kv, ++gi);
    }
  }

  // dK (times scale; KL: and 1 / f) and dV of this warpgroup's keys, stored once in the inputs' dtype.
  const int64_t lead0 = query_lead(a, kv, 0);
  const float dk_scale = a.unscale ? a.scale * a.unscale[kv] : a.scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = j0 + cw * 64 + warp * 16 + g + 8 * r;
    if (j >= p.S) continue;
    T* dk_row = a.dk ? static_cast<T*>(a.dk) + dense_lead_off(p, p.k, lead0) + j * p.k.dense_row : nullptr;
    T* dv_row = a.dv ? static_cast<T*>(a.dv) + dense_lead_off(p, p.v, lead0) + j * p.v.dense_row : nullptr;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * t;
      if (dk_row && col < p.E)
        *reinterpret_cast<uint32_t*>(dk_row + col) = pack2<T>(dk[4 * n + 2 * r] * dk_scale, dk[4 * n + 2 * r + 1] * dk_scale);
      if constexpr (!KL)
        if (dv_row && col < p.Ev)
          *reinterpret_cast<uint32_t*>(dv_row + col) = pack2<T>(dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1]);
    }
  }
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
