// The validated, normalized form of one attention call, shared by every backend.
//
// The leading dims of the output, (*batch, Hq), are the "lead" dims; each lead index is one
// attention head problem of L query rows and S keys. Every operand is described by its strides
// over the lead dims of the output (0 where it is broadcast) and over its own last two dims.
// GQA is a stride rule too: on the head dim, key/value read head h / group.
#pragma once

#include <cstdint>
#include <vector>

#include "sdpa_math/attention.h"

namespace sdpa_math::core {

enum class DropoutMode { None, ExplicitMask, Random };

// One operand (query, key, value, a mask, an output...) seen through the lead dims.
struct Operand {
  const char* data = nullptr;  // nullptr = absent
  DType dtype = DType::Float32;
  int64_t lead_strides[kMaxDims] = {};  // memory strides over the output's lead dims, 0 = broadcast
  int64_t row_stride = 0;               // stride of its second-to-last dim as seen by the problem
  int64_t col_stride = 0;               // stride of its last dim as seen by the problem
  int64_t head_group = 1;               // GQA: lead coordinate on the head dim is divided by this
  // The same in a dense (contiguous) buffer of the operand's own shape: where its gradient
  // accumulates. Broadcast dims have dense stride 0, so broadcast copies sum into one element.
  int64_t dense_lead_strides[kMaxDims] = {};
  int64_t dense_row_stride = 0;
  int64_t dense_col_stride = 0;
  Shape own_shape;  // the operand's own shape (gradients have it)

  bool present() const { return data != nullptr; }
};

struct Problem {
  int lead_ndim = 0;
  int64_t lead_shape[kMaxDims] = {};
  int64_t num_lead = 0;  // product of lead_shape
  int64_t L = 0, S = 0, E = 0, Ev = 0;

  Operand query, key, value;
  Operand attn_mask;        // present() iff a mask is used
  bool mask_is_bool = false;
  Operand dropout_mask;     // present() iff mode == ExplicitMask
  DType dtype = DType::Float32;  // of query, key and value
  Device device;                 // of every input

  double scale = 1.0;
  bool is_causal = false;
  DropoutMode dropout = DropoutMode::None;
  double dropout_p = 0.0;
  uint64_t seed = 0, offset = 0;
  const uint64_t* rng_device = nullptr;  // AttentionOptions::rng_device

  ForwardShapes shapes;

  // Factor on the kept entries (contract §8/§9): explicit mask: O = c (A ⊙ M) V;
  // random: P = c (A ⊙ M). At p = 1 random dropout returns zeros, as native's dropout does.
  double keep_scale() const {
    if (dropout == DropoutMode::None) return 1.0;
    if (dropout == DropoutMode::Random && dropout_p >= 1.0) return 0.0;
    return 1.0 / (1.0 - dropout_p);
  }
};

// Offset (in elements) of lead index `lead` in an operand, by its memory or dense strides.
int64_t lead_offset(const Problem& p, const Operand& op, int64_t lead);
int64_t dense_lead_offset(const Problem& p, const Operand& op, int64_t lead);

// An operand for an output of the problem's own layout (O, P, lse, dO, dP): no broadcast.
// `rows`/`cols` are its last two dims; for lse (rows only) pass cols = -1.
Operand output_operand(const Problem& p, const TensorView& v, bool has_cols);

// Validation: the one place where the contract's errors are raised.
Problem make_problem(const ForwardArgs& args);
void check_forward_outputs(const Problem& p, const ForwardOutputs& out);
void check_stats_outputs(const Problem& p, const StatsOutputs& out);  // and refuses dropout
void check_backward(const Problem& p, const BackwardArgs& args, const BackwardOutputs& out);
void check_kl_backward(const Problem& p, const KlBackwardArgs& args, const BackwardOutputs& out);  // and refuses dropout
void check_kl_forward(const Problem& p, const KlForwardArgs& args, const TensorView* kl, const TensorView* row_sum);  // outputs: nullptr to skip; refuses dropout
void check_kl_rows(const KlRowsArgs& args, const TensorView& kl, const TensorView& row_sum);
void check_softmax_rows(const SoftmaxRowsArgs& args, const TensorView& out);

}  // namespace sdpa_math::core
