// The decode backward (fp16/bf16; common.cuh describes the decode kernels): per (head, block of
// kSplitKeys keys) CTA, K and V rows read once, dK and dV of the block's keys stored (or added
// to fp32 accumulators) and dQ summed over them, for up to kDecodeMaxRows query rows. The
// mma.sync backward (sm80/backward_sm80.cu) runs it for decode shapes.
#include <type_traits>

#include "common.cuh"

namespace sdpa_math::cuda {
namespace {

// Eight (fp16/bf16) or four (fp32) floats rounded to T, as one 16-byte word.
template <typename T>
SDPA_MATH_D uint4 pack16(const float (&x)[16 / sizeof(T)]) {
  if constexpr (std::is_same_v<T, float>) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T lo = from_float<T>(x[2 * i]), hi = from_float<T>(x[2 * i + 1]);
      uint16_t bl, bh;
      memcpy(&bl, &lo, 2);
      memcpy(&bh, &hi, 2);
      w[i] = static_cast<uint32_t>(bl) | (static_cast<uint32_t>(bh) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The backward for a few query rows (fp16/bf16, after delta = rowsum(A . dA) is known): per
// (head, block of keys) CTA, every key row j of K and V is read once and
//   g_r = dO_r . V_j, A_rj (the saved P without dropout, else exp(s - lse)), dA, dS, W by the
//   contract's rules; dV_j = sum_r W_rj dO_r and dK_j = scale sum_r dS_rj q_r, stored (16 bytes
//   a lane where the gradient is dense and aligned, else per element, or added to the fp32
//   accumulators when heads share key rows); dQ_r += scale dS_rj K_j summed over the CTA's
//   keys, then added to the fp32 dQ.
// The step's P and dP elements are loaded beside its K and V rows, so one memory latency is
// paid per step, not two. A tile backward would sweep a 64-row query tile per key block for one
// row. CTAs per SM: five for one row (a few bytes spilled outside the key loop, and measured
// faster than a four-CTA variant: bench/NOTES.md), three for four rows, whose per-row dQ sums
// need more than 128 registers.
// (A CTA's rows are `heads` heads of one GQA group, L rows each: RowInfo.)
template <typename T, int DT, int R, bool PLAIN>
__global__ void __launch_bounds__(kThreads, R == 1 ? 5 : 3) decode_backward(DevProblem p, BackwardBuffers<float> gb, int64_t blocks, int64_t heads) {
  using Lay = Layout<T, DT>;
  constexpr int U = R == 1 ? kUnroll / 2 : kUnroll / 4;  // warp steps per buffer
  extern __shared__ float smem[];
  __shared__ RowInfo rows[R];
  const int count = static_cast<int>(heads * p.L);  // rows of this CTA, <= R
  float* q = smem;                   // count x DT
  float* dout = q + count * DT;      // count x DT (zero without dO)
  float* part = dout + count * DT;   // warps x DT (one row of dQ at a time)
  const int64_t first_lead = blockIdx.x / blocks * heads, blk = blockIdx.x % blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  const bool has_go = p.grad_out.data != nullptr, has_gp = p.grad_probs.data != nullptr;
  const bool a_from_probs = p.probs.data != nullptr && p.dropout == Dropout::None;
  describe_rows<R>(p, first_lead, count, rows);
  load_query_rows<DT>(p, p.q, p.E, first_lead, count, q);
  load_query_rows<DT>(p, p.grad_out, p.Ev, first_lead, count, dout);
  __syncthreads();
  const float scale = static_cast<float>(p.scale);
  const int64_t k_at = lead_off(p, p.k, first_lead), v_at = lead_off(p, p.v, first_lead);
  const bool want_dk = gb.dk || gb.dk_out, want_dv = gb.dv || gb.dv_out;
  const int64_t dk_lead = want_dk ? dense_lead_off(p, p.k, first_lead) : 0;
  const int64_t dv_lead = want_dv ? dense_lead_off(p, p.v, first_lead) : 0;
  // Whole 16-byte chunks of a stored gradient row go out as one store where they are aligned.
  auto chunk_stores = [](const void* base, int64_t at, int64_t row, int64_t col, int64_t width) {
    return base != nullptr && col == 1 && width % Lay::EPL == 0 && row % Lay::EPL == 0 && at % Lay::EPL == 0 &&
           reinterpret_cast<uintptr_t>(base) % 16 == 0;
  };
  const bool vec_dk = chunk_stores(gb.dk_out, dk_lead, p.k.dense_row, p.k.dense_col, p.E);
  const bool vec_dv = chunk_stores(gb.dv_out, dv_lead, p.v.dense_row, p.v.dense_col, p.Ev);
  float delta[R], lse[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    delta[r] = r < count ? gb.delta[first_lead * p.L + r] : 0.0f;
    lse[r] = r < count && !a_from_probs
                 ? load_elem<float>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, rows[r].lead) + rows[r].r * p.lse.row)
                 : 0.0f;
  }
  const int64_t first = blk * kSplitKeys, j_end = min(p.S, first + kSplitKeys);
  constexpr int kStep = U * Lay::KPW;
  float dq[R][Lay::CH][Lay::EPL] = {};

  // A step's K and V rows and its P and dP elements, loaded together.
  struct Step {
    uint4 k[U][Lay::CH], v[U][Lay::CH];
    float a[U][R], dp[U][R];
  };
  auto fetch = [&](int64_t j0, Step& st) {
    load_rows<T, DT, U>(p.k, k_at, j0, j_end, p.E, lane, true, st.k);
    load_rows<T, DT, U>(p.v, v_at, j0, j_end, p.Ev, lane, has_go, st.v);  // V only feeds dO . V
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * Lay::KPW + kofs;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const bool here = r < count && j < j_end;
        // P and dP have the inputs' dtype here (decode_backward_declines).
        st.a[u][r] = here && a_from_probs ? to_float<T>(reinterpret_cast<const T*>(p.probs.data)[rows[r].probs_at + j * p.probs.col]) : 0.0f;
        st.dp[u][r] = here && has_gp ? to_float<T>(reinterpret_cast<const T*>(p.grad_probs.data)[rows[r].grad_probs_at + j * p.grad_probs.col])
                                     : 0.0f;
      }
    }
  };
  // One warp step: dS and the weights of its keys, their dK and dV rows, and the dQ sums.
  auto consume = [&](int64_t j0, const Step& cur) {
    const auto& kraw = cur.k;
    const auto& vraw = cur.v;
    const auto& a_in = cur.a;
    const auto& dp_in = cur.dp;
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
      for (int r = 0; r < R; ++r) {
        if (r >= count) break;
        // g = dO_r . V_j and (to recompute A) s = q_r . K_j, over the group's lanes.
        float g = 0.0f, qk = 0.0f;
#pragma unroll
        for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) {
            const int e = (sub + c * Lay::LPK) * Lay::EPL + i;
            g += dout[r * DT + e] * vx[c][i];
            if (!a_from_probs) qk += q[r * DT + e] * kx[c][i];
          }
#pragma unroll
        for (int o = Lay::LPK / 2; o > 0; o >>= 1) {
          g += __shfl_xor_sync(0xffffffffu, g, o);
          if (!a_from_probs) qk += __shfl_xor_sync(0xffffffffu, qk, o);
        }
        float ds = 0.0f, w = 0.0f;
        if (j < j_end) {
          const float a = a_from_probs ? a_in[u][r] : prob_from_lse<float>(logit_at<PLAIN>(p, qk, rows[r], j), lse[r]);
          const float keep = keep_at<PLAIN>(p, rows[r], j);
          const float g_used = has_go ? g : 0.0f;
          const float da = PLAIN ? g_used + dp_in[u][r] : grad_softmax<float>(p, g_used, dp_in[u][r], keep);
          ds = a * (da - delta[r]);
          w = PLAIN ? a : value_weight<float>(p, a, keep);
          if (!PLAIN && gb.dmask && ds != 0.0f && sub == 0)
            atomicAdd(gb.dmask + dense_lead_off(p, p.mask, rows[r].lead) + rows[r].r * p.mask.dense_row + j * p.mask.dense_col, ds);
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
        if (vec_dk && e0 < p.E) {
          *reinterpret_cast<uint4*>(static_cast<T*>(gb.dk_out) + dk_lead + j * p.k.dense_row + e0) = pack16<T>(dk_acc[c]);
        } else if (want_dk) {
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) {
            const int64_t off = dk_lead + j * p.k.dense_row + (e0 + i) * p.k.dense_col;
            if (e0 + i >= p.E) break;
            if (gb.dk_out) static_cast<T*>(gb.dk_out)[off] = from_float<T>(dk_acc[c][i]);
            else if (dk_acc[c][i] != 0.0f) atomicAdd(gb.dk + off, dk_acc[c][i]);
          }
        }
        if (vec_dv && e0 < p.Ev) {
          *reinterpret_cast<uint4*>(static_cast<T*>(gb.dv_out) + dv_lead + j * p.v.dense_row + e0) = pack16<T>(dv_acc[c]);
        } else if (want_dv) {
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) {
            const int64_t off = dv_lead + j * p.v.dense_row + (e0 + i) * p.v.dense_col;
            if (e0 + i >= p.Ev) break;
            if (gb.dv_out) static_cast<T*>(gb.dv_out)[off] = from_float<T>(dv_acc[c][i]);
            else if (dv_acc[c][i] != 0.0f) atomicAdd(gb.dv + off, dv_acc[c][i]);
          }
        }
      }
    }
  };
  // Two buffers: the next step's loads are in flight while this step's values are used.
  constexpr int64_t kStride = kWarps * kStep;
  Step next;
  fetch(first + warp * kStep, next);
  for (int64_t j0 = first + warp * kStep; j0 < j_end; j0 += kStride) {
    const Step cur = next;
    fetch(j0 + kStride, next);
    consume(j0, cur);
  }

  // dQ of each row: over the warp's key groups (shuffles), its warps (shared memory), then added.
  if (!gb.dq) return;
  for (int r = 0; r < count; ++r) {
    const int64_t dq_at = dense_lead_off(p, p.q, rows[r].lead) + rows[r].r * p.q.dense_row;
#pragma unroll
    for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
      for (int i = 0; i < Lay::EPL; ++i) {
        float v = 0.0f;
#pragma unroll
        for (int x = 0; x < R; ++x)
          if (x == r) v = dq[x][c][i];
#pragma unroll
        for (int o = 16; o >= Lay::LPK; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (kofs == 0) part[warp * DT + (sub + c * Lay::LPK) * Lay::EPL + i] = v;
      }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < p.E; e += kThreads) {
      float total = 0.0f;
      for (int x = 0; x < kWarps; ++x) total += part[x * DT + e];
      if (total != 0.0f) atomicAdd(gb.dq + dq_at + e * p.q.dense_col, total);
    }
    __syncthreads();
  }
}

template <typename T>
void launch_backward_for_head(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  const int64_t heads = decode_heads_per_cta(p), count = heads * p.L;
  const int64_t blocks = (p.S + kSplitKeys - 1) / kSplitKeys, ctas = p.num_lead / heads * blocks;
  const unsigned grid = grid_x(ctas, "decode backward");
  auto go = [&](auto kernel, int dt) {
    const size_t smem = sizeof(float) * (2 * count * dt + kWarps * dt);
    kernel<<<grid, kThreads, smem, stream>>>(p, g, blocks, heads);
  };
  // One row per CTA: kernels with a quarter of the registers; without mask, causal or dropout:
  // kernels without their branches.
  auto by_rule = [&](auto one_plain, auto one_full, auto rows_plain, auto rows_full, int dt) {
    if (count == 1) plain(p) ? go(one_plain, dt) : go(one_full, dt);
    else plain(p) ? go(rows_plain, dt) : go(rows_full, dt);
  };
  constexpr int RM = kDecodeMaxRows;
  if (head <= 64)
    by_rule(decode_backward<T, 64, 1, true>, decode_backward<T, 64, 1, false>, decode_backward<T, 64, RM, true>,
            decode_backward<T, 64, RM, false>, 64);
  else if (head <= 128)
    by_rule(decode_backward<T, 128, 1, true>, decode_backward<T, 128, 1, false>, decode_backward<T, 128, RM, true>,
            decode_backward<T, 128, RM, false>, 128);
  else
    by_rule(decode_backward<T, 256, 1, true>, decode_backward<T, 256, 1, false>, decode_backward<T, 256, RM, true>,
            decode_backward<T, 256, RM, false>, 256);
  check_launch("decode backward");
}

}  // namespace

const char* decode_backward_declines(const DevProblem& p) {
  if (const char* why = decode_declines(p)) return why;
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return "inputs not float16 or bfloat16";
  // dO, P and dP are read in the inputs' dtype.
  if ((p.grad_out.data && p.grad_out.dtype != p.q.dtype) || (p.grad_probs.data && p.grad_probs.dtype != p.q.dtype) ||
      (p.probs.data && p.probs.dtype != p.q.dtype))
    return "dO, dP or the saved P not in the inputs' dtype";
  return nullptr;
}

void decode_backward_run(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) launch_backward_for_head<__half>(p, g, stream);
  else launch_backward_for_head<__nv_bfloat16>(p, g, stream);
}

}  // namespace sdpa_math::cuda
