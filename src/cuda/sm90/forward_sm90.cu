// The Hopper forward (fp16/bf16): per CTA 128 query rows of one head, one producer warpgroup
// and two consumer warpgroups of 64 rows each.
//
// The producer's one thread brings Q once and then the key tiles of both passes through the TMA
// unit into a ring of shared-memory stages (K alone in pass 1, K and V in pass 2), each stage
// completing on its `full` mbarrier and handed back on its `empty` one. The consumers run the two
// passes of the design: pass 1 forms S = Q Kᵀ with wgmma (both operands in shared memory) and
// keeps each row's running max and sum; pass 2 forms S again, writes P = exp(s - m) / l once from
// registers, and accumulates O += u V with wgmma taking u = exp(s - m) as its A operand from
// registers (O is divided by l at the end). Scores are in base-2 units (one multiply-add and one
// ex2 per element). The row maximum propagates NaN (max.NaN), so a NaN score gives a NaN row of
// P and O and a NaN lse, as the math op does.
//
// Registers: the producer gives its share back (setmaxnreg), the consumers take 232 each: S is 64
// fp32 per thread, O up to 64, u as A fragments 32.
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../launch.cuh"
#include "../mma.cuh"
#include "hopper.cuh"
#include "sm90.cuh"
#include "tensor_maps.cuh"
#include "trace.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

constexpr int kBM = 128;              // query rows per CTA
constexpr int kBN = 128;              // keys per tile

// The timeline of trace.cuh: FWD_TRACE(statement) is the statement in a trace build
// (SDPA_MATH_FWD_TRACE) and in the forward proper (not the statistics kernel), else nothing;
// FWD_STAMP(code) stamps a step.
#ifdef SDPA_MATH_FWD_TRACE
#define FWD_TRACE(...)          \
  do {                          \
    if constexpr (!STATS) {     \
      __VA_ARGS__;              \
    }                           \
  } while (0)
#else
#define FWD_TRACE(...) \
  do {                 \
  } while (0)
#endif
#define FWD_STAMP(code) FWD_TRACE(if (trace_leader) trace::stamp(trace_role, trace_slot, code))

// Shared memory: Q; a ring of K tiles (both passes) and one of V tiles (pass 2), each stage with a
// `full` and an `empty` mbarrier; each consumer warpgroup's 64 x kBN tiles of P on their way out.
template <int D, bool STATS>
struct Tiles {
  static constexpr int kBlocks = D / 64;  // 128-byte column blocks across the head
  // P tiles per warpgroup, used in turn by the key tiles. With two, a tile's stores into shared
  // memory wait only for the TMA store of two tiles before to have read its buffer, not for the
  // one just issued. The head-128 forward trades a K stage for the second buffer: its masked
  // kernels 2-4 % faster, the unmasked ones unchanged (run s25-v88). At head 64, where shared
  // memory has room for both, a second buffer measured nothing (v88), and the statistics kernel
  // writes no P through it.
  static constexpr int kPBuffers = !STATS && D == 128 ? 2 : 1;
  static constexpr int kKStages = D == 64 ? 4 : kPBuffers == 2 ? 2 : 3;
  static constexpr int kVStages = 2;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kKVBytes = kBN * D * 2;  // one K or V tile
  static constexpr int kPBytes = 64 * kBN * 2;  // one warpgroup's P tile
  static constexpr int kBarriers = 2 * kKStages + 2 * kVStages + 1;
  // + one byte a query row: whether the row is NaN, for the causal tail's fill; + where each
  // consumer warp's mask plan bits start
  static constexpr size_t kSmem =
      1024 + kQBytes + (kKStages + kVStages) * kKVBytes + 2 * kPBuffers * kPBytes + 8 * kBarriers + kBM + 4 * 8;
};

struct Args {
  MapCoords q, k, v, p;
  bool p_tma;   // P's tiles leave shared memory by TMA stores (rows 16-byte aligned), else by the
                // warpgroup's own coalesced stores, 8 bytes a thread (p_vec4), 4 (p_vec2) or 4 and 2
  bool p_vec8;  // P's rows take 16-byte stores (the causal zeros)
  bool p_vec4;  // P's rows take 8-byte stores
  bool p_vec2;  // P's rows take 4-byte stores (S even); else (odd S) pairs and 2-byte stores
  bool mask_vec16 = false;  // a bool mask's rows take 16-byte loads (the scan for hidden key tiles)
  bool fold;    // a positive scale (in fp32): clean tiles in base-2 units fold the scale into max
                // and exponent (decided here: a double compare in the kernel waits on the
                // tensor-core pipe)
  float scale;       // the scale in fp32, and times log2 e (base-2 units: unmasked, bool and fp16
  float scale_log2;  // masks)
  int64_t lead0 = 0, leads = 0;  // this launch's lead indices: lead0 .. lead0 + leads - 1
  // The mask plan (see build_mask_plan), built for a float mask's forward (nullptr otherwise):
  // which key tiles leave the logits of a warp's 16 rows as they are. Its bits for (plan lead,
  // row group) start at plan + (plan_lead * plan_groups + group) * plan_words; plan_groups is 1
  // for a mask broadcast over rows.
  const uint32_t* plan = nullptr;
  int64_t plan_groups = 0;
  int plan_words = 0;
};

// The statistics kernel's targets (forward_sm90<..., STATS = true>: P is not written).
// Column sums leave as one partial row per warpgroup (64 query rows), in a fixed order, so the
// sums do not depend on timing: col_part[(lead - lead0) * slots + slot][j] for the keys the
// warpgroup's CTA covers (slot = 2 * row tile + warpgroup; causal CTAs stop at their diagonal
// tile), and col_nan[...][slot] = NaN when one of the slot's rows is NaN (a NaN row of P is NaN
// at every key, the ones past the diagonal too), else untouched (zeroed by the caller).
// stats_columns() adds the slots up afterwards.
struct StatsArgs {
  float* col_part = nullptr;  // nullptr: no column sums
  float* col_nan = nullptr;
  DevOperand ent;             // row entropy, fp32 (data nullptr: not wanted)
  DevOperand win;             // P's rows first + k * step, k < count, in the inputs' dtype
  int64_t win_first = 0, win_step = 1, win_count = 0;
};

// Max over this thread's elements of accumulator row r (s[4n + 2r], s[4n + 2r + 1]) as a tree,
// not a 32-long chain of dependent instructions.
template <int N>
SDPA_MATH_D float row_max(const float (&s)[N], int r) {
  float v[N / 4];
#pragma unroll
  for (int n = 0; n < N / 4; ++n) v[n] = max_nan(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]);
  static_assert(N == 64, "the tree below halves 16 values four times");
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = max_nan(v[i], v[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = max_nan(v[i], v[i + 4]);
  return max_nan(max_nan(v[0], v[2]), max_nan(v[1], v[3]));
}
// exp(logit - m) for a logit x: base-2 logits (unmasked, bool and fp16 masks) take 2^(x·mul − m)
// in one multiply-add, where mul folds in the scale for raw scores; natural ones (bf16 and fp32
// masks, on the tiles the mask changes: see exponent_of) take 2^((x − m)·log2 e), the difference
// first, since x and m near a float mask's finfo.min would overflow fp32 times log2 e.
template <bool NATURAL>
SDPA_MATH_D float exp_from(float x, float mul, float m) {
  if constexpr (NATURAL) return fast_exp2((x - m) * 1.4426950408889634f);
  else return fast_exp2(fmaf(x, mul, -m));
}
// The multiply-add of a row's exponents over one tile, 2^(x·mul − off). Base-2 kernels: mul and
// m as exp_from. Natural kernels: a tile the mask changes has had m subtracted first
// (shift_row), then 2^(x·log2 e), as exp_from; a tile of raw scores (clean, its pairs neutral,
// the scale folded) takes the base-2 kernels' one multiply-add, 2^(s·scale·log2 e − m·log2 e),
// where logits scaled it first and the exponent took a subtract and a multiply. Safe from the
// overflow above: the row's max is at least the tile's largest scaled score, so m·log2 e cannot
// run to −inf. Towards +inf (a mask value near fp32's largest somewhere else in the row) off is
// +inf and the tile's exponents 0, their value's limit; scores themselves past FLT_MAX / log2 e
// are then limited as in the unmasked kernels.
struct Exponent {
  float mul, off;
};
template <bool NATURAL>
SDPA_MATH_D Exponent exponent_of(bool raw, float mul, float m, float scale_log2) {
  if constexpr (!NATURAL) return {mul, m};
  else return raw ? Exponent{scale_log2, m * 1.4426950408889634f} : Exponent{1.4426950408889634f, 0.0f};
}
// x − m in place over the elements of accumulator row r (a natural kernel's tile the mask changes).
template <int N>
SDPA_MATH_D void shift_row(float (&s)[N], int r, float m) {
#pragma unroll
  for (int n = 0; n < N / 4; ++n) {
    s[4 * n + 2 * r] -= m;
    s[4 * n + 2 * r + 1] -= m;
  }
}
// Σ 2^(x·mul − off) over the same elements as row_max, in four independent partial sums.
template <int N>
SDPA_MATH_D float row_sum_exp(const float (&s)[N], int r, const Exponent& e) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < N / 4; ++n)
    acc[n % 4] += exp_from<false>(s[4 * n + 2 * r], e.mul, e.off) + exp_from<false>(s[4 * n + 2 * r + 1], e.mul, e.off);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// STATS: the warpgroup's 64 rows of P summed per key of the tile at j0. This thread holds its two
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

// The mask's element type, fixed per kernel so its loads are plain typed loads.
enum class MaskKind : int { None, Bool, Same /* the inputs' dtype */, Float32 };

// Two neighbouring mask elements (keys j, j + 1) as one load, and element e of them applied to
// a scaled score x (BASE2: x in base-2 units, a float mask's value times log2 e).
template <typename T, MaskKind M, bool BASE2>
struct MaskPair {
  using Raw = std::conditional_t<M == MaskKind::Bool, uint16_t, std::conditional_t<M == MaskKind::Same, uint32_t, float2>>;
  static constexpr int kBytes = M == MaskKind::Bool ? 1 : M == MaskKind::Same ? 2 : 4;  // per element
  // A bool mask selects -inf for a hidden key instead of adding it, so a NaN score there (a NaN
  // key) takes no part in the row (contract §13); adding gave NaN + -inf = NaN, a NaN row (run
  // s27-v102). A float mask is added, as the math op adds it.
  static SDPA_MATH_D float apply(float x, const Raw& raw, int e) {
    if constexpr (M == MaskKind::Bool) {
      return ((raw >> (8 * e)) & 0xFF) ? x : -INFINITY;
    } else {
      float v;
      if constexpr (M == MaskKind::Same) v = to_float<T>(reinterpret_cast<const T*>(&raw)[e]);
      else v = e ? raw.y : raw.x;
      return BASE2 ? fmaf(v, 1.4426950408889634f, x) : x + v;
    }
  }
  // Folds a pair into acc, which starts at kNeutralStart; neutral(acc): every pair folded leaves
  // its logits as they are (bool: both keys visible; float: both +0 or -0). Bool bytes are 0 or
  // 1 in torch, and a byte without its low bit only makes the test fail, so a tile is never
  // taken for visible when it is not. A NaN or any nonzero float fails the test too.
  using Acc = uint32_t;
  static constexpr Acc kNeutralStart = M == MaskKind::Bool ? 0xFFFFFFFFu : 0u;
  static SDPA_MATH_D Acc fold_in(Acc acc, const Raw& raw) {
    if constexpr (M == MaskKind::Bool) return acc & raw;
    else if constexpr (M == MaskKind::Same) return acc | raw;
    else return acc | __float_as_uint(raw.x) | __float_as_uint(raw.y);
  }
  // A pair that is neutral (both keys visible, both values 0), for the plan's padding.
  static SDPA_MATH_D Raw neutral_raw() {
    if constexpr (M == MaskKind::Bool) return Raw(0x0101u);
    else return Raw{};
  }
  static SDPA_MATH_D bool neutral(Acc acc) {
    if constexpr (M == MaskKind::Bool) return (acc & 0x0101u) == 0x0101u;
    else if constexpr (M == MaskKind::Same) return (acc & 0x7FFF7FFFu) == 0;
    else return (acc & 0x7FFFFFFFu) == 0;
  }
};

// The mask plan's lead index of a forward lead index: the mask's lead coordinates with a nonzero
// stride, numbered row-major (the broadcast ones dropped, so every head sharing a (B, 1, L, S)
// mask shares its plan).
SDPA_MATH_HD int64_t plan_lead(const DevProblem& p, int64_t lead) {
  int64_t idx = 0, mult = 1;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    int64_t n = p.lead_shape[d], c = lead % n;
    lead /= n;
    if (d == p.lead_ndim - 1) {
      c /= p.mask.head_group;
      n /= p.mask.head_group;
    }
    if (p.mask.lead[d] != 0) {
      idx += c * mult;
      mult *= n;
    }
  }
  return idx;
}
// How many plan leads there are: the last lead index has every coordinate at its largest.
inline int64_t plan_leads(const DevProblem& p) { return plan_lead(p, p.num_lead - 1) + 1; }
// The mask's element offset of plan lead index idx (the inverse numbering of plan_lead).
SDPA_MATH_D int64_t plan_mask_offset(const DevProblem& p, int64_t idx) {
  int64_t off = 0;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    if (p.mask.lead[d] == 0) continue;
    const int64_t n = d == p.lead_ndim - 1 ? p.lead_shape[d] / p.mask.head_group : p.lead_shape[d];
    off += (idx % n) * p.mask.lead[d];
    idx /= n;
  }
  return off;
}

// The mask plan of a float mask: for each plan lead, group of 16 rows (one consumer warp's,
// groups of 16 from row 0; one group when the mask is broadcast over rows) and key tile, a bit
// set when every pair of the tile's keys (< S) in the group's rows (< L) is neutral
// (MaskPair::neutral: the bool kernels' vote, taken once per mask instead of once per head and
// pass). A (B, 1, L, S) mask is read once here, and the forward's warps load no pairs of a
// neutral tile. One warp per (plan lead, group, tile): 16 rows x 64 pairs, 32 loads a lane
// issued together. The plan starts zeroed (no tile neutral), so a tile this kernel did not
// reach is masked, never wrongly left out.
template <typename T, MaskKind M>
__global__ void __launch_bounds__(128) build_mask_plan(const DevProblem p, uint32_t* plan, int64_t groups, int words,
                                                       int64_t items) {
  using Mask = MaskPair<T, M, false>;
  const int lane = threadIdx.x % 32;
  const int64_t n_tiles = (p.S + kBN - 1) / kBN;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * 128 + threadIdx.x) / 32; item < items;
       item += static_cast<int64_t>(gridDim.x) * 4) {
    const int64_t tile = item % n_tiles, group = (item / n_tiles) % groups, lead = item / (n_tiles * groups);
    const char* m0 = p.mask.data + (plan_mask_offset(p, lead) + group * 16 * p.mask.row) * Mask::kBytes;
    const int64_t j0 = tile * kBN;
    // Rows of the group: one for a mask broadcast over rows (not groups == 1: L <= 16 has one
    // group of rows of its own, which the first form read as row 0 alone: review).
    const int rows = p.mask.row == 0 ? 1 : static_cast<int>(p.L - group * 16 < 16 ? p.L - group * 16 : 16);
    const int pairs = static_cast<int>((p.S - j0 < kBN ? p.S - j0 : kBN) / 2);  // S is even (a mask's rows are pair-aligned: inputs_apply)
    typename Mask::Raw raw[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {  // pair lane + 32 (i % 2) of row i / 2
      const int r = i / 2, c = lane + 32 * (i % 2);
      raw[i] = Mask::neutral_raw();
      if (r < rows && c < pairs)
        raw[i] = *reinterpret_cast<const typename Mask::Raw*>(m0 + (r * p.mask.row + j0 + 2 * c) * Mask::kBytes);
    }
    typename Mask::Acc acc = Mask::kNeutralStart;
#pragma unroll
    for (int i = 0; i < 32; ++i) acc = Mask::fold_in(acc, raw[i]);
    const bool neutral = __all_sync(0xffffffffu, Mask::neutral(acc));
    if (lane == 0 && neutral) atomicOr(plan + (lead * groups + group) * words + tile / 32, 1u << (tile % 32));
  }
}

// MASK = None: scores in base-2 units (x = s * scale * log2 e; one multiply-add and one ex2 per
// element), causal and the key tail by index, only on the tiles that need it; a bool mask keeps
// the logit or selects -inf, in the same units, and an fp16 mask adds its value times log2 e.
// With a bf16 or fp32 mask: natural units (x = s * scale + mask), so a row held at the mask's
// finfo.min still has finite logits (their base-2 form would overflow fp32) and gives the math
// op's uniform row; exponents are taken of differences, (x - m) * log2 e, except on a bf16
// mask's tiles that change no logit (exponent_of).
//
// STATS: the statistics kernel. P is not written (except the rows of st.win); pass 2 reduces it
// instead: each row's entropy −Σ P log P = log l + Σ_j P_j (m − x_j) (every term ≥ 0, no
// cancellation; m the row's max logit, l its sum of exp(x − m)) and the warpgroup's column sums.
//
// P_COPY: TMA cannot address P (mostly: its rows are not 16-byte aligned, S % 8 != 0) and its
// staged tiles leave by the warpgroup's own stores instead. Kernels of their own: with the copy's
// code in the TMA kernels (never run there) those were 3-7 % slower at their register limit (run
// s30-v115).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY = false>
__global__ void __launch_bounds__(kThreads, 1)
    forward_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                 const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_p, const DevProblem p,
                 const Args a, const StatsArgs st, const int64_t tiles) {
  using C = Tiles<D, STATS>;
  static_assert(!(STATS && P_COPY), "the statistics kernel writes no P tile");
  constexpr bool kMasked = MASK != MaskKind::None;
  // Pass 2 with the warpgroup's own products overlapped (see the loop), in the unmasked head-128
  // forward: prefill1k_d128 -2.5 %, gqa1k_d128 -4 % (run s26-v93). Head 64 lost 1-2 % with it and
  // keeps one product per turn; so do the statistics kernel (its column sums hold u's registers
  // longer) and the masked kernels (with the mask's pairs live as well they spill: fp32 mask,
  // head 128, 940 bytes; with the pairs loaded a tile ahead, session 28, bool 156 and fp16 64).
  constexpr bool kOverlap = !STATS && !kMasked && D == 128;
  // Logits in natural units only where a mask value can be near fp32's lowest (an fp32 or bf16
  // mask): a row held at finfo.min would overflow fp32 in base 2. A bool mask selects -inf,
  // which base 2 takes as is, and an fp16 mask's lowest (-65504) is 94500 in base 2: those are in
  // base-2 units, so their tiles whose pairs are neutral fold the scale as unmasked ones do (an
  // exponent one multiply-add, not a subtract and a multiply).
  constexpr bool kNatural = (MASK == MaskKind::Same && !std::is_same_v<T, __half>) || MASK == MaskKind::Float32;
  static_assert(!(kNatural && kOverlap), "the overlapped pass 2 does not shift a natural kernel's rows (shift_row)");
  // A float mask's forward reads the mask plan (build_mask_plan, always built for it): the warps
  // load no pairs of a tile the plan marks neutral and take no vote. Bool masks (one byte a key:
  // their loads cost little) keep the warps' vote, and so does the statistics form. With both
  // paths in one kernel, every masked forward was 12-17 % slower, the plan unused (run s29-v110).
  constexpr bool kPlanned = kMasked && !STATS && MASK != MaskKind::Bool;
  constexpr float kNegInf = -INFINITY;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sQ = reinterpret_cast<T*>(base);
  T* sK = reinterpret_cast<T*>(base + C::kQBytes);
  T* sV = sK + C::kKStages * kBN * D;
  T* sP = sV + C::kVStages * kBN * D;
  uint64_t* k_full = reinterpret_cast<uint64_t*>(sP + 2 * C::kPBuffers * 64 * kBN);
  uint64_t* k_empty = k_full + C::kKStages;
  uint64_t* v_full = k_empty + C::kKStages;
  uint64_t* v_empty = v_full + C::kVStages;
  uint64_t* q_full = v_empty + C::kVStages;
  uint8_t* row_is_nan = reinterpret_cast<uint8_t*>(q_full + 1);  // [kBM], the causal tail's fill value
  int* plan_at = reinterpret_cast<int*>(row_is_nan + kBM);  // [kConsumerWarps]: where each warp's plan bits start

  // The longest causal row blocks first, over every head of the launch.
  const int64_t lead = a.lead0 + blockIdx.x % a.leads;
  const int64_t row_tile = tiles - 1 - blockIdx.x / a.leads;
  const int64_t i0 = row_tile * kBM;
  const int64_t j_end = p.causal ? (i0 + kBM < p.S ? i0 + kBM : p.S) : p.S;
  int n_tiles = static_cast<int>((j_end + kBN - 1) / kBN);  // less the tiles a bool mask hides (below)
  // STATS: a CTA none of whose rows needs P normalised as it goes (no column sums asked, no row
  // of the window) runs one pass over the keys instead of two: the max and sum grow online, and
  // O and the entropy's sum are rescaled as the max grows (flash attention's way).
  bool one_pass = false;
  if constexpr (STATS) {
    bool window_rows = false;
    if (st.win_count > 0) {
      const int64_t rows_end = i0 + kBM < p.L ? i0 + kBM : p.L;
      const int64_t k = i0 <= st.win_first ? 0 : (i0 - st.win_first + st.win_step - 1) / st.win_step;
      window_rows = k < st.win_count && st.win_first + k * st.win_step < rows_end;
    }
    one_pass = st.col_part == nullptr && !window_rows;
  }

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kKStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&k_empty[s], kConsumerWarps);
    }
    for (int s = 0; s < C::kVStages; ++s) {
      mbar_init(&v_full[s], 1);
      mbar_init(&v_empty[s], kConsumerWarps);
    }
    mbar_init(q_full, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if constexpr (MASK == MaskKind::Bool && !STATS) {
    // Key tiles at the end that a bool mask hides from every row of the CTA contribute nothing
    // to O, l or the max, so they are neither loaded nor multiplied: the CTA stops before them,
    // and the causal tail's fill below writes their P (0, or NaN in a NaN row, as for keys right
    // of the diagonal; a NaN at a hidden key is ignored: docs/contract.md §13). (The statistics
    // form keeps every tile: its column pass counts the tiles each CTA covers.)
    // A key-padding mask (broadcast over rows: (B, 1, 1, S)): the threads scan its row from the
    // last tile, a key pair each, and stop at the first tile with a visible pair. Run s27-v101
    // (prefill1k_d128 fp16, A/B/A): batches padded by 0-3/8 of their keys 0.217 -> 0.191 ms; a
    // mask with nothing to skip unchanged. The same scan over 128 rows, 2-byte loads one after
    // another, took 10 % of the forward, and Q issued before the scan made it slower still
    // (+6 %).
    const uint8_t* m0 = reinterpret_cast<const uint8_t*>(p.mask.data) + lead_off(p, p.mask, lead);
    if (p.mask.row == 0) {
      while (n_tiles > 0) {
        const int64_t j0 = static_cast<int64_t>(n_tiles - 1) * kBN;
        const int pairs = static_cast<int>((j_end - j0 + 1) / 2);  // S is even (a mask's rows are pair-aligned: inputs_apply)
        bool seen = false;
        for (int c = threadIdx.x; c < pairs; c += blockDim.x)
          seen |= *reinterpret_cast<const uint16_t*>(m0 + j0 + 2 * c) != 0;
        if (__syncthreads_or(seen)) break;
        --n_tiles;
      }
    } else if (a.mask_vec16) {
      // A mask with rows of its own (Hugging Face's (B, 1, L, S): causal and padding in one),
      // 16-byte aligned: the CTA's rows of two tiles a step (2048 16-byte chunks, 6 a thread),
      // every thread's loads issued together, so a step costs about one L2 round trip. A causal
      // mask's upper triangle is then skipped as the causal kernel skips it (with a causal bool
      // mask and 100 padded keys, prefill1k_d128 0.25 -> 0.19 ms, runs s28-v103..v107).
      const int64_t rows = p.L - i0 < kBM ? p.L - i0 : kBM;
      const uint8_t* mr = m0 + i0 * p.mask.row;
      constexpr int kPerThread = (2 * kBM * kBN / 16 + kThreads - 1) / kThreads;
      while (n_tiles > 0) {
        // Tiles t_hi - 1 and t_hi (t_hi alone when it is tile 0): keys j_lo .. j_hi - 1.
        const int t_hi = n_tiles - 1;
        const int64_t j_lo = static_cast<int64_t>(t_hi > 0 ? t_hi - 1 : 0) * kBN;
        const int64_t j_hi = j_end < static_cast<int64_t>(t_hi + 1) * kBN ? j_end : static_cast<int64_t>(t_hi + 1) * kBN;
        const int chunks_row = static_cast<int>((j_hi - j_lo) / 16);  // S % 16 == 0 (mask_vec16)
        const int chunks = static_cast<int>(rows) * chunks_row;     // at most 2048
        uint4 v[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
          const int idx = threadIdx.x + i * kThreads;
          v[i] = idx < chunks ? *reinterpret_cast<const uint4*>(mr + (idx / chunks_row) * p.mask.row + j_lo +
                                                                 (idx % chunks_row) * 16)
                              : make_uint4(0, 0, 0, 0);
        }
        bool seen_hi = false, seen_lo = false;
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
          const int idx = threadIdx.x + i * kThreads;
          const bool any = (v[i].x | v[i].y | v[i].z | v[i].w) != 0;
          if (j_lo + (idx % chunks_row) * 16 >= static_cast<int64_t>(t_hi) * kBN) seen_hi |= any;
          else seen_lo |= any;
        }
        if (__syncthreads_or(seen_hi)) break;
        const bool lo = __syncthreads_or(seen_lo);
        n_tiles = t_hi;  // tile t_hi hidden
        if (lo) break;
        if (n_tiles > 0) --n_tiles;  // tile t_hi - 1 hidden as well
      }
    }
  }
#ifdef SDPA_MATH_FWD_TRACE
  const bool trace_leader = threadIdx.x % 128 == 0;
  const int trace_role = threadIdx.x / 128;
  int trace_slot = 0;
  bool trace_pass2 = false;  // which pass the products being stamped belong to
  if constexpr (!STATS) {
    if (threadIdx.x == 0) trace::cta_info(1);
  }
#endif

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // producer
    // The maps' coordinates of this head, computed before the warpgroup gives registers back.
    int cq[3], ck[3], cv[3];
    map_coords(a.q, lead, cq);
    map_coords(a.k, lead, ck);
    map_coords(a.v, lead, cv);
    regs_release<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      mbar_arrive_expect_tx(q_full, C::kQBytes);
#pragma unroll
      for (int b = 0; b < C::kBlocks; ++b)
        tma_load_5d(sQ + b * kBM * 64, &tm_q, q_full, b * 64, static_cast<int>(i0), cq[0], cq[1], cq[2]);
      // Tile nt of a map into the next stage of a ring: use n of a stage waits for the n-th
      // release of it (parity (n & 1) ^ 1: the first use finds it free).
      auto produce = [&](T* ring, const CUtensorMap* map, uint64_t* full_bars, uint64_t* empty_bars, int stages,
                         int& use, int nt, const int (&c)[3]) {
        const int st = use % stages;
        mbar_wait(&empty_bars[st], ((use++ / stages) & 1) ^ 1);
        FWD_STAMP(ring == sK ? trace::kProdK : trace::kProdV);
        mbar_arrive_expect_tx(&full_bars[st], C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBlocks; ++b)
          tma_load_5d(ring + st * kBN * D + b * kBN * 64, map, &full_bars[st], b * 64, nt * kBN, c[0], c[1], c[2]);
      };
      int kt = 0, vt = 0;
      for (int pass = one_pass ? 1 : 0; pass < 2; ++pass)
        for (int nt = 0; nt < n_tiles; ++nt) {
          produce(sK, &tm_k, k_full, k_empty, C::kKStages, kt, nt, ck);
          if (pass == 1) produce(sV, &tm_v, v_full, v_empty, C::kVStages, vt, nt, cv);
        }
    }
    return;
  }

  // Consumers: warpgroup cw holds rows i0 + 64 cw .. + 63; this thread rows row[0] and row[0] + 8
  // (quad g of its warp), keys 8n + 2t, + 1 of each 8-key group n of a tile.
  regs_claim<kConsumerRegs>();
  const int cw = wg - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int64_t row[2] = {i0 + cw * 64 + warp * 16 + g, i0 + cw * 64 + warp * 16 + g + 8};
  const bool row_ok[2] = {row[0] < p.L, row[1] < p.L};
  const int64_t warp_row0 = i0 + cw * 64 + warp * 16;
  T* P = STATS ? nullptr : reinterpret_cast<T*>(p.probs.data) + lead_off(p, p.probs, lead);
  T* p_row[2] = {nullptr, nullptr};  // where this thread's rows of P go (STATS: window rows only)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (STATS) {
      const int64_t k = row[r] - st.win_first;
      if (row_ok[r] && k >= 0 && k % st.win_step == 0 && k / st.win_step < st.win_count)
        p_row[r] = reinterpret_cast<T*>(st.win.data) + lead_off(p, st.win, lead) + (k / st.win_step) * st.win.row;
    } else {
      p_row[r] = P + row[r] * p.probs.row;
    }
  }
  using Mask = MaskPair<T, MASK == MaskKind::None ? MaskKind::Bool : MASK, !kNatural>;
  const char* m_row[2] = {nullptr, nullptr};
  if constexpr (kMasked) {
    const int64_t esize = Mask::kBytes;
    const int64_t m_at = lead_off(p, p.mask, lead);
#pragma unroll
    for (int r = 0; r < 2; ++r) m_row[r] = p.mask.data + (m_at + (row_ok[r] ? row[r] : 0) * p.mask.row) * esize;
  }
  // Where this warp's bits of the mask plan start, as an offset from a.plan (which stays in the
  // parameter bank) kept in shared memory: the kernel is at its register limit, and two
  // registers more for the plan made it slower (run s29-v110). Warps whose rows all lie past L
  // take the last group's bits (their logits are never used).
  const int plan_warp = cw * 4 + warp;
  if constexpr (kPlanned) {
    if (lane == 0) {
      const int64_t group = warp_row0 / 16 < a.plan_groups ? warp_row0 / 16 : a.plan_groups - 1;
      plan_at[plan_warp] = static_cast<int>((plan_lead(p, lead) * a.plan_groups + group) * a.plan_words);
    }
    __syncwarp();
  }
  const float scale = kNatural ? a.scale : a.scale_log2;
  const T* q_rows = sQ + cw * 64 * 64;  // this warpgroup's 64 rows of each column block
  // This warpgroup's P tiles in shared memory (kPBuffers, used in turn by the key tiles): two
  // 64-column blocks [64 rows][64] each, 128-byte swizzled as the P map's TMA store reads them;
  // pair (r, 8n + 2t) is at chunk (n % 8) ^ (r % 8).
  T* p_tile = sP + cw * C::kPBuffers * 64 * kBN;
  const int p_bar = 1 + cw;  // named barrier of this warpgroup's 128 threads
  const bool p_leader = tid == 0;
  int cp[3] = {0, 0, 0};
  map_coords(a.p, lead, cp);

  // A tile needs index checks when it runs past the keys or crosses this warp's causal diagonal.
  // Clean tiles with a positive scale skip the scaling: the scale folds into the max (max(s) ·
  // scale) and into the exponent's multiply-add (natural kernels: exponent_of). A bool mask
  // selects -inf in place of the raw score (one select an element, as the add it replaced; the
  // select after a multiply cost 10 % on masked prefill1k_d128, run s28-v103); a tile a float
  // mask changes is scaled. Natural units fold only in the bf16 mask's forward: the statistics
  // kernel keeps scaled logits (its pass 2 takes exp_from, not exponent_of), and the fp32 mask's
  // head-128 forward spilled 124 bytes with the fold against 72.
  auto tile_is_clean = [&](int64_t j0) { return j0 + kBN <= p.S && (!p.causal || j0 + kBN - 1 <= warp_row0); };
  const bool fold = (!kNatural || (MASK == MaskKind::Same && !STATS)) && a.fold;
  // Ping-pong: the two warpgroups take turns to issue their products (named barriers 3 and 4), so
  // one's softmax runs while the other's products occupy the tensor cores instead of both
  // drifting into lockstep on the same tiles. Warpgroup 0 goes first. Turns a CTA takes: pass 1
  // one a tile; pass 2 two a tile (S, then u V), or with kOverlap one a tile (S of this tile and
  // u V of the last) plus one for the last tile's u V.
  const int turns = kOverlap ? (n_tiles > 0 ? 2 * n_tiles + 1 : 0) : (one_pass ? 2 : 3) * n_tiles;
  int turn = 0;
  auto turn_begin = [&] { named_barrier(3 + cw, 256); };
  auto turn_end = [&] {
    if (++turn < turns || cw == 0) named_barrier_arrive(3 + (1 - cw), 256);  // none after the last
  };
  if (cw == 1 && turns > 0) named_barrier_arrive(3, 256);

  // The mask's pairs for this thread's elements of the tile at key j0 (rows unit-stride and
  // pair-aligned: forward_applies). Rows past L read row 0's (their logits are never used), so a
  // clean tile's pairs are all loaded. A tile's pairs are loaded as soon as the last tile's are
  // used (to_logits), so they have that tile's softmax, the wait for K and the products to
  // arrive: loaded after the products were issued, their wait was a third of the stalls of a
  // forward with a (B, 1, L, S) mask (ncu, run s28-v105). (A mask broadcast over rows loads the
  // same pairs twice, from L1: copying row 0's instead makes each copy wait for its load, 16
  // waits a tile, 1.5x the masked kernel's time, session 18.)
  typename Mask::Raw mask_pairs[kMasked ? kBN / 8 : 1][2] = {};
  bool pairs_masked = true;  // kPlanned: whether the tile whose pairs load_mask took changes a logit
  auto load_mask = [&](int64_t j0) {
    if constexpr (kMasked) {
      if constexpr (kPlanned) {  // a neutral tile's pairs are not loaded
        const int tile = static_cast<int>(j0 / kBN);
        pairs_masked = !((a.plan[plan_at[plan_warp] + tile / 32] >> (tile % 32)) & 1u);
        if (!pairs_masked) return;
      }
      const int keys = static_cast<int>(p.S - j0 < kBN ? p.S - j0 : kBN);
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int jj = n * 8 + 2 * t;
          if (jj < keys)
            mask_pairs[n][r] = *reinterpret_cast<const typename Mask::Raw*>(m_row[r] + (j0 + jj) * Mask::kBytes);
        }
    }
  };
  // S = Q Kᵀ of the stage's keys into s: issued and committed, not waited for (inside a turn).
  auto issue_scores = [&](float (&s)[kBN / 2], const T* k_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int b = kk / 4, off = (kk % 4) * 16;
      Wgmma<T, kBN>::template ss<0, 0>(s, desc_sw128(q_rows + b * kBM * 64 + off, 16, 1024),
                                    desc_sw128(k_tile + b * kBN * 64 + off, 16, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // S = Q Kᵀ for this warpgroup's rows and the stage's keys (raw dot products), in its turn.
  auto scores = [&](float (&s)[kBN / 2], int stage) {
    fence_regs(s);
    turn_begin();
    FWD_STAMP(trace_pass2 ? trace::kP2Turn : trace::kP1Turn);
    issue_scores(s, sK + stage * kBN * D);
    turn_end();
    wgmma_wait<0>();
    fence_regs(s);
    FWD_STAMP(trace_pass2 ? trace::kP2Done : trace::kP1Done);
  };
  // Scores to logits in place: scaled, masked, -inf where hidden (past S, causal, a false mask
  // entry, a padding row). `clean` tiles skip the index checks (rows past L then get finite
  // logits, which nothing reads: their P, O, lse and statistics are never stored); `raw` ones
  // (clean, the scale folded) keep raw scores; `masked` false: the mask is left out (its pairs
  // change no logit of the tile).
  auto logits = [&](float (&s)[kBN / 2], int64_t j0, bool clean, bool raw, bool masked) {
    if (raw) {  // a bool mask's select alone
      if constexpr (MASK == MaskKind::Bool) {
        if (masked) {
#pragma unroll
          for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[4 * n + c] = Mask::apply(s[4 * n + c], mask_pairs[n][c >> 1], c & 1);
        }
      }
      return;
    }
    if (clean) {
      if (kMasked && masked) {
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) s[4 * n + c] = Mask::apply(s[4 * n + c] * scale, mask_pairs[n][c >> 1], c & 1);
      } else {
#pragma unroll
        for (int i = 0; i < kBN / 2; ++i) s[i] *= scale;
      }
      return;
    }
    // Keys visible to each row: columns < limit[r] of the tile.
    int limit[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int64_t lim = p.S - j0 < kBN ? p.S - j0 : kBN;
      if (p.causal && row[r] - j0 + 1 < lim) lim = row[r] - j0 + 1;
      limit[r] = row_ok[r] ? static_cast<int>(lim > 0 ? lim : 0) : 0;
    }
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = c >> 1, jj = n * 8 + 2 * t + (c & 1);
        float x = s[4 * n + c] * scale;
        if (kMasked && masked && jj < limit[r]) x = Mask::apply(x, mask_pairs[n][r], c & 1);
        s[4 * n + c] = jj < limit[r] ? x : kNegInf;
      }
  };
  // The same, the mask's part decided for the warp: a tile whose pairs leave every logit of the
  // warp as it is (all keys visible, or all zero; the plan's bit, else the warp's vote on its
  // pairs) is taken as unmasked, so 7 of 8 tiles of a padding mask on 1k keys skip the
  // per-element work. Then the pairs of the tile at `next` are loaded (none when next < 0). Returns whether s was left raw (the scale still to apply).
  auto to_logits = [&](float (&s)[kBN / 2], int64_t j0, bool clean, bool raw, int64_t next) {
    bool masked = false;
    if constexpr (kPlanned) {
      masked = pairs_masked;
    } else if constexpr (kMasked) {
      typename Mask::Acc acc = Mask::kNeutralStart;
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) acc = Mask::fold_in(Mask::fold_in(acc, mask_pairs[n][0]), mask_pairs[n][1]);
      masked = !__all_sync(0xffffffffu, Mask::neutral(acc));
    }
    raw = raw && (MASK == MaskKind::None || MASK == MaskKind::Bool || !masked);  // float values add to scaled scores
    logits(s, j0, clean, raw, masked);
    if (next >= 0) load_mask(next);
    return raw;
  };

  load_mask(0);  // the first tile's pairs, for pass 1 (or pass 2 of a one-pass CTA)
  mbar_wait(q_full, 0);
  FWD_STAMP(trace::kStart);

  // Pass 1: the running max (common to the quad sharing a row) and per-thread partial sums.
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  int kt = 0;  // uses of the K ring so far (its stage and phase)
  for (int nt = 0; nt < (one_pass ? 0 : n_tiles); ++nt, ++kt) {
    const int stage = kt % C::kKStages;
    FWD_STAMP(trace::kP1Top);
    mbar_wait(&k_full[stage], (kt / C::kKStages) & 1);
    FWD_STAMP(trace::kP1KFull);
    float s[kBN / 2];
    const int64_t j0 = static_cast<int64_t>(nt) * kBN;
    scores(s, stage);
    if (lane == 0) mbar_arrive(&k_empty[stage]);
    const bool clean = tile_is_clean(j0);
    const bool raw = to_logits(s, j0, clean, fold && clean, nt + 1 < n_tiles ? j0 + kBN : 0);  // after the last: pass 2's first
    const float mul = raw ? scale : 1.0f;  // logit = s · mul
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float new_max = max_nan(m[r], quad_max_nan(row_max(s, r)) * mul);
      if (new_max == kNegInf) continue;
      if (kNatural && !raw) shift_row(s, r, new_max);
      const float add = row_sum_exp(s, r, exponent_of<kNatural>(raw, mul, new_max, a.scale_log2));
      l[r] = l[r] * exp_from<kNatural>(m[r], 1.0f, new_max) + add;  // exp(-inf) = 0 on the first tile
      m[r] = new_max;
    }
  }

  // P = exp(x - m) / l; the lse. A fully masked row (l = 0) gives P = 0 and lse = -inf; a NaN
  // anywhere in the row gives NaN throughout. (One-pass CTAs: after their pass.)
  float inv_l[2] = {0.0f, 0.0f};
  auto finish_rows = [&] {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const RowEnd e = end_of_row<kNatural>(l[r], m[r]);
      inv_l[r] = e.inv_l;
      if (t == 0 && row_ok[r]) reinterpret_cast<float*>(p.lse.data)[lead_off(p, p.lse, lead) + row[r] * p.lse.row] = e.lse;
      if (t == 0) row_is_nan[cw * 64 + warp * 16 + g + 8 * r] = e.nan;
    }
  };
  if (!one_pass) finish_rows();
  // One-pass CTAs: the running max (-inf while a row has seen no visible key); m is then the
  // reference of the exponents and of l, h and O: the max, or 0 while the max is -inf.
  float run_max[2] = {kNegInf, kNegInf};
  if (one_pass) m[0] = m[1] = 0.0f;

  // Pass 2: P once, O += u V.
  float h[2] = {0.0f, 0.0f};  // STATS: Σ u (m − x) over this thread's elements of each row
  float* col_buf = reinterpret_cast<float*>(p_tile);  // STATS: 2 x [4 warps][kBN] column sums
  float* col_out = nullptr;  // STATS: this warpgroup's partial row of column sums
  if constexpr (STATS) {
    if (st.col_part != nullptr) col_out = st.col_part + ((lead - a.lead0) * 2 * tiles + 2 * row_tile + cw) * p.S;
  }
  // stmatrix row addresses (P through shared memory): lane L gives row L % 8 of matrix L / 8,
  // which is 8-key group nb = L / 16 of rows 8 ((L / 8) % 2) + 0..7 of the warp's 16; for the
  // stmatrix of groups 2 k + (0, 1) (k < 4 within each 64-key block) its 16-byte chunk is
  // (2 k + nb) ^ (row % 8) of the 128-byte swizzle, and row % 8 = L % 8.
  uint32_t p_addr[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int rr = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), n = 2 * k + (lane >> 4);
    p_addr[k] = smem_u32(p_tile + rr * 64 + (n ^ (lane & 7)) * 8);
  }
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  // P through shared memory, in three steps both pass-2 loops take: the tile's buffer
  // free (its TMA store kPBuffers tiles ago has read it: all but the kPBuffers - 1 most recent bulk
  // groups, one a tile, have; P_COPY: the warpgroup's own copy of it is done, which the barrier
  // ensures); P = u / l into it by stmatrix, 16 rows x 16 keys (four 8 x 8 matrices) an
  // instruction at the addresses p_addr precomputed, each u pair also handed to `keep` (n2, nb,
  // r, u0, u1) for the products; the tile to global memory while the products run (TMA clips it
  // at L and S; the copy checks both).
  auto p_buffer_free = [&] {
    if constexpr (!P_COPY) {
      if (p_leader) bulk_wait_read<C::kPBuffers - 1>();
    }
    named_barrier(p_bar, 128);
    FWD_STAMP(trace::kP2PFree);
  };
  // (natural kernels: s shifted by m first where not raw, see exponent_of)
  auto p_to_smem = [&](const float (&s)[kBN / 2], bool raw, float mul, int p_buf, auto&& keep) {
    const Exponent e[2] = {exponent_of<kNatural>(raw, mul, m[0], a.scale_log2),
                           exponent_of<kNatural>(raw, mul, m[1], a.scale_log2)};
#pragma unroll
    for (int n2 = 0; n2 < kBN / 16; ++n2) {
      uint32_t pr[4];
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 2 * n2 + nb;
          const float u0 = exp_from<false>(s[4 * n + 2 * r], e[r].mul, e[r].off);
          const float u1 = exp_from<false>(s[4 * n + 2 * r + 1], e[r].mul, e[r].off);
          keep(n2, nb, r, u0, u1);
          pr[nb * 2 + r] = pack2<T>(u0 * inv_l[r], u1 * inv_l[r]);
        }
      stmatrix_x4(p_addr[n2 % 4] + (p_buf * (kBN / 64) + n2 / 4) * 64 * 64 * 2, pr[0], pr[1], pr[2], pr[3]);
    }
  };
  // Rows of P that TMA cannot address (mostly rows not 16-byte aligned: S % 8 != 0, as for most
  // prompt lengths) leave the staged tile by the warpgroup's own stores, each warp instruction
  // (or pair of them, with 4-byte stores) covering 256 contiguous bytes of one row, where stores
  // straight from the registers' fragments wrote 16 bytes in each of 8 rows (a third slower on
  // prefill1k_d64, run s26-v95). The copy runs after the warpgroup has issued its next products
  // (p_tile_out only waits for the tile to be staged), so that it overlaps them; the tile's buffer
  // is free again once the warpgroup has passed its next p_buffer_free.
  //
  // Lane l takes keys 4 l .. 4 l + 3 (8 bytes, in 64-key block l / 16, chunk (l % 16) / 2 of the
  // swizzle); warp w rows w + 4 k, k < 16, whose swizzle row (w + 4 k) % 8 is w or w + 4 in turn,
  // so the shared-memory addresses are two values plus constants and the global address steps
  // by 4 rows. Four loads (LDS, by shared-window address) are issued before their stores: the
  // first form, through generic pointers, compiled to generic loads each waited for before its
  // store (~30 instructions a store, run s30-v114).
  auto p_tile_copy = [&](int p_buf, int64_t j0, auto width) {
    constexpr int kW = decltype(width)::value;  // store width: 8 (rows 8-byte aligned), 4 (S even) or 2 (odd S: see below)
    const int chunk = (lane % 16) / 2;
    const uint32_t block = smem_u32(p_tile + (p_buf * (kBN / 64) + lane / 16) * 64 * 64 + warp * 64 + (lane % 2) * 4);
    // (two scalars, not an array: indexed at run time below, an array went to the stack)
    const uint32_t from_even = block + (chunk ^ warp) * 16, from_odd = block + (chunk ^ warp ^ 4) * 16;
    const int64_t first = i0 + cw * 64 + warp;  // this warp's first row
    const int rows = static_cast<int>(first >= p.L ? 0 : (p.L - first + 3) / 4);  // rows w + 4 k below L
    const int64_t key = j0 + lane * 4;
    if (key >= p.S) return;
    const int in = static_cast<int>(p.S - key < 4 ? p.S - key : 4);  // keys of the piece below S: 4 with 8-byte stores
    char* to = reinterpret_cast<char*>(P + first * p.probs.row + key);
    const int64_t step = 4 * p.probs.row * static_cast<int64_t>(sizeof(T));
    // Odd S: the warp's rows are 4 apart (the step a multiple of 8 bytes) and its keys start at
    // an even key, so all its pieces share one alignment: 4-byte pairs where the rows are 4-byte
    // aligned, else a 2-byte head, one pair and a 2-byte tail. Four 2-byte stores a piece made
    // S = 1023 0.229 ms against S = 1020's 0.174 (run s31-v119).
    const bool shifted = kW == 2 && (reinterpret_cast<uintptr_t>(to) & 2) != 0;
    auto put = [&](uint2 w) {
      if constexpr (kW == 8) {
        *reinterpret_cast<uint2*>(to) = w;
      } else if constexpr (kW == 4) {  // S even: in is 2 or 4
        reinterpret_cast<uint32_t*>(to)[0] = w.x;
        if (in == 4) reinterpret_cast<uint32_t*>(to)[1] = w.y;
      } else if (!shifted) {  // odd S, this warp's rows 4-byte aligned: pairs, a last key alone
        uint16_t* h = reinterpret_cast<uint16_t*>(to);
        if (in >= 2) reinterpret_cast<uint32_t*>(to)[0] = w.x;
        else h[0] = static_cast<uint16_t>(w.x);
        if (in == 4) reinterpret_cast<uint32_t*>(to)[1] = w.y;
        else if (in == 3) h[2] = static_cast<uint16_t>(w.y);
      } else {  // odd S, rows 2 bytes past 4-byte alignment: key 0 alone, keys 1-2 as a pair, key 3
        uint16_t* h = reinterpret_cast<uint16_t*>(to);
        h[0] = static_cast<uint16_t>(w.x);
        if (in >= 3) *reinterpret_cast<uint32_t*>(h + 1) = __funnelshift_r(w.x, w.y, 16);
        else if (in == 2) h[1] = static_cast<uint16_t>(w.x >> 16);
        if (in == 4) h[3] = static_cast<uint16_t>(w.y >> 16);
      }
      to += step;
    };
    if (rows >= 16) {  // all 16 of the warp's rows (every row block but a last partial one)
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 4) {
        uint2 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = lds64((k & 1 ? from_odd : from_even) + (k0 + k) * 4 * 64 * 2);  // 4 rows a step
#pragma unroll
        for (int k = 0; k < 4; ++k) put(w[k]);
      }
    } else {
      for (int k = 0; k < rows; ++k) put(lds64((k & 1 ? from_odd : from_even) + k * 4 * 64 * 2));
    }
  };
  auto p_tile_copy_out = [&](int p_buf, int64_t j0) {
    if (a.p_vec4)
      p_tile_copy(p_buf, j0, std::integral_constant<int, 8>{});
    else if (a.p_vec2)
      p_tile_copy(p_buf, j0, std::integral_constant<int, 4>{});
    else
      p_tile_copy(p_buf, j0, std::integral_constant<int, 2>{});
  };
  auto p_tile_out = [&](int p_buf, int64_t j0) {
    FWD_STAMP(trace::kP2PStaged);
    if constexpr (P_COPY) {  // staged: the warpgroup copies it out after issuing its next products
      named_barrier(p_bar, 128);
    } else {
      fence_proxy_async();
      named_barrier(p_bar, 128);
      if (p_leader) {
#pragma unroll
        for (int b = 0; b < kBN / 64; ++b)
          tma_store_5d(&tm_p, p_tile + (p_buf * (kBN / 64) + b) * 64 * 64, static_cast<int>(j0) + b * 64,
                       static_cast<int>(i0) + cw * 64, cp[0], cp[1], cp[2]);
        bulk_commit();
      }
    }
  };
  if constexpr (kOverlap) {
    // Pass 2 in FlashAttention 3's order: one turn a tile issues S of tile n and then u V of tile
    // n - 1, and the warpgroup waits only for the first (wait_group 1: groups complete in order),
    // so tile n's softmax and P run while u V of tile n - 1 is still on the tensor cores. Pass 2
    // never rescales O, so the softmax writes nothing that product reads; u's fragments it does
    // read, and tile n's are packed only after it has been waited for. Tile 0's S takes a turn
    // of its own, and so does the last tile's u V.
    uint32_t u_frag[kBN / 16][4];
    fence_regs(o);  // O's zeros stay above the first product (else ptxas serialises them: C7515)
    FWD_TRACE(trace_pass2 = true);
    // Tile nt's S has been waited for: its K stage back, u = exp(x - m) in place of s, P = u / l
    // out, and (after u V of the last tile is waited for) u into the A fragments.
    auto softmax_and_p = [&](float (&s)[kBN / 2], int nt) {
      const int64_t j0 = static_cast<int64_t>(nt) * kBN;
      if (lane == 0) mbar_arrive(&k_empty[kt % C::kKStages]);
      const bool clean = tile_is_clean(j0);
      const bool raw = to_logits(s, j0, clean, fold && clean, -1);  // unmasked (kOverlap): no pairs to load
      const float mul = raw ? scale : 1.0f;
      const int p_buf = nt % C::kPBuffers;
      p_buffer_free();
      float (&u)[kBN / 2] = s;  // u replaces s in place, for pack_u after u V of the last tile
      p_to_smem(s, raw, mul, p_buf, [&](int n2, int nb, int r, float u0, float u1) {
        u[4 * (2 * n2 + nb) + 2 * r] = u0;
        u[4 * (2 * n2 + nb) + 2 * r + 1] = u1;
      });
      p_tile_out(p_buf, j0);
      FWD_STAMP(trace::kP2Written);
    };
    // A fragment of k-step n2: {row g, keys 2t..} {row g+8, 2t..} {g, 2t+8..} {g+8, 2t+8..}.
    auto pack_u = [&](const float (&s)[kBN / 2]) {
#pragma unroll
      for (int n2 = 0; n2 < kBN / 16; ++n2)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int n = 2 * n2 + nb;
            u_frag[n2][nb * 2 + r] = pack2<T>(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]);
          }
    };
    // u V of tile nt - 1 (its V stage waited for, u and O fenced), issued after what the turn
    // has issued already.
    auto issue_pv = [&](int nt) {
      const T* v_tile = sV + ((nt - 1) % C::kVStages) * kBN * D;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
        Wgmma<T, D>::template rs<1>(o, u_frag[kk], desc_sw128(v_tile + kk * 16 * 64, kBN * 128, 1024), 1);
      wgmma_commit();
    };
    auto fence_pv_operands = [&] {
      fence_regs(o);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) fence_regs(u_frag[kk]);
    };
    if (n_tiles > 0) {  // tile 0: S alone
      float s[kBN / 2];
      FWD_STAMP(trace::kP2Top);
      mbar_wait(&k_full[kt % C::kKStages], (kt / C::kKStages) & 1);
      fence_regs(s);
      turn_begin();
      FWD_STAMP(trace::kP2Turn);
      issue_scores(s, sK + (kt % C::kKStages) * kBN * D);
      turn_end();
      wgmma_wait<0>();
      fence_regs(s);
      FWD_STAMP(trace::kP2Done);
      softmax_and_p(s, 0);
      pack_u(s);
      ++kt;
    }
    for (int nt = 1; nt < n_tiles; ++nt, ++kt) {
      float s[kBN / 2];
      FWD_STAMP(trace::kP2Top);
      mbar_wait(&k_full[kt % C::kKStages], (kt / C::kKStages) & 1);
      mbar_wait(&v_full[(nt - 1) % C::kVStages], ((nt - 1) / C::kVStages) & 1);
      FWD_STAMP(trace::kP2VFull);
      fence_pv_operands();
      fence_regs(s);
      turn_begin();
      FWD_STAMP(trace::kP2Turn);
      issue_scores(s, sK + (kt % C::kKStages) * kBN * D);
      issue_pv(nt);
      turn_end();
      // Tile nt - 1's P under both products; every thread has copied it before this iteration's
      // p_buffer_free, so no later tile's stmatrix can overwrite it first (any kPBuffers).
      if constexpr (P_COPY) p_tile_copy_out((nt - 1) % C::kPBuffers, static_cast<int64_t>(nt - 1) * kBN);
      wgmma_wait<1>();  // S of this tile; u V of the last may still run
      fence_regs(s);
      FWD_STAMP(trace::kP2Done);
      softmax_and_p(s, nt);
      wgmma_wait<0>();
      fence_pv_operands();
      FWD_STAMP(trace::kP2PvDone);
      if (lane == 0) mbar_arrive(&v_empty[(nt - 1) % C::kVStages]);
      pack_u(s);
    }
    if (n_tiles > 0) {  // the last tile's u V alone
      mbar_wait(&v_full[(n_tiles - 1) % C::kVStages], ((n_tiles - 1) / C::kVStages) & 1);
      fence_pv_operands();
      turn_begin();
      issue_pv(n_tiles);
      turn_end();
      if constexpr (P_COPY) p_tile_copy_out((n_tiles - 1) % C::kPBuffers, static_cast<int64_t>(n_tiles - 1) * kBN);
      wgmma_wait<0>();
      fence_pv_operands();
      if (lane == 0) mbar_arrive(&v_empty[(n_tiles - 1) % C::kVStages]);
    }
  } else
  for (int nt = 0; nt < n_tiles; ++nt, ++kt) {
    const int stage = kt % C::kKStages, v_stage = nt % C::kVStages;
    FWD_TRACE(trace_pass2 = true);
    FWD_STAMP(trace::kP2Top);
    mbar_wait(&k_full[stage], (kt / C::kKStages) & 1);
    FWD_STAMP(trace::kP2KFull);
    float s[kBN / 2];
    const int64_t j0 = static_cast<int64_t>(nt) * kBN;
    scores(s, stage);
    if (lane == 0) mbar_arrive(&k_empty[stage]);
    const bool clean = tile_is_clean(j0);
    const bool raw = to_logits(s, j0, clean, fold && clean, nt + 1 < n_tiles ? j0 + kBN : -1);
    const float mul = raw ? scale : 1.0f;
    const int keys = static_cast<int>(p.S - j0 < kBN ? p.S - j0 : kBN);  // P columns of this tile
    if constexpr (STATS) {
      if (one_pass) {
        // The tile's max; l, h (Σ u (m − x)) and O move from the old reference to the new:
        // times a = exp(m_old − m_new), and h also gains (m_new − m_old) l_old. A row that had
        // seen no visible key has l = h = O = 0 (a = 0: exp of an old reference of 0 against a
        // very negative new max would overflow). Where a underflows to 0, h is 0 too, not
        // 0 · (m_new − m_old) l: after a tile held at a float mask's finfo.min, m_new − m_old is
        // near FLT_MAX and times l it is inf (review, session 18).
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
    }
    // This key tile's P buffer; its last store (kPBuffers tiles ago: TMA, or the warpgroup's copy)
    // has read it before it is rewritten (p_buffer_free).
    const int p_buf = nt % C::kPBuffers;
    if constexpr (!STATS) p_buffer_free();
    uint32_t u_frag[kBN / 16][4];
    float col[STATS ? kBN / 4 : 1];  // this thread's two rows of P summed: keys 8n + 2t (+1) at 2n (+1)
    if constexpr (!STATS) {
      // A fragment of k-step n2: {row g, keys 2t..} {row g+8, 2t..} {g, 2t+8..} {g+8, 2t+8..}.
      if (kNatural && !raw) {
        shift_row(s, 0, m[0]);
        shift_row(s, 1, m[1]);
      }
      p_to_smem(s, raw, mul, p_buf, [&](int n2, int nb, int r, float u0, float u1) {
        u_frag[n2][nb * 2 + r] = pack2<T>(u0, u1);
      });
    } else {
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float u0 = exp_from<kNatural>(s[4 * n + 2 * r], mul, m[r]);
          const float u1 = exp_from<kNatural>(s[4 * n + 2 * r + 1], mul, m[r]);
          u_frag[n / 2][(n & 1) * 2 + r] = pack2<T>(u0, u1);
          const int jj = n * 8 + 2 * t;  // the window's rows are pair-aligned (stats_conditions): pairs never straddle S
          if ((STATS ? p_row[r] != nullptr : row_ok[r]) && (clean || jj < keys))
            *reinterpret_cast<uint32_t*>(p_row[r] + j0 + jj) = pack2<T>(u0 * inv_l[r], u1 * inv_l[r]);
          if constexpr (STATS) {
            // P for the column sums: rows past L count 0 (clean tiles do not mask them; their
            // zero-filled queries give a uniform row, or NaN next to an infinite key, so a select,
            // not a product with 0); inv_l is 0 for a fully masked row. And u (m − x) for the
            // entropy: 0 where u = 0 (hidden keys: x = -inf).
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
    }
    if constexpr (!STATS) p_tile_out(p_buf, j0);
    FWD_STAMP(trace::kP2Written);
    mbar_wait(&v_full[v_stage], (nt / C::kVStages) & 1);
    FWD_STAMP(trace::kP2VFull);
    const T* v_tile = sV + v_stage * kBN * D;
    fence_regs(o);  // u and O are written before the fence, read by the products after it
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) fence_regs(u_frag[kk]);
    turn_begin();
    FWD_STAMP(trace::kP2PvTurn);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      Wgmma<T, D>::template rs<1>(o, u_frag[kk], desc_sw128(v_tile + kk * 16 * 64, kBN * 128, 1024), 1);
    wgmma_commit();
    turn_end();
    if constexpr (P_COPY) p_tile_copy_out(p_buf, j0);  // under u V
    wgmma_wait<0>();
    fence_regs(o);
    FWD_STAMP(trace::kP2PvDone);
    // The column sums once u's registers are free (the other warpgroup's products run meanwhile):
    // during the product they would push the kernel past its registers.
    if constexpr (STATS) {
      if (st.col_part != nullptr) column_sums(col, col_buf + (nt & 1) * 4 * kBN, warp, lane, tid, p_bar, col_out + j0, p.S - j0);
    }
    if (lane == 0) mbar_arrive(&v_empty[v_stage]);
  }
  if constexpr (!STATS && !P_COPY) {
    if (p_leader) bulk_wait_read<0>();  // shared memory outlives the last store's reads
  }
  if (one_pass) finish_rows();

  // O = (u V) / l, two columns a store.
  T* O = reinterpret_cast<T*>(p.out.data) + lead_off(p, p.out, lead);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_ok[r]) continue;
    T* o_row = O + row[r] * p.out.row;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * t;
      if (col < p.Ev)
        *reinterpret_cast<uint32_t*>(o_row + col) = pack2<T>(o[4 * n + 2 * r] * inv_l[r], o[4 * n + 2 * r + 1] * inv_l[r]);
    }
  }

  FWD_STAMP(trace::kEnd);
#ifdef SDPA_MATH_FWD_TRACE
  if constexpr (!STATS) {
    if (threadIdx.x == 128) trace::cta_info(2);
  }
#endif
  const int64_t z0 = static_cast<int64_t>(n_tiles) * kBN;
  if constexpr (STATS) {
    // Entropy log l + Σ P (m − x) in natural units (kernels in base-2 units count x and m in base 2);
    // 0 for a fully masked row, NaN for a NaN row (its l).
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
    return;
  }

  // Causal, or the trailing tiles a bool mask hides: the keys right of the last tile are hidden
  // from every row of the CTA: zeros, 16 bytes a store where rows allow; NaN in a NaN row (prob_of_hidden_key: the math op's softmax of a
  // NaN row is NaN at its hidden keys too). Each row's flag comes from the quad that holds it.
  if (z0 < p.S) {
    named_barrier(5, 256);  // the consumers' row_is_nan writes before their reads
    const int64_t rows = (p.L - i0 < kBM ? p.L - i0 : kBM);
    const int ct = threadIdx.x - 128;
    const uint32_t nan2 = pack2<T>(NAN, NAN);
    if (a.p_vec8) {
      const int64_t chunks = (p.S - z0) / 8;
      for (int64_t idx = ct; idx < rows * chunks; idx += 256) {
        const int64_t r = idx / chunks, c = z0 + (idx % chunks) * 8;
        const uint32_t v = row_is_nan[r] ? nan2 : 0u;
        *reinterpret_cast<uint4*>(P + (i0 + r) * p.probs.row + c) = make_uint4(v, v, v, v);
      }
    } else {
      const int64_t cols = p.S - z0;
      for (int64_t idx = ct; idx < rows * cols; idx += 256) {
        const int64_t r = idx / cols, c = z0 + idx % cols;
        P[(i0 + r) * p.probs.row + c] = from_float<T>(row_is_nan[r] ? NAN : 0.0f);
      }
    }
  }
}

// ---- host side --------------------------------------------------------------------------------

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

template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
void launch(const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& pm,
            const DevProblem& p, const Args& a, const StatsArgs& st, cudaStream_t stream) {
  const int64_t tiles = (p.L + kBM - 1) / kBM;
  const int64_t blocks = tiles * a.leads;
  const char* what = STATS ? "sm90 statistics" : "sm90 forward";
  const unsigned grid = grid_x(blocks, what);
  const auto kernel = &forward_sm90<T, D, MASK, STATS, P_COPY>;
  set_smem_limit(reinterpret_cast<const void*>(kernel), Tiles<D, STATS>::kSmem);
#ifdef SDPA_MATH_FWD_TRACE
  if (!STATS) trace::clear(stream);
#endif
  kernel<<<grid, kThreads, Tiles<D, STATS>::kSmem, stream>>>(q, k, v, pm, p, a, st, tiles);
  check_launch(what);
#ifdef SDPA_MATH_FWD_TRACE
  if (!STATS) trace::write(stream, grid);
#endif
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
bool forward_for(const DevProblem& p, uint32_t* plan, cudaStream_t stream) {
  CUtensorMap q, k, v, pm;
  Args a;
  MaskKind mask;
  if (!common_args(p, q, k, v, a, mask)) return false;
  a.p_vec8 = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 8);
  a.p_vec4 = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 4);
  a.p_vec2 = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 2);
  a.mask_vec16 = p.mask_is_bool && rows_vectorizable(p.mask, p.lead_ndim, p.S, 1, 16);
  a.p_tma = make_map(&pm, p, p.probs, p.L, p.S, 64, a.p);
  if (!a.p_tma) std::memset(&pm, 0, sizeof(pm));  // the copy kernels take the map unused
  const PlanShape ps = plan_shape(p);
  if (mask == MaskKind::Same || mask == MaskKind::Float32) {
    // A float mask's kernel reads the plan from its first tile on: decline before anything is
    // launched without one (no workspace, or no key: S = 0), or where the kernel's 32-bit plan
    // offsets would not reach (a plan of 8 GB, never in practice).
    if (plan == nullptr || ps.total_words() <= 0 || ps.total_words() > INT32_MAX) return false;
    const int64_t items = ps.leads * ps.groups * ((p.S + kBN - 1) / kBN);
    const int64_t blocks = std::min<int64_t>((items + 3) / 4, int64_t(1) << 20);
    if (mask == MaskKind::Same)
      build_mask_plan<T, MaskKind::Same><<<grid_x(blocks, "sm90 mask plan"), 128, 0, stream>>>(p, plan, ps.groups, ps.words, items);
    else
      build_mask_plan<T, MaskKind::Float32><<<grid_x(blocks, "sm90 mask plan"), 128, 0, stream>>>(p, plan, ps.groups, ps.words, items);
    check_launch("sm90 mask plan");
    a.plan = plan;
    a.plan_groups = ps.groups;
    a.plan_words = ps.words;
  }
  if (a.p_tma) launch_for_head<false, false, T>(q, k, v, pm, p, a, StatsArgs{}, mask, stream);
  else launch_for_head<false, true, T>(q, k, v, pm, p, a, StatsArgs{}, mask, stream);
  return true;
}

// Lead indices per statistics launch: the column sums' partial rows (and flags) of one launch
// take at most kStatsWorkspaceFloats.
constexpr int64_t kStatsWorkspaceFloats = int64_t(16) << 20;  // 64 MiB
int64_t stats_leads_per_launch(const DevProblem& p) {
  const int64_t per_lead = 2 * ((p.L + kBM - 1) / kBM) * (p.S + 1);
  return std::max<int64_t>(1, std::min<int64_t>(p.num_lead, kStatsWorkspaceFloats / std::max<int64_t>(per_lead, 1)));
}

template <typename T>
bool stats_for(const DevProblem& p, const StatsTargets& t, float* workspace, cudaStream_t stream) {
  CUtensorMap q, k, v, unused;
  Args a;
  MaskKind mask;
  if (!common_args(p, q, k, v, a, mask)) return false;
  a.p_tma = false;
  a.p_vec8 = false;
  a.p_vec4 = false;
  a.p_vec2 = false;
  std::memset(&unused, 0, sizeof(unused));
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
    launch_for_head<true, false, T>(q, k, v, unused, p, a, st, mask, stream);
    if (cols) {
      const int64_t blocks = std::min<int64_t>((a.leads * p.S + 255) / 256, 65535);
      stats_columns<<<grid_x(blocks, "sm90 column sums"), 256, 0, stream>>>(st.col_part, st.col_nan, p, t.col_sum, lead0,
                                                                             a.leads, tiles);
      check_launch("sm90 column sums");
    }
  }
  return true;
}

// What both kernels need of the inputs and of O and lse.
bool inputs_apply(const DevProblem& p) {
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return false;
  if (p.dropout != Dropout::None) return false;
  if (p.E <= 0 || p.Ev <= 0 || p.E > 128 || p.Ev > 128 || padded_head(p.E) != padded_head(p.Ev)) return false;
  if (p.E % 8 != 0 || p.Ev % 8 != 0) return false;
  // O in the inputs' dtype with rows that take 4-byte pair stores, lse in fp32 (as the binding
  // allocates them).
  if (p.out.dtype != p.q.dtype || p.lse.dtype != DType::Float32) return false;
  if (!rows_vectorizable(p.out, p.lead_ndim, p.Ev, 2, 2)) return false;
  // A mask is read a pair of keys at a time.
  if (p.mask.data != nullptr) {
    const int bytes = p.mask_is_bool ? 1 : p.mask.dtype == DType::Float32 ? 4 : 2;
    if (!rows_vectorizable(p.mask, p.lead_ndim, p.S, bytes, 2)) return false;
  }
  return p.L > 0 && p.L <= 2147483647LL && p.S <= 2147483647LL && device_supported();
}

}  // namespace

bool forward_applies(const DevProblem& p) {
  // P in the inputs' dtype, unit column stride (rows of any length: an odd S takes the copy
  // kernels' pair and 2-byte stores).
  return inputs_apply(p) && p.probs.dtype == p.q.dtype && rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 1);
}

int64_t forward_workspace_words(const DevProblem& p) { return plan_shape(p).total_words(); }

bool forward(const DevProblem& p, uint32_t* workspace, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) return forward_for<__half>(p, workspace, stream);
  return forward_for<__nv_bfloat16>(p, workspace, stream);
}

bool stats_conditions(const DevProblem& p, const StatsTargets& t) {
  MaskKind mask;
  if (!inputs_apply(p) || !mask_kind(p, mask)) return false;
  // fp32 statistics; the window's rows as P's (inputs' dtype, pair stores).
  if (t.col_sum.data != nullptr && t.col_sum.dtype != DType::Float32) return false;
  if (t.entropy.data != nullptr && t.entropy.dtype != DType::Float32) return false;
  if (t.rows.data != nullptr && (t.rows.dtype != p.q.dtype || !rows_vectorizable(t.rows, p.lead_ndim, p.S, 2, 2)))
    return false;
  // Launches split the heads, not a head's row tiles: one head's partial rows of column sums
  // (L x S / 16 bytes) must fit the workspace budget (L = S = 32K does not).
  if (t.col_sum.data != nullptr && 2 * ((p.L + kBM - 1) / kBM) * (p.S + 1) > kStatsWorkspaceFloats) return false;
  return true;
}

bool stats_applies(const DevProblem& p, const StatsTargets& t) {
  if (!stats_conditions(p, t)) return false;
  CUtensorMap q, k, v;  // TMA can address the inputs
  Args a;
  MaskKind mask;
  return common_args(p, q, k, v, a, mask);
}

int64_t stats_workspace_floats(const DevProblem& p, const StatsTargets& t) {
  if (t.col_sum.data == nullptr) return 0;
  return stats_leads_per_launch(p) * 2 * ((p.L + kBM - 1) / kBM) * (p.S + 1);
}

bool forward_stats(const DevProblem& p, const StatsTargets& t, float* workspace, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) return stats_for<__half>(p, t, workspace, stream);
  return stats_for<__nv_bfloat16>(p, t, workspace, stream);
}

}  // namespace sdpa_math::cuda::sm90
