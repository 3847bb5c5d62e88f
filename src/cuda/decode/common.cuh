// What the decode kernels share (src/cuda/decode/: forward.cu, finalize.cu, stats.cu,
// backward.cu): the launch constants, how a head's elements are spread over a warp, the
// forward's workspace and its layout, the 16-byte row loads and the contract's per-key rules.
//
// Decode is a few query rows (L <= kDecodeMaxRows), fp16, bf16 and fp32 inputs with fp32
// arithmetic. A tile kernel would give one CTA per head and waste all but L of its 64 rows;
// here the keys of each head are split into blocks and every (head, block) is a CTA, so the
// chip fills however few heads there are. The time is reading K and V, so each kernel reads
// each key row once:
//   forward.cu   the forward's first step, per (head, block): the logits (kept in an fp32
//                workspace, since P needs the row's max and sum over all blocks), the block's
//                max and sum and its unnormalized share of O; and the host side of the forward;
//   finalize.cu  its second step, per row: max and sum over the blocks, lse, O, and P from the
//                kept logits;
//   stats.cu     forward_stats's column sums, entropy and window rows, from the same logits;
//   backward.cu  the backward (fp16/bf16), K and V rows read once per key block likewise.
// Rows of K and V are read 16 bytes per lane, a key row split over LPK lanes, so a warp covers
// 32 / LPK keys per load and issues the loads of several steps together. Every contract rule
// (mask, causal, dropout, fully masked and NaN rows) comes from device_problem.cuh.
//
// The device helpers and the workspace type sit in an anonymous namespace, as the kernels that
// take them do: each file has its own copy, and the kernels keep internal linkage. What one file
// asks of another (launch plans and launches) uses named types only.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "../decode.cuh"
#include "../launch.cuh"
#include "../mma.cuh"

namespace sdpa_math::cuda {

// The forward's key block: kSplitKeysTc where decode_partial_tc takes the first step, else
// kSplitKeys (forward.cu).
int64_t decode_split_keys(const DevProblem& p);

// The second step for a chunk of `chunk` heads from lead index lead0 (finalize.cu). The plan
// holds the grids, taken before any kernel of the chunk runs, so that an oversized problem is
// refused before anything is launched.
struct DecodeFinalizePlan {
  dim3 finalize_grid;  // decode_finalize: rows x chunks of P's keys
  unsigned rows_grid;  // decode_finalize_rows: rows in groups of kRowWarps
};
DecodeFinalizePlan decode_finalize_plan(const DevProblem& p, int64_t chunk);
void decode_finalize_launch(const DevProblem& p, const DecodeFinalizePlan& plan, float* workspace, int64_t lead0,
                            int64_t chunk, cudaStream_t stream);

// forward_stats's statistics for the same chunk (stats.cu), after the finalize.
struct DecodeStatsPlan {
  bool any;            // some statistic asked for (else nothing to launch)
  int chunks;          // chunks of kStatsKeys keys a row
  dim3 grid;           // decode_stats: heads x key chunks
  unsigned entropy_grid;  // decode_entropy: rows in groups of 128
};
DecodeStatsPlan decode_stats_plan(const DevProblem& p, int64_t chunk, const StatsTargets* stats);
void decode_stats_launch(const DevProblem& p, const DecodeStatsPlan& plan, const StatsTargets& stats, float* workspace,
                         int64_t lead0, int64_t chunk, cudaStream_t stream);

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kSplitKeys = 256;
constexpr int kSplitKeysTc = 512;  // decode_partial_tc's blocks: 8 chunks of 16 keys a warp
constexpr int kUnroll = 4;          // warp steps in flight per warp: two register buffers of kUnroll / 2
constexpr int64_t kStatsKeys = 2048;  // keys of a decode_stats CTA (the workspace keeps a sum per chunk)

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

// Logits rows of the workspace are S rounded up to 4 floats: they start 16-byte aligned.
inline int64_t decode_score_row(const DevProblem& p) { return (p.S + 3) / 4 * 4; }

// The workspace of the chunk of heads [lead0, lead0 + chunk) at `workspace`: logits, then the
// shares of O, then the statistics, then the entropy sums. Rows of the first two are multiples
// of 4 floats (decode_score_row; Ev, as decode_declines asks), so decode_finalize_rows's 16-byte
// loads of either are aligned whatever the number of rows and blocks.
inline DecodeWorkspace chunk_workspace(const DevProblem& p, float* workspace, int64_t lead0, int64_t chunk) {
  const int64_t split = decode_split_keys(p), blocks = (p.S + split - 1) / split;
  DecodeWorkspace w;
  w.scores = workspace;
  w.score_row = decode_score_row(p);
  w.partial = w.scores + chunk * p.L * w.score_row;
  w.stats = w.partial + chunk * p.L * blocks * p.Ev;
  w.ent_part = w.stats + chunk * p.L * blocks * 2;
  w.blocks = blocks;
  w.lead0 = lead0;
  w.heads = decode_heads_per_cta(p);
  return w;
}

// exp(x - m) as a weight relative to a max m >= x: 0 for x = -inf (also when m = -inf, which
// would give NaN), NaN when either is NaN.
SDPA_MATH_D float weight_to(float x, float m) { return x == neg_inf<float>() ? 0.0f : __expf(x - m); }

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

}  // namespace
}  // namespace sdpa_math::cuda
