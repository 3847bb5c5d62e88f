// The Hopper forward's statistics form (STATS): P is not written, except the rows of a window;
// pass 2 reduces it instead to each row's entropy and the warpgroup's column sums. Here: which
// CTAs run one pass, the one-pass rescale, a tile's reduction, the column sums' reduce-scatter
// and the entropy epilogue.
#pragma once

#include "forward_sm90_consumer.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// Whether a statistics CTA (rows i0 ..) runs one pass over the keys instead of two: none of its
// rows needs P normalised as it goes (no column sums asked, no row of the window), so the max
// and sum grow online, and O and the entropy's sum are rescaled as the max grows (flash
// attention's way).
SDPA_MATH_D bool stats_one_pass(const DevProblem& p, const StatsArgs& st, int64_t i0) {
  bool window_rows = false;
  if (st.win_count > 0) {
    const int64_t rows_end = i0 + kBM < p.L ? i0 + kBM : p.L;
    const int64_t k = i0 <= st.win_first ? 0 : (i0 - st.win_first + st.win_step - 1) / st.win_step;
    window_rows = k < st.win_count && st.win_first + k * st.win_step < rows_end;
  }
  return st.col_part == nullptr && !window_rows;
}

// The warpgroup's 64 rows of P summed per key of the tile at j0. This thread holds its two
// rows' sums at keys 8n + 2t (+1) in col[2n] (col[2n + 1]); a reduce-scatter over the warp's
// eight row groups (lanes xor 16, 8, 4) leaves each lane four keys' sums over the warp's 16 rows,
// the four warps meet in shared memory (buf: [4][kBN]), and thread k adds key k's four partials
// in a fixed order and writes them to out[k] (k < keys). No atomics: the same sums every run.
SDPA_MATH_D void column_sums(float (&col)[kBN / 4], float* buf, int warp, int lane, int tid, int bar, float* out,
                             int64_t keys) {
  static_assert(kBN == 128, "the reduce-scatter below halves 32 values three times");
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const bool hi = lane & 16;
    const float keep = hi ? col[i + 16] : col[i], give = hi ? col[i] : col[i + 16];
    col[i] = keep + __shfl_xor_sync(0xffffffffu, give, 16);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const bool hi = lane & 8;
    const float keep = hi ? col[i + 8] : col[i], give = hi ? col[i] : col[i + 8];
    col[i] = keep + __shfl_xor_sync(0xffffffffu, give, 8);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool hi = lane & 4;
    const float keep = hi ? col[i + 4] : col[i], give = hi ? col[i] : col[i + 4];
    col[i] = keep + __shfl_xor_sync(0xffffffffu, give, 4);
  }
  // Lane (g, t) now holds keys 16g + 2t (+1) in col[0] (col[1]) and 16g + 8 + 2t (+1) in col[2] (col[3]).
  const int g = lane >> 2, t = lane & 3;
  float* mine = buf + warp * kBN + 16 * g + 2 * t;
  *reinterpret_cast<float2*>(mine) = make_float2(col[0], col[1]);
  *reinterpret_cast<float2*>(mine + 8) = make_float2(col[2], col[3]);
  named_barrier(bar, 128);
  if (tid < keys) out[tid] = (buf[tid] + buf[kBN + tid]) + (buf[2 * kBN + tid] + buf[3 * kBN + tid]);
}

// A one-pass CTA's step to the tile's max: l, h (Σ u (m − x)) and O move from the old reference
// to the new, times a = exp(m_old − m_new), and h also gains (m_new − m_old) l_old. A row that
// had seen no visible key has l = h = O = 0 (a = 0: exp of an old reference of 0 against a very
// negative new max would overflow). Where a underflows to 0, h is 0 too, not
// 0 · (m_new − m_old) l: after a tile held at a float mask's finfo.min, m_new − m_old is near
// FLT_MAX and times l it is inf.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::stats_rescale(const float (&s)[kBN / 2], float mul) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float new_max = max_nan(run_max[r], quad_max_nan(row_max(s, r)) * mul);
    const float ref = new_max == kNegInf ? 0.0f : new_max;
    const float a_r = run_max[r] == kNegInf ? 0.0f : exp_from<kNatural>(m[r], 1.0f, ref);
    h[r] = a_r == 0.0f ? 0.0f : fmaf(a_r * l[r], ref - m[r], a_r * h[r]);  // NaN a: NaN
    l[r] *= a_r;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[4 * n + 2 * r] *= a_r;
      o[4 * n + 2 * r + 1] *= a_r;
    }
    m[r] = ref;
    run_max[r] = new_max;
  }
}

// A tile's u = exp(x − m) into the A fragments of u V, the window's rows of P, and this thread's
// share of the column sums (col) and of the entropy's Σ u (m − x) (h).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::stats_tile(const float (&s)[kBN / 2], int64_t j0, bool clean,
                                                                 float mul, int keys, uint32_t (&u_frag)[kBN / 16][4],
                                                                 float (&col)[kBN / 4]) {
#pragma unroll
  for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float u0 = exp_from<kNatural>(s[4 * n + 2 * r], mul, m[r]);
      const float u1 = exp_from<kNatural>(s[4 * n + 2 * r + 1], mul, m[r]);
      u_frag[n / 2][(n & 1) * 2 + r] = pack2<T>(u0, u1);
      const int jj = n * 8 + 2 * t;  // the window's rows are pair-aligned (stats_declines): pairs never straddle S
      if (p_row[r] != nullptr && (clean || jj < keys))
        *reinterpret_cast<uint32_t*>(p_row[r] + j0 + jj) = pack2<T>(u0 * inv_l[r], u1 * inv_l[r]);
      // P for the column sums: rows past L count 0 (clean tiles do not mask them; their
      // zero-filled queries give a uniform row, or NaN next to an infinite key, so a select, not
      // a product with 0); inv_l is 0 for a fully masked row. And u (m − x) for the entropy: 0
      // where u = 0 (hidden keys: x = -inf).
      const float p0 = row_ok[r] ? u0 * inv_l[r] : 0.0f, p1 = row_ok[r] ? u1 * inv_l[r] : 0.0f;
      if (one_pass) l[r] += u0 + u1;
      col[2 * n] = r ? col[2 * n] + p0 : p0;
      col[2 * n + 1] = r ? col[2 * n + 1] + p1 : p1;
      if (st.ent.data != nullptr) {
        const float d0 = fminf(fmaf(-s[4 * n + 2 * r], mul, m[r]), 1e30f);
        const float d1 = fminf(fmaf(-s[4 * n + 2 * r + 1], mul, m[r]), 1e30f);
        h[r] = fmaf(u1, d1, fmaf(u0, d0, h[r]));
      }
    }
}

// Entropy log l + Σ P (m − x) in natural units (kernels in base-2 units count x and m in base 2);
// 0 for a fully masked row, NaN for a NaN row (its l). The window's rows of P right of the CTA's
// last tile, and the slot's NaN flag for the column sums.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::stats_epilogue() {
  const int64_t z0 = static_cast<int64_t>(n_tiles) * kBN;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float total = quad_sum(l[r]), sum_h = quad_sum(h[r]);
    if (st.ent.data != nullptr && t == 0 && row_ok[r]) {
      const float ent = total > 0.0f ? logf(total) + (kNatural ? sum_h : sum_h * 0.6931471805599453f) / total
                        : total == 0.0f ? 0.0f
                                        : total;
      reinterpret_cast<float*>(st.ent.data)[lead_off(p, st.ent, lead) + row[r] * st.ent.row] = ent;
    }
    // Keys right of the CTA's last tile (causal): hidden from the row; NaN in a NaN row.
    if (p_row[r] != nullptr)
      for (int64_t c = z0 + t; c < p.S; c += 4) p_row[r][c] = from_float<T>(total != total ? total : 0.0f);
    if (st.col_part != nullptr && __any_sync(0xffffffffu, row_ok[r] && total != total) && lane == 0)
      st.col_nan[(lead - a.lead0) * 2 * tiles + 2 * row_tile + cw] = NAN;
  }
}

}  // namespace sdpa_math::cuda::sm90::fwd
