// The one exception type of sdpa_math. Every bad input is reported by validation before any
// output is written; the code lets callers (tests, the PyTorch binding) tell the cases apart
// without parsing messages, and the message names the problem in words a user can act on.
#pragma once

#include <stdexcept>
#include <string>

namespace sdpa_math {

enum class ErrorCode {
  RankTooLow,             // a tensor with fewer than 2 dims
  BatchNotBroadcastable,  // leading (batch) dims of query/key/value do not broadcast
  HeadDimMismatch,        // E of key differs from E of query
  SequenceMismatch,       // key and value have different lengths S
  GqaHeadsNotDivisible,   // enable_gqa with Hq not a multiple of Hkv
  HeadsMismatch,          // different head counts without enable_gqa
  MaskNotBroadcastable,   // attn_mask does not broadcast to (*batch, Hq, L, S)
  MaskDtype,              // attn_mask neither bool, float32 nor the query's dtype
  CausalWithMask,         // is_causal together with attn_mask
  DropoutProbability,     // dropout_p outside [0, 1]
  DropoutMaskShape,       // dropout_mask does not broadcast to (*batch, Hq, L, S)
  DropoutMaskDtype,       // dropout_mask neither bool nor floating
  DeviceMismatch,         // tensors on different devices
  DtypeMismatch,          // query, key and value of different dtypes
  UnsupportedDtype,       // integer, fp8, ...
  TooManyDims,            // more than kMaxDims dims
  BadOutput,              // an output or gradient buffer of the wrong shape, dtype or device
  BadGradient,            // grad_output / grad_probs of the wrong shape or dtype
  BackendUnavailable,     // e.g. CUDA requested in a build without CUDA
  CudaFailure,            // a CUDA runtime call or kernel launch failed
  BadWindow,              // a window of query rows with first < 0 or step < 1
};

const char* error_code_name(ErrorCode code);

class Error : public std::invalid_argument {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::invalid_argument(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace sdpa_math
