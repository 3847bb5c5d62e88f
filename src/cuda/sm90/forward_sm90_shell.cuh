// The Hopper forward's kernel shell: what every part of the kernel and the host launcher share.
// The tile sizes, the launch's arguments, the shared-memory layout, the named barriers, the
// trace hooks, and the declaration of the per-kernel launch functions, which only the
// instantiation files (forward_sm90_<dtype>_d<head>.cu) define, so that the kernel bodies
// compile there, side by side, and not in the host launcher (forward_sm90.cu).
//
// The design (forward_sm90_kernel.cuh puts it together): per CTA 128 query rows of one head, one
// producer warpgroup and two consumer warpgroups of 64 rows each. The producer's one thread brings
// Q once and then the key tiles of both passes through the TMA unit into a ring of shared-memory
// stages (K alone in pass 1, K and V in pass 2), each stage completing on its `full` mbarrier and
// handed back on its `empty` one. The consumers run the two passes: pass 1 forms S = Q Kᵀ with
// wgmma (both operands in shared memory) and keeps each row's running max and sum; pass 2 forms
// S again, writes P = exp(s - m) / l once from registers, and accumulates O += u V with wgmma
// taking u = exp(s - m) as its A operand from registers (O is divided by l at the end). Scores are
// in base-2 units (one multiply-add and one ex2 per element). The row maximum propagates NaN
// (max.NaN), so a NaN score gives a NaN row of P and O and a NaN lse, as the math op does.
//
// Registers: the producer gives its share back (setmaxnreg: kProducerRegs), the consumers take
// kConsumerRegs each (hopper.cuh): S is 64 fp32 per thread, O up to 64, u as A fragments 32.
#pragma once

#include <cudaTypedefs.h>

#include <cstdint>

#include "../device_problem.cuh"
#include "hopper.cuh"
#include "tensor_maps.cuh"
#include "trace.cuh"

namespace sdpa_math::cuda::sm90::fwd {

constexpr int kBM = 128;  // query rows per CTA
constexpr int kBN = 128;  // keys per tile

// The mask's element type, fixed per kernel so its loads are plain typed loads.
enum class MaskKind : int { None, Bool, Same /* the inputs' dtype */, Float32 };

// The CTA's named barriers (id 0 is __syncthreads'). Each consumer warpgroup has one of its own
// 128 threads (its P tile's buffer and its column sums), one per warpgroup gates the ping-pong
// of product turns (256 threads: both consumer warpgroups), and one joins the two consumer
// warpgroups before the causal tail's fill.
enum class NamedBarrier : int {
  kWarpgroup0 = 1,  // + consumer warpgroup index
  kTurn0 = 3,       // + consumer warpgroup index: its turn to issue products
  kTailFill = 5,
};
SDPA_MATH_D int barrier_id(NamedBarrier b, int offset = 0) { return static_cast<int>(b) + offset; }

// The shared memory's sizes: Q; a ring of K tiles (both passes) and one of V tiles (pass 2), each
// stage with a `full` and an `empty` mbarrier; each consumer warpgroup's 64 x kBN tiles of P on
// their way out.
template <int D, bool STATS>
struct Tiles {
  static constexpr int kBlocks = D / 64;  // 128-byte column blocks across the head
  // P tiles per warpgroup, used in turn by the key tiles. With two, a tile's stores into shared
  // memory wait only for the TMA store of two tiles before to have read its buffer, not for the
  // one just issued. The head-128 forward trades a K stage for the second buffer: its masked
  // kernels were a few per cent faster that way, the unmasked ones unchanged. At head 64, where
  // shared memory has room for both, a second buffer gained nothing, and the statistics kernel
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

// Where each part of Tiles lies in the dynamic shared memory (aligned to 1024 bytes, as the
// 128-byte swizzle of the TMA tiles needs).
template <typename T, int D, bool STATS>
struct Smem {
  using C = Tiles<D, STATS>;
  T* sQ;
  T* sK;
  T* sV;
  T* sP;
  uint64_t* k_full;
  uint64_t* k_empty;
  uint64_t* v_full;
  uint64_t* v_empty;
  uint64_t* q_full;
  uint8_t* row_is_nan;  // [kBM], the causal tail's fill value
  int* plan_at;         // [kConsumerWarps]: where each warp's plan bits start

  SDPA_MATH_D explicit Smem(unsigned char* raw) {
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    sQ = reinterpret_cast<T*>(base);
    sK = reinterpret_cast<T*>(base + C::kQBytes);
    sV = sK + C::kKStages * kBN * D;
    sP = sV + C::kVStages * kBN * D;
    k_full = reinterpret_cast<uint64_t*>(sP + 2 * C::kPBuffers * 64 * kBN);
    k_empty = k_full + C::kKStages;
    v_full = k_empty + C::kKStages;
    v_empty = v_full + C::kVStages;
    q_full = v_empty + C::kVStages;
    row_is_nan = reinterpret_cast<uint8_t*>(q_full + 1);
    plan_at = reinterpret_cast<int*>(row_is_nan + kBM);
  }
  // One thread sets the rings' barriers up: `full` completes on the producer's arrival and the
  // TMA bytes, `empty` on one arrival per consumer warp.
  SDPA_MATH_D void init_barriers() const {
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

// An array in a struct of its own, for the arrays the kernel's parts keep in registers (a pass's
// scores, u's fragments): the inliner lets a function's array reuse the object of an array of
// the same type from another inlined call (pass 1's scores for pass 2's, say), which is harmless
// for memory but, once both are registers, carries one's last values into the other's first
// products as if they were read there, and the kernel compiles to other machine code than the
// same arrays as locals of one function would. The inliner reuses only objects of array type.
template <typename A>
struct Own {
  A v;
};

// The timeline of trace.cuh: FWD_TRACE(statement) is the statement in a trace build
// (SDPA_MATH_FWD_TRACE) and in the forward proper (not the statistics kernel), else nothing;
// FWD_STAMP(code) stamps a step through the TraceState `tr` in scope.
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
#define FWD_STAMP(code) FWD_TRACE(if (tr.leader) trace::stamp(tr.role, tr.slot, code))

// A thread's trace state (empty outside a trace build): whether it stamps (the producer thread
// and the first thread of each consumer warpgroup), its role, its next slot, and which pass the
// products being stamped belong to.
struct TraceState {
#ifdef SDPA_MATH_FWD_TRACE
  bool leader;
  int role;
  int slot;
  bool pass2;
  SDPA_MATH_D TraceState() : leader(threadIdx.x % 128 == 0), role(threadIdx.x / 128), slot(0), pass2(false) {}
#endif
};

// One kernel's launch (a grid of row tiles x heads). Declared here, defined in
// forward_sm90_kernel.cuh and instantiated by the instantiation files only.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
void launch(const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& pm,
            const DevProblem& p, const Args& a, const StatsArgs& st, cudaStream_t stream);

// The 12 kernels of one (dtype, head) group: 4 mask kinds x {TMA store of P, P copied by the
// warpgroups, statistics}. PREFIX is `template` (an explicit instantiation: the instantiation
// files) or `extern template` (a declaration that it exists elsewhere: the host launcher).
#define SDPA_MATH_SM90_FWD_KERNEL(PREFIX, T, D, MASK, STATS, P_COPY)                                           \
  PREFIX void launch<T, D, MaskKind::MASK, STATS, P_COPY>(                                                     \
      const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const DevProblem&,      \
      const Args&, const StatsArgs&, cudaStream_t);
#define SDPA_MATH_SM90_FWD_MASK_KINDS(PREFIX, T, D, STATS, P_COPY)      \
  SDPA_MATH_SM90_FWD_KERNEL(PREFIX, T, D, None, STATS, P_COPY)          \
  SDPA_MATH_SM90_FWD_KERNEL(PREFIX, T, D, Bool, STATS, P_COPY)          \
  SDPA_MATH_SM90_FWD_KERNEL(PREFIX, T, D, Same, STATS, P_COPY)          \
  SDPA_MATH_SM90_FWD_KERNEL(PREFIX, T, D, Float32, STATS, P_COPY)
#define SDPA_MATH_SM90_FWD_GROUP(PREFIX, T, D)               \
  SDPA_MATH_SM90_FWD_MASK_KINDS(PREFIX, T, D, false, false)  \
  SDPA_MATH_SM90_FWD_MASK_KINDS(PREFIX, T, D, false, true)   \
  SDPA_MATH_SM90_FWD_MASK_KINDS(PREFIX, T, D, true, false)

}  // namespace sdpa_math::cuda::sm90::fwd
