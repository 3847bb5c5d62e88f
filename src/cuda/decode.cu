// The forward for a few query rows (decode: L <= kDecodeMaxRows), fp16, bf16 and fp32 inputs
// with fp32 arithmetic. A tile kernel would give one CTA per head and waste all but L of its 64
// rows; here the keys of each head are split into blocks of kSplitKeys and every (head, block)
// is a CTA, so the chip fills however few heads there are. The time is reading K and V:
//   1) decode_stats: per (head, block) and row, the block's max and sum of exp (reads K);
//   2) decode_probs: per (head, block), the row's max and sum from all blocks' stats, then
//      P = exp(s - m) / l written once (K read again: it is never kept, so the extra memory stays
//      a few KB of stats plus an fp32 O), and the block's share of O = sum_j P_j V_j added
//      atomically to the fp32 O;
//   3) decode_output: O rounded to its dtype (times c for an explicit dropout mask).
// decode_backward (fp16/bf16) reads each K and V row once per key block likewise.
// Rows of K and V are read 16 bytes per lane, a key row split over LPK lanes, so a warp covers
// 32 / LPK keys per load and issues the loads of several steps together; on the H200 these
// kernels reach about half the DRAM bandwidth (bench/NOTES.md, step 13). Every contract rule
// (mask, causal, dropout, fully masked rows) comes from device_problem.cuh.
#include <type_traits>

#include "decode.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMinBlocksPerSM = 4;  // at most 128 registers: 16 warps per SM
constexpr int kSplitKeys = 256;
constexpr int kUnroll = 4;          // warp steps whose loads are issued together

// How DT head elements of T are spread over a warp: 16-byte chunks of EPL elements, LPK lanes
// per key row holding CH chunks each, KPW key rows per warp step.
template <typename T, int DT>
struct Layout {
  static constexpr int EPL = 16 / static_cast<int>(sizeof(T));
  static constexpr int CHUNKS = DT / EPL;
  static constexpr int LPK = CHUNKS < 32 ? CHUNKS : 32;
  static constexpr int CH = CHUNKS / LPK;
  static constexpr int KPW = 32 / LPK;
};

struct DecodeBuffers {
  float* stats;    // [lead][row][block][2]: the block's max and sum of exp
  float* out;      // [lead][row][Ev]: O in fp32, accumulated over blocks
  int64_t blocks;  // key blocks per head
};

template <typename T>
SDPA_MATH_D void unpack16(const uint4& raw, float (&x)[16 / sizeof(T)]) {
  if constexpr (std::is_same_v<T, float>) {
    x[0] = __uint_as_float(raw.x), x[1] = __uint_as_float(raw.y), x[2] = __uint_as_float(raw.z), x[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      T lo, hi;
      const uint16_t bl = static_cast<uint16_t>(w[i] & 0xffffu), bh = static_cast<uint16_t>(w[i] >> 16);
      memcpy(&lo, &bl, 2);
      memcpy(&hi, &bh, 2);
      x[2 * i] = to_float<T>(lo);
      x[2 * i + 1] = to_float<T>(hi);
    }
  }
}

// This lane's 16-byte chunks of the rows it reads in U warp steps from row j0: row
// j0 + u * KPW + lane / LPK of operand op (lead offset `at`), zero past `width` and for rows at
// or past j_end (or all rows when !wanted).
template <typename T, int DT, int U>
SDPA_MATH_D void load_rows(const DevOperand& op, int64_t at, int64_t j0, int64_t j_end, int64_t width, int lane,
                           bool wanted, uint4 (&raw)[U][Layout<T, DT>::CH]) {
  using Lay = Layout<T, DT>;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  const T* row0 = reinterpret_cast<const T*>(op.data) + at + (j0 + kofs) * op.row;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool row_ok = wanted && j0 + u * Lay::KPW + kofs < j_end;
#pragma unroll
    for (int c = 0; c < Lay::CH; ++c) {
      const int64_t e0 = static_cast<int64_t>(sub + c * Lay::LPK) * Lay::EPL;
      raw[u][c] = row_ok && e0 < width ? __ldg(reinterpret_cast<const uint4*>(row0 + u * Lay::KPW * op.row + e0))
                                       : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The query rows of this head in shared memory as fp32 (rows x DT, zero past E).
template <int DT>
SDPA_MATH_D void load_queries(const DevProblem& p, int64_t lead, float* q) {
  const int64_t q_at = lead_off(p, p.q, lead);
  for (int64_t n = threadIdx.x; n < p.L * DT; n += kThreads) {
    const int64_t r = n / DT, e = n % DT;
    q[n] = e < p.E ? load_elem<float>(p.q.dtype, p.q.data, q_at + r * p.q.row + e * p.q.col) : 0.0f;
  }
}

// The masked logits of the keys this lane's group reads in kUnroll warp steps from j0: key
// j0 + u * KPW + (lane / LPK). Every lane of a group gets its key's sums; rows past L and keys
// past j_end give -inf.
template <typename T, int DT>
SDPA_MATH_D void key_logits(const DevProblem& p, const float* q, int64_t k_at, int64_t m_at, int64_t j0,
                            int64_t j_end, int lane, float (&s)[kUnroll][kDecodeMaxRows]) {
  using Lay = Layout<T, DT>;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  uint4 raw[kUnroll][Lay::CH];
  load_rows<T, DT, kUnroll>(p.k, k_at, j0, j_end, p.E, lane, true, raw);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int r = 0; r < kDecodeMaxRows; ++r) s[u][r] = neg_inf<float>();
  // Rows past L are skipped (L is the same for the whole warp): decode's one row costs one pass.
#pragma unroll
  for (int r = 0; r < kDecodeMaxRows; ++r) {
    if (r >= p.L) break;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float acc = 0.0f;
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) {
        float x[Lay::EPL];
        unpack16<T>(raw[u][c], x);
        const float* qr = q + r * DT + (sub + c * Lay::LPK) * Lay::EPL;
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) acc += qr[i] * x[i];
      }
#pragma unroll
      for (int o = Lay::LPK / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      const int64_t j = j0 + u * Lay::KPW + kofs;
      if (j < j_end) s[u][r] = masked_logit<float>(p, acc, m_at, r, j);
    }
  }
}

template <typename T, int DT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) decode_stats(DevProblem p, DecodeBuffers b) {
  using Lay = Layout<T, DT>;
  extern __shared__ float smem[];
  float* q = smem;              // L x DT
  float* part = q + p.L * DT;   // warps x kDecodeMaxRows x 2
  const int64_t lead = blockIdx.x / b.blocks, blk = blockIdx.x % b.blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_queries<DT>(p, lead, q);
  __syncthreads();
  const int64_t k_at = lead_off(p, p.k, lead), m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t j_end = min(p.S, (blk + 1) * kSplitKeys);
  constexpr int kStep = kUnroll * Lay::KPW;  // keys per warp step
  float m[kDecodeMaxRows], l[kDecodeMaxRows];
#pragma unroll
  for (int r = 0; r < kDecodeMaxRows; ++r) {
    m[r] = neg_inf<float>();
    l[r] = 0.0f;
  }
  for (int64_t j0 = blk * kSplitKeys + warp * kStep; j0 < j_end; j0 += kWarps * kStep) {
    float s[kUnroll][kDecodeMaxRows];
    key_logits<T, DT>(p, q, k_at, m_at, j0, j_end, lane, s);
    if (lane % Lay::LPK == 0)  // one lane per key adds it
#pragma unroll
      for (int r = 0; r < kDecodeMaxRows; ++r) {
        if (r >= p.L) break;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) lse_combine<float>(m[r], l[r], s[u][r], 1.0f);
      }
  }
  // Over the warp's key groups, then over warps.
#pragma unroll
  for (int r = 0; r < kDecodeMaxRows; ++r) {
    if (r >= p.L) break;
#pragma unroll
    for (int o = 16; o >= Lay::LPK; o >>= 1)
      lse_combine<float>(m[r], l[r], __shfl_xor_sync(0xffffffffu, m[r], o), __shfl_xor_sync(0xffffffffu, l[r], o));
    if (lane == 0) {
      part[(warp * kDecodeMaxRows + r) * 2] = m[r];
      part[(warp * kDecodeMaxRows + r) * 2 + 1] = l[r];
    }
  }
  __syncthreads();
  if (threadIdx.x < p.L) {
    const int r = threadIdx.x;
    float mm = neg_inf<float>(), ll = 0.0f;
    for (int w = 0; w < kWarps; ++w) lse_combine<float>(mm, ll, part[(w * kDecodeMaxRows + r) * 2], part[(w * kDecodeMaxRows + r) * 2 + 1]);
    float* st = b.stats + ((lead * p.L + r) * b.blocks + blk) * 2;
    st[0] = mm;
    st[1] = ll;
  }
}

template <typename T, int DT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) decode_probs(DevProblem p, DecodeBuffers b) {
  using Lay = Layout<T, DT>;
  extern __shared__ float smem[];
  float* q = smem;                            // L x DT
  float* w = q + p.L * DT;                    // L x kSplitKeys: the returned P of this block
  float* row_max = w + p.L * kSplitKeys;      // kDecodeMaxRows
  float* row_sum = row_max + kDecodeMaxRows;  // kDecodeMaxRows
  float* part = row_sum + kDecodeMaxRows;     // warps x DT (one row at a time)
  const int64_t lead = blockIdx.x / b.blocks, blk = blockIdx.x % b.blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  load_queries<DT>(p, lead, q);
  if (threadIdx.x < p.L) {
    const int r = threadIdx.x;
    float mm = neg_inf<float>(), ll = 0.0f;
    const float* st = b.stats + (lead * p.L + r) * b.blocks * 2;
    for (int64_t c = 0; c < b.blocks; ++c) lse_combine<float>(mm, ll, st[2 * c], st[2 * c + 1]);
    row_max[r] = mm;
    row_sum[r] = ll;
    // The log-sum-exp, once per row (contract §6: -inf for a fully masked row, NaN for a NaN one).
    if (blk == 0)
      store_elem<float>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, lead) + r * p.lse.row, lse_from_max_sum<float>(mm, ll));
  }
  __syncthreads();

  // P of this block's keys from the row's max and sum: written once, and kept for O.
  const int64_t k_at = lead_off(p, p.k, lead), v_at = lead_off(p, p.v, lead);
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t p_at = lead_off(p, p.probs, lead);
  const int64_t first = blk * kSplitKeys, j_end = min(p.S, first + kSplitKeys), n = j_end - first;
  constexpr int kStep = kUnroll * Lay::KPW;
  for (int64_t j0 = first + warp * kStep; j0 < j_end; j0 += kWarps * kStep) {
    float s[kUnroll][kDecodeMaxRows];
    key_logits<T, DT>(p, q, k_at, m_at, j0, j_end, lane, s);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * Lay::KPW + kofs;
#pragma unroll
      for (int r = 0; r < kDecodeMaxRows; ++r) {
        if (r >= p.L) break;
        if (j < j_end && sub == 0) {  // one lane per key writes its P
          const float pr = returned_prob<float>(p, prob_from_max_sum<float>(s[u][r], row_max[r], row_sum[r]),
                                                keep_of<float>(p, d_at, lead, r, j));
          w[r * kSplitKeys + (j - first)] = pr;
          store_elem<float>(p.probs.dtype, p.probs.data, p_at + r * p.probs.row + j * p.probs.col, pr);
        }
      }
    }
  }
  __syncthreads();

  // This block's share of O: each lane group takes every KPW-th key of its warp's steps, LPK
  // lanes over the value row; summed over groups (shuffles) and warps (shared memory), then
  // added to the fp32 O.
  for (int r = 0; r < p.L; ++r) {
    float acc[Lay::CH][Lay::EPL] = {};
    for (int64_t jj0 = warp * kStep; jj0 < n; jj0 += kWarps * kStep) {
      uint4 raw[kUnroll][Lay::CH];
      load_rows<T, DT, kUnroll>(p.v, v_at, first + jj0, j_end, p.Ev, lane, true, raw);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t jj = jj0 + u * Lay::KPW + kofs;
        const float pr = jj < n ? w[r * kSplitKeys + jj] : 0.0f;
#pragma unroll
        for (int c = 0; c < Lay::CH; ++c) {
          float x[Lay::EPL];
          unpack16<T>(raw[u][c], x);
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) acc[c][i] += pr * x[i];
        }
      }
    }
#pragma unroll
    for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
      for (int i = 0; i < Lay::EPL; ++i) {
        float v = acc[c][i];
#pragma unroll
        for (int o = 16; o >= Lay::LPK; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (kofs == 0) part[warp * DT + (sub + c * Lay::LPK) * Lay::EPL + i] = v;
      }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) {
      float total = 0.0f;
      for (int x = 0; x < kWarps; ++x) total += part[x * DT + e];
      if (total != 0.0f) atomicAdd(b.out + (lead * p.L + r) * p.Ev + e, total);
    }
    __syncthreads();
  }
}

__global__ void decode_output(DevProblem p, const float* out) {
  const int64_t total = p.num_lead * p.L * p.Ev;
  const float f = output_factor<float>(p);
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < total;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = n % p.Ev, r = (n / p.Ev) % p.L, lead = n / (p.Ev * p.L);
    store_elem<float>(p.out.dtype, p.out.data, lead_off(p, p.out, lead) + r * p.out.row + e * p.out.col, out[n] * f);
  }
}

// The backward for a few query rows (fp16/bf16, after delta = rowsum(A . dA) is known): per
// (head, block of keys) CTA, every key row j of K and V is read once and
//   g_r = dO_r . V_j, A_rj (the saved P without dropout, else exp(s - lse)), dA, dS, W by the
//   contract's rules; dV_j = sum_r W_rj dO_r and dK_j = scale sum_r dS_rj q_r, stored (or added
//   to the fp32 accumulators when heads share key rows); dQ_r += scale dS_rj K_j summed over the
//   CTA's keys, then added to the fp32 dQ.
// A tile backward would sweep a 64-row query tile per key block for one row. Three CTAs per SM:
// the per-row dQ sums need more than 128 registers without spilling.
template <typename T, int DT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM - 1) decode_backward(DevProblem p, BackwardBuffers<float> gb,
                                                                                int64_t blocks) {
  using Lay = Layout<T, DT>;
  constexpr int U = 2;  // warp steps whose loads are issued together
  extern __shared__ float smem[];
  float* q = smem;                 // L x DT
  float* dout = q + p.L * DT;      // L x DT (zero without dO)
  float* part = dout + p.L * DT;   // warps x DT (one row of dQ at a time)
  const int64_t lead = blockIdx.x / blocks, blk = blockIdx.x % blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  const bool has_go = p.grad_out.data != nullptr, has_gp = p.grad_probs.data != nullptr;
  const bool a_from_probs = p.probs.data != nullptr && p.dropout == Dropout::None;
  load_queries<DT>(p, lead, q);
  {
    const int64_t go_at = has_go ? lead_off(p, p.grad_out, lead) : 0;
    for (int64_t n = threadIdx.x; n < p.L * DT; n += kThreads) {
      const int64_t r = n / DT, e = n % DT;
      dout[n] = has_go && e < p.Ev ? load_elem<float>(p.grad_out.dtype, p.grad_out.data, go_at + r * p.grad_out.row + e * p.grad_out.col)
                                   : 0.0f;
    }
  }
  __syncthreads();
  const float scale = static_cast<float>(p.scale);
  const int64_t k_at = lead_off(p, p.k, lead), v_at = lead_off(p, p.v, lead);
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t pr_at = p.probs.data ? lead_off(p, p.probs, lead) : 0;
  const int64_t gp_at = has_gp ? lead_off(p, p.grad_probs, lead) : 0;
  const int64_t lse_at = lead_off(p, p.lse, lead);
  const bool want_dk = gb.dk || gb.dk_out, want_dv = gb.dv || gb.dv_out;
  const int64_t dk_lead = want_dk ? dense_lead_off(p, p.k, lead) : 0;
  const int64_t dv_lead = want_dv ? dense_lead_off(p, p.v, lead) : 0;
  const int64_t first = blk * kSplitKeys, j_end = min(p.S, first + kSplitKeys);
  constexpr int kStep = U * Lay::KPW;
  float dq[kDecodeMaxRows][Lay::CH][Lay::EPL] = {};

  for (int64_t j0 = first + warp * kStep; j0 < j_end; j0 += kWarps * kStep) {
    uint4 kraw[U][Lay::CH], vraw[U][Lay::CH];
    load_rows<T, DT, U>(p.k, k_at, j0, j_end, p.E, lane, true, kraw);
    load_rows<T, DT, U>(p.v, v_at, j0, j_end, p.Ev, lane, has_go, vraw);  // V only feeds dO . V
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * Lay::KPW + kofs;
      float kx[Lay::CH][Lay::EPL], vx[Lay::CH][Lay::EPL];
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) {
        unpack16<T>(kraw[u][c], kx[c]);
        unpack16<T>(vraw[u][c], vx[c]);
      }
      float dk_acc[Lay::CH][Lay::EPL] = {}, dv_acc[Lay::CH][Lay::EPL] = {};
#pragma unroll
      for (int r = 0; r < kDecodeMaxRows; ++r) {
        if (r >= p.L) break;
        // g = dO_r . V_j and (to recompute A) s = q_r . K_j, over the group's lanes.
        float g = 0.0f, qk = 0.0f;
#pragma unroll
        for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) {
            const int e = (sub + c * Lay::LPK) * Lay::EPL + i;
            g += dout[r * DT + e] * vx[c][i];
            qk += q[r * DT + e] * kx[c][i];
          }
#pragma unroll
        for (int o = Lay::LPK / 2; o > 0; o >>= 1) {
          g += __shfl_xor_sync(0xffffffffu, g, o);
          qk += __shfl_xor_sync(0xffffffffu, qk, o);
        }
        float ds = 0.0f, w = 0.0f;
        if (j < j_end) {
          const float a = a_from_probs
                              ? load_elem<float>(p.probs.dtype, p.probs.data, pr_at + r * p.probs.row + j * p.probs.col)
                              : prob_from_lse<float>(masked_logit<float>(p, qk, m_at, r, j),
                                                     load_elem<float>(p.lse.dtype, p.lse.data, lse_at + r * p.lse.row));
          const float keep = keep_of<float>(p, d_at, lead, r, j);
          const float dp = has_gp ? load_elem<float>(p.grad_probs.dtype, p.grad_probs.data, gp_at + r * p.grad_probs.row + j * p.grad_probs.col)
                                  : 0.0f;
          const float da = grad_softmax<float>(p, has_go ? g : 0.0f, dp, keep);
          ds = a * (da - gb.delta[lead * p.L + r]);
          w = value_weight<float>(p, a, keep);
          if (gb.dmask && ds != 0.0f && sub == 0)
            atomicAdd(gb.dmask + dense_lead_off(p, p.mask, lead) + r * p.mask.dense_row + j * p.mask.dense_col, ds);
        }
#pragma unroll
        for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) {
            const int e = (sub + c * Lay::LPK) * Lay::EPL + i;
            dv_acc[c][i] += w * dout[r * DT + e];
            dk_acc[c][i] += scale * ds * q[r * DT + e];
            dq[r][c][i] += scale * ds * kx[c][i];
          }
      }
      if (j >= j_end) continue;
      // Key row j's dK and dV: this lane's chunks.
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) {
        const int64_t e0 = static_cast<int64_t>(sub + c * Lay::LPK) * Lay::EPL;
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) {
          const int64_t e = e0 + i;
          if (want_dk && e < p.E) {
            const int64_t off = dk_lead + j * p.k.dense_row + e * p.k.dense_col;
            if (gb.dk_out) static_cast<T*>(gb.dk_out)[off] = from_float<T>(dk_acc[c][i]);
            else if (dk_acc[c][i] != 0.0f) atomicAdd(gb.dk + off, dk_acc[c][i]);
          }
          if (want_dv && e < p.Ev) {
            const int64_t off = dv_lead + j * p.v.dense_row + e * p.v.dense_col;
            if (gb.dv_out) static_cast<T*>(gb.dv_out)[off] = from_float<T>(dv_acc[c][i]);
            else if (dv_acc[c][i] != 0.0f) atomicAdd(gb.dv + off, dv_acc[c][i]);
          }
        }
      }
    }
  }

  // dQ of each row: over the warp's key groups (shuffles), its warps (shared memory), then added.
  if (!gb.dq) return;
  const int64_t dq_lead = dense_lead_off(p, p.q, lead);
  for (int r = 0; r < p.L; ++r) {
#pragma unroll
    for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
      for (int i = 0; i < Lay::EPL; ++i) {
        float v = 0.0f;
#pragma unroll
        for (int x = 0; x < kDecodeMaxRows; ++x)
          if (x == r) v = dq[x][c][i];
#pragma unroll
        for (int o = 16; o >= Lay::LPK; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (kofs == 0) part[warp * DT + (sub + c * Lay::LPK) * Lay::EPL + i] = v;
      }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < p.E; e += kThreads) {
      float total = 0.0f;
      for (int x = 0; x < kWarps; ++x) total += part[x * DT + e];
      if (total != 0.0f) atomicAdd(gb.dq + dq_lead + r * p.q.dense_row + e * p.q.dense_col, total);
    }
    __syncthreads();
  }
}

template <typename T, int DT>
void launch_decode(const DevProblem& p, const DecodeBuffers& b, cudaStream_t stream) {
  const int64_t ctas = p.num_lead * b.blocks;
  if (ctas > 2147483647LL) throw Error(ErrorCode::CudaFailure, "too many key blocks for one CUDA launch");
  const size_t q_bytes = sizeof(float) * p.L * DT;
  const size_t stats_smem = q_bytes + sizeof(float) * kWarps * kDecodeMaxRows * 2;
  decode_stats<T, DT><<<static_cast<unsigned>(ctas), kThreads, stats_smem, stream>>>(p, b);
  check_launch("decode statistics");
  const size_t probs_smem = q_bytes + sizeof(float) * (p.L * kSplitKeys + 2 * kDecodeMaxRows + kWarps * DT);
  decode_probs<T, DT><<<static_cast<unsigned>(ctas), kThreads, probs_smem, stream>>>(p, b);
  check_launch("decode probabilities");
}

template <typename T>
void launch_for_head(const DevProblem& p, const DecodeBuffers& b, cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  if (head <= 64) launch_decode<T, 64>(p, b, stream);
  else if (head <= 128) launch_decode<T, 128>(p, b, stream);
  else launch_decode<T, 256>(p, b, stream);
}

}  // namespace

bool decode_applies(const DevProblem& p) {
  if (p.L > kDecodeMaxRows || p.L == 0 || p.S == 0 || p.E == 0) return false;
  if ((p.E > p.Ev ? p.E : p.Ev) > kDecodeMaxHead) return false;
  int elem = 0;
  switch (p.q.dtype) {
    case DType::Float16: case DType::BFloat16: elem = 2; break;
    case DType::Float32: elem = 4; break;
    default: return false;
  }
  // Rows of K and V move 16 bytes per lane: unit column stride, aligned rows.
  const int vec = 16 / elem;
  return rows_vectorizable(p.k, p.lead_ndim, p.E, elem, vec) && rows_vectorizable(p.v, p.lead_ndim, p.Ev, elem, vec);
}

bool decode_backward_applies(const DevProblem& p) {
  return decode_applies(p) && (p.q.dtype == DType::Float16 || p.q.dtype == DType::BFloat16);
}

template <typename T>
void launch_backward_for_head(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  const int64_t blocks = (p.S + kSplitKeys - 1) / kSplitKeys, ctas = p.num_lead * blocks;
  if (ctas > 2147483647LL) throw Error(ErrorCode::CudaFailure, "too many key blocks for one CUDA launch");
  auto go = [&](auto kernel, int dt) {
    const size_t smem = sizeof(float) * (2 * p.L * dt + kWarps * dt);
    kernel<<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(p, g, blocks);
  };
  if (head <= 64) go(decode_backward<T, 64>, 64);
  else if (head <= 128) go(decode_backward<T, 128>, 128);
  else go(decode_backward<T, 256>, 256);
  check_launch("decode backward");
}

void decode_backward_run(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) launch_backward_for_head<__half>(p, g, stream);
  else launch_backward_for_head<__nv_bfloat16>(p, g, stream);
}

int64_t decode_stats_floats(const DevProblem& p) {
  return p.num_lead * p.L * ((p.S + kSplitKeys - 1) / kSplitKeys) * 2;
}

void decode_forward(const DevProblem& p, float* stats, float* out_acc, cudaStream_t stream) {
  const DecodeBuffers b{stats, out_acc, (p.S + kSplitKeys - 1) / kSplitKeys};
  switch (p.q.dtype) {
    case DType::Float16: launch_for_head<__half>(p, b, stream); break;
    case DType::BFloat16: launch_for_head<__nv_bfloat16>(p, b, stream); break;
    default: launch_for_head<float>(p, b, stream); break;
  }
  const int64_t total = p.num_lead * p.L * p.Ev;
  const int64_t grid = std::min<int64_t>((total + 255) / 256, 65535);
  if (grid > 0) {
    decode_output<<<static_cast<unsigned>(grid), 256, 0, stream>>>(p, out_acc);
    check_launch("decode output");
  }
}

}  // namespace sdpa_math::cuda
