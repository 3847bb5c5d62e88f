// The KL form of the Hopper backward (fp16/bf16, sm_90a): kl_to's gradient without P, dQ and dK
// of Σ_i g_i KL(r_i ‖ P_i) with P recomputed from the saved lse. kl_rows_prep makes the row
// vectors the main kernel reads (backward_sm90.cuh's KL form, which describes the kernels), and
// the entry points sm90.cuh declares for it.
#include <type_traits>

#include "backward_sm90.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

// The KL form's row vectors, one block per (key head, 64-row query tile of its group). First f:
// for fp16 (SCALED) the power of two that brings the group's largest finite |g| R to within
// (2^13, 2^14], so that dS = f g (R P − r), at most f |g| R in size for a reference of
// non-negative rows, neither overflows fp16 nor sinks into its subnormals (a mean over many rows
// makes g tiny); 1 for bf16 (fp32's range). Then per query row: lse·log2 e (+inf past L, so P = 0
// there), f g R and f g (0 past L), at rows c · num_lead + lead of the [3 · num_lead][q_tiles · 64]
// buffer; and 1 / f for dK and dQ.
template <bool SCALED>
__global__ void __launch_bounds__(256) kl_rows_prep(const DevProblem p, const Args a, const DevOperand row_sum,
                                                    const DevOperand grad_kl, float* rows, float* unscale) {
  // blockIdx.x: the key head; blockIdx.y: one 64-row query tile of one head of its group. Each
  // block takes the group's max itself (G·L reads from L2), so no second launch waits on it.
  const int64_t kv = blockIdx.x, width = a.q_tiles * kBM;
  auto at = [&](const DevOperand& op, int64_t lead, int64_t i) {
    return reinterpret_cast<const float*>(op.data)[lead_off(p, op, lead) + i * op.row];
  };
  float f = 1.0f;
  if constexpr (SCALED) {
    __shared__ float part[8];
    float m = 0.0f;
    for (int64_t gi = 0; gi < a.group; ++gi) {
      // one unravel per head, not per element (the int64 divisions were most of this loop)
      const int64_t lead = query_lead(a, kv, gi);
      const float* g_row = reinterpret_cast<const float*>(grad_kl.data) + lead_off(p, grad_kl, lead);
      const float* r_row = reinterpret_cast<const float*>(row_sum.data) + lead_off(p, row_sum, lead);
      for (int64_t i = threadIdx.x; i < p.L; i += blockDim.x) {
        const float v = fabsf(g_row[i * grad_kl.row] * r_row[i * row_sum.row]);
        if (isfinite(v)) m = fmaxf(m, v);
      }
    }
    for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = m;
    __syncthreads();
    m = part[0];
    for (int w = 1; w < 8; ++w) m = fmaxf(m, part[w]);
    if (m > 0.0f) f = exp2f(fminf(fmaxf(floorf(log2f(16384.0f / m)), -126.0f), 126.0f));
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) unscale[kv] = 1.0f / f;
  if (threadIdx.x >= kBM) return;
  const int64_t lead = query_lead(a, kv, blockIdx.y / a.q_tiles), i = (blockIdx.y % a.q_tiles) * kBM + threadIdx.x;
  const bool in = i < p.L;
  const float g = in ? at(grad_kl, lead, i) : 0.0f;
  rows[lead * width + i] = in ? at(p.lse, lead, i) * 1.4426950408889634f : INFINITY;
  rows[(p.num_lead + lead) * width + i] = in ? f * g * at(row_sum, lead, i) : 0.0f;
  rows[(2 * p.num_lead + lead) * width + i] = f * g;
}

// Floats of the KL form's workspace before dQ's accumulator: the row vectors, then 1 / f per key
// head (rounded up to 4 floats, so the accumulator stays 16-byte aligned for its reductions).
int64_t kl_rows_floats(const DevProblem& p) {
  const int64_t kv_leads = p.num_lead / p.k.head_group;
  return 3 * p.num_lead * ((p.L + kBM - 1) / kBM) * kBM + (kv_leads + 3) / 4 * 4;
}

template <typename T>
bool kl_backward_for(const DevProblem& p, const KlInputs& in, const BackwardTargets& out, float* workspace,
                     cudaStream_t stream) {
  Args a{};
  a.has_do = false;
  a.has_dp = true;
  CUtensorMap maps[7] = {};
  const int64_t D = padded_head(p.E);
  if (!make_map(&maps[0], p, p.q, p.L, p.E, kBM, a.q) || !make_map(&maps[1], p, p.k, p.S, p.E, kBN, a.k)) return false;
  // The reference through TMA where its rows allow, else the copy warps take it (4-byte aligned
  // rows; 8-byte copies where they allow it).
  a.p_tma = make_map(&maps[5], p, in.reference, p.L, p.S, kBM, a.dp);
  if (!a.p_tma && !rows_vectorizable(in.reference, p.lead_ndim, p.S, 2, 2)) return false;
  a.map_piece = rows_vectorizable(in.reference, p.lead_ndim, p.S, 2, 4) ? 8 : 4;
  if (!a.p_tma) maps[5] = maps[0];
  maps[2] = maps[1];  // V, dO and P: not read in the KL form
  maps[3] = maps[4] = maps[0];
  DevProblem pk = p;  // the kernel finds the reference where the ordinary backward finds dP_ext
  pk.grad_probs = in.reference;
  a.group = p.k.head_group;
  a.heads = p.lead_ndim > 0 ? p.lead_shape[p.lead_ndim - 1] : 1;
  a.kv_leads = p.num_lead / a.group;
  a.q_tiles = (p.L + kBM - 1) / kBM;
  a.scale = static_cast<float>(p.scale);
  float* rows = workspace;
  float* unscale = rows + 3 * p.num_lead * a.q_tiles * kBM;
  if (!make_rows_map_f32(&maps[6], rows, a.q_tiles * kBM, 3 * p.num_lead, kBM)) return false;
  a.delta = rows;
  a.unscale = unscale;
  a.dq_acc = workspace + kl_rows_floats(p);
  a.dk = out.dk;
  a.dv = nullptr;
  const dim3 prep_grid(grid_x(a.kv_leads, "sm90 KL rows"), grid_yz(a.group * a.q_tiles, "sm90 KL rows"));
  if (std::is_same_v<T, __half>)
    kl_rows_prep<true><<<prep_grid, 256, 0, stream>>>(p, a, in.row_sum, in.grad_kl, rows, unscale);
  else
    kl_rows_prep<false><<<prep_grid, 256, 0, stream>>>(p, a, in.row_sum, in.grad_kl, rows, unscale);
  check_launch("sm90 KL rows");
  if (D == 64) launch<T, 64, true>(maps, pk, a, out, stream);
  else launch<T, 128, true>(maps, pk, a, out, stream);
  return true;
}

}  // namespace

const char* kl_conditions_decline(const DevProblem& p, const KlInputs& in) {
  if (const char* why = kl_inputs_decline(p, in.reference.dtype)) return why;
  if (p.lse.dtype != DType::Float32 || in.row_sum.dtype != DType::Float32 || in.grad_kl.dtype != DType::Float32)
    return "the lse, the reference's row sums or the KL's gradient are not float32";
  if (!qk_stored_per_head(p)) return "q or k is broadcast over batch dims or has a non-unit column stride";
  if (!(p.L > 0 && p.S > 0 && p.L <= 2147483647LL && p.S <= 2147483647LL)) return "L or S is 0 or above 2^31";
  // The kernel's lead indices and the row vectors' rows (three per lead index) in 32-bit arithmetic.
  if (3 * p.num_lead > 2147483647LL) return "more than 2^31 / 3 lead indices (batch x heads)";
  // kl_rows_prep's second grid dimension: a GQA group's query tiles (65,535 at most).
  if (p.k.head_group * ((p.L + kBM - 1) / kBM) > 65535) return "a GQA group has more than 65,535 query tiles";
  return nullptr;
}

const char* kl_backward_declines(const DevProblem& p, const KlInputs& in) {
  if (const char* why = kl_conditions_decline(p, in)) return why;
  // What TMA must address: q, k and the reference as they are (the row vectors live in the
  // workspace, aligned as any allocation; a placeholder address stands for it here).
  CUtensorMap map;
  MapCoords mc;
  const int64_t q_tiles = (p.L + kBM - 1) / kBM;
  if (!make_map(&map, p, p.q, p.L, p.E, kBM, mc) || !make_map(&map, p, p.k, p.S, p.E, kBN, mc))
    return "the TMA unit cannot address q or k";
  if (!make_map(&map, p, in.reference, p.L, p.S, kBM, mc) && !rows_vectorizable(in.reference, p.lead_ndim, p.S, 2, 2))
    return "the reference map's keys are not contiguous in 4-byte aligned rows";
  if (!make_rows_map_f32(&map, reinterpret_cast<const float*>(std::uintptr_t{256}), q_tiles * kBM, 3 * p.num_lead, kBM))
    return "the TMA unit cannot address the row vectors";
  return nullptr;
}

bool kl_backward_applies(const DevProblem& p, const KlInputs& in) { return kl_backward_declines(p, in) == nullptr; }

int64_t kl_backward_workspace_floats(const DevProblem& p) {
  return kl_rows_floats(p) + p.num_lead * ((p.L + kBM - 1) / kBM) * kBM * padded_head(p.E);
}

bool kl_backward(const DevProblem& p, const KlInputs& in, const BackwardTargets& out, float* workspace, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) return kl_backward_for<__half>(p, in, out, workspace, stream);
  return kl_backward_for<__nv_bfloat16>(p, in, out, workspace, stream);
}

}  // namespace sdpa_math::cuda::sm90
