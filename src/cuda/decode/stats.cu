// The decode statistics (common.cuh describes the decode kernels): forward_stats's column sums,
// row entropy and window rows of P for up to kDecodeMaxRows query rows, from the logits and
// block statistics that the decode forward's first step (forward.cu) kept in the workspace,
// after its second step (finalize.cu) has written O and lse; P itself is not written.
#include "common.cuh"

namespace sdpa_math::cuda {
namespace {

// forward_stats's statistics for decode (StatsTargets, attention.h's definitions), after the
// finalize has written O and lse (P not written). A CTA takes kStatsKeys keys of every row of one
// head (the column sums add over the head's L rows: a CTA holds them all, so no atomics), forms
// P from the kept logits as decode_finalize_rows forms it, exp(s - m) * (1 / l), and reduces it:
//   col_sum_j = sum_r P_rj, stored 16 bytes at a time where the output allows;
//   entropy_r = -sum_j P log P = log l + sum_j P_rj (m - s_rj), every term >= 0 (the Hopper
//     statistics kernel's form); 0 for a fully masked row (l = 0), NaN for a NaN row. A row of
//     several CTAs leaves each CTA's sum in w.ent_part, which decode_entropy adds up in order
//     (deterministic, as the column sums);
//   the window's rows of P, stored as they are formed.
// The logits are in natural units (decode_partial_tc stores them so too). Every load of a thread
// goes out before the rows' max and sum are known; small CTAs (128 threads) so that a whole MHA
// decode (1024 heads) is resident at once (the first form, a CTA of 256 threads a head with the
// loads after the statistics, measured slower: bench/NOTES.md).
constexpr int kStatsThreads = 128;
constexpr int kStatsVecs = static_cast<int>(kStatsKeys / (4 * kStatsThreads));  // groups of 4 keys a thread
template <int R>  // rows a head at most: 1 (MHA decode: a quarter of the registers) or kDecodeMaxRows
__global__ void __launch_bounds__(kStatsThreads) decode_stats(DevProblem p, DecodeWorkspace w, StatsTargets t) {
  constexpr int kStatsWarps = kStatsThreads / 32;
  __shared__ float red[kStatsWarps][R][2];
  __shared__ float row_m[R], row_l[R];
  const int L = static_cast<int>(p.L), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t local = blockIdx.x, lead = w.lead0 + local, S = p.S;
  const int64_t k0 = blockIdx.y * kStatsKeys;
  // This thread's logits: keys k0 + 4 (threadIdx.x + i kStatsThreads) .. + 3 of each row.
  float4 sv[kStatsVecs][R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float* sc = w.scores + (local * L + (r < L ? r : 0)) * w.score_row;  // 16-byte aligned rows
#pragma unroll
    for (int i = 0; i < kStatsVecs; ++i) {
      const int64_t j = k0 + 4 * (threadIdx.x + i * kStatsThreads);
      if (r < L && j + 3 < S) {
        sv[i][r] = __ldg(reinterpret_cast<const float4*>(sc + j));
      } else {  // the row's last keys (its padding is never written), and rows past L
        sv[i][r].x = r < L && j < S ? __ldg(sc + j) : 0.0f;
        sv[i][r].y = r < L && j + 1 < S ? __ldg(sc + j + 1) : 0.0f;
        sv[i][r].z = r < L && j + 2 < S ? __ldg(sc + j + 2) : 0.0f;
        sv[i][r].w = 0.0f;
      }
    }
  }
  // Each row's max and sum over its blocks.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= L) break;
    const float* st = w.stats + (local * L + r) * w.blocks * 2;
    float m = neg_inf<float>(), l = 0.0f;
    for (int64_t b = threadIdx.x; b < w.blocks; b += kStatsThreads) lse_combine<float>(m, l, __ldg(st + 2 * b), __ldg(st + 2 * b + 1));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      lse_combine<float>(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));
    if (lane == 0) red[warp][r][0] = m, red[warp][r][1] = l;
  }
  __syncthreads();
  if (threadIdx.x < L) {
    float m = neg_inf<float>(), l = 0.0f;
    for (int x = 0; x < kStatsWarps; ++x) lse_combine<float>(m, l, red[x][threadIdx.x][0], red[x][threadIdx.x][1]);
    row_m[threadIdx.x] = m, row_l[threadIdx.x] = l;
  }
  __syncthreads();
  float m[R], inv_l[R], ent[R];
  int64_t win_at[R];  // the row's offset in the window, -1 outside it
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = r < L ? row_m[r] : 0.0f;
    inv_l[r] = r < L ? inv_row_sum(row_l[r]) : 0.0f;
    ent[r] = 0.0f;
    const int64_t k = r - t.rows_first;
    win_at[r] = t.rows.data && r < L && k >= 0 && k % t.rows_step == 0 && k / t.rows_step < t.rows_count
                    ? lead_off(p, t.rows, lead) + k / t.rows_step * t.rows.row
                    : -1;
  }
  float* cols = t.col_sum.data ? reinterpret_cast<float*>(t.col_sum.data) + lead_off(p, t.col_sum, lead) : nullptr;
#pragma unroll
  for (int i = 0; i < kStatsVecs; ++i) {
    const int64_t j = k0 + 4 * (threadIdx.x + i * kStatsThreads);
    if (j >= S) break;
    const int valid = S - j < 4 ? static_cast<int>(S - j) : 4;
    float4 col = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= L) break;
      const float4 x = sv[i][r];
      const float4 pr = make_float4(prob_from_max_inv_sum(x.x, m[r], inv_l[r]), prob_from_max_inv_sum(x.y, m[r], inv_l[r]),
                                    prob_from_max_inv_sum(x.z, m[r], inv_l[r]), prob_from_max_inv_sum(x.w, m[r], inv_l[r]));
      col = make_float4(col.x + pr.x, col.y + pr.y, col.z + pr.z, col.w + pr.w);
      // A hidden key (x = -inf, P = 0) adds 0, not 0 * inf; keys past S have P = exp(0 - m) / l
      // and are left out.
      auto term = [&](float q, float xv, bool in) { return in && q != 0.0f ? q * (m[r] - xv) : 0.0f; };
      ent[r] += term(pr.x, x.x, true) + term(pr.y, x.y, valid > 1) + term(pr.z, x.z, valid > 2) + term(pr.w, x.w, valid > 3);
      if (win_at[r] >= 0) {
        const float pv[4] = {pr.x, pr.y, pr.z, pr.w};
        for (int u = 0; u < valid; ++u) store_elem<float>(t.rows.dtype, t.rows.data, win_at[r] + (j + u) * t.rows.col, pv[u]);
      }
    }
    if (cols) {
      float* at = cols + j * t.col_sum.row;
      if (valid == 4 && t.col_sum.row == 1 && reinterpret_cast<uintptr_t>(at) % 16 == 0) {
        *reinterpret_cast<float4*>(at) = col;
      } else {
        const float cv[4] = {col.x, col.y, col.z, col.w};
        for (int u = 0; u < valid; ++u) at[u * t.col_sum.row] = cv[u];
      }
    }
  }
  if (!t.entropy.data) return;
  __syncthreads();  // red is reused
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= L) break;
    float e = ent[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) e += __shfl_xor_sync(0xffffffffu, e, o);
    if (lane == 0) red[warp][r][0] = e;
  }
  __syncthreads();
  if (threadIdx.x < L) {
    float e = 0.0f;
    for (int x = 0; x < kStatsWarps; ++x) e += red[x][threadIdx.x][0];
    const float l = row_l[threadIdx.x];
    if (gridDim.y == 1) {
      const float entropy = l > 0.0f ? logf(l) + e : l == 0.0f ? 0.0f : l;  // l NaN: a NaN row
      reinterpret_cast<float*>(t.entropy.data)[lead_off(p, t.entropy, lead) + threadIdx.x * t.entropy.row] = entropy;
    } else {  // the row's chunk sums, then its l at the end: decode_entropy adds them up
      float* part = w.ent_part + (local * L + threadIdx.x) * (gridDim.y + 1);
      part[blockIdx.y] = e;
      if (blockIdx.y == 0) part[gridDim.y] = l;
    }
  }
}

// The entropy of rows that decode_stats split over several CTAs: a thread a row.
__global__ void decode_entropy(DevProblem p, DecodeWorkspace w, StatsTargets t, int64_t rows, int chunks) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const float* part = w.ent_part + row * (chunks + 1);
  float e = 0.0f;
  for (int c = 0; c < chunks; ++c) e += part[c];
  const float l = part[chunks];
  const float entropy = l > 0.0f ? logf(l) + e : l == 0.0f ? 0.0f : l;
  const int64_t lead = w.lead0 + row / p.L, r = row % p.L;
  reinterpret_cast<float*>(t.entropy.data)[lead_off(p, t.entropy, lead) + r * t.entropy.row] = entropy;
}

}  // namespace

const char* decode_stats_declines(const DevProblem& p, const StatsTargets& t) {
  if (const char* why = decode_declines(p)) return why;
  if ((t.col_sum.data && t.col_sum.dtype != DType::Float32) || (t.entropy.data && t.entropy.dtype != DType::Float32))
    return "statistics not float32";
  if (p.dropout != Dropout::None) return "dropout";
  if ((p.S + kStatsKeys - 1) / kStatsKeys > 65535) return "more than 65,535 chunks of 2048 keys";
  return nullptr;
}

DecodeStatsPlan decode_stats_plan(const DevProblem& p, int64_t chunk, const StatsTargets* stats) {
  // decode_stats_declines keeps the key chunks within the grid's second dimension.
  DecodeStatsPlan plan;
  plan.any = stats && (stats->col_sum.data || stats->entropy.data || stats->rows.data);
  plan.chunks = static_cast<int>((p.S + kStatsKeys - 1) / kStatsKeys);
  plan.grid = plan.any ? dim3(grid_x(chunk, "decode statistics"), grid_yz(plan.chunks, "decode statistics")) : dim3(1);
  plan.entropy_grid = plan.any ? grid_x((chunk * p.L + 127) / 128, "decode statistics") : 1;
  return plan;
}

void decode_stats_launch(const DevProblem& p, const DecodeStatsPlan& plan, const StatsTargets& stats, float* workspace,
                         int64_t lead0, int64_t chunk, cudaStream_t stream) {
  const DecodeWorkspace w = chunk_workspace(p, workspace, lead0, chunk);
  if (p.L == 1) decode_stats<1><<<plan.grid, kStatsThreads, 0, stream>>>(p, w, stats);
  else decode_stats<kDecodeMaxRows><<<plan.grid, kStatsThreads, 0, stream>>>(p, w, stats);
  if (stats.entropy.data && plan.chunks > 1)
    decode_entropy<<<plan.entropy_grid, 128, 0, stream>>>(p, w, stats, chunk * p.L, plan.chunks);
  check_launch("decode statistics");
}

}  // namespace sdpa_math::cuda
