#include "kernels/onednn_linear.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <dlfcn.h>

#include <exception>
#include <optional>

namespace mixprec::kernels {
namespace {

// The op TorchInductor's CPU fusions call. Called boxed: its C++ signature changed across
// LibTorch versions, its schema did not.
const c10::OperatorHandle* linear_pointwise_op() {
  static const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op ? &*op : nullptr;
}

// A LibTorch built without oneDNN registers no kernel for the op; in bf16, oneDNN refuses CPUs
// without AVX-512 (or AVX-NE-CONVERT).
bool onednn_linear_runs(at::ScalarType dtype) {
  const auto probe = [](at::ScalarType dtype) {
    if (!at::hasMKLDNN() || linear_pointwise_op() == nullptr) return false;
    try {
      const auto x = at::arange(1, 5, dtype).view({2, 2});       // (1 2; 3 4)
      const auto y = onednn_linear(x, x, at::ones({2}, dtype));  // x x^T + 1
      return at::equal(y, at::tensor({6.f, 12.f, 12.f, 26.f}).view({2, 2}).to(dtype));
    } catch (const std::exception&) {  // c10::Error, or oneDNN's own
      return false;
    }
  };
  if (dtype == at::kFloat) {
    static const bool fp32 = probe(at::kFloat);
    return fp32;
  }
  static const bool bf16 = probe(at::kBFloat16);
  return dtype == at::kBFloat16 && bf16;
}

// LibTorch's at::native::mkldnn_matmul(mat1, mat2, result, beta, alpha): exported, but its header
// is not installed, and whether it takes fp32 depends on the version and the CPU (2.13's does
// where the CPU has AVX-512 BW/VL/DQ or AVX-NE-CONVERT; the probe below finds out). Looked up by
// its mangled name in the library that holds at::globalContext (libtorch_cpu), so that a
// LibTorch without it (or with other parameters) leaves it unused rather than failing to load
// mixprec. The name does not fix the return type: that it stays void is assumed.
using MkldnnMatmul = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float,
                              float);
MkldnnMatmul mkldnn_matmul() {
  static const auto fn = []() -> MkldnnMatmul {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&at::globalContext), &info) == 0) return nullptr;
    // Already loaded, so nothing loads; the handle stays open, as fn points into it.
    void* library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) return nullptr;
    return reinterpret_cast<MkldnnMatmul>(
        dlsym(library, "_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff"));
  }();
  return fn;
}

bool onednn_mm_runs() {
  static const bool runs = [] {
    if (!at::hasMKLDNN() || mkldnn_matmul() == nullptr) return false;
    try {
      const auto x = at::arange(1, 5, at::kFloat).view({2, 2});  // (1 2; 3 4)
      const auto y = at::arange(5, 9, at::kFloat).view({2, 2});  // (5 6; 7 8)
      return at::equal(onednn_mm(x.t(), y), at::tensor({26.f, 30.f, 38.f, 44.f}).view({2, 2}));
    } catch (const std::exception&) {  // "only enabled for bf16 and fp16", oneDNN's own
      return false;
    }
  }();
  return runs;
}

bool cpu_strided(const at::Tensor& t, at::ScalarType dtype) {
  return t.is_cpu() && t.layout() == at::kStrided && t.scalar_type() == dtype;
}

// Row-major, or the transpose of a row-major tensor.
bool plain_or_transposed(const at::Tensor& t) {
  return row_major(t) || (t.dim() == 2 && t.stride(0) == 1 && t.stride(1) == t.size(0));
}

}  // namespace

bool onednn_linear_available(at::ScalarType dtype) {
  return onednn_linear_runs(dtype) && at::globalContext().userEnabledMkldnn();
}

bool onednn_linear_takes(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const auto dtype = x.scalar_type();
  const auto operand = [&](const at::Tensor& t) { return cpu_strided(t, dtype); };
  return x.dim() >= 1 && x.numel() > 0 && operand(x) && w.dim() == 2 && w.numel() > 0 &&
         w.size(1) == x.size(-1) && operand(w) && w.is_non_overlapping_and_dense() &&
         (!bias.defined() || (bias.dim() == 1 && bias.size(0) == w.size(0) && operand(bias))) &&
         (dtype == at::kFloat || dtype == at::kBFloat16) && onednn_linear_available(dtype);
}

bool onednn_mm_takes(const at::Tensor& a, const at::Tensor& b) {
  const auto operand = [](const at::Tensor& t) {
    return cpu_strided(t, at::kFloat) && t.numel() > 0 && plain_or_transposed(t);
  };
  return a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && operand(a) && operand(b) &&
         onednn_mm_runs() && at::globalContext().userEnabledMkldnn();
}

at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b) {
  RECORD_FUNCTION("mixprec::onednn_mm", std::vector<c10::IValue>());  // not a dispatcher op
  auto result = at::empty({a.size(0), b.size(1)}, a.options());
  mkldnn_matmul()(a, b, result, /*beta=*/0.0f, /*alpha=*/1.0f);
  return result;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  torch::jit::Stack stack{x,
                          w,
                          bias.defined() ? c10::IValue(bias) : c10::IValue(),
                          c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  linear_pointwise_op()->callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

}  // namespace mixprec::kernels
