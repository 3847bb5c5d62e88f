// The Hopper forward's consumer warpgroups: their state (one object per thread, held in
// registers once its member functions are inlined into the kernel) and their common steps: the
// ping-pong of product turns, S = Q Kᵀ, the mask's pairs and the scores' conversion to logits.
// The passes are in forward_sm90_mainloop.cuh, P's way out in forward_sm90_p_store.cuh, the
// statistics kernel's parts in forward_sm90_stats.cuh: all members of Consumer, defined out of
// line, each __forceinline__ so the kernel compiles to one body as if written in one piece.
#pragma once

#include <type_traits>

#include "../mma.cuh"
#include "forward_sm90_mask.cuh"
#include "forward_sm90_shell.cuh"
#include "forward_sm90_softmax.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// MASK = None: scores in base-2 units (x = s * scale * log2 e; one multiply-add and one ex2 per
// element), causal and the key tail by index, only on the tiles that need it; a bool mask keeps
// the logit or selects -inf, in the same units, and an fp16 mask adds its value times log2 e.
// With a bf16 or fp32 mask: natural units (x = s * scale + mask), so a row held at the mask's
// finfo.min still has finite logits (their base-2 form would overflow fp32) and gives the math
// op's uniform row; exponents are taken of differences, (x - m) * log2 e, except on a bf16
// mask's tiles that change no logit (exponent_of).
//
// STATS: the statistics kernel. P is not written (except the rows of st.win); pass 2 reduces it
// instead: each row's entropy −Σ P log P = log l + Σ_j P_j (m − x_j) (every term ≥ 0, no
// cancellation; m the row's max logit, l its sum of exp(x − m)) and the warpgroup's column sums.
//
// P_COPY: TMA cannot address P (mostly: its rows are not 16-byte aligned, S % 8 != 0) and its
// staged tiles leave by the warpgroup's own stores instead. Kernels of their own: with the copy's
// code in the TMA kernels (never run there) those ran slower at their register limit.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
struct Consumer {
  using C = Tiles<D, STATS>;
  static constexpr bool kMasked = MASK != MaskKind::None;
  // Pass 2 with the warpgroup's own products overlapped (pass2_overlapped), in the unmasked
  // head-128 forward, where it was a few per cent faster. Head 64 lost time with it and keeps
  // one product per turn; so do the statistics kernel (its column sums hold u's registers
  // longer) and the masked kernels (with the mask's pairs live as well they spill).
  static constexpr bool kOverlap = !STATS && !kMasked && D == 128;
  // Logits in natural units only where a mask value can be near fp32's lowest (an fp32 or bf16
  // mask): a row held at finfo.min would overflow fp32 in base 2. A bool mask selects -inf,
  // which base 2 takes as is, and an fp16 mask's lowest (-65504) is 94500 in base 2: those are in
  // base-2 units, so their tiles whose pairs are neutral fold the scale as unmasked ones do (an
  // exponent one multiply-add, not a subtract and a multiply).
  static constexpr bool kNatural = (MASK == MaskKind::Same && !std::is_same_v<T, __half>) || MASK == MaskKind::Float32;
  static_assert(!(kNatural && kOverlap), "the overlapped pass 2 does not shift a natural kernel's rows (shift_row)");
  // A float mask's forward reads the mask plan (build_mask_plan, always built for it): the warps
  // load no pairs of a tile the plan marks neutral and take no vote. Bool masks (one byte a key:
  // their loads cost little) keep the warps' vote, and so does the statistics form. With both
  // paths in one kernel, every masked forward was markedly slower, the plan unused.
  static constexpr bool kPlanned = kMasked && !STATS && MASK != MaskKind::Bool;
  static constexpr float kNegInf = -INFINITY;
  using Mask = MaskPair<T, MASK == MaskKind::None ? MaskKind::Bool : MASK, !kNatural>;
  static constexpr int kMaskGroups = kMasked ? kBN / 8 : 1;  // 8-key groups whose mask pairs a thread keeps

  // The launch's and the CTA's (kernel parameters and the kernel's locals).
  const CUtensorMap& tm_p;
  const DevProblem& p;
  const Args& a;
  const StatsArgs& st;
  const Smem<T, D, STATS>& sm;
  TraceState& tr;
  const int cw;  // consumer warpgroup: 0 or 1
  const int64_t tiles, lead, row_tile, i0;
  const int n_tiles;
  const bool one_pass;

  // Warpgroup cw holds rows i0 + 64 cw .. + 63; this thread rows row[0] and row[0] + 8 (quad g
  // of its warp), keys 8n + 2t, + 1 of each 8-key group n of a tile.
  int tid, warp, lane, g, t;
  int64_t warp_row0;
  T* P;
  int plan_warp;
  float scale;
  const T* q_rows;  // this warpgroup's 64 rows of each column block
  // This warpgroup's P tiles in shared memory (kPBuffers, used in turn by the key tiles): two
  // 64-column blocks [64 rows][64] each, 128-byte swizzled as the P map's TMA store reads them;
  // pair (r, 8n + 2t) is at chunk (n % 8) ^ (r % 8).
  T* p_tile;
  int p_bar;  // named barrier of this warpgroup's 128 threads
  bool p_leader;
  bool fold;
  int turns, turn = 0;
  bool pairs_masked = true;  // kPlanned: whether the tile whose pairs load_mask took changes a logit
  int kt = 0;                // uses of the K ring so far (its stage and phase)
  float* col_buf;            // STATS: 2 x [4 warps][kBN] column sums
  float* col_out;            // STATS: this warpgroup's partial row of column sums

  // The arrays: each an object of its own (a local of consume(), forward_sm90_kernel.cuh),
  // referred to from here. Arrays indexed in loops that only unrolling makes constant keep the object they lie
  // in from being split into registers until then; as members they would hold every scalar
  // above in memory as long, and the optimiser would see another kernel.
  int64_t (&row)[2];
  bool (&row_ok)[2];
  T* (&p_row)[2];             // where this thread's rows of P go (STATS: window rows only)
  const char* (&m_row)[2];    // this thread's rows of the mask
  int (&cp)[3];               // the P map's coordinates of this head
  typename Mask::Raw (&mask_pairs)[kMaskGroups][2];  // the pairs of the tile load_mask took last
  // The softmax's: each row's max (the reference of the exponents) and sum, 1 / l, the running
  // max (one-pass statistics CTAs) and (STATS) Σ u (m − x) over this thread's elements.
  float (&m)[2];
  float (&l)[2];
  float (&inv_l)[2];
  float (&run_max)[2];
  float (&h)[2];
  uint32_t (&p_addr)[4];  // stmatrix row addresses (prepare_pass2)
  float (&o)[D / 2];

  SDPA_MATH_D Consumer(const CUtensorMap& tm_p_, const DevProblem& p_, const Args& a_, const StatsArgs& st_,
                       const Smem<T, D, STATS>& sm_, TraceState& tr_, int cw_, int64_t tiles_, int64_t lead_,
                       int64_t row_tile_, int64_t i0_, int n_tiles_, bool one_pass_, int64_t (&row_)[2],
                       bool (&row_ok_)[2], T* (&p_row_)[2], const char* (&m_row_)[2], int (&cp_)[3],
                       typename Mask::Raw (&mask_pairs_)[kMaskGroups][2], float (&m_)[2], float (&l_)[2],
                       float (&inv_l_)[2], float (&run_max_)[2], float (&h_)[2], uint32_t (&p_addr_)[4],
                       float (&o_)[D / 2]);

  // Steps (this file).
  SDPA_MATH_D bool tile_is_clean(int64_t j0) const;
  SDPA_MATH_D void turn_begin();
  SDPA_MATH_D void turn_end();
  SDPA_MATH_D void load_mask(int64_t j0);
  SDPA_MATH_D void issue_scores(float (&s)[kBN / 2], const T* k_tile);
  SDPA_MATH_D void scores(float (&s)[kBN / 2], int stage);
  SDPA_MATH_D void logits(float (&s)[kBN / 2], int64_t j0, bool clean, bool raw, bool masked);
  SDPA_MATH_D bool to_logits(float (&s)[kBN / 2], int64_t j0, bool clean, bool raw, int64_t next);
  // The passes (forward_sm90_mainloop.cuh).
  SDPA_MATH_D void pass1();
  SDPA_MATH_D void finish_rows();
  SDPA_MATH_D void prepare_pass2();
  SDPA_MATH_D void pass2_overlapped();
  SDPA_MATH_D void pass2();
  // P's way out and O (forward_sm90_p_store.cuh).
  SDPA_MATH_D void p_buffer_free();
  template <typename Keep>
  SDPA_MATH_D void p_to_smem(const float (&s)[kBN / 2], bool raw, float mul, int p_buf, Keep&& keep);
  template <int kW>
  SDPA_MATH_D void p_tile_copy(int p_buf, int64_t j0);
  SDPA_MATH_D void p_tile_copy_out(int p_buf, int64_t j0);
  SDPA_MATH_D void p_tile_out(int p_buf, int64_t j0);
  SDPA_MATH_D void store_o();
  SDPA_MATH_D void fill_tail();
  // The statistics kernel's (forward_sm90_stats.cuh).
  SDPA_MATH_D void stats_rescale(const float (&s)[kBN / 2], float mul);
  SDPA_MATH_D void stats_tile(const float (&s)[kBN / 2], int64_t j0, bool clean, float mul, int keys,
                              uint32_t (&u_frag)[kBN / 16][4], float (&col)[kBN / 4]);
  SDPA_MATH_D void stats_epilogue();
};

template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D Consumer<T, D, MASK, STATS, P_COPY>::Consumer(
    const CUtensorMap& tm_p_, const DevProblem& p_, const Args& a_, const StatsArgs& st_, const Smem<T, D, STATS>& sm_,
    TraceState& tr_, int cw_, int64_t tiles_, int64_t lead_, int64_t row_tile_, int64_t i0_, int n_tiles_,
    bool one_pass_, int64_t (&row_)[2], bool (&row_ok_)[2], T* (&p_row_)[2], const char* (&m_row_)[2], int (&cp_)[3],
    typename Consumer::Mask::Raw (&mask_pairs_)[Consumer::kMaskGroups][2], float (&m_)[2], float (&l_)[2],
    float (&inv_l_)[2], float (&run_max_)[2], float (&h_)[2], uint32_t (&p_addr_)[4], float (&o_)[D / 2])
    : tm_p(tm_p_), p(p_), a(a_), st(st_), sm(sm_), tr(tr_), cw(cw_), tiles(tiles_), lead(lead_), row_tile(row_tile_),
      i0(i0_), n_tiles(n_tiles_), one_pass(one_pass_), row(row_), row_ok(row_ok_), p_row(p_row_), m_row(m_row_),
      cp(cp_), mask_pairs(mask_pairs_), m(m_), l(l_), inv_l(inv_l_), run_max(run_max_), h(h_), p_addr(p_addr_),
      o(o_) {
  tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  row[0] = i0 + cw * 64 + warp * 16 + g;
  row[1] = i0 + cw * 64 + warp * 16 + g + 8;
  row_ok[0] = row[0] < p.L;
  row_ok[1] = row[1] < p.L;
  warp_row0 = i0 + cw * 64 + warp * 16;
  P = STATS ? nullptr : reinterpret_cast<T*>(p.probs.data) + lead_off(p, p.probs, lead);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (STATS) {
      const int64_t k = row[r] - st.win_first;
      if (row_ok[r] && k >= 0 && k % st.win_step == 0 && k / st.win_step < st.win_count)
        p_row[r] = reinterpret_cast<T*>(st.win.data) + lead_off(p, st.win, lead) + (k / st.win_step) * st.win.row;
    } else {
      p_row[r] = P + row[r] * p.probs.row;
    }
  }
  if constexpr (kMasked) {
    const int64_t esize = Mask::kBytes;
    const int64_t m_at = lead_off(p, p.mask, lead);
#pragma unroll
    for (int r = 0; r < 2; ++r) m_row[r] = p.mask.data + (m_at + (row_ok[r] ? row[r] : 0) * p.mask.row) * esize;
  }
  // Where this warp's bits of the mask plan start, as an offset from a.plan (which stays in the
  // parameter bank) kept in shared memory: the kernel is at its register limit, and two
  // registers more for the plan made it slower. Warps whose rows all lie past L take the last
  // group's bits (their logits are never used).
  plan_warp = cw * 4 + warp;
  if constexpr (kPlanned) {
    if (lane == 0) {
      const int64_t group = warp_row0 / 16 < a.plan_groups ? warp_row0 / 16 : a.plan_groups - 1;
      sm.plan_at[plan_warp] = static_cast<int>((plan_lead(p, lead) * a.plan_groups + group) * a.plan_words);
    }
    __syncwarp();
  }
  scale = kNatural ? a.scale : a.scale_log2;
  q_rows = sm.sQ + cw * 64 * 64;
  p_tile = sm.sP + cw * C::kPBuffers * 64 * kBN;
  p_bar = barrier_id(NamedBarrier::kWarpgroup0, cw);
  p_leader = tid == 0;
  map_coords(a.p, lead, cp);
  // Clean tiles with a positive scale skip the scaling: the scale folds into the max (max(s) ·
  // scale) and into the exponent's multiply-add (natural kernels: exponent_of). Natural units
  // fold only in the bf16 mask's forward: the statistics kernel keeps scaled logits (its pass 2
  // takes exp_from, not exponent_of), and the fp32 mask's head-128 forward spilled more with the
  // fold than without.
  fold = (!kNatural || (MASK == MaskKind::Same && !STATS)) && a.fold;
  // Ping-pong: the two warpgroups take turns to issue their products (NamedBarrier::kTurn0 + cw),
  // so one's softmax runs while the other's products occupy the tensor cores instead of both
  // drifting into lockstep on the same tiles. Warpgroup 0 goes first. Turns a CTA takes: pass 1
  // one a tile; pass 2 two a tile (S, then u V), or with kOverlap one a tile (S of this tile and
  // u V of the last) plus one for the last tile's u V.
  turns = kOverlap ? (n_tiles > 0 ? 2 * n_tiles + 1 : 0) : (one_pass ? 2 : 3) * n_tiles;
  if (cw == 1 && turns > 0) named_barrier_arrive(barrier_id(NamedBarrier::kTurn0, 0), 256);
}

// A tile needs index checks when it runs past the keys or crosses this warp's causal diagonal.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D bool Consumer<T, D, MASK, STATS, P_COPY>::tile_is_clean(int64_t j0) const {
  return j0 + kBN <= p.S && (!p.causal || j0 + kBN - 1 <= warp_row0);
}

template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::turn_begin() {
  named_barrier(barrier_id(NamedBarrier::kTurn0, cw), 256);
}
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::turn_end() {
  if (++turn < turns || cw == 0) named_barrier_arrive(barrier_id(NamedBarrier::kTurn0, 1 - cw), 256);  // none after the last
}

// The mask's pairs for this thread's elements of the tile at key j0 (rows unit-stride and
// pair-aligned: forward_declines). Rows past L read row 0's (their logits are never used), so a
// clean tile's pairs are all loaded. A tile's pairs are loaded as soon as the last tile's are
// used (to_logits), so they have that tile's softmax, the wait for K and the products to
// arrive: loaded after the products were issued, their wait was a third of the stalls of a
// forward with a (B, 1, L, S) mask. (A mask broadcast over rows loads the same pairs twice, from
// L1: copying row 0's instead makes each copy wait for its load, 16 waits a tile, much slower.)
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::load_mask(int64_t j0) {
  if constexpr (kMasked) {
    if constexpr (kPlanned) {  // a neutral tile's pairs are not loaded
      const int tile = static_cast<int>(j0 / kBN);
      pairs_masked = !((a.plan[sm.plan_at[plan_warp] + tile / 32] >> (tile % 32)) & 1u);
      if (!pairs_masked) return;
    }
    const int keys = static_cast<int>(p.S - j0 < kBN ? p.S - j0 : kBN);
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int jj = n * 8 + 2 * t;
        if (jj < keys)
          mask_pairs[n][r] = *reinterpret_cast<const typename Mask::Raw*>(m_row[r] + (j0 + jj) * Mask::kBytes);
      }
  }
}

// S = Q Kᵀ of the stage's keys into s: issued and committed, not waited for (inside a turn).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::issue_scores(float (&s)[kBN / 2], const T* k_tile) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int b = kk / 4, off = (kk % 4) * 16;
    Wgmma<T, kBN>::template ss<0, 0>(s, desc_sw128(q_rows + b * kBM * 64 + off, 16, 1024),
                                  desc_sw128(k_tile + b * kBN * 64 + off, 16, 1024), kk > 0);
  }
  wgmma_commit();
}

// S = Q Kᵀ for this warpgroup's rows and the stage's keys (raw dot products), in its turn.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::scores(float (&s)[kBN / 2], int stage) {
  fence_regs(s);
  turn_begin();
  FWD_STAMP(tr.pass2 ? trace::kP2Turn : trace::kP1Turn);
  issue_scores(s, sm.sK + stage * kBN * D);
  turn_end();
  wgmma_wait<0>();
  fence_regs(s);
  FWD_STAMP(tr.pass2 ? trace::kP2Done : trace::kP1Done);
}

// Scores to logits in place: scaled, masked, -inf where hidden (past S, causal, a false mask
// entry, a padding row). `clean` tiles skip the index checks (rows past L then get finite
// logits, which nothing reads: their P, O, lse and statistics are never stored); `raw` ones
// (clean, the scale folded) keep raw scores; `masked` false: the mask is left out (its pairs
// change no logit of the tile). A bool mask selects -inf in place of the raw score (one select
// an element, as an add would be; a select after the multiply cost a tenth of a masked
// forward); a tile a float mask changes is scaled.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::logits(float (&s)[kBN / 2], int64_t j0, bool clean, bool raw,
                                                             bool masked) {
  if (raw) {  // a bool mask's select alone
    if constexpr (MASK == MaskKind::Bool) {
      if (masked) {
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) s[4 * n + c] = Mask::apply(s[4 * n + c], mask_pairs[n][c >> 1], c & 1);
      }
    }
    return;
  }
  if (clean) {
    if (kMasked && masked) {
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[4 * n + c] = Mask::apply(s[4 * n + c] * scale, mask_pairs[n][c >> 1], c & 1);
    } else {
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) s[i] *= scale;
    }
    return;
  }
  // Keys visible to each row: columns < limit[r] of the tile.
  int limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int64_t lim = p.S - j0 < kBN ? p.S - j0 : kBN;
    if (p.causal && row[r] - j0 + 1 < lim) lim = row[r] - j0 + 1;
    limit[r] = row_ok[r] ? static_cast<int>(lim > 0 ? lim : 0) : 0;
  }
#pragma unroll
  for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = c >> 1, jj = n * 8 + 2 * t + (c & 1);
      float x = s[4 * n + c] * scale;
      if (kMasked && masked && jj < limit[r]) x = Mask::apply(x, mask_pairs[n][r], c & 1);
      s[4 * n + c] = jj < limit[r] ? x : kNegInf;
    }
}

// The same, the mask's part decided for the warp: a tile whose pairs leave every logit of the
// warp as it is (all keys visible, or all zero; the plan's bit, else the warp's vote on its
// pairs) is taken as unmasked, so 7 of 8 tiles of a padding mask on 1k keys skip the
// per-element work. Then the pairs of the tile at `next` are loaded (none when next < 0).
// Returns whether s was left raw (the scale still to apply).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D bool Consumer<T, D, MASK, STATS, P_COPY>::to_logits(float (&s)[kBN / 2], int64_t j0, bool clean, bool raw,
                                                                int64_t next) {
  bool masked = false;
  if constexpr (kPlanned) {
    masked = pairs_masked;
  } else if constexpr (kMasked) {
    typename Mask::Acc acc = Mask::kNeutralStart;
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) acc = Mask::fold_in(Mask::fold_in(acc, mask_pairs[n][0]), mask_pairs[n][1]);
    masked = !__all_sync(0xffffffffu, Mask::neutral(acc));
  }
  raw = raw && (MASK == MaskKind::None || MASK == MaskKind::Bool || !masked);  // float values add to scaled scores
  logits(s, j0, clean, raw, masked);
  if (next >= 0) load_mask(next);
  return raw;
}

}  // namespace sdpa_math::cuda::sm90::fwd
