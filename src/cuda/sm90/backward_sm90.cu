// The Hopper backward (fp16/bf16, sm_90a) from the forward's saved P, without dropout: delta per
// query row (delta_rows), then backward_sm90.cuh's main kernel and dQ conversion, and the entry
// points sm90.cuh declares for it. backward_sm90.cuh describes the kernels.
#include <memory>
#include <type_traits>

#include "backward_sm90.cuh"

namespace sdpa_math::cuda::sm90 {

// What backward_declines prepares for a problem it takes: the maps of Q, K, V, dO, P and dP_ext
// and the kernel's arguments (delta's map and the workspace pointers come with the run).
struct BackwardPrepared {
  CUtensorMap maps[6];
  Args a;
};

namespace {

// delta_i = dO_i · O_i + P_i · dP_ext,i in fp32. 32 / RPW lanes per row: with dP_ext (S long
// rows) a warp a row (RPW = 1); with dO alone (rows of at most 128 elements) four rows a warp, so a
// lane has more than one short load in flight. VW elements a load: 8 (16 bytes) or 4 (8 bytes)
// where every row allows, else 1. The 8-byte loads are for rows of S % 8 = 4 keys (tail100_d64's
// 1100), which element loads read well below copy bandwidth (bench/NOTES.md).
template <typename T, int VW, int RPW>
__global__ void delta_rows(const DevProblem p, float* delta, int64_t q_tiles) {
  static_assert(VW == 8 || VW == 4 || VW == 1, "16-byte, 8-byte or element loads");
  using Vec = std::conditional_t<VW == 8, uint4, uint2>;
  constexpr int kLanes = 32 / RPW;  // per row
  const int lane = threadIdx.x % 32, sub = lane % kLanes;
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32) * RPW + lane / kLanes;
  const bool valid = row < p.num_lead * p.L;
  // A warp's index math is most of its instructions here: 32-bit divisions where they fit.
  int64_t lead = 0, i = 0;
  if (valid && ((row | p.L) >> 31) == 0) {
    lead = static_cast<uint32_t>(row) / static_cast<uint32_t>(p.L);
    i = static_cast<uint32_t>(row) % static_cast<uint32_t>(p.L);
  } else if (valid) {
    lead = row / p.L;
    i = row % p.L;
  }
  auto dot = [&](const DevOperand& x, const DevOperand& y, int64_t n) {
    const T* xr = reinterpret_cast<const T*>(x.data) + lead_off_narrow(p, x, lead) + i * x.row;
    const T* yr = reinterpret_cast<const T*>(y.data) + lead_off_narrow(p, y, lead) + i * y.row;
    float acc = 0.0f;
    if (!valid) return acc;
    if constexpr (VW > 1) {
#pragma unroll 4  // several loads in flight per lane: long rows run at copy bandwidth
      for (int64_t e = sub * VW; e < n; e += VW * kLanes) {
        const Vec xa = *reinterpret_cast<const Vec*>(xr + e), ya = *reinterpret_cast<const Vec*>(yr + e);
        uint32_t xs[VW / 2], ys[VW / 2];
        memcpy(xs, &xa, sizeof(xs));
        memcpy(ys, &ya, sizeof(ys));
#pragma unroll
        for (int h = 0; h < VW / 2; ++h) {
          const float2 u = unpack2<T>(xs[h]), w = unpack2<T>(ys[h]);
          acc = fmaf(u.x, w.x, fmaf(u.y, w.y, acc));
        }
      }
    } else {
      for (int64_t e = sub; e < n; e += kLanes) acc = fmaf(to_float<T>(xr[e * x.col]), to_float<T>(yr[e * y.col]), acc);
    }
    return acc;
  };
  float acc = 0.0f;
  if (p.grad_out.data) acc += dot(p.grad_out, p.out, p.Ev);
  if (p.grad_probs.data) acc += dot(p.probs, p.grad_probs, p.S);
  for (int s = kLanes / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);  // within the row's lanes
  if (valid && sub == 0) delta[lead * q_tiles * kBM + i] = acc;
}

// Why TMA cannot address the operands (the maps are encoded into f: all but delta's, which is
// the call's workspace), or nullptr.
const char* prepare(const DevProblem& p, BackwardPrepared& f) {
  Args& a = f.a;
  CUtensorMap* maps = f.maps;
  a.has_do = p.grad_out.data != nullptr;
  a.has_dp = p.grad_probs.data != nullptr;
  const char* tma = "the TMA unit cannot address q, k, v or dO (unit column stride, 16-byte aligned base and strides, at "
                    "most three lead dims of their own)";
  if (!make_map(&maps[0], p, p.q, p.L, p.E, kBM, a.q) || !make_map(&maps[1], p, p.k, p.S, p.E, kBN, a.k) ||
      !make_map(&maps[2], p, p.v, p.S, p.Ev, kBN, a.v))
    return tma;
  if (a.has_do && !make_map(&maps[3], p, p.grad_out, p.L, p.Ev, kBM, a.dout)) return tma;
  a.p_tma = make_map(&maps[4], p, p.probs, p.L, p.S, kBM, a.p) &&
            (!a.has_dp || make_map(&maps[5], p, p.grad_probs, p.L, p.S, kBM, a.dp));
  // Otherwise the producer's copy warps take them: rows of P and dP_ext must be 4-byte aligned,
  // and take 8-byte copies where both allow it.
  auto rows_allow = [&](int w) {
    return rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, w) &&
           (!a.has_dp || rows_vectorizable(p.grad_probs, p.lead_ndim, p.S, 2, w));
  };
  if (!a.p_tma && !rows_allow(2))
    return "P or dP neither addressable by the TMA unit nor with 4-byte aligned rows (an even key count)";
  a.map_piece = rows_allow(4) ? 8 : 4;
  // Maps not used: never read; a copy keeps every parameter initialised.
  if (!a.has_do) maps[3] = maps[0];
  if (!a.p_tma) maps[4] = maps[0];
  if (!a.has_dp || !a.p_tma) maps[5] = maps[0];
  a.group = p.k.head_group;
  a.heads = p.lead_ndim > 0 ? p.lead_shape[p.lead_ndim - 1] : 1;
  a.kv_leads = p.num_lead / a.group;
  a.q_tiles = (p.L + kBM - 1) / kBM;
  a.scale = static_cast<float>(p.scale);
  a.unscale = nullptr;
  return nullptr;
}

template <typename T>
void backward_for(const DevProblem& p, const BackwardPrepared& f, const BackwardTargets& out, float* workspace,
                  cudaStream_t stream) {
  Args a = f.a;
  CUtensorMap maps[7];
  for (int m = 0; m < 6; ++m) maps[m] = f.maps[m];
  float* delta = workspace;
  a.delta = delta;
  // The workspace comes from the caller's allocator, 16-byte aligned (backend.cu's Scratch).
  if (!make_rows_map_f32(&maps[6], delta, a.q_tiles * kBM, p.num_lead, kBM))
    throw Error(ErrorCode::CudaFailure, "sm90 backward: the TMA unit cannot address the delta workspace");
  a.dq_acc = workspace + backward_delta_floats(p);
  a.dk = out.dk;
  a.dv = out.dv;
  const int64_t D = padded_head(p.E);
  const int64_t rows = p.num_lead * p.L;
  auto vec = [&](int w) {
    return (!a.has_do || (rows_vectorizable(p.grad_out, p.lead_ndim, p.Ev, 2, w) &&
                          rows_vectorizable(p.out, p.lead_ndim, p.Ev, 2, w))) &&
           (!a.has_dp || (rows_vectorizable(p.grad_probs, p.lead_ndim, p.S, 2, w) &&
                          rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, w)));
  };
  const int vw = vec(8) ? 8 : vec(4) ? 4 : 1;
  // 8 warps a block; four rows a warp without dP_ext.
  const int64_t delta_blocks = a.has_dp ? (rows + 7) / 8 : (rows + 31) / 32;
  const unsigned delta_grid = grid_x(delta_blocks, "sm90 delta");
  const auto delta_kernel =
      a.has_dp ? (vw == 8 ? &delta_rows<T, 8, 1> : vw == 4 ? &delta_rows<T, 4, 1> : &delta_rows<T, 1, 1>)
               : (vw == 8 ? &delta_rows<T, 8, 4> : vw == 4 ? &delta_rows<T, 4, 4> : &delta_rows<T, 1, 4>);
  delta_kernel<<<delta_grid, 256, 0, stream>>>(p, delta, a.q_tiles);
  check_launch("sm90 delta");
  if (D == 64) launch<T, 64, false>(maps, p, a, out, stream);
  else launch<T, 128, false>(maps, p, a, out, stream);
}

}  // namespace

const char* backward_declines(const DevProblem& p, std::shared_ptr<const BackwardPrepared>* prepared) {
  if (!device_supported()) return "not a Hopper GPU (compute capability 9.0), or turned off by SDPA_MATH_SM90=0";
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return "inputs not float16 or bfloat16";
  if (p.dropout != Dropout::None) return "dropout";
  if (p.probs.data == nullptr || p.probs.dtype != p.q.dtype) return "no saved P in the inputs' dtype";
  if (p.grad_out.data && (p.grad_out.dtype != p.q.dtype || p.out.data == nullptr || p.out.dtype != p.q.dtype))
    return "dO or the saved O not in the inputs' dtype";
  if (p.grad_probs.data && p.grad_probs.dtype != p.q.dtype) return "dP not in the inputs' dtype";
  if (p.E <= 0 || p.Ev <= 0 || p.E > 128 || p.Ev > 128 || padded_head(p.E) != padded_head(p.Ev))
    return "head sizes not both in 1..64 or both in 65..128";
  if (p.E % 8 != 0 || p.Ev % 8 != 0) return "a head size not a multiple of 8";
  // Each query row belongs to one lead index and each key row to one key head (GQA groups the
  // last lead dim): the gradients are stored, not summed over broadcast dims.
  bool broadcast = p.k.head_group != p.v.head_group || !qk_stored_per_head(p) || p.v.dense_col != 1;
  for (int d = 0; d < p.lead_ndim; ++d)
    if (p.lead_shape[d] != 1 && p.v.dense_lead[d] == 0) broadcast = true;
  if (broadcast) return "q, k or v broadcast over lead dims other than GQA's group";
  if (p.L <= 0 || p.S <= 0 || p.L > 2147483647LL || p.S > 2147483647LL) return "L or S is 0 or above 2^31";
  // The kernel's lead index math is 32-bit (map_coords32, lead_off32).
  if (p.num_lead > 2147483647LL) return "more than 2^31 lead indices (batch x heads)";
  auto f = std::make_shared<BackwardPrepared>();
  if (const char* why = prepare(p, *f)) return why;
  if (prepared) *prepared = std::move(f);
  return nullptr;
}

int64_t backward_delta_floats(const DevProblem& p) { return p.num_lead * ((p.L + kBM - 1) / kBM) * kBM; }

int64_t backward_workspace_floats(const DevProblem& p) {
  return backward_delta_floats(p) + p.num_lead * ((p.L + kBM - 1) / kBM) * kBM * padded_head(p.E);
}

void backward(const DevProblem& p, const BackwardPrepared& prepared, const BackwardTargets& out, float* workspace,
              cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) backward_for<__half>(p, prepared, out, workspace, stream);
  else backward_for<__nv_bfloat16>(p, prepared, out, workspace, stream);
}

}  // namespace sdpa_math::cuda::sm90
