// One test per bad input of contract.md: the error's code and message, and that nothing was
// written (the output buffers keep their sentinel bytes).
#include <gtest/gtest.h>

#include <cmath>

#include "test_cases.h"

namespace sdpa_math::testing {
namespace {

Case small() {
  Case c;
  c.dtype = DType::Float32;
  c.batch = {2};
  c.hq = c.hkv = 4;
  c.L = 5;
  c.S = 6;
  c.E = c.Ev = 8;
  return c;
}

// Runs forward on both CPU backends with outputs sized for the valid `good` problem; expects the
// error and untouched outputs.
void expect_forward_error(const ForwardArgs& args, ErrorCode code, const std::string& text) {
  for (Backend be : {Backend::Reference, Backend::Cpu}) {
    Tensor o = empty_tensor(DType::Float32, make_shape({2, 4, 5, 8}));
    Tensor p = empty_tensor(DType::Float32, make_shape({2, 4, 5, 6}));
    Tensor l = empty_tensor(DType::Float32, make_shape({2, 4, 5}));
    const auto before = o.storage, before_p = p.storage, before_l = l.storage;
    expect_error([&] { forward(be, args, {o.view, p.view, l.view}); }, code, text);
    EXPECT_EQ(o.storage, before);
    EXPECT_EQ(p.storage, before_p);
    EXPECT_EQ(l.storage, before_l);
  }
}

TEST(Validation, RankBelowTwo) {
  Built b = build(small());
  Tensor q = empty_tensor(DType::Float32, make_shape({8}));
  b.args.query = q.view;
  expect_forward_error(b.args, ErrorCode::RankTooLow, "query must have at least 2 dimensions");
}

TEST(Validation, BatchDimsDoNotBroadcast) {
  Case c = small();
  c.kv_batch = {3};
  Built b = build(c);
  expect_forward_error(b.args, ErrorCode::BatchNotBroadcastable, "do not broadcast");
}

TEST(Validation, KeyHeadDimDiffers) {
  Built b = build(small());
  Tensor k = empty_tensor(DType::Float32, make_shape({2, 4, 6, 7}));
  b.args.key = k.view;
  expect_forward_error(b.args, ErrorCode::HeadDimMismatch, "key's last dimension (7) must equal query's last dimension (8)");
}

TEST(Validation, KeyAndValueLengthsDiffer) {
  Built b = build(small());
  Tensor v = empty_tensor(DType::Float32, make_shape({2, 4, 7, 8}));
  b.args.value = v.view;
  expect_forward_error(b.args, ErrorCode::SequenceMismatch, "key and value must have the same sequence length");
}

TEST(Validation, GqaHeadsNotDivisible) {
  Case c = small();
  c.hkv = 3;
  c.gqa = true;
  Built b = build(c);
  expect_forward_error(b.args, ErrorCode::GqaHeadsNotDivisible,
                       "Number of heads in key and value must divide the number of heads in query");
}

TEST(Validation, HeadsMismatchWithoutGqa) {
  Case c = small();
  c.hkv = 2;
  Built b = build(c);
  expect_forward_error(b.args, ErrorCode::HeadsMismatch, "pass enable_gqa=True");
}

TEST(Validation, MaskDoesNotBroadcast) {
  Built b = build(small());
  Tensor m = empty_tensor(DType::Float32, make_shape({5, 5}));
  b.args.attn_mask = m.view;
  expect_forward_error(b.args, ErrorCode::MaskNotBroadcastable, "attn_mask of shape (5, 5) cannot be broadcast");
}

TEST(Validation, MaskWithMoreDimsThanTheAttention) {
  Built b = build(small());
  Tensor m = empty_tensor(DType::Float32, make_shape({1, 2, 4, 5, 6}));
  b.args.attn_mask = m.view;
  expect_forward_error(b.args, ErrorCode::MaskNotBroadcastable, "cannot be broadcast");
}

TEST(Validation, MaskDtypeIntegerOrOtherFloat) {
  Built b = build(small());
  Tensor m = empty_tensor(DType::Int64, make_shape({5, 6}));
  b.args.attn_mask = m.view;
  expect_forward_error(b.args, ErrorCode::MaskDtype, "Expected attn_mask dtype to be bool or float or to match query dtype");
  Tensor m64 = empty_tensor(DType::Float64, make_shape({5, 6}));  // float64 mask, float32 query
  b.args.attn_mask = m64.view;
  expect_forward_error(b.args, ErrorCode::MaskDtype, "attn_mask.dtype: float64");
}

TEST(Validation, CausalWithMask) {
  Case c = small();
  c.mask = MaskKind::Float2D;
  c.causal = true;
  Built b = build(c);
  expect_forward_error(b.args, ErrorCode::CausalWithMask, "Explicit attn_mask should not be set when is_causal=True");
}

TEST(Validation, DropoutProbabilityOutOfRange) {
  for (double p : {-0.1, 1.5, std::nan("")}) {
    Built b = build(small());
    b.args.options.dropout_p = p;
    expect_forward_error(b.args, ErrorCode::DropoutProbability, "dropout probability has to be between 0 and 1");
  }
}

TEST(Validation, DropoutMaskWrongShape) {
  Built b = build(small());
  Tensor m = empty_tensor(DType::Bool, make_shape({5, 7}));
  b.args.options.dropout_p = 0.5;
  b.args.dropout_mask = m.view;
  expect_forward_error(b.args, ErrorCode::DropoutMaskShape, "dropout_mask of shape (5, 7) does not match");
}

TEST(Validation, DropoutMaskWrongDtype) {
  Built b = build(small());
  Tensor m = empty_tensor(DType::Int32, make_shape({5, 6}));
  b.args.options.dropout_p = 0.5;
  b.args.dropout_mask = m.view;
  expect_forward_error(b.args, ErrorCode::DropoutMaskDtype, "dropout_mask must be bool or floating");
}

// With dropout_p == 0 the dropout mask is ignored (contract §7), even one of the wrong shape.
TEST(Validation, DropoutMaskIgnoredWithoutDropout) {
  Built b = build(small());
  Tensor m = empty_tensor(DType::Bool, make_shape({3, 3}));
  b.args.dropout_mask = m.view;
  Tensor o = empty_tensor(DType::Float32, make_shape({2, 4, 5, 8})), p = empty_tensor(DType::Float32, make_shape({2, 4, 5, 6})),
         l = empty_tensor(DType::Float32, make_shape({2, 4, 5}));
  EXPECT_NO_THROW(forward(Backend::Cpu, b.args, {o.view, p.view, l.view}));
  for (double x : read(p.view)) EXPECT_TRUE(std::isfinite(x));
}

TEST(Validation, TensorsOnDifferentDevices) {
  Built b = build(small());
  b.args.key.device = Device{DeviceType::CUDA, 0};
  expect_forward_error(b.args, ErrorCode::DeviceMismatch, "Expected key to be on the same device as query");
}

TEST(Validation, MixedDtypes) {
  Built b = build(small());
  Tensor k = empty_tensor(DType::Float16, make_shape({2, 4, 6, 8}));
  b.args.key = k.view;
  expect_forward_error(b.args, ErrorCode::DtypeMismatch, "Expected query, key, and value to have the same dtype");
}

TEST(Validation, UnsupportedDtypes) {
  for (DType d : {DType::Int64, DType::Int32, DType::Float8_e4m3fn, DType::Float8_e5m2, DType::Bool}) {
    Tensor q = empty_tensor(d, make_shape({2, 4, 5, 8})), k = empty_tensor(d, make_shape({2, 4, 6, 8})),
           v = empty_tensor(d, make_shape({2, 4, 6, 8}));
    ForwardArgs a;
    a.query = q.view;
    a.key = k.view;
    a.value = v.view;
    expect_forward_error(a, ErrorCode::UnsupportedDtype, std::string("query has dtype ") + dtype_name(d));
  }
}

TEST(Validation, OutputOfWrongShape) {
  Built b = build(small());
  Tensor o = empty_tensor(DType::Float32, make_shape({2, 4, 5, 9})), p = empty_tensor(DType::Float32, make_shape({2, 4, 5, 6})),
         l = empty_tensor(DType::Float32, make_shape({2, 4, 5}));
  expect_error([&] { forward(Backend::Cpu, b.args, {o.view, p.view, l.view}); }, ErrorCode::BadOutput,
               "output has shape (2, 4, 5, 9), expected (2, 4, 5, 8)");
}

TEST(Validation, GradientOfWrongShapeAndMaskGradWithoutFloatMask) {
  Built b = build(small());
  Tensor l = empty_tensor(DType::Float32, make_shape({2, 4, 5}));
  Tensor bad_dO = empty_tensor(DType::Float32, make_shape({2, 4, 5, 7}));
  Tensor dq = empty_tensor(DType::Float32, make_shape({2, 4, 5, 8}));
  BackwardArgs args;
  args.forward = b.args;
  args.logsumexp = l.view;
  args.grad_output = bad_dO.view;
  const auto before = dq.storage;
  expect_error([&] { backward(Backend::Cpu, args, {dq.view, std::nullopt, std::nullopt, std::nullopt}); },
               ErrorCode::BadGradient, "grad_output has shape");
  EXPECT_EQ(dq.storage, before);
  args.grad_output.reset();
  Tensor gm = empty_tensor(DType::Float32, make_shape({5, 6}));
  expect_error([&] { backward(Backend::Cpu, args, {dq.view, std::nullopt, std::nullopt, gm.view}); },
               ErrorCode::BadOutput, "no float attn_mask");
}

TEST(Validation, CudaBackendNeedsItsBuildAndCudaTensors) {
  Built b = build(small());
  Tensor o = empty_tensor(DType::Float32, make_shape({2, 4, 5, 8})), p = empty_tensor(DType::Float32, make_shape({2, 4, 5, 6})),
         l = empty_tensor(DType::Float32, make_shape({2, 4, 5}));
  if (backend_available(Backend::Cuda)) {
    // A build with CUDA refuses host tensors on the CUDA backend before touching them.
    expect_error([&] { forward(Backend::Cuda, b.args, {o.view, p.view, l.view}); }, ErrorCode::DeviceMismatch,
                 "the cuda backend cannot run tensors on cpu");
  } else {
    expect_error([&] { forward(Backend::Cuda, b.args, {o.view, p.view, l.view}); }, ErrorCode::BackendUnavailable,
                 "the cuda backend is not in this build");
  }
}

TEST(Validation, HostBackendsRefuseADeviceDropoutStream) {
  // rng_device points at device memory the host kernels cannot read; they take options.seed.
  Built b = build(small());
  const uint64_t pair[2] = {1, 2};
  b.args.options.dropout_p = 0.3;
  b.args.options.rng_device = pair;
  Tensor o = empty_tensor(DType::Float32, make_shape({2, 4, 5, 8})), p = empty_tensor(DType::Float32, make_shape({2, 4, 5, 6})),
         l = empty_tensor(DType::Float32, make_shape({2, 4, 5}));
  for (Backend backend : {Backend::Cpu, Backend::Reference})
    expect_error([&] { forward(backend, b.args, {o.view, p.view, l.view}); }, ErrorCode::DeviceMismatch,
                 "rng_device is for CUDA");
}

}  // namespace
}  // namespace sdpa_math::testing
