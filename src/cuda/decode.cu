// The kernels for a few query rows (decode: L <= kDecodeMaxRows), fp16, bf16 and fp32 inputs
// with fp32 arithmetic. A tile kernel would give one CTA per head and waste all but L of its 64
// rows; here the keys of each head are split into blocks of kSplitKeys and every (head, block)
// is a CTA, so the chip fills however few heads there are. The time is reading K and V, so the
// forward reads each once:
//   1) decode_partial: per (head, block), each key's logit s (kept in an fp32 workspace, since
//      P needs the row's max and sum over all blocks), and the block's max m_b, sum of
//      exp(s - m_b) and unnormalized share of O, sum_j exp(s_j - m_b) M_j V_j (M: the returned P's dropout
//      factor), with K and V rows loaded together;
//   2) decode_finalize (decode_finalize_rows for short rows without dropout): per row, the max
//      and sum over blocks, the log-sum-exp, O from the blocks' shares, and P = exp(s - m) / l
//      from the kept logits.
// The workspace is L*S4 + L*blocks*(Ev + 2) floats per head (S4: S rounded up to 4, so that rows of
// logits start 16-byte aligned); heads are taken in chunks so that it stays within
// kWorkspaceFloats (one head's worth at least).
// decode_partial_tc does step 1 on tensor cores for fp16/bf16 with E = Ev = 64 or 128 and no
// mask, causal or dropout: mma.sync for K Q^T and V^T P^T, fed from registers without shared
// memory or ldmatrix (see the kernel), in blocks of kSplitKeysTc keys.
// decode_backward (fp16/bf16) reads each K and V row once per key block likewise.
// Rows of K and V are read 16 bytes per lane, a key row split over LPK lanes, so a warp covers
// 32 / LPK keys per load and issues the loads of several steps together. Every contract rule
// (mask, causal, dropout, fully masked and NaN rows) comes from device_problem.cuh.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "decode.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kSplitKeys = 256;
constexpr int kSplitKeysTc = 512;  // decode_partial_tc's blocks: 8 chunks of 16 keys a warp
constexpr int kUnroll = 4;          // warp steps in flight per warp: two register buffers of kUnroll / 2
constexpr int kFinalizeThreads = 256;
constexpr int64_t kFinalizeKeys = 4096;               // keys of one row per finalize CTA
constexpr int64_t kWorkspaceFloats = (64 << 20) / 4;  // 64 MiB

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

// The forward's workspace for the chunk of heads [lead0, lead0 + chunk).
struct DecodeWorkspace {
  float* scores;   // [chunk][row][score_row]: the masked logits
  float* stats;    // [chunk][row][block][2]: the block's max m_b and sum of exp(s - m_b)
  float* partial;  // [chunk][row][block][Ev]: the block's sum of exp(s - m_b) M V
  float* ent_part;  // [chunk][row][stats chunks + 1]: decode_stats's entropy sums of a row, then its l
  int64_t score_row;  // S rounded up to 4: rows of logits start 16-byte aligned
  int64_t blocks;     // key blocks per head
  int64_t lead0;
  int64_t heads;   // heads per CTA (decode_heads_per_cta)
};

// exp(x - m) as a weight relative to a max m >= x: 0 for x = -inf (also when m = -inf, which
// would give NaN), NaN when either is NaN.
SDPA_MATH_D float weight_to(float x, float m) { return x == neg_inf<float>() ? 0.0f : __expf(x - m); }
// The same in base 2 (decode_partial_tc's logits are scaled by log2 e).
SDPA_MATH_D float weight2_to(float x, float m) { return x == neg_inf<float>() ? 0.0f : fast_exp2(x - m); }

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

// The query rows one CTA takes: `heads` consecutive heads (leads) that read the same key head
// (GQA's group, or one head), L rows each. CTA row x is row x % L of lead first_lead + x / L;
// rows are numbered lead * L + r in the workspace and in delta. Reading K and V once for the
// whole group, rather than once per head, is what makes GQA decode cost what MHA decode costs.
struct RowInfo {
  int64_t lead;
  int r;
  int64_t mask_at, dmask_at, probs_at, grad_probs_at;  // lead offsets (+ r * row for P and dP)
};

template <int R>
SDPA_MATH_D void describe_rows(const DevProblem& p, int64_t first_lead, int count, RowInfo (&rows)[R]) {
  if (threadIdx.x < count) {
    RowInfo& ri = rows[threadIdx.x];
    ri.lead = first_lead + threadIdx.x / p.L;
    ri.r = static_cast<int>(threadIdx.x % p.L);
    ri.mask_at = p.mask.data ? lead_off(p, p.mask, ri.lead) : 0;
    ri.dmask_at = p.dmask.data ? lead_off(p, p.dmask, ri.lead) : 0;
    ri.probs_at = p.probs.data ? lead_off(p, p.probs, ri.lead) + ri.r * p.probs.row : 0;
    ri.grad_probs_at = p.grad_probs.data ? lead_off(p, p.grad_probs, ri.lead) + ri.r * p.grad_probs.row : 0;
  }
}

// Rows of operand op (q or dO) for the CTA's rows in shared memory as fp32 (count x DT, zero
// past width; all zero when op is absent).
template <int DT>
SDPA_MATH_D void load_query_rows(const DevProblem& p, const DevOperand& op, int64_t width, int64_t first_lead,
                                 int count, float* dst) {
  for (int64_t n = threadIdx.x; n < count * DT; n += kThreads) {
    const int64_t x = n / DT, e = n % DT, lead = first_lead + x / p.L, r = x % p.L;
    dst[n] = op.data && e < width ? load_elem<float>(op.dtype, op.data, lead_off(p, op, lead) + r * op.row + e * op.col) : 0.0f;
  }
}

// The contract's logit and keep factor for CTA row ri and key j. PLAIN kernels are the ones
// launched without a mask, causal or dropout: their per-key work skips those rules' branches.
template <bool PLAIN>
SDPA_MATH_D float logit_at(const DevProblem& p, float dot, const RowInfo& ri, int64_t j) {
  if constexpr (PLAIN) return dot * static_cast<float>(p.scale);
  else return masked_logit<float>(p, dot, ri.mask_at, ri.r, j);
}
template <bool PLAIN>
SDPA_MATH_D float keep_at(const DevProblem& p, const RowInfo& ri, int64_t j) {
  if constexpr (PLAIN) return 1.0f;
  else return keep_of<float>(p, ri.dmask_at, ri.lead, ri.r, j);
}
SDPA_MATH_HD bool plain(const DevProblem& p) { return !p.mask.data && !p.causal && p.dropout == Dropout::None; }

// Whether decode_partial_tc takes the forward's first step: fp16/bf16, E = Ev = 64 or 128,
// PLAIN. SDPA_MATH_DECODE_TC=0 keeps decode_partial everywhere (A/B measurements: bench/NOTES.md,
// sessions 35 and 36). The key block size follows the kernel.
bool tensor_core_partial(const DevProblem& p) {
  static const bool enabled = [] {
    const char* env = std::getenv("SDPA_MATH_DECODE_TC");
    return !(env && std::string(env) == "0");
  }();
  return enabled && (p.q.dtype == DType::Float16 || p.q.dtype == DType::BFloat16) && p.E == p.Ev &&
         (p.E == 64 || p.E == 128) && plain(p);
}
int64_t split_keys(const DevProblem& p) { return tensor_core_partial(p) ? kSplitKeysTc : kSplitKeys; }

// The masked logits of key rows whose K chunks this lane holds (U warp steps from j0): key
// j0 + u * KPW + (lane / LPK). Every lane of a group gets its key's logit; rows past L and keys
// past j_end give -inf.
template <typename T, int DT, int U, int R, bool PLAIN>
SDPA_MATH_D void key_logits(const DevProblem& p, const float* q, const RowInfo (&rows)[R], int count,
                            const uint4 (&raw)[U][Layout<T, DT>::CH], int64_t j0, int64_t j_end, int lane,
                            float (&s)[U][R]) {
  using Lay = Layout<T, DT>;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) s[u][r] = neg_inf<float>();
  // Rows past count are skipped (the same for the whole CTA): decode's one row costs one pass.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= count) break;
#pragma unroll
    for (int u = 0; u < U; ++u) {
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
      if (j < j_end) s[u][r] = logit_at<PLAIN>(p, acc, rows[r], j);
    }
  }
}

// One pass over a block's K and V rows. Each group of LPK lanes keeps, per row, a running max m,
// sum l of exp(s - m) and its chunks of sum exp(s - m) M V (M: returned_prob's dropout factor; O's
// own factor comes at the end), rescaled
// when m grows; the groups, then the warps are merged at the end.
// CTAs per SM: five for one row; four for up to four rows (L > 1, or a GQA group's heads)
// without the mask, causal and dropout branches, at 128 registers and no spill (their time is
// their instruction stream and its latencies: 3 CTAs took 0.167 ms on decode_s32k_d128_gqa, 4
// take 0.142, bench/NOTES.md session 33 — that shape now runs decode_partial_tc; these kernels
// keep fp32, head 256, Ev != E and PLAIN with SDPA_MATH_DECODE_TC=0); three for the four-row
// kernels with those branches, which spill at 128.
template <typename T, int DT, int R, bool PLAIN>
__global__ void __launch_bounds__(kThreads, R == 1 ? 5 : (PLAIN ? 4 : 3)) decode_partial(DevProblem p, DecodeWorkspace w) {
  using Lay = Layout<T, DT>;
  constexpr int U = Lay::CH == 1 ? kUnroll / 2 : kUnroll / 4;  // per buffer; register budget at head 256
  extern __shared__ float smem[];
  __shared__ RowInfo rows[R];
  const int count = static_cast<int>(w.heads * p.L);  // rows of this CTA, <= R
  float* q = smem;                       // count x DT
  float* sc = q + count * DT;            // count x kSplitKeys: the block's logits
  float* wstat = sc + count * kSplitKeys;  // warps x R x 2: each warp's (m, l)
  float* wacc = wstat + kWarps * R * 2;  // warps x R x DT: each warp's share of O
  const int64_t blk = blockIdx.x % w.blocks, first_lead = w.lead0 + blockIdx.x / w.blocks * w.heads;
  const int64_t row0 = (first_lead - w.lead0) * p.L;  // the CTA's first row in the workspace
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  describe_rows<R>(p, first_lead, count, rows);
  load_query_rows<DT>(p, p.q, p.E, first_lead, count, q);
  __syncthreads();
  const int64_t k_at = lead_off(p, p.k, first_lead), v_at = lead_off(p, p.v, first_lead);
  const int64_t first = blk * kSplitKeys, j_end = min(p.S, first + kSplitKeys), n = j_end - first;
  constexpr int kStep = U * Lay::KPW;  // keys per warp step
  float m[R], l[R], acc[R][Lay::CH][Lay::EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf<float>();
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
      for (int i = 0; i < Lay::EPL; ++i) acc[r][c][i] = 0.0f;
  }
  // One warp step: the logits of its keys and the online update of m, l and the share of O.
  auto consume = [&](int64_t j0, const uint4 (&kraw)[U][Lay::CH], const uint4 (&vraw)[U][Lay::CH]) {
    float s[U][R];
    key_logits<T, DT, U, R, PLAIN>(p, q, rows, count, kraw, j0, j_end, lane, s);
    float vx[U][Lay::CH][Lay::EPL];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) unpack16<T>(vraw[u][c], vx[u][c]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= count) break;
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = max_nan(mx, s[u][r]);
      const float alpha = weight_to(m[r], mx);
      l[r] *= alpha;
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) acc[r][c][i] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + u * Lay::KPW + kofs;
        const float e = weight_to(s[u][r], mx);
        l[r] += e;
        if (j < j_end && sub == 0) sc[r * kSplitKeys + (j - first)] = s[u][r];
        // Keys past j_end have e = 0; their dropout entries lie outside the row (initcheck found
        // the read), so they are not read.
        const float wv = PLAIN || p.dropout == Dropout::None || j >= j_end
                             ? e
                             : returned_prob<float>(p, e, keep_at<PLAIN>(p, rows[r], j));
#pragma unroll
        for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) acc[r][c][i] += wv * vx[u][c][i];
      }
      m[r] = mx;
    }
  };
  // Two register buffers: the next step's rows are in flight while this step's are used. (A
  // loop unrolled by two, with no copy of the buffer, ran no faster: bench/NOTES.md.)
  constexpr int64_t kStride = kWarps * kStep;
  uint4 knext[U][Lay::CH], vnext[U][Lay::CH];
  load_rows<T, DT, U>(p.k, k_at, first + warp * kStep, j_end, p.E, lane, true, knext);
  load_rows<T, DT, U>(p.v, v_at, first + warp * kStep, j_end, p.Ev, lane, true, vnext);
  for (int64_t j0 = first + warp * kStep; j0 < j_end; j0 += kStride) {
    uint4 kraw[U][Lay::CH], vraw[U][Lay::CH];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) kraw[u][c] = knext[u][c], vraw[u][c] = vnext[u][c];
    load_rows<T, DT, U>(p.k, k_at, j0 + kStride, j_end, p.E, lane, true, knext);
    load_rows<T, DT, U>(p.v, v_at, j0 + kStride, j_end, p.Ev, lane, true, vnext);
    consume(j0, kraw, vraw);
  }
  // The warp's key groups merged by shuffles, then each warp's result into shared memory.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= count) break;
#pragma unroll
    for (int o = 16; o >= Lay::LPK; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[r], o), l2 = __shfl_xor_sync(0xffffffffu, l[r], o);
      const float mx = max_nan(m[r], m2), a = weight_to(m[r], mx), b = weight_to(m2, mx);
      l[r] = l[r] * a + l2 * b;
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i)
          acc[r][c][i] = acc[r][c][i] * a + __shfl_xor_sync(0xffffffffu, acc[r][c][i], o) * b;
      m[r] = mx;
    }
    if (kofs == 0) {
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) wacc[(warp * R + r) * DT + (sub + c * Lay::LPK) * Lay::EPL + i] = acc[r][c][i];
    }
    if (lane == 0) {
      wstat[(warp * R + r) * 2] = m[r];
      wstat[(warp * R + r) * 2 + 1] = l[r];
    }
  }
  __syncthreads();
  // The block's (m_b, l_b) and share of O over the warps, and its logits, to the workspace.
  for (int r = 0; r < count; ++r) {
    float mb = neg_inf<float>();
    for (int x = 0; x < kWarps; ++x) mb = max_nan(mb, wstat[(x * R + r) * 2]);
    const int64_t at = (row0 + r) * w.blocks + blk;
    for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) {
      float o = 0.0f;
      for (int x = 0; x < kWarps; ++x) o += weight_to(wstat[(x * R + r) * 2], mb) * wacc[(x * R + r) * DT + e];
      w.partial[at * p.Ev + e] = o;
    }
    if (threadIdx.x == 0) {
      float lb = 0.0f;
      for (int x = 0; x < kWarps; ++x) lb += weight_to(wstat[(x * R + r) * 2], mb) * wstat[(x * R + r) * 2 + 1];
      w.stats[at * 2] = mb;
      w.stats[at * 2 + 1] = lb;
    }
    float* dst = w.scores + (row0 + r) * w.score_row + first;
    for (int64_t jj = threadIdx.x; jj < n; jj += kThreads) dst[jj] = sc[r * kSplitKeys + jj];
  }
}

// decode_partial's results on tensor cores (fp16/bf16, E = Ev = DT = 64 or 128, PLAIN problems),
// for the CTA's count <= kDecodeMaxRows rows. The products are taken transposed, S^T = K Q^T and
// O^T = V^T P^T: keys and output dimensions are the M side of m16n8k16 and the rows its N side,
// so every accumulator register holds a result (the untransposed form pads 16 rows of M to
// count and carries twice the registers of O). Each warp takes kSplitKeysTc / 4 keys in chunks
// of 16, with the next chunk's rows in flight while one is used (two register buffers). Per
// chunk:
// - A = K: lane (g, t) loads 16 bytes (8 head dimensions) of key rows g and g + 8 for each 32
//   dimensions, straight from global memory. A dot product does not care in which order the
//   dimensions are summed, so those 8 dimensions serve as the A fragments of two k-steps:
//   k-step 2 qq + x reads dimensions 32 qq + 8 t + 4 x + {0, 1} as k = 2t, 2t+1 and + {2, 3} as
//   k = 2t+8, 2t+9; B = Q^T takes the same order (built once).
// - Lane (g, t) gets the logits of keys g and g + 8 for rows 2t and 2t + 1; a row's max is taken
//   over the 8 lanes of one t. P^T as the B operand of O^T = V^T P^T needs row g's keys 2t, 2t+1
//   (and + 8): one movmatrix.trans of the packed (key g; rows 2t, 2t+1) words gives them. P is
//   rounded to T there, as flash attention does.
// - A = V^T: m-tile (z, jp)'s row g stands for dimension 64 z + 8 g + 2 jp, row g + 8 for the
//   one after it. Lane (g, t) loads 16 bytes of the rows of keys 2t, 2t+1, 2t+8, 2t+9 at
//   dimension 64 z + 8 g and pairs them with byte permutes.
// - O^T's accumulators hold rows 2t and 2t + 1, whose rescale factors the lane computed itself.
// 8 + 8 mma a chunk for DT = 128. The online softmax runs in base 2 (logits times log2 e); the
// block's max is stored in natural units, its sum is the same number. Key indices inside the
// block are 32-bit and each lane's row addresses are computed once. Measured in bench/NOTES.md,
// sessions 35 and 36 (prototype: tests/gpu/decode_tc_rate.cu, partial_tc_t).
template <typename T, int DT>
__global__ void __launch_bounds__(kThreads, 2) decode_partial_tc(DevProblem p, DecodeWorkspace w) {
  static_assert(DT == 64 || DT == 128, "registers: O^T takes DT / 4 of them a lane");
  constexpr int R = kDecodeMaxRows;
  static_assert(R <= 8, "rows are the N side (8) of m16n8k16");
  constexpr int kWarpKeys = kSplitKeysTc / kWarps, kChunks = kWarpKeys / 16, QQ = DT / 32, Z = DT / 64;
  constexpr int kPad = 4;  // sc's rows 4 banks apart: a warp's stores (rows 2t, 2t+1; keys g) meet no conflict
  static_assert(kChunks % 2 == 0, "the prefetching loop takes chunks in pairs");
  constexpr float kLog2e = 1.4426950408889634f;
  __shared__ float sc[R][kSplitKeysTc + kPad];  // the block's logits (natural units)
  __shared__ float wstat[kWarps][R][2];         // each warp's (m, l), base 2
  __shared__ __align__(16) float wacc[kWarps][R][DT];  // each warp's share of O (float2 stores)
  const int count = static_cast<int>(w.heads * p.L);
  // 32-bit: the grid is below 2^31 CTAs (grid_x), and a 64-bit division is a long call.
  const unsigned nblocks = static_cast<unsigned>(w.blocks), blk = blockIdx.x % nblocks;
  const int64_t first_lead = w.lead0 + static_cast<int64_t>(blockIdx.x / nblocks) * w.heads;
  const int64_t row0 = (first_lead - w.lead0) * p.L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int r0 = 2 * t, r1 = 2 * t + 1;  // this lane's rows of S^T and O^T
  // B = Q^T: row g's dimensions in the permuted order (zero for g >= count). Rows of 16 bytes
  // when q's rows allow it (the contiguous and the (B, L, H, E) layouts), else element by element.
  uint32_t qb[2 * QQ][2];
  {
    const int gr = g < count ? g : 0;
    const int64_t lead = first_lead + gr / p.L, r = gr % p.L;
    const T* qrow = reinterpret_cast<const T*>(p.q.data) + lead_off_narrow(p, p.q, lead) + r * p.q.row;
    const bool vec = p.q.col == 1 && reinterpret_cast<uintptr_t>(qrow) % 16 == 0;
#pragma unroll
    for (int qq = 0; qq < QQ; ++qq) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (g < count) {
        if (vec) {
          u = __ldg(reinterpret_cast<const uint4*>(qrow + 32 * qq + 8 * t));
        } else {
          auto at = [&](int i) { return reinterpret_cast<const uint16_t*>(qrow + (32 * qq + 8 * t + i) * p.q.col); };
          u = make_uint4(pack_raw(at(0), at(1)), pack_raw(at(2), at(3)), pack_raw(at(4), at(5)), pack_raw(at(6), at(7)));
        }
      }
      qb[2 * qq][0] = u.x, qb[2 * qq][1] = u.y, qb[2 * qq + 1][0] = u.z, qb[2 * qq + 1][1] = u.w;
    }
  }
  const int64_t first = static_cast<int64_t>(blk) * kSplitKeysTc, wfirst = first + warp * kWarpKeys;
  const int n = static_cast<int>(min(p.S - first, static_cast<int64_t>(kSplitKeysTc)));  // the block's keys
  const int wn = n - warp * kWarpKeys;  // the warp's keys (<= 0: none)
  const int64_t krow = p.k.row, vrow = p.v.row;
  const T* kp = reinterpret_cast<const T*>(p.k.data) + lead_off_narrow(p, p.k, first_lead) + (wfirst + g) * krow + 8 * t;
  const T* vp = reinterpret_cast<const T*>(p.v.data) + lead_off_narrow(p, p.v, first_lead) + (wfirst + 2 * t) * vrow + 8 * g;
  const float scale = static_cast<float>(p.scale);
  auto row16 = [](const T* at, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(at)) : make_uint4(0u, 0u, 0u, 0u);
  };
  using KRows = uint4[2][QQ];
  using VRows = uint4[4][Z];
  auto load = [&](KRows& kr, VRows& vr, int chunk) {
    const int c0 = chunk * 16;
    const T* kc = kp + c0 * krow;
    const T* vc = vp + c0 * vrow;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int qq = 0; qq < QQ; ++qq) kr[h][qq] = row16(kc + 8 * h * krow + 32 * qq, c0 + 8 * h + g < wn);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int dk = (i & 1) + (i >> 1) * 8;
#pragma unroll
      for (int z = 0; z < Z; ++z) vr[i][z] = row16(vc + dk * vrow + 64 * z, c0 + 2 * t + dk < wn);
    }
  };
  float m0 = neg_inf<float>(), m1 = neg_inf<float>(), l0 = 0.0f, l1 = 0.0f;  // rows r0, r1; base 2
  float o[Z][4][4];  // O^T: m-tile (z, jp)
#pragma unroll
  for (int z = 0; z < Z; ++z)
#pragma unroll
    for (int jp = 0; jp < 4; ++jp)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[z][jp][c] = 0.0f;
  auto consume = [&](const KRows& kr, const VRows& vr, int chunk) {
    const int c0 = chunk * 16;
    float s[2][4] = {};  // two product chains (x = 0, 1), added after
#pragma unroll
    for (int qq = 0; qq < QQ; ++qq)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const uint4 &k0 = kr[0][qq], &k1 = kr[1][qq];
        const uint32_t a[4] = {x ? k0.z : k0.x, x ? k1.z : k1.x, x ? k0.w : k0.y, x ? k1.w : k1.y};
        mma_16816<T>(s[x], a, qb[2 * qq + x][0], qb[2 * qq + x][1]);
      }
    float x2[4];  // base-2 logits of (key g, row r0), (g, r1), (g + 8, r0), (g + 8, r1)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int kk = c0 + g + (i >> 1) * 8;  // in the warp's keys
      const float logit = (s[0][i] + s[1][i]) * scale;
      x2[i] = kk < wn ? logit * kLog2e : neg_inf<float>();
      const int r = (i & 1) ? r1 : r0;
      if (r < count && kk < wn) sc[r][warp * kWarpKeys + kk] = logit;
    }
    const float mn0 = max_nan(m0, col_max_nan(max_nan(x2[0], x2[2])));
    const float mn1 = max_nan(m1, col_max_nan(max_nan(x2[1], x2[3])));
    const float a0 = weight2_to(m0, mn0), a1 = weight2_to(m1, mn1);
    const float p00 = weight2_to(x2[0], mn0), p01 = weight2_to(x2[1], mn1);
    const float p10 = weight2_to(x2[2], mn0), p11 = weight2_to(x2[3], mn1);
    l0 = l0 * a0 + (p00 + p10);
    l1 = l1 * a1 + (p01 + p11);
    m0 = mn0, m1 = mn1;
#pragma unroll
    for (int z = 0; z < Z; ++z)
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) o[z][jp][0] *= a0, o[z][jp][1] *= a1, o[z][jp][2] *= a0, o[z][jp][3] *= a1;
    const uint32_t b0 = transpose8x8_b16(pack2<T>(p00, p01)), b1 = transpose8x8_b16(pack2<T>(p10, p11));
#pragma unroll
    for (int z = 0; z < Z; ++z)
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        auto word = [&](const uint4& u) { return jp == 0 ? u.x : jp == 1 ? u.y : jp == 2 ? u.z : u.w; };
        const uint32_t v0 = word(vr[0][z]), v1 = word(vr[1][z]), v2 = word(vr[2][z]), v3 = word(vr[3][z]);
        const uint32_t a[4] = {__byte_perm(v0, v1, 0x5410u), __byte_perm(v0, v1, 0x7632u), __byte_perm(v2, v3, 0x5410u),
                               __byte_perm(v2, v3, 0x7632u)};
        mma_16816<T>(o[z][jp], a, b0, b1);
      }
  };
  {
    uint4 ka[2][QQ], va[4][Z], kb[2][QQ], vb[4][Z];
    load(ka, va, 0);
#pragma unroll 1
    for (int chunk = 0; chunk < kChunks; chunk += 2) {
      load(kb, vb, chunk + 1);
      consume(ka, va, chunk);
      if (chunk + 2 < kChunks) load(ka, va, chunk + 2);
      consume(kb, vb, chunk + 1);
    }
  }
  l0 = col_sum(l0), l1 = col_sum(l1);
  if (g == 0) {
    if (r0 < count) wstat[warp][r0][0] = m0, wstat[warp][r0][1] = l0;
    if (r1 < count) wstat[warp][r1][0] = m1, wstat[warp][r1][1] = l1;
  }
#pragma unroll
  for (int z = 0; z < Z; ++z)
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      const int e = 64 * z + 8 * g + 2 * jp;
      if (r0 < count) *reinterpret_cast<float2*>(&wacc[warp][r0][e]) = make_float2(o[z][jp][0], o[z][jp][2]);
      if (r1 < count) *reinterpret_cast<float2*>(&wacc[warp][r1][e]) = make_float2(o[z][jp][1], o[z][jp][3]);
    }
  __syncthreads();
  // The block's (m_b, l_b) and share of O over the warps, and its logits, to the workspace.
  for (int r = 0; r < count; ++r) {
    float mb = neg_inf<float>();
    for (int x = 0; x < kWarps; ++x) mb = max_nan(mb, wstat[x][r][0]);
    auto wt = [&](int x) { return weight2_to(wstat[x][r][0], mb); };
    const int64_t at = (row0 + r) * w.blocks + blk;
    for (int e = threadIdx.x; e < DT; e += kThreads) {
      float acc = 0.0f;
      for (int x = 0; x < kWarps; ++x) acc += wt(x) * wacc[x][r][e];
      w.partial[at * DT + e] = acc;
    }
    if (threadIdx.x == 0) {
      float lb = 0.0f;
      for (int x = 0; x < kWarps; ++x) lb += wt(x) * wstat[x][r][1];
      w.stats[at * 2] = mb * (1.0f / kLog2e);
      w.stats[at * 2 + 1] = lb;
    }
    float* dst = w.scores + (row0 + r) * w.score_row + first;
    for (int jj = threadIdx.x; jj < n; jj += kThreads) dst[jj] = sc[r][jj];
  }
}

// Per row (and chunk of kFinalizeKeys keys): the row's max and sum over its blocks; P of the
// chunk's keys from the kept logits; on the first chunk also the log-sum-exp and O.
// The kernel is a chain of dependent L2 reads, so its steps issue their loads ahead of their
// use: a thread's logits of the chunk at once, before the row's max and sum; O's per-block shares
// split over groups of threads, each thread with kFinalizeBatch blocks' loads (statistic and
// share) in flight (bench/NOTES.md, session 33: one load at a time took 0.068 ms of GQA decode's
// 0.237, with 128 blocks a row).
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
// (the lead's offsets, the dtype and dropout branches) made it issue-bound on MHA decode: 25 µs
// for 1024 rows of 2048 keys (bench/NOTES.md, sessions 33 and 36). A warp a row has few warps in
// all (one a row), so what counts is the instructions each issues: every load of the row goes
// out at once, 16 bytes a lane (lane `lane` holds keys 4 lane + 128 i .. + 3, the statistics of
// block `lane`, and O's shares of dimensions 4 lane + 128 c .. + 3 of every block), P is
// exp(s - m) times 1 / l, stored 4 keys at a time where P's row allows.
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
// decode (1024 heads) is resident at once: the first form, a CTA of 256 threads a head with the
// loads after the statistics, took 0.044 ms there (bench/NOTES.md, session 37).
constexpr int kStatsThreads = 128;
constexpr int64_t kStatsKeys = 2048;                                       // keys of a CTA
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

// The backward for a few query rows (fp16/bf16, after delta = rowsum(A . dA) is known): per
// (head, block of keys) CTA, every key row j of K and V is read once and
//   g_r = dO_r . V_j, A_rj (the saved P without dropout, else exp(s - lse)), dA, dS, W by the
//   contract's rules; dV_j = sum_r W_rj dO_r and dK_j = scale sum_r dS_rj q_r, stored (16 bytes
//   a lane where the gradient is dense and aligned, else per element, or added to the fp32
//   accumulators when heads share key rows); dQ_r += scale dS_rj K_j summed over the CTA's
//   keys, then added to the fp32 dQ.
// The step's P and dP elements are loaded beside its K and V rows, so one memory latency is
// paid per step, not two. A tile backward would sweep a 64-row query tile per key block for one
// row. CTAs per SM: five for one row (96 registers, a few bytes spilled outside the key loop, and
// measured faster than a four-CTA variant: bench/NOTES.md session 13), three for four rows, whose per-row dQ
// sums need more than 128 registers.
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
        // P and dP have the inputs' dtype here (tensor_core_backward_applies).
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

template <typename T, int DT>
void launch_decode(const DevProblem& p, const DecodeWorkspace& w, int64_t chunk, const StatsTargets* stats,
                   cudaStream_t stream) {
  const int64_t ctas = chunk / w.heads * w.blocks, count = w.heads * p.L;
  // Every grid first, so an oversized problem is refused before any kernel runs.
  const unsigned partial_grid = grid_x(ctas, "decode blocks");
  const int64_t p_chunks = p.probs.data ? (p.S + kFinalizeKeys - 1) / kFinalizeKeys : 1;
  const dim3 finalize_grid(grid_x(chunk * p.L, "decode rows"), grid_yz(p_chunks, "decode rows"));
  const unsigned rows_grid = grid_x((chunk * p.L + kRowWarps - 1) / kRowWarps, "decode rows");
  // The statistics' grids only when asked (the plain forward keeps its own limits on S);
  // decode_stats_applies keeps their key chunks within the grid's second dimension.
  const bool any_stats = stats && (stats->col_sum.data || stats->entropy.data || stats->rows.data);
  const int stats_chunks = static_cast<int>((p.S + kStatsKeys - 1) / kStatsKeys);
  const dim3 stats_grid = any_stats ? dim3(grid_x(chunk, "decode statistics"), grid_yz(stats_chunks, "decode statistics"))
                                    : dim3(1);
  const unsigned entropy_grid = any_stats ? grid_x((chunk * p.L + 127) / 128, "decode statistics") : 1;
  // decode_partial: one row per CTA has kernels of its own (a quarter of the registers).
  auto go = [&](auto kernel, int rows) {
    const size_t smem = sizeof(float) * (count * DT + count * kSplitKeys + kWarps * rows * (2 + DT));
    kernel<<<partial_grid, kThreads, smem, stream>>>(p, w);
  };
  auto tensor_cores = [&] {
    if constexpr (!std::is_same_v<T, float> && DT <= 128) {
      if (tensor_core_partial(p)) {
        decode_partial_tc<T, DT><<<partial_grid, kThreads, 0, stream>>>(p, w);
        return true;
      }
    }
    return false;
  };
  if (!tensor_cores()) {
    if (count == 1) plain(p) ? go(decode_partial<T, DT, 1, true>, 1) : go(decode_partial<T, DT, 1, false>, 1);
    else if (plain(p)) go(decode_partial<T, DT, kDecodeMaxRows, true>, kDecodeMaxRows);
    else go(decode_partial<T, DT, kDecodeMaxRows, false>, kDecodeMaxRows);
  }
  check_launch("decode blocks");
  if (decode_finalize_rows_apply(p)) decode_finalize_rows<T><<<rows_grid, kRowWarps * 32, 0, stream>>>(p, w, chunk * p.L);
  else decode_finalize<<<finalize_grid, kFinalizeThreads, 0, stream>>>(p, w);
  check_launch("decode rows");
  if (any_stats) {
    if (p.L == 1) decode_stats<1><<<stats_grid, kStatsThreads, 0, stream>>>(p, w, *stats);
    else decode_stats<kDecodeMaxRows><<<stats_grid, kStatsThreads, 0, stream>>>(p, w, *stats);
    if (stats->entropy.data && stats_chunks > 1)
      decode_entropy<<<entropy_grid, 128, 0, stream>>>(p, w, *stats, chunk * p.L, stats_chunks);
    check_launch("decode statistics");
  }
}

template <typename T>
void launch_for_head(const DevProblem& p, const DecodeWorkspace& w, int64_t chunk, const StatsTargets* stats,
                     cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  if (head <= 64) launch_decode<T, 64>(p, w, chunk, stats, stream);
  else if (head <= 128) launch_decode<T, 128>(p, w, chunk, stats, stream);
  else launch_decode<T, 256>(p, w, chunk, stats, stream);
}

// Workspace floats of one head, and how many heads one pass takes.
int64_t score_row(const DevProblem& p) { return (p.S + 3) / 4 * 4; }
int64_t workspace_per_lead(const DevProblem& p) {
  const int64_t blocks = (p.S + split_keys(p) - 1) / split_keys(p), stats_chunks = (p.S + kStatsKeys - 1) / kStatsKeys;
  return p.L * score_row(p) + p.L * blocks * (p.Ev + 2) + p.L * (stats_chunks + 1);
}
int64_t leads_per_pass(const DevProblem& p) {
  const int64_t heads = decode_heads_per_cta(p);  // whole groups: num_lead is a multiple of it
  return std::max<int64_t>(1, std::min<int64_t>(p.num_lead, kWorkspaceFloats / workspace_per_lead(p)) / heads) * heads;
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

bool decode_stats_applies(const DevProblem& p, const StatsTargets& t) {
  const bool fp32 = (!t.col_sum.data || t.col_sum.dtype == DType::Float32) &&
                    (!t.entropy.data || t.entropy.dtype == DType::Float32);
  return fp32 && decode_applies(p) && p.dropout == Dropout::None && (p.S + kStatsKeys - 1) / kStatsKeys <= 65535;
}

bool decode_backward_applies(const DevProblem& p) {
  return decode_applies(p) && (p.q.dtype == DType::Float16 || p.q.dtype == DType::BFloat16);
}

// How many heads of one key head's group a CTA takes: the most that divide the group with
// heads * L <= kDecodeMaxRows (1 without GQA).
int64_t decode_heads_per_cta(const DevProblem& p) {
  const int64_t g = p.k.head_group == p.v.head_group ? p.k.head_group : 1;
  int64_t h = 1;
  for (int64_t d = 1; d <= g; ++d)
    if (g % d == 0 && d * p.L <= kDecodeMaxRows) h = d;
  return h;
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

void decode_backward_run(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) launch_backward_for_head<__half>(p, g, stream);
  else launch_backward_for_head<__nv_bfloat16>(p, g, stream);
}

int64_t decode_workspace_floats(const DevProblem& p) { return leads_per_pass(p) * workspace_per_lead(p); }

void decode_forward(const DevProblem& p, float* workspace, cudaStream_t stream, const StatsTargets* stats) {
  const int64_t chunk_max = leads_per_pass(p), blocks = (p.S + split_keys(p) - 1) / split_keys(p);
  for (int64_t lead0 = 0; lead0 < p.num_lead; lead0 += chunk_max) {
    const int64_t chunk = std::min(chunk_max, p.num_lead - lead0);
    DecodeWorkspace w;
    w.scores = workspace;
    // Logits, then the shares of O, then the statistics: rows of both of the first two are
    // multiples of 4 floats (score_row; Ev, as decode_applies asks), so decode_finalize_rows's
    // 16-byte loads of either are aligned whatever the number of rows and blocks.
    w.score_row = score_row(p);
    w.partial = w.scores + chunk * p.L * w.score_row;
    w.stats = w.partial + chunk * p.L * blocks * p.Ev;
    w.ent_part = w.stats + chunk * p.L * blocks * 2;
    w.blocks = blocks;
    w.lead0 = lead0;
    w.heads = decode_heads_per_cta(p);
    switch (p.q.dtype) {
      case DType::Float16: launch_for_head<__half>(p, w, chunk, stats, stream); break;
      case DType::BFloat16: launch_for_head<__nv_bfloat16>(p, w, chunk, stats, stream); break;
      default: launch_for_head<float>(p, w, chunk, stats, stream); break;
    }
  }
}

}  // namespace sdpa_math::cuda
