// The Hopper backward's two consumer warpgroups: per stage the products and dS of their own 64
// keys, dQ's share over all 128, and at the end dK and dV of their keys.
#pragma once

#include "backward_sm90_shell.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

// dK (times scale; KL: and 1 / f) and dV of this warpgroup's keys, stored once in the inputs' dtype.
template <typename T, int D, bool KL>
SDPA_MATH_D void store_dk_dv(const DevProblem& p, const Args& a, int64_t kv, int64_t j0, int cw, int warp, int g, int t,
                             const float (&dk)[D / 2], const float (&dv)[KL ? 1 : D / 2]) {
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

template <typename T, int D, bool HAS_DO, bool KL>
SDPA_MATH_D void consume(const DevProblem& p, const Args& a, const Smem<T, D, KL>& s) {
  using C = Tiles<D, KL>;
  // Consumers: warpgroup cw owns keys j0 + 64 cw .. + 63. In its 64 x 64 (query, key) tiles this
  // thread holds rows warp*16 + g and + 8, keys 8n + 2t and + 1 (n < 8); in its dK and dV tiles
  // (key, column) keys warp*16 + g and + 8 of its 64, columns 8n + 2t and + 1.
  const CtaKeys ck = cta_keys(p, a);
  const int64_t kv = ck.kv, j0 = ck.j0, t_first = ck.t_first;
  const int cw = threadIdx.x / 128 - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  float dk[D / 2], dv[KL ? 1 : D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < (KL ? 1 : D / 2); ++i) dv[i] = 0.0f;
  const T* v_rows = s.v + cw * 64 * 64;  // this warpgroup's 64 keys of each V column block
  const T* k_rows = s.k + cw * 64 * 64;  // and of each K column block (the KL form's S = Q Kᵀ)
  const float scale_log2 = a.scale * 1.4426950408889634f;
  // dQ: this warpgroup's half of the columns (for D = 64 a half of the one 64-element block).
  const T* k_cols = D == 128 ? s.k + cw * kBN * 64 : s.k + cw * 32;
  constexpr int kDq = D / 4;  // dQ accumulators per thread: 64 rows x D/2 columns
  mbar_wait(s.kv_full, 0);

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
    mbar_wait(&s.full[st], (use / C::kStages) & 1);
    // Maps the copy warps wrote (generic proxy) are read by dV's product (async proxy).
    if (!a.p_tma) fence_proxy_async();
    // Row vectors of this thread's rows: delta; KL: lse·log2 e, g R f, g f.
    // Shared memory through 32-bit shared-window addresses (LDS / STS): generic pointers compiled
    // to generic loads and stores (LD.E / ST.E) with 64-bit address arithmetic (see the notes).
    const uint32_t rv = smem_u32(s.delta + st * 3 * kBM + warp * 16 + g);
    auto row_at = [&](int k) { return __uint_as_float(lds32(rv + 4 * k)); };
    const float dl[2] = {row_at(0), row_at(8)};
    const T* sQ = s.q_tile(st);
    const T* sDO = s.do_tile(st);
    const T* p_blk = s.p_tile(st) + cw * kBM * 64;
    const T* dp_blk = s.dp_tile(st) + cw * kBM * 64;
    T* ds_buf = s.ds + (use & 1) * 2 * kBM * 64;  // both warpgroups' blocks of this step
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
    {  // the stage's pairs into registers
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
    // Every thread arrives, each releasing its own reads of the stage (one arrival a warp, after
    // the warpgroup's barriers, was enough on the hardware, but compute-sanitizer's racecheck
    // reported the copy warps' next writes against those reads; 256 arrivals cost nothing measurable).
    mbar_arrive(&s.empty[st]);
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

  store_dk_dv<T, D, KL>(p, a, kv, j0, cw, warp, g, t, dk, dv);
}

}  // namespace
}  // namespace sdpa_math::cuda::sm90
