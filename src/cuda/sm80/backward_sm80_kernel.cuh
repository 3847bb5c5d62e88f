// The tensor-core backward's kernel (backward_tc, mma.sync: fp16/bf16, sm_80 and newer) and its
// launch function, launch_backward<T, DT, BN>. Only the instantiation files
// (backward_sm80_<dtype>_d<head>.cu) instantiate launch_backward, and with it the kernel's two
// variants of each tile, so that a parallel build compiles them side by side; the host side
// (backward_sm80.cu) includes this header for the tile sizes and the shared-memory check
// (key_block_fits) and declares the launch functions `extern template`.
//
// The design: per CTA one head's block of BN keys; it sweeps the query rows in tiles of 64 and
// per tile:
//   A) per warp (16 query rows): S = Q K^T and G = dO V^T on tensor cores, A = exp(scale S + mask
//      - lse), dA and dS = A (dA - delta) by the contract's dropout rules; W (what multiplied V)
//      and scale dS go to shared memory, transposed, and dS feeds the mask gradient;
//   B) per warp (16 keys): dV += W^T dO and dK += scale dS^T Q, in registers for the whole sweep;
//   C) per warp (16 query rows): dQ += scale dS K, added atomically to an fp32 accumulator.
// delta = rowsum(A . dA) comes first: from memory as rowsum(dO . O) + rowsum(P . dP) when the
// forward's O and P are given, else recomputed on the generic path.
// dK and dV go to fp32 accumulators too (atomically), which is what sums them over GQA groups
// and broadcast batch dims; when each key row is one CTA's alone they are stored directly.
//
// The kernel lives in the named namespace sdpa_math::cuda::sm80 (it was in an anonymous one when
// the whole backward was one file), so that the instantiation files and the host side name the
// same functions; the kernel's name and template parameters are unchanged.
#pragma once

#include "../launch.cuh"
#include "../mma.cuh"
#include "../tensor_core.cuh"

namespace sdpa_math::cuda::sm80 {

constexpr int kThreads = 128;  // 4 warps
constexpr int kBM = 64;        // query rows per sweep step

struct BackwardFlags {
  bool q_vec, k_vec, v_vec, go_vec, p_vec, gp_vec;  // 16-byte row loads
  bool a_from_probs;  // A is the forward's P (no dropout): read it, do not recompute Q K^T
};

// Dynamic shared memory of a CTA: K, V (BN rows), Q, dO (kBM rows), P, dP (kBM x BN) and the
// transposed W, dS tiles (BN x kBM), rows padded by 8 elements.
template <typename T, int DT, int BN>
constexpr size_t backward_smem_bytes() {
  return sizeof(T) * (2 * BN * (DT + 8) + 2 * kBM * (DT + 8) + 2 * kBM * (BN + 8) + 2 * BN * (kBM + 8));
}

// Whether a key block of BN keys for head tile DT fits the device's shared memory. The narrower
// blocks (128: 32 keys, 256: 16 keys) are for 99 KB GPUs (RTX 30/40, L4, L40S).
template <typename T, int DT, int BN>
bool key_block_fits() {
  return backward_smem_bytes<T, DT, BN>() <= smem_optin_limit();
}

// s[n][c] = a_row . b_col over `kchunks` chunks of 16 for this warp's 16 rows (A: [row][k],
// B: [col][k], both row-major in shared memory).
template <typename T, int DT, int BN, int LDA, int LDB>
SDPA_MATH_D void warp_products(float (&s)[BN / 8][4], const T* sA, const T* sB, int warp, int g, int t, int kchunks) {
#pragma unroll
  for (int n = 0; n < BN / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[n][c] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < DT / 16; ++kk) {
    if (kk >= kchunks) break;
    const T* qa = sA + (warp * 16 + g) * LDA + kk * 16 + 2 * t;
    const uint32_t a[4] = {load32(qa), load32(qa + 8 * LDA), load32(qa + 8), load32(qa + 8 * LDA + 8)};
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      const T* kb = sB + (n * 8 + g) * LDB + kk * 16 + 2 * t;
      mma_16816<T>(s[n], a, load32(kb), load32(kb + 8));
    }
  }
}

// GENERAL = false is the plain case: no mask, no dropout, A read from P. Then dA = G + dP,
// dS = A (dA - delta) and W = A, a few instructions per element.
template <typename T, int DT, int BN, bool GENERAL>
__global__ void __launch_bounds__(kThreads) backward_tc(DevProblem p, BackwardBuffers<float> gb, BackwardFlags f,
                                                        int64_t key_blocks) {
  constexpr int LD = DT + 8;       // rows of Q, dO, K, V tiles
  constexpr int LDP = BN + 8;      // rows of the P and dP tiles: (query, key)
  constexpr int LDT = kBM + 8;     // rows of the transposed W and dS tiles: (key, query)
  constexpr int KEY_GROUPS = BN / 16;            // warps per key group in phase B
  constexpr int COL_SPLIT = 4 / KEY_GROUPS;      // head-dim slices per key group
  constexpr int COLS = DT / COL_SPLIT;           // head-dim columns a warp owns in phase B
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * LD;
  T* sQ = sV + BN * LD;
  T* sdO = sQ + kBM * LD;
  T* sP = sdO + kBM * LD;
  T* sdP = sP + kBM * LDP;
  T* sWt = sdP + kBM * LDP;
  T* sdSt = sWt + BN * LDT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int64_t lead = blockIdx.x / key_blocks;
  const int64_t j0 = (blockIdx.x % key_blocks) * BN;
  const int64_t q_at = lead_off(p, p.q, lead), k_at = lead_off(p, p.k, lead), v_at = lead_off(p, p.v, lead);
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t go_at = p.grad_out.data ? lead_off(p, p.grad_out, lead) : 0;
  const int64_t gp_at = p.grad_probs.data ? lead_off(p, p.grad_probs, lead) : 0;
  const int64_t pr_at = p.probs.data ? lead_off(p, p.probs, lead) : 0;
  const int64_t lse_at = lead_off(p, p.lse, lead);
  const bool has_go = p.grad_out.data != nullptr, has_gp = p.grad_probs.data != nullptr;
  const bool want_dk = gb.dk || gb.dk_out, want_dv = gb.dv || gb.dv_out;
  const int kchunks = static_cast<int>((p.E + 15) / 16), vchunks = static_cast<int>((p.Ev + 15) / 16);
  const int etiles = static_cast<int>((p.E + 7) / 8);
  const float scale = static_cast<float>(p.scale);
  constexpr float kNegInf = -INFINITY;
  // The P / dP tile's columns are the keys j0..j0+BN (as a [row][col] tile of the operand).
  DevOperand probs_cols = p.probs, gp_cols = p.grad_probs;

  load_tile_async<T, BN, DT, LD, kThreads>(sK, p.k, k_at, j0, p.S, p.E, f.k_vec);
  load_tile_async<T, BN, DT, LD, kThreads>(sV, p.v, v_at, j0, p.S, p.Ev, f.v_vec);

  // One query tile's inputs: Q, dO, and P, dP restricted to this CTA's keys.
  auto load_rows = [&](int64_t i0) {
    load_tile_async<T, kBM, DT, LD, kThreads>(sQ, p.q, q_at, i0, p.L, p.E, f.q_vec);
    if (has_go) load_tile_async<T, kBM, DT, LD, kThreads>(sdO, p.grad_out, go_at, i0, p.L, p.Ev, f.go_vec);
    if (f.a_from_probs)
      load_tile_async<T, kBM, BN, LDP, kThreads>(sP, probs_cols, pr_at + j0 * p.probs.col, i0, p.L, p.S - j0, f.p_vec);
    if (has_gp)
      load_tile_async<T, kBM, BN, LDP, kThreads>(sdP, gp_cols, gp_at + j0 * p.grad_probs.col, i0, p.L, p.S - j0,
                                                 f.gp_vec);
    cp_async_commit();
  };

  const int kg = warp % KEY_GROUPS, col0 = (warp / KEY_GROUPS) * COLS;
  float dk[COLS / 8][4], dv[COLS / 8][4];
#pragma unroll
  for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk[n][c] = dv[n][c] = 0.0f;

  // Causal: key j is seen by rows i >= j, so the sweep starts at the tile holding row j0.
  const int64_t first = p.causal ? (j0 / kBM) * kBM : 0;
  if (first < p.L) load_rows(first);
  else cp_async_commit();
  for (int64_t i0 = first; i0 < p.L; i0 += kBM) {
    cp_async_wait<0>();
    __syncthreads();

    // Phase A.
    float s[BN / 8][4], gd[BN / 8][4];
    if (!f.a_from_probs) warp_products<T, DT, BN, LD, LD>(s, sQ, sK, warp, g, t, kchunks);
    if (has_go) warp_products<T, DT, BN, LD, LD>(gd, sdO, sV, warp, g, t, vchunks);
    uint32_t ds_frag[BN / 16][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int il = warp * 16 + g + 8 * r;
      const int64_t i = i0 + il;
      const bool row_ok = i < p.L;
      const float lse = (row_ok && !f.a_from_probs) ? load_elem<float>(p.lse.dtype, p.lse.data, lse_at + i * p.lse.row) : kNegInf;
      const float delta = row_ok ? gb.delta[lead * p.L + i] : 0.0f;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = 2 * r + e;
          const int jl = n * 8 + 2 * t + e;  // key within the block
          const int64_t j = j0 + jl;
          float ds = 0.0f, w = 0.0f;
          if constexpr (!GENERAL) {
            // Out-of-range rows and keys hold zeros in the P tile, so they give zeros here.
            const float a = to_float<T>(sP[il * LDP + jl]);
            const float da = (has_go ? gd[n][c] : 0.0f) + (has_gp ? to_float<T>(sdP[il * LDP + jl]) : 0.0f);
            ds = a * (da - delta);
            w = a;
          } else if (row_ok && j < p.S) {
            const float a = f.a_from_probs ? to_float<T>(sP[il * LDP + jl])
                                           : prob_from_lse<float>(masked_logit<float>(p, s[n][c], m_at, i, j), lse);
            const float keep = keep_of<float>(p, d_at, lead, i, j);
            const float dp = has_gp ? to_float<T>(sdP[il * LDP + jl]) : 0.0f;
            const float da = grad_softmax<float>(p, has_go ? gd[n][c] : 0.0f, dp, keep);
            ds = a * (da - delta);
            w = value_weight<float>(p, a, keep);
            if (gb.dmask && ds != 0.0f)
              atomicAdd(gb.dmask + dense_lead_off(p, p.mask, lead) + i * p.mask.dense_row + j * p.mask.dense_col, ds);
          }
          s[n][c] = ds * scale;
          sWt[jl * LDT + il] = from_float<T>(w);
          sdSt[jl * LDT + il] = from_float<T>(ds * scale);
        }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      ds_frag[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      ds_frag[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      ds_frag[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      ds_frag[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    __syncthreads();

    // Phase B: this warp's 16 keys x COLS columns of dV and dK.
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) {
      const T* wa = sWt + (kg * 16 + g) * LDT + kk * 16 + 2 * t;
      const T* sa = sdSt + (kg * 16 + g) * LDT + kk * 16 + 2 * t;
      const uint32_t aw[4] = {load32(wa), load32(wa + 8 * LDT), load32(wa + 8), load32(wa + 8 * LDT + 8)};
      const uint32_t as[4] = {load32(sa), load32(sa + 8 * LDT), load32(sa + 8), load32(sa + 8 * LDT + 8)};
#pragma unroll
      for (int n = 0; n < COLS / 8; ++n) {
        const int col = col0 + n * 8;
        uint32_t b0, b1;
        if (want_dv && has_go && col < p.Ev) {
          load_b_trans<T>(sdO + (kk * 16) * LD + col, LD, lane, b0, b1);
          mma_16816<T>(dv[n], aw, b0, b1);
        }
        if (want_dk && col < p.E) {
          load_b_trans<T>(sQ + (kk * 16) * LD + col, LD, lane, b0, b1);
          mma_16816<T>(dk[n], as, b0, b1);
        }
      }
    }
    __syncthreads();  // Q, dO, P, dP are free: the next tile loads during phase C
    if (i0 + kBM < p.L) load_rows(i0 + kBM);

    // Phase C: dQ of this warp's 16 rows.
    if (gb.dq) {
      const int64_t dq_lead = dense_lead_off(p, p.q, lead);
#pragma unroll 4
      for (int n = 0; n < DT / 8; ++n) {
        if (n >= etiles) break;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          uint32_t b0, b1;
          load_b_trans<T>(sK + (kk * 16) * LD + n * 8, LD, lane, b0, b1);
          mma_16816<T>(acc, ds_frag[kk], b0, b1);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int64_t i = i0 + warp * 16 + g + 8 * (c >> 1);
          const int64_t col = n * 8 + 2 * t + (c & 1);
          if (i < p.L && col < p.E && acc[c] != 0.0f)
            atomicAdd(gb.dq + dq_lead + i * p.q.dense_row + col * p.q.dense_col, acc[c]);
        }
      }
    }
  }

  // dK and dV of this CTA's keys: stored, or added to the dense accumulators.
  const int64_t dk_lead = want_dk ? dense_lead_off(p, p.k, lead) : 0;
  const int64_t dv_lead = want_dv ? dense_lead_off(p, p.v, lead) : 0;
  T* dk_out = static_cast<T*>(gb.dk_out);
  T* dv_out = static_cast<T*>(gb.dv_out);
#pragma unroll
  for (int n = 0; n < COLS / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t j = j0 + kg * 16 + g + 8 * (c >> 1);
      const int64_t col = col0 + n * 8 + 2 * t + (c & 1);
      if (j >= p.S) continue;
      const int64_t k_off = dk_lead + j * p.k.dense_row + col * p.k.dense_col;
      const int64_t v_off = dv_lead + j * p.v.dense_row + col * p.v.dense_col;
      if (col < p.E) {
        if (dk_out) dk_out[k_off] = from_float<T>(dk[n][c]);
        else if (gb.dk) atomicAdd(gb.dk + k_off, dk[n][c]);
      }
      if (col < p.Ev) {
        if (dv_out) dv_out[v_off] = from_float<T>(dv[n][c]);
        else if (gb.dv) atomicAdd(gb.dv + v_off, dv[n][c]);
      }
    }
}

template <typename T, int DT, int BN>
void launch_backward(const DevProblem& p, const BackwardBuffers<float>& g, const BackwardFlags& f, bool general,
                     cudaStream_t stream) {
  const int64_t key_blocks = (p.S + BN - 1) / BN;
  const int64_t blocks = key_blocks * p.num_lead;
  if (blocks == 0) return;
  const size_t smem = backward_smem_bytes<T, DT, BN>();
  if (general) {
    set_smem_limit(reinterpret_cast<const void*>(&backward_tc<T, DT, BN, true>), smem);
    backward_tc<T, DT, BN, true><<<grid_x(blocks, "tensor-core backward"), kThreads, smem, stream>>>(p, g, f, key_blocks);
  } else {
    set_smem_limit(reinterpret_cast<const void*>(&backward_tc<T, DT, BN, false>), smem);
    backward_tc<T, DT, BN, false><<<grid_x(blocks, "tensor-core backward"), kThreads, smem, stream>>>(p, g, f, key_blocks);
  }
  check_launch("tensor-core backward");
}

// The launch functions of one tile (DT, BN), each compiling both kernel variants (GENERAL true
// and false). PREFIX is `template` (an explicit instantiation: the instantiation files) or
// `extern template` (a declaration that it is compiled elsewhere: the host side).
#define SDPA_MATH_SM80_BWD_TILE(PREFIX, T, DT, BN)                                                        \
  PREFIX void launch_backward<T, DT, BN>(const DevProblem&, const BackwardBuffers<float>&, const BackwardFlags&, bool, \
                                         cudaStream_t);

}  // namespace sdpa_math::cuda::sm80
