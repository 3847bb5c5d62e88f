// The Hopper forward's host side: which problems it takes and why not (forward_declines,
// stats_declines, which encode the TMA maps and fill the arguments of a problem they take), the
// workspaces, and the dispatch to the kernel of a problem's dtype, head size, mask kind and P
// store. The kernels themselves compile in the
// instantiation files (forward_sm90_<dtype>_d<head>.cu, from forward_sm90_kernel.cuh), which
// define the launch functions declared `extern template` below; this file compiles only the
// two small kernels of its own: the mask plan (build_mask_plan) and the column sums' total
// (stats_columns).
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "../launch.cuh"
#include "forward_sm90_mask.cuh"
#include "forward_sm90_shell.cuh"
#include "sm90.cuh"
#include "tensor_maps.cuh"

namespace sdpa_math::cuda::sm90 {

// What forward_declines and stats_declines prepare for a problem they take: the encoded maps of
// Q, K, V (and P, where TMA stores it) and the kernels' arguments, so that running asks nothing.
struct ForwardPrepared {
  CUtensorMap q, k, v, pm;
  fwd::Args a;
  fwd::MaskKind mask;
};

namespace fwd {

// The 48 kernels' launch functions, compiled elsewhere (one file per dtype and head size).
SDPA_MATH_SM90_FWD_GROUP(extern template, __half, 64)
SDPA_MATH_SM90_FWD_GROUP(extern template, __half, 128)
SDPA_MATH_SM90_FWD_GROUP(extern template, __nv_bfloat16, 64)
SDPA_MATH_SM90_FWD_GROUP(extern template, __nv_bfloat16, 128)

namespace {
// STATS: column sums from the slots' partial rows, added in slot order (deterministic); slots
// that do not cover key j (causal CTAs stop at their diagonal tile) add only their NaN flag.
__global__ void stats_columns(const float* __restrict__ part, const float* __restrict__ nan_flags, const DevProblem p,
                              const DevOperand cs, int64_t lead0, int64_t leads, int64_t tiles) {
  const int64_t slots = 2 * tiles;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < leads * p.S;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t ll = idx / p.S, j = idx % p.S;
    static_assert(kBM == kBN && kBM == 2 * 64, "slot s = 2 x row tile + warpgroup covers key j iff its row tile >= j / kBN");
    const int64_t first = p.causal ? 2 * (j / kBN) : 0;
    float sum = 0.0f;
    for (int64_t s = 0; s < slots; ++s)
      sum += s >= first ? part[(ll * slots + s) * p.S + j] : nan_flags[ll * slots + s];
    reinterpret_cast<float*>(cs.data)[lead_off(p, cs, lead0 + ll) + j * cs.row] = sum;
  }
}

template <typename T, int D, bool STATS, bool P_COPY>
void launch_for_mask(const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& pm,
                     const DevProblem& p, const Args& a, const StatsArgs& st, MaskKind mask, cudaStream_t stream) {
  switch (mask) {
    case MaskKind::None: return launch<T, D, MaskKind::None, STATS, P_COPY>(q, k, v, pm, p, a, st, stream);
    case MaskKind::Bool: return launch<T, D, MaskKind::Bool, STATS, P_COPY>(q, k, v, pm, p, a, st, stream);
    case MaskKind::Same: return launch<T, D, MaskKind::Same, STATS, P_COPY>(q, k, v, pm, p, a, st, stream);
    case MaskKind::Float32: return launch<T, D, MaskKind::Float32, STATS, P_COPY>(q, k, v, pm, p, a, st, stream);
  }
}

template <bool STATS, bool P_COPY, typename T>
void launch_for_head(const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& pm,
                     const DevProblem& p, const Args& a, const StatsArgs& st, MaskKind mask, cudaStream_t stream) {
  if (padded_head(p.E) == 64) launch_for_mask<T, 64, STATS, P_COPY>(q, k, v, pm, p, a, st, mask, stream);
  else launch_for_mask<T, 128, STATS, P_COPY>(q, k, v, pm, p, a, st, mask, stream);
}

// The mask's kind, or false when this kernel does not read it (another float dtype).
bool mask_kind(const DevProblem& p, MaskKind& kind) {
  if (p.mask.data == nullptr) kind = MaskKind::None;
  else if (p.mask_is_bool) kind = MaskKind::Bool;
  else if (p.mask.dtype == p.q.dtype) kind = MaskKind::Same;
  else if (p.mask.dtype == DType::Float32) kind = MaskKind::Float32;
  else return false;
  return true;
}

// The maps of Q, K, V and the arguments both kernels share; false when TMA cannot address them.
bool common_args(const DevProblem& p, CUtensorMap& q, CUtensorMap& k, CUtensorMap& v, Args& a, MaskKind& mask) {
  if (!mask_kind(p, mask) || !make_map(&q, p, p.q, p.L, p.E, kBM, a.q) || !make_map(&k, p, p.k, p.S, p.E, kBN, a.k) ||
      !make_map(&v, p, p.v, p.S, p.Ev, kBN, a.v))
    return false;
  a.scale = static_cast<float>(p.scale);
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  // On the fp32 value: a scale that rounds to 0 would make a hidden key's raw -inf times 0 = NaN.
  a.fold = a.scale_log2 > 0.0f;
  a.lead0 = 0;
  a.leads = p.num_lead;
  return true;
}

// The mask plan's size: built for every float mask of the forward (its kernels read no mask
// without it), one bit per (plan lead, 16 rows, key tile). A mask shared by the heads ((B, 1, L,
// S), (L, S)) is read once more for it and its neutral tiles never; a mask of its own per head
// ((B, H, L, S)) is read a third time (the forward reads it in both passes); one broadcast over
// rows ((B, H, 1, S), ALiBi's form) costs a row per head. Zero words: no plan (bool masks,
// which the warps vote on, and none).
struct PlanShape {
  int64_t leads = 0, groups = 0;
  int words = 0;
  int64_t total_words() const { return leads * groups * words; }
};
PlanShape plan_shape(const DevProblem& p) {
  PlanShape s;
  if (p.mask.data == nullptr || p.mask_is_bool) return s;
  s.leads = plan_leads(p);
  s.groups = p.mask.row == 0 ? 1 : (p.L + 15) / 16;
  s.words = static_cast<int>(((p.S + kBN - 1) / kBN + 31) / 32);
  return s;
}

template <typename T>
void forward_for(const DevProblem& p, const ForwardPrepared& f, uint32_t* plan, cudaStream_t stream) {
  Args a = f.a;
  if (f.mask == MaskKind::Same || f.mask == MaskKind::Float32) {
    const PlanShape ps = plan_shape(p);
    const int64_t items = ps.leads * ps.groups * ((p.S + kBN - 1) / kBN);
    const int64_t blocks = std::min<int64_t>((items + 3) / 4, int64_t(1) << 20);
    if (f.mask == MaskKind::Same)
      build_mask_plan<T, MaskKind::Same><<<grid_x(blocks, "sm90 mask plan"), 128, 0, stream>>>(p, plan, ps.groups, ps.words, items);
    else
      build_mask_plan<T, MaskKind::Float32><<<grid_x(blocks, "sm90 mask plan"), 128, 0, stream>>>(p, plan, ps.groups, ps.words, items);
    check_launch("sm90 mask plan");
    a.plan = plan;
    a.plan_groups = ps.groups;
    a.plan_words = ps.words;
  }
  if (a.p_tma) launch_for_head<false, false, T>(f.q, f.k, f.v, f.pm, p, a, StatsArgs{}, f.mask, stream);
  else launch_for_head<false, true, T>(f.q, f.k, f.v, f.pm, p, a, StatsArgs{}, f.mask, stream);
}

// Lead indices per statistics launch: the column sums' partial rows (and flags) of one launch
// take at most kStatsWorkspaceFloats.
constexpr int64_t kStatsWorkspaceFloats = int64_t(16) << 20;  // 64 MiB
int64_t stats_leads_per_launch(const DevProblem& p) {
  const int64_t per_lead = 2 * ((p.L + kBM - 1) / kBM) * (p.S + 1);
  return std::max<int64_t>(1, std::min<int64_t>(p.num_lead, kStatsWorkspaceFloats / std::max<int64_t>(per_lead, 1)));
}

template <typename T>
void stats_for(const DevProblem& p, const ForwardPrepared& f, const StatsTargets& t, float* workspace, cudaStream_t stream) {
  Args a = f.a;
  StatsArgs st;
  st.ent = t.entropy;
  st.win = t.rows;
  st.win_first = t.rows_first;
  st.win_step = t.rows_step;
  st.win_count = t.rows.data != nullptr ? t.rows_count : 0;
  const bool cols = t.col_sum.data != nullptr;
  const int64_t tiles = (p.L + kBM - 1) / kBM, per_launch = cols ? stats_leads_per_launch(p) : p.num_lead;
  for (int64_t lead0 = 0; lead0 < p.num_lead; lead0 += per_launch) {
    a.lead0 = lead0;
    a.leads = std::min(per_launch, p.num_lead - lead0);
    if (cols) {
      st.col_part = workspace;
      st.col_nan = workspace + a.leads * 2 * tiles * p.S;
      check_cuda(cudaMemsetAsync(st.col_nan, 0, sizeof(float) * a.leads * 2 * tiles, stream), "clearing the NaN flags");
    }
    launch_for_head<true, false, T>(f.q, f.k, f.v, f.pm, p, a, st, f.mask, stream);
    if (cols) {
      const int64_t blocks = std::min<int64_t>((a.leads * p.S + 255) / 256, 65535);
      stats_columns<<<grid_x(blocks, "sm90 column sums"), 256, 0, stream>>>(st.col_part, st.col_nan, p, t.col_sum, lead0,
                                                                             a.leads, tiles);
      check_launch("sm90 column sums");
    }
  }
}

// Why neither kernel takes the inputs, O or lse; nullptr when both could.
const char* inputs_decline(const DevProblem& p) {
  if (!device_supported())
    return "not a Hopper GPU (compute capability 9.0), or turned off by SDPA_MATH_SM90=0";
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return "inputs not float16 or bfloat16";
  if (p.dropout != Dropout::None) return "dropout";
  if (p.E <= 0 || p.Ev <= 0 || p.E > 128 || p.Ev > 128 || padded_head(p.E) != padded_head(p.Ev))
    return "head sizes not both in 1..64 or both in 65..128";
  if (p.E % 8 != 0 || p.Ev % 8 != 0) return "a head size not a multiple of 8";
  // O in the inputs' dtype with rows that take 4-byte pair stores, lse in fp32 (as the binding
  // allocates them).
  if (p.out.dtype != p.q.dtype || p.lse.dtype != DType::Float32) return "O not in the inputs' dtype or lse not float32";
  if (!rows_vectorizable(p.out, p.lead_ndim, p.Ev, 2, 2)) return "O's rows do not take 4-byte stores";
  // A mask is read a pair of keys at a time.
  MaskKind kind;
  if (!mask_kind(p, kind)) return "a float mask neither float32 nor the inputs' dtype";
  if (p.mask.data != nullptr) {
    const int bytes = p.mask_is_bool ? 1 : p.mask.dtype == DType::Float32 ? 4 : 2;
    if (!rows_vectorizable(p.mask, p.lead_ndim, p.S, bytes, 2))
      return "mask rows not read a pair of keys at a time (unit key stride, even row strides and key count)";
  }
  if (p.L > 2147483647LL || p.S > 2147483647LL) return "L or S above 2^31";
  return nullptr;
}

// Why TMA cannot address Q, K and V (the maps are encoded into f), or nullptr.
const char* prepare_common(const DevProblem& p, ForwardPrepared& f) {
  if (!common_args(p, f.q, f.k, f.v, f.a, f.mask))
    return "the TMA unit cannot address q, k or v (unit column stride, 16-byte aligned base and strides, at most "
           "three lead dims of their own)";
  return nullptr;
}

}  // namespace
}  // namespace fwd

using fwd::inputs_decline;
using fwd::kBM;
using fwd::kStatsWorkspaceFloats;
using fwd::MaskKind;
using fwd::plan_shape;
using fwd::prepare_common;
using fwd::stats_for;
using fwd::stats_leads_per_launch;

const char* forward_declines(const DevProblem& p, std::shared_ptr<const ForwardPrepared>* prepared) {
  if (const char* why = inputs_decline(p)) return why;
  // P in the inputs' dtype, unit column stride (rows of any length: an odd S takes the copy
  // kernels' pair and 2-byte stores).
  if (p.probs.dtype != p.q.dtype) return "P not in the inputs' dtype";
  if (!rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 1)) return "P without unit column stride";
  // A float mask's kernel reads the plan from its first tile on: no plan without keys (S = 0),
  // nor where the kernel's 32-bit plan offsets would not reach (a plan of 8 GB, never in practice).
  const int64_t words = plan_shape(p).total_words();
  if ((p.mask.data != nullptr && !p.mask_is_bool) && (words <= 0 || words > INT32_MAX))
    return "a float mask and no keys, or a mask plan beyond 2^31 words";
  if (p.L == 0) return "no query rows";
  auto f = std::make_shared<ForwardPrepared>();
  if (const char* why = prepare_common(p, *f)) return why;
  fwd::Args& a = f->a;
  a.p_vec8 = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 8);
  a.p_vec4 = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 4);
  a.p_vec2 = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 2);
  a.mask_vec16 = p.mask_is_bool && rows_vectorizable(p.mask, p.lead_ndim, p.S, 1, 16);
  a.p_tma = make_map(&f->pm, p, p.probs, p.L, p.S, 64, a.p);
  if (!a.p_tma) std::memset(&f->pm, 0, sizeof(f->pm));  // the copy kernels take the map unused
  if (prepared) *prepared = std::move(f);
  return nullptr;
}

int64_t forward_workspace_words(const DevProblem& p) { return plan_shape(p).total_words(); }

void forward(const DevProblem& p, const ForwardPrepared& f, uint32_t* workspace, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) fwd::forward_for<__half>(p, f, workspace, stream);
  else fwd::forward_for<__nv_bfloat16>(p, f, workspace, stream);
}

const char* stats_declines(const DevProblem& p, const StatsTargets& t, std::shared_ptr<const ForwardPrepared>* prepared) {
  if (const char* why = inputs_decline(p)) return why;
  if (p.L == 0) return "no query rows";
  // fp32 statistics; the window's rows as P's (inputs' dtype, pair stores).
  if ((t.col_sum.data != nullptr && t.col_sum.dtype != DType::Float32) ||
      (t.entropy.data != nullptr && t.entropy.dtype != DType::Float32))
    return "statistics not float32";
  if (t.rows.data != nullptr && (t.rows.dtype != p.q.dtype || !rows_vectorizable(t.rows, p.lead_ndim, p.S, 2, 2)))
    return "the window's rows not in the inputs' dtype with 4-byte aligned rows (an even key count)";
  // Launches split the heads, not a head's row tiles: one head's partial rows of column sums
  // (L x S / 16 bytes) must fit the workspace budget (L = S = 32K does not).
  if (t.col_sum.data != nullptr && 2 * ((p.L + kBM - 1) / kBM) * (p.S + 1) > kStatsWorkspaceFloats)
    return "one head's column-sum partials exceed the 64 MiB workspace (L x S above about 2^30)";
  auto f = std::make_shared<ForwardPrepared>();
  if (const char* why = prepare_common(p, *f)) return why;
  f->a.p_tma = false;
  f->a.p_vec8 = f->a.p_vec4 = f->a.p_vec2 = false;
  std::memset(&f->pm, 0, sizeof(f->pm));
  if (prepared) *prepared = std::move(f);
  return nullptr;
}

int64_t stats_workspace_floats(const DevProblem& p, const StatsTargets& t) {
  if (t.col_sum.data == nullptr) return 0;
  return stats_leads_per_launch(p) * 2 * ((p.L + kBM - 1) / kBM) * (p.S + 1);
}

void forward_stats(const DevProblem& p, const ForwardPrepared& f, const StatsTargets& t, float* workspace,
                   cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) stats_for<__half>(p, f, t, workspace, stream);
  else stats_for<__nv_bfloat16>(p, f, t, workspace, stream);
}

}  // namespace sdpa_math::cuda::sm90
