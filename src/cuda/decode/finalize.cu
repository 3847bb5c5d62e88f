// The decode forward's second step (common.cuh describes the decode kernels): per row, the max
// and sum over the key blocks that forward.cu's first step left in the workspace, the
// log-sum-exp, O from the blocks' shares, and P = exp(s - m) / l from the kept logits.
// decode_finalize takes any row (a CTA per row and chunk of kFinalizeKeys keys);
// decode_finalize_rows takes short rows without dropout, a warp a row.
#include "common.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int kFinalizeThreads = 256;
constexpr int64_t kFinalizeKeys = 4096;  // keys of one row per finalize CTA

// Per row (and chunk of kFinalizeKeys keys): the row's max and sum over its blocks; P of the
// chunk's keys from the kept logits; on the first chunk also the log-sum-exp and O.
// The kernel is a chain of dependent L2 reads, so its steps issue their loads ahead of their
// use: a thread's logits of the chunk at once, before the row's max and sum; O's per-block shares
// split over groups of threads, each thread with kFinalizeBatch blocks' loads (statistic and
// share) in flight (one load at a time left GQA decode's finalize waiting on L2: bench/NOTES.md).
constexpr int kFinalizeBatch = 4;
static_assert(kFinalizeKeys % kFinalizeThreads == 0, "a chunk's keys are kFinalizeKeys / kFinalizeThreads a thread");
static_assert(kDecodeMaxHead <= kFinalizeThreads, "O's groups of threads cover Ev with one element a thread");
__global__ void __launch_bounds__(kFinalizeThreads) decode_finalize(DevProblem p, DecodeWorkspace w) {
  constexpr int kPerThread = static_cast<int>(kFinalizeKeys / kFinalizeThreads);
  __shared__ float red[kFinalizeThreads / 32][2];
  __shared__ float o_part[kFinalizeThreads];
  const int64_t row = blockIdx.x, local = row / p.L, lead = w.lead0 + local;
  const int r = static_cast<int>(row % p.L);
  const float* st = w.stats + row * w.blocks * 2;
  const float* s = w.scores + row * w.score_row;
  // This thread's logits of the chunk, loaded before the row's max and sum are known.
  // (No P wanted, forward_stats: one chunk a row, O and lse only; no key is stored.)
  const int64_t j0 = blockIdx.y * kFinalizeKeys + threadIdx.x, j_end = min(p.S, (blockIdx.y + 1) * kFinalizeKeys);
  float sv[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t j = j0 + i * kFinalizeThreads;
    sv[i] = j < j_end ? __ldg(s + j) : 0.0f;
  }
  float m = neg_inf<float>(), l = 0.0f;
  for (int64_t b = threadIdx.x; b < w.blocks; b += kFinalizeThreads) lse_combine<float>(m, l, __ldg(st + 2 * b), __ldg(st + 2 * b + 1));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    lse_combine<float>(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));
  if (threadIdx.x % 32 == 0) {
    red[threadIdx.x / 32][0] = m;
    red[threadIdx.x / 32][1] = l;
  }
  __syncthreads();
  m = neg_inf<float>(), l = 0.0f;
  for (int x = 0; x < kFinalizeThreads / 32; ++x) lse_combine<float>(m, l, red[x][0], red[x][1]);

  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t p_at = lead_off(p, p.probs, lead) + r * p.probs.row;
  const float inv_l = inv_row_sum(l);  // P = exp(s - m) * (1 / l): as decode_finalize_rows and decode_stats
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t j = j0 + i * kFinalizeThreads;
    if (j >= j_end || !p.probs.data) break;
    const float pr = returned_prob<float>(p, prob_from_max_inv_sum(sv[i], m, inv_l), keep_of<float>(p, d_at, lead, r, j));
    store_elem<float>(p.probs.dtype, p.probs.data, p_at + j * p.probs.col, pr);
  }
  if (blockIdx.y != 0) return;
  // Contract §6: lse -inf for a fully masked row, NaN for a NaN one; O zero, resp. NaN.
  if (threadIdx.x == 0)
    store_elem<float>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, lead) + r * p.lse.row, lse_from_max_sum<float>(m, l));
  // O: groups of `span` threads (span >= Ev, a power of two), group g summing blocks g, g + G, ...
  int span = kFinalizeThreads;
  while (span / 2 >= (p.Ev > 0 ? p.Ev : 1)) span /= 2;
  const int groups = kFinalizeThreads / span, g = threadIdx.x / span, e = threadIdx.x % span;
  const float* part = w.partial + row * w.blocks * p.Ev + e;
  float o = 0.0f;
  if (e < p.Ev) {
    for (int64_t b0 = g; b0 < w.blocks; b0 += kFinalizeBatch * groups) {
      float wt[kFinalizeBatch], pv[kFinalizeBatch];
#pragma unroll
      for (int u = 0; u < kFinalizeBatch; ++u) {
        const int64_t b = b0 + u * groups;
        wt[u] = b < w.blocks ? weight_to(__ldg(st + 2 * b), m) : 0.0f;
        pv[u] = b < w.blocks ? __ldg(part + b * p.Ev) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kFinalizeBatch; ++u) o += wt[u] * pv[u];
    }
  }
  o_part[threadIdx.x] = o;
  __syncthreads();
  if (g != 0 || e >= p.Ev) return;
  for (int x = 1; x < groups; ++x) o += o_part[x * span + e];
  const float f = output_factor<float>(p);
  const int64_t o_at = lead_off(p, p.out, lead) + r * p.out.row;
  store_elem<float>(p.out.dtype, p.out.data, o_at + e * p.out.col, l == 0.0f ? 0.0f : o / l * f);
}

// decode_finalize's job for short rows without dropout (decode_finalize_rows_apply): one warp a
// row. decode_finalize gives each row a CTA of 256 threads per 4096 keys, whose per-thread setup
// (the lead's offsets, the dtype and dropout branches) made it issue-bound on MHA decode
// (bench/NOTES.md). A warp a row has few warps in all (one a row), so what counts is the
// instructions each issues: every load of the row goes out at once, 16 bytes a lane (lane `lane`
// holds keys 4 lane + 128 i .. + 3, the statistics of block `lane`, and O's shares of dimensions
// 4 lane + 128 c .. + 3 of every block), P is exp(s - m) times 1 / l, stored 4 keys at a time
// where P's row allows.
constexpr int kRowWarps = 4;           // rows per CTA
constexpr int64_t kRowMaxKeys = 2048;  // longer rows keep decode_finalize's split over CTAs
constexpr int kRowVecs = static_cast<int>(kRowMaxKeys / 128);            // groups of 4 logits a lane
constexpr int kRowMaxBlocks = static_cast<int>(kRowMaxKeys / kSplitKeys);  // kSplitKeysTc is larger
constexpr int kRowDimVecs = (kDecodeMaxHead + 127) / 128;                // groups of 4 dimensions a lane
static_assert(kSplitKeysTc >= kSplitKeys && kRowMaxBlocks <= 32, "a row's blocks' statistics are one a lane");
template <typename T>
SDPA_MATH_D void store_probs4(T* at, int64_t col, bool vec, int valid, float4 pr) {
  if (vec && valid == 4) {
    if constexpr (std::is_same_v<T, float>) *reinterpret_cast<float4*>(at) = pr;
    else *reinterpret_cast<uint2*>(at) = make_uint2(pack2<T>(pr.x, pr.y), pack2<T>(pr.z, pr.w));
    return;
  }
  const float x[4] = {pr.x, pr.y, pr.z, pr.w};
  for (int u = 0; u < valid; ++u) {
    if constexpr (std::is_same_v<T, float>) at[u * col] = x[u];
    else at[u * col] = from_float<T>(x[u]);
  }
}
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32) decode_finalize_rows(DevProblem p, DecodeWorkspace w, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * int64_t{kRowWarps} + threadIdx.x / 32;
  if (row >= rows) return;
  const int S = static_cast<int>(p.S), nb = static_cast<int>(w.blocks), Ev = static_cast<int>(p.Ev);
  const float* st = w.stats + row * nb * 2;
  const float* sc = w.scores + row * w.score_row;  // 16-byte aligned
  const float* part = w.partial + row * nb * Ev;   // aligned: see decode_forward's workspace layout
  float4 sv[kRowVecs];
#pragma unroll
  for (int i = 0; i < kRowVecs; ++i) {
    const int j = 128 * i + 4 * lane;
    if (j + 3 < S) {
      sv[i] = __ldg(reinterpret_cast<const float4*>(sc + j));
    } else {  // the row's last keys (the padding of the row is never written)
      sv[i].x = j < S ? __ldg(sc + j) : 0.0f;
      sv[i].y = j + 1 < S ? __ldg(sc + j + 1) : 0.0f;
      sv[i].z = j + 2 < S ? __ldg(sc + j + 2) : 0.0f;
      sv[i].w = 0.0f;
    }
  }
  const float mb = lane < nb ? __ldg(st + 2 * lane) : neg_inf<float>(), lb = lane < nb ? __ldg(st + 2 * lane + 1) : 0.0f;
  float4 pv[kRowMaxBlocks][kRowDimVecs];
#pragma unroll
  for (int b = 0; b < kRowMaxBlocks; ++b)
#pragma unroll
    for (int c = 0; c < kRowDimVecs; ++c) {
      const int e = 128 * c + 4 * lane;
      pv[b][c] = b < nb && e < Ev ? __ldg(reinterpret_cast<const float4*>(part + b * Ev + e)) : make_float4(0, 0, 0, 0);
    }
  float m = mb, l = lb;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    lse_combine<float>(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));
  const int64_t lead = w.lead0 + row / p.L;
  const int r = static_cast<int>(row % p.L);
  T* probs = p.probs.data ? reinterpret_cast<T*>(p.probs.data) + lead_off_narrow(p, p.probs, lead) + r * p.probs.row
                         : nullptr;  // forward_stats: O and lse only
  const int64_t col = p.probs.col;
  const bool vec = col == 1 && reinterpret_cast<uintptr_t>(probs) % (4 * sizeof(T)) == 0;
  const float inv_l = inv_row_sum(l);
#pragma unroll
  for (int i = 0; i < kRowVecs; ++i) {
    const int j = 128 * i + 4 * lane;
    if (probs && j < S) {
      const float4 pr = make_float4(prob_from_max_inv_sum(sv[i].x, m, inv_l), prob_from_max_inv_sum(sv[i].y, m, inv_l),
                                    prob_from_max_inv_sum(sv[i].z, m, inv_l), prob_from_max_inv_sum(sv[i].w, m, inv_l));
      store_probs4<T>(probs + j * col, col, vec, min(4, S - j), pr);
    }
  }
  // O = sum_b exp(m_b - m) share_b / l; contract §6: lse -inf for a fully masked row, NaN for a
  // NaN one; O zero, resp. NaN.
  const float wb = weight_to(mb, m);
  float4 acc[kRowDimVecs] = {};
#pragma unroll
  for (int b = 0; b < kRowMaxBlocks; ++b) {
    const float wt = b < nb ? __shfl_sync(0xffffffffu, wb, b) : 0.0f;
#pragma unroll
    for (int c = 0; c < kRowDimVecs; ++c)
      acc[c] = make_float4(acc[c].x + wt * pv[b][c].x, acc[c].y + wt * pv[b][c].y, acc[c].z + wt * pv[b][c].z,
                           acc[c].w + wt * pv[b][c].w);
  }
  const int64_t o_at = lead_off_narrow(p, p.out, lead) + r * p.out.row;
#pragma unroll
  for (int c = 0; c < kRowDimVecs; ++c) {
    const int e = 128 * c + 4 * lane;
    if (e < Ev) {
      const float x[4] = {acc[c].x, acc[c].y, acc[c].z, acc[c].w};
#pragma unroll
      for (int u = 0; u < 4; ++u)
        store_elem<float>(p.out.dtype, p.out.data, o_at + (e + u) * p.out.col, l == 0.0f ? 0.0f : x[u] / l);
    }
  }
  if (lane == 0) store_elem<float>(p.lse.dtype, p.lse.data, lead_off_narrow(p, p.lse, lead) + r * p.lse.row, lse_from_max_sum<float>(m, l));
}
bool decode_finalize_rows_apply(const DevProblem& p) {
  return p.dropout == Dropout::None && p.S <= kRowMaxKeys && (!p.probs.data || p.probs.dtype == p.q.dtype);
}

}  // namespace

DecodeFinalizePlan decode_finalize_plan(const DevProblem& p, int64_t chunk) {
  const int64_t p_chunks = p.probs.data ? (p.S + kFinalizeKeys - 1) / kFinalizeKeys : 1;
  DecodeFinalizePlan plan;
  plan.finalize_grid = dim3(grid_x(chunk * p.L, "decode rows"), grid_yz(p_chunks, "decode rows"));
  plan.rows_grid = grid_x((chunk * p.L + kRowWarps - 1) / kRowWarps, "decode rows");
  return plan;
}

void decode_finalize_launch(const DevProblem& p, const DecodeFinalizePlan& plan, float* workspace, int64_t lead0,
                            int64_t chunk, cudaStream_t stream) {
  const DecodeWorkspace w = chunk_workspace(p, workspace, lead0, chunk);
  if (decode_finalize_rows_apply(p)) {
    auto rows = [&](auto kernel) { kernel<<<plan.rows_grid, kRowWarps * 32, 0, stream>>>(p, w, chunk * p.L); };
    switch (p.q.dtype) {
      case DType::Float16: rows(decode_finalize_rows<__half>); break;
      case DType::BFloat16: rows(decode_finalize_rows<__nv_bfloat16>); break;
      default: rows(decode_finalize_rows<float>); break;
    }
  } else {
    decode_finalize<<<plan.finalize_grid, kFinalizeThreads, 0, stream>>>(p, w);
  }
  check_launch("decode rows");
}

}  // namespace sdpa_math::cuda
