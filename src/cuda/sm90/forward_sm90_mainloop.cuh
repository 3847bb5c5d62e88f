// The Hopper forward's main loops: the producer's TMA loads of Q and the key tiles, the
// consumers' pass 1 (each row's max and sum) and pass 2 (P once, O += u V), the latter in two
// forms: one product per turn, and the unmasked head-128 forward's overlapped order.
#pragma once

#include "forward_sm90_consumer.cuh"
#include "forward_sm90_p_store.cuh"
#include "forward_sm90_stats.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// The producer warpgroup: its one thread brings Q, then the K tiles of pass 1 and the K and V
// tiles of pass 2 (one pass for a one-pass statistics CTA) into the rings. The maps' coordinates
// of this head are computed before the warpgroup gives registers back.
template <typename T, int D, bool STATS>
SDPA_MATH_D void produce(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v, const Args& a,
                         const Smem<T, D, STATS>& sm, TraceState& tr, int64_t lead, int64_t i0, int n_tiles,
                         bool one_pass) {
  using C = Tiles<D, STATS>;
  Own<int[3]> cq, ck, cv;
  map_coords(a.q, lead, cq.v);
  map_coords(a.k, lead, ck.v);
  map_coords(a.v, lead, cv.v);
  regs_release<kProducerRegs>();
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&tm_q);
    prefetch_tensor_map(&tm_k);
    prefetch_tensor_map(&tm_v);
    mbar_arrive_expect_tx(sm.q_full, C::kQBytes);
#pragma unroll
    for (int b = 0; b < C::kBlocks; ++b)
      tma_load_5d(sm.sQ + b * kBM * 64, &tm_q, sm.q_full, b * 64, static_cast<int>(i0), cq.v[0], cq.v[1], cq.v[2]);
    // Tile nt of a map into the next stage of a ring: use n of a stage waits for the n-th
    // release of it (parity (n & 1) ^ 1: the first use finds it free).
    auto produce_tile = [&](T* ring, const CUtensorMap* map, uint64_t* full_bars, uint64_t* empty_bars, int stages,
                            int& use, int nt, const int (&c)[3]) {
      const int st = use % stages;
      mbar_wait(&empty_bars[st], ((use++ / stages) & 1) ^ 1);
      FWD_STAMP(ring == sm.sK ? trace::kProdK : trace::kProdV);
      mbar_arrive_expect_tx(&full_bars[st], C::kKVBytes);
#pragma unroll
      for (int b = 0; b < C::kBlocks; ++b)
        tma_load_5d(ring + st * kBN * D + b * kBN * 64, map, &full_bars[st], b * 64, nt * kBN, c[0], c[1], c[2]);
    };
    int kt = 0, vt = 0;
    for (int pass = one_pass ? 1 : 0; pass < 2; ++pass)
      for (int nt = 0; nt < n_tiles; ++nt) {
        produce_tile(sm.sK, &tm_k, sm.k_full, sm.k_empty, C::kKStages, kt, nt, ck.v);
        if (pass == 1) produce_tile(sm.sV, &tm_v, sm.v_full, sm.v_empty, C::kVStages, vt, nt, cv.v);
      }
  }
}

// Pass 1: the running max (common to the quad sharing a row) and per-thread partial sums.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::pass1() {
  for (int nt = 0; nt < (one_pass ? 0 : n_tiles); ++nt, ++kt) {
    const int stage = kt % C::kKStages;
    FWD_STAMP(trace::kP1Top);
    mbar_wait(&sm.k_full[stage], (kt / C::kKStages) & 1);
    FWD_STAMP(trace::kP1KFull);
    Own<float[kBN / 2]> s_;
    float (&s)[kBN / 2] = s_.v;
    const int64_t j0 = static_cast<int64_t>(nt) * kBN;
    scores(s, stage);
    if (lane == 0) mbar_arrive(&sm.k_empty[stage]);
    const bool clean = tile_is_clean(j0);
    const bool raw = to_logits(s, j0, clean, fold && clean, nt + 1 < n_tiles ? j0 + kBN : 0);  // after the last: pass 2's first
    const float mul = raw ? scale : 1.0f;  // logit = s · mul
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float new_max = max_nan(m[r], quad_max_nan(row_max(s, r)) * mul);
      if (new_max == kNegInf) continue;
      if (kNatural && !raw) shift_row(s, r, new_max);
      const float add = row_sum_exp(s, r, exponent_of<kNatural>(raw, mul, new_max, a.scale_log2));
      l[r] = l[r] * exp_from<kNatural>(m[r], 1.0f, new_max) + add;  // exp(-inf) = 0 on the first tile
      m[r] = new_max;
    }
  }
}

// P = exp(x - m) / l; the lse. A fully masked row (l = 0) gives P = 0 and lse = -inf; a NaN
// anywhere in the row gives NaN throughout. (One-pass CTAs: after their pass.)
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::finish_rows() {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const RowEnd e = end_of_row<kNatural>(l[r], m[r]);
    inv_l[r] = e.inv_l;
    if (t == 0 && row_ok[r]) reinterpret_cast<float*>(p.lse.data)[lead_off(p, p.lse, lead) + row[r] * p.lse.row] = e.lse;
    if (t == 0) sm.row_is_nan[cw * 64 + warp * 16 + g + 8 * r] = e.nan;
  }
}

// Pass 2's state. One-pass CTAs: the running max (-inf while a row has seen no visible key); m is
// then the reference of the exponents and of l, h and O: the max, or 0 while the max is -inf.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::prepare_pass2() {
  run_max[0] = run_max[1] = kNegInf;
  if (one_pass) m[0] = m[1] = 0.0f;
  h[0] = h[1] = 0.0f;
  col_buf = reinterpret_cast<float*>(p_tile);
  col_out = nullptr;
  if constexpr (STATS) {
    if (st.col_part != nullptr) col_out = st.col_part + ((lead - a.lead0) * 2 * tiles + 2 * row_tile + cw) * p.S;
  }
  // stmatrix row addresses (P through shared memory): lane L gives row L % 8 of matrix L / 8,
  // which is 8-key group nb = L / 16 of rows 8 ((L / 8) % 2) + 0..7 of the warp's 16; for the
  // stmatrix of groups 2 k + (0, 1) (k < 4 within each 64-key block) its 16-byte chunk is
  // (2 k + nb) ^ (row % 8) of the 128-byte swizzle, and row % 8 = L % 8.
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int rr = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), n = 2 * k + (lane >> 4);
    p_addr[k] = smem_u32(p_tile + rr * 64 + (n ^ (lane & 7)) * 8);
  }
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
}

// Pass 2 in FlashAttention 3's order (kOverlap): one turn a tile issues S of tile n and then u V
// of tile n - 1, and the warpgroup waits only for the first (wait_group 1: groups complete in
// order), so tile n's softmax and P run while u V of tile n - 1 is still on the tensor cores.
// Pass 2 never rescales O, so the softmax writes nothing that product reads; u's fragments it
// does read, and tile n's are packed only after it has been waited for. Tile 0's S takes a turn
// of its own, and so does the last tile's u V.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::pass2_overlapped() {
  Own<uint32_t[kBN / 16][4]> u_frag_;
  uint32_t (&u_frag)[kBN / 16][4] = u_frag_.v;
  fence_regs(o);  // O's zeros stay above the first product (else ptxas serialises them: C7515)
  FWD_TRACE(tr.pass2 = true);
  // Tile nt's S has been waited for: its K stage back, u = exp(x - m) in place of s, P = u / l
  // out, and (after u V of the last tile is waited for) u into the A fragments.
  auto softmax_and_p = [&](float (&s)[kBN / 2], int nt) {
    const int64_t j0 = static_cast<int64_t>(nt) * kBN;
    if (lane == 0) mbar_arrive(&sm.k_empty[kt % C::kKStages]);
    const bool clean = tile_is_clean(j0);
    const bool raw = to_logits(s, j0, clean, fold && clean, -1);  // unmasked (kOverlap): no pairs to load
    const float mul = raw ? scale : 1.0f;
    const int p_buf = nt % C::kPBuffers;
    p_buffer_free();
    float (&u)[kBN / 2] = s;  // u replaces s in place, for pack_u after u V of the last tile
    p_to_smem(s, raw, mul, p_buf, [&](int n2, int nb, int r, float u0, float u1) {
      u[4 * (2 * n2 + nb) + 2 * r] = u0;
      u[4 * (2 * n2 + nb) + 2 * r + 1] = u1;
    });
    p_tile_out(p_buf, j0);
    FWD_STAMP(trace::kP2Written);
  };
  // A fragment of k-step n2: {row g, keys 2t..} {row g+8, 2t..} {g, 2t+8..} {g+8, 2t+8..}.
  auto pack_u = [&](const float (&s)[kBN / 2]) {
#pragma unroll
    for (int n2 = 0; n2 < kBN / 16; ++n2)
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 2 * n2 + nb;
          u_frag[n2][nb * 2 + r] = pack2<T>(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]);
        }
  };
  // u V of tile nt - 1 (its V stage waited for, u and O fenced), issued after what the turn
  // has issued already.
  auto issue_pv = [&](int nt) {
    const T* v_tile = sm.sV + ((nt - 1) % C::kVStages) * kBN * D;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      Wgmma<T, D>::template rs<1>(o, u_frag[kk], desc_sw128(v_tile + kk * 16 * 64, kBN * 128, 1024), 1);
    wgmma_commit();
  };
  auto fence_pv_operands = [&] {
    fence_regs(o);
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) fence_regs(u_frag[kk]);
  };
  if (n_tiles > 0) {  // tile 0: S alone
    Own<float[kBN / 2]> s_;
    float (&s)[kBN / 2] = s_.v;
    FWD_STAMP(trace::kP2Top);
    mbar_wait(&sm.k_full[kt % C::kKStages], (kt / C::kKStages) & 1);
    fence_regs(s);
    turn_begin();
    FWD_STAMP(trace::kP2Turn);
    issue_scores(s, sm.sK + (kt % C::kKStages) * kBN * D);
    turn_end();
    wgmma_wait<0>();
    fence_regs(s);
    FWD_STAMP(trace::kP2Done);
    softmax_and_p(s, 0);
    pack_u(s);
    ++kt;
  }
  for (int nt = 1; nt < n_tiles; ++nt, ++kt) {
    Own<float[kBN / 2]> s_;
    float (&s)[kBN / 2] = s_.v;
    FWD_STAMP(trace::kP2Top);
    mbar_wait(&sm.k_full[kt % C::kKStages], (kt / C::kKStages) & 1);
    mbar_wait(&sm.v_full[(nt - 1) % C::kVStages], ((nt - 1) / C::kVStages) & 1);
    FWD_STAMP(trace::kP2VFull);
    fence_pv_operands();
    fence_regs(s);
    turn_begin();
    FWD_STAMP(trace::kP2Turn);
    issue_scores(s, sm.sK + (kt % C::kKStages) * kBN * D);
    issue_pv(nt);
    turn_end();
    // Tile nt - 1's P under both products; every thread has copied it before this iteration's
    // p_buffer_free, so no later tile's stmatrix can overwrite it first (any kPBuffers).
    if constexpr (P_COPY) p_tile_copy_out((nt - 1) % C::kPBuffers, static_cast<int64_t>(nt - 1) * kBN);
    wgmma_wait<1>();  // S of this tile; u V of the last may still run
    fence_regs(s);
    FWD_STAMP(trace::kP2Done);
    softmax_and_p(s, nt);
    wgmma_wait<0>();
    fence_pv_operands();
    FWD_STAMP(trace::kP2PvDone);
    if (lane == 0) mbar_arrive(&sm.v_empty[(nt - 1) % C::kVStages]);
    pack_u(s);
  }
  if (n_tiles > 0) {  // the last tile's u V alone
    mbar_wait(&sm.v_full[(n_tiles - 1) % C::kVStages], ((n_tiles - 1) / C::kVStages) & 1);
    fence_pv_operands();
    turn_begin();
    issue_pv(n_tiles);
    turn_end();
    if constexpr (P_COPY) p_tile_copy_out((n_tiles - 1) % C::kPBuffers, static_cast<int64_t>(n_tiles - 1) * kBN);
    wgmma_wait<0>();
    fence_pv_operands();
    if (lane == 0) mbar_arrive(&sm.v_empty[(n_tiles - 1) % C::kVStages]);
  }
}

// Pass 2 with one product per turn: S of the tile, then (its P written or, STATS, reduced) u V.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::pass2() {
  for (int nt = 0; nt < n_tiles; ++nt, ++kt) {
    const int stage = kt % C::kKStages, v_stage = nt % C::kVStages;
    FWD_TRACE(tr.pass2 = true);
    FWD_STAMP(trace::kP2Top);
    mbar_wait(&sm.k_full[stage], (kt / C::kKStages) & 1);
    FWD_STAMP(trace::kP2KFull);
    Own<float[kBN / 2]> s_;
    float (&s)[kBN / 2] = s_.v;
    const int64_t j0 = static_cast<int64_t>(nt) * kBN;
    scores(s, stage);
    if (lane == 0) mbar_arrive(&sm.k_empty[stage]);
    const bool clean = tile_is_clean(j0);
    const bool raw = to_logits(s, j0, clean, fold && clean, nt + 1 < n_tiles ? j0 + kBN : -1);
    const float mul = raw ? scale : 1.0f;
    const int keys = static_cast<int>(p.S - j0 < kBN ? p.S - j0 : kBN);  // P columns of this tile
    if constexpr (STATS) {
      if (one_pass) stats_rescale(s, mul);
    }
    // This key tile's P buffer; its last store (kPBuffers tiles ago: TMA, or the warpgroup's copy)
    // has read it before it is rewritten (p_buffer_free).
    const int p_buf = nt % C::kPBuffers;
    if constexpr (!STATS) p_buffer_free();
    Own<uint32_t[kBN / 16][4]> u_frag_;
  uint32_t (&u_frag)[kBN / 16][4] = u_frag_.v;
    Own<float[STATS ? kBN / 4 : 1]> col_;  // this thread's two rows of P summed: keys 8n + 2t (+1) at 2n (+1)
    float (&col)[STATS ? kBN / 4 : 1] = col_.v;
    if constexpr (!STATS) {
      // A fragment of k-step n2: {row g, keys 2t..} {row g+8, 2t..} {g, 2t+8..} {g+8, 2t+8..}.
      if (kNatural && !raw) {
        shift_row(s, 0, m[0]);
        shift_row(s, 1, m[1]);
      }
      p_to_smem(s, raw, mul, p_buf, [&](int n2, int nb, int r, float u0, float u1) {
        u_frag[n2][nb * 2 + r] = pack2<T>(u0, u1);
      });
    } else {
      stats_tile(s, j0, clean, mul, keys, u_frag, col);
    }
    if constexpr (!STATS) p_tile_out(p_buf, j0);
    FWD_STAMP(trace::kP2Written);
    mbar_wait(&sm.v_full[v_stage], (nt / C::kVStages) & 1);
    FWD_STAMP(trace::kP2VFull);
    const T* v_tile = sm.sV + v_stage * kBN * D;
    fence_regs(o);  // u and O are written before the fence, read by the products after it
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) fence_regs(u_frag[kk]);
    turn_begin();
    FWD_STAMP(trace::kP2PvTurn);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      Wgmma<T, D>::template rs<1>(o, u_frag[kk], desc_sw128(v_tile + kk * 16 * 64, kBN * 128, 1024), 1);
    wgmma_commit();
    turn_end();
    if constexpr (P_COPY) p_tile_copy_out(p_buf, j0);  // under u V
    wgmma_wait<0>();
    fence_regs(o);
    FWD_STAMP(trace::kP2PvDone);
    // The column sums once u's registers are free (the other warpgroup's products run meanwhile):
    // during the product they would push the kernel past its registers.
    if constexpr (STATS) {
      if (st.col_part != nullptr) column_sums(col, col_buf + (nt & 1) * 4 * kBN, warp, lane, tid, p_bar, col_out + j0, p.S - j0);
    }
    if (lane == 0) mbar_arrive(&sm.v_empty[v_stage]);
  }
}

}  // namespace sdpa_math::cuda::sm90::fwd
