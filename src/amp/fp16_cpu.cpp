// Design note: fp16 on CPUs without FP16 arithmetic.
//
// Where: kernels registered for the aten ops at the CPU dispatch key, not at
// AutocastCPU. The backward of an fp16 matmul runs outside autocast, on fp16
// tensors, and reaches the CPU key only; a kernel there serves the forward, the
// backward, and models cast to fp16 alike. A kernel handles Half inputs itself
// and hands every other dtype, unchanged, to LibTorch's own kernel for that
// key (at::cpu::mm, ...; at::compositeexplicitautograd::convolution for ops
// without a CPU kernel), so no other dtype changes by a bit.
//
// When: a torch::Library made at run time, on first need, not a static
// TORCH_LIBRARY_IMPL: a program that never asks mixprec for fp16 keeps
// LibTorch's kernels, and the dispatcher's "overriding a previously registered
// kernel" warning, meant for accidental clashes, is silenced around our
// deliberate override. Registration is for the life of the process; the path
// setting is read on every call, so it can be switched off at any time.
//
// What: up-cast the fp16 inputs to fp32 (exact), run the fp32 kernel (fp32
// accumulation, the fast GEMM: for mm and a linear layer's addmm with a
// row-major first operand, oneDNN's, as models::linear's), round the result to
// fp16 once. A matmul's
// backward up-casts its incoming gradient twice (once per input's gradient, the
// second time often as a transposed view): a small cache of the last up-casts
// serves the second (UpcastCache).
//
// What not: the out= and in-place forms of the GEMMs (addmm_, mm.out, ...),
// addbmm and _addmm_activation reach LibTorch's own fp16 kernels; nothing in
// autocast, autograd or the models calls them with fp16. Rather than compute
// them in fp32 behind the user's back, a kernel there warns once per op that
// the op runs at LibTorch's fp16 speed, then calls LibTorch's kernel as is.
#include "mixprec/amp/fp16_cpu.h"

#include "mixprec/log/logging.h"

#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/_addmm_activation_cpu_dispatch.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_cpu_dispatch.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_cpu_dispatch.h>
#include <ATen/ops/addbmm_cpu_dispatch.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/addmv_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/convolution_backward_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/convolution_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/dot_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/mv_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/vdot_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>

#include "kernels/onednn_linear.h"

namespace mixprec::amp {

namespace {

std::atomic<Fp16CpuPath> g_path{Fp16CpuPath::kAuto};
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_calls{0};

bool wants_fast_path(Fp16CpuPath path) {
  return path == Fp16CpuPath::kAlways || (path == Fp16CpuPath::kAuto && !cpu_has_native_fp16());
}

// Half inputs, and the fast path on: count the call and take it.
bool fast(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    if (t->scalar_type() != at::kHalf) return false;
  if (!wants_fast_path(g_path.load(std::memory_order_relaxed))) return false;
  g_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The fp32 copies of the last fp16 tensors up-cast, per thread (autograd runs a CPU backward
// on the thread that called it). A copy serves any dense view of the same elements at the same
// version (a transposed gradient too), and is dropped when it serves or when newer copies push
// it out: at most kEntries fp32 tensors are held between ops.
class UpcastCache {
 public:
  at::Tensor up(const at::Tensor& t) {
    if (!cacheable(t)) return t.to(at::kFloat);
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->same_elements(t)) {
        auto fp32 = it->fp32.as_strided(t.sizes(), t.strides(), 0);
        entries_.erase(it);
        return fp32;
      }
    if (entries_.size() == kEntries) entries_.pop_front();  // before the new copy: less memory
    auto fp32 = t.to(at::kFloat);
    if (fp32.strides() == t.strides() && fp32.storage_offset() == 0)
      entries_.push_back(
          {c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()),
           t.storage().data(), t.storage_offset(), t.numel(), t._version(), fp32});
    return fp32;
  }

 private:
  static constexpr size_t kEntries = 2;  // a matmul's two fp16 inputs
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // held weakly: its address stays unique
    const void* data;
    int64_t offset, numel, version;
    at::Tensor fp32;

    // Dense tensors at the same offset with as many elements cover the same memory.
    bool same_elements(const at::Tensor& t) const {
      return !storage.expired() &&
             storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
             data == t.storage().data() && offset == t.storage_offset() && numel == t.numel() &&
             version == t._version();
    }
  };
  static bool cacheable(const at::Tensor& t) {
    return !t.is_inference() && t.has_storage() && t.is_non_overlapping_and_dense();
  }
  std::deque<Entry> entries_;
};

at::Tensor up(const at::Tensor& t) {
  thread_local UpcastCache cache;
  return cache.up(t);
}
std::optional<at::Tensor> up(const std::optional<at::Tensor>& t) {
  if (!t || !t->defined()) return t;
  return up(*t);
}
at::Tensor down(const at::Tensor& t) { return t.defined() ? t.to(at::kHalf) : t; }

// The fp32 product a b + bias (bias (N) or undefined): oneDNN's GEMM where it runs and takes
// them (kernels/onednn_linear.h: its linear for a row-major a, bias fused; its matmul for
// transposed operands, as in a weight gradient), else LibTorch's, with its checks.
at::Tensor fp32_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b) {
  if (kernels::row_major(a) && b.dim() == 2 && kernels::onednn_linear_takes(a, b.t(), bias))
    return kernels::onednn_linear(a, b.t(), bias.defined() ? bias.contiguous() : bias);
  if (!bias.defined() && kernels::onednn_mm_takes(a, b)) return kernels::onednn_mm(a, b);
  return bias.defined() ? at::cpu::addmm(bias, a, b) : at::cpu::mm(a, b);
}

at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
  if (!fast({&self, &mat2})) return at::cpu::mm(self, mat2);
  return down(fp32_addmm({}, up(self), up(mat2)));
}

at::Tensor bmm(const at::Tensor& self, const at::Tensor& mat2) {
  if (!fast({&self, &mat2})) return at::cpu::bmm(self, mat2);
  return down(at::cpu::bmm(up(self), up(mat2)));
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  if (!fast({&self, &mat1, &mat2})) return at::cpu::addmm(self, mat1, mat2, beta, alpha);
  if (beta.equal(1) && alpha.equal(1) && self.dim() == 1)  // a linear layer's
    return down(fp32_addmm(up(self), up(mat1), up(mat2)));
  return down(at::cpu::addmm(up(self), up(mat1), up(mat2), beta, alpha));
}

at::Tensor baddbmm(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  if (!fast({&self, &batch1, &batch2})) return at::cpu::baddbmm(self, batch1, batch2, beta, alpha);
  return down(at::cpu::baddbmm(up(self), up(batch1), up(batch2), beta, alpha));
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                       c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool transposed,
                       c10::SymIntArrayRef output_padding, c10::SymInt groups) {
  namespace ce = at::compositeexplicitautograd;
  if (!fast({&input, &weight}) || (bias && bias->defined() && bias->scalar_type() != at::kHalf))
    return ce::convolution_symint(input, weight, bias, stride, padding, dilation, transposed,
                                  output_padding, groups);
  return down(ce::convolution_symint(up(input), up(weight), up(bias), stride, padding, dilation,
                                     transposed, output_padding, groups));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalSymIntArrayRef bias_sizes, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation, bool transposed, c10::SymIntArrayRef output_padding,
    c10::SymInt groups, std::array<bool, 3> output_mask) {
  namespace ce = at::compositeexplicitautograd;
  if (!fast({&grad_output, &input, &weight}))
    return ce::convolution_backward_symint(grad_output, input, weight, bias_sizes, stride, padding,
                                           dilation, transposed, output_padding, groups,
                                           output_mask);
  auto [gi, gw, gb] = ce::convolution_backward_symint(
      up(grad_output), up(input), up(weight), bias_sizes, stride, padding, dilation, transposed,
      output_padding, groups, output_mask);
  return {down(gi), down(gw), down(gb)};
}

// mv is composite in LibTorch (addmv.out underneath); 1-D matmul reaches it.
at::Tensor mv(const at::Tensor& self, const at::Tensor& vec) {
  if (!fast({&self, &vec})) return at::compositeexplicitautograd::mv(self, vec);
  return down(at::compositeexplicitautograd::mv(up(self), up(vec)));
}

at::Tensor addmv(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  if (!fast({&self, &mat, &vec})) return at::cpu::addmv(self, mat, vec, beta, alpha);
  return down(at::cpu::addmv(up(self), up(mat), up(vec), beta, alpha));
}

at::Tensor dot(const at::Tensor& self, const at::Tensor& other) {
  if (!fast({&self, &other})) return at::cpu::dot(self, other);
  return down(at::cpu::dot(up(self), up(other)));
}

at::Tensor vdot(const at::Tensor& self, const at::Tensor& other) {
  if (!fast({&self, &other})) return at::cpu::vdot(self, other);
  return down(at::cpu::vdot(up(self), up(other)));
}

// logsumexp is fp32 on both paths. A mask LibTorch's fp16 kernel takes (fp16 or fp32) is
// up-cast; any other (bool, bf16) goes to that kernel, whose error names it: up-cast, a bool
// mask would become an additive 0/1 one, masking nothing.
bool mask_for_fp16(const std::optional<at::Tensor>& mask) {
  return !mask || !mask->defined() || mask->scalar_type() == at::kHalf ||
         mask->scalar_type() == at::kFloat;
}

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& query, const at::Tensor& key,
                                                   const at::Tensor& value, double dropout_p,
                                                   bool is_causal,
                                                   const std::optional<at::Tensor>& attn_mask,
                                                   std::optional<double> scale) {
  if (!mask_for_fp16(attn_mask) || !fast({&query, &key, &value}))
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p,
                                                                is_causal, attn_mask, scale);
  auto [out, lse] = at::cpu::_scaled_dot_product_flash_attention_for_cpu(
      up(query), up(key), up(value), dropout_p, is_causal, up(attn_mask), scale);
  return {down(out), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp, double dropout_p,
    bool is_causal, const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  if (!mask_for_fp16(attn_mask) || !fast({&grad_out, &query, &key, &value, &out}))
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale);
  auto [gq, gk, gv] = at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
      up(grad_out), up(query), up(key), up(value), up(out), logsumexp, dropout_p, is_causal,
      up(attn_mask), scale);
  return {down(gq), down(gk), down(gv)};
}

bool is_half(const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kHalf; }
template <typename T>
bool is_half(const T&) {
  return false;
}

// A kernel for an op the fast path does not cover: while the fast path is on,
// the first call with an fp16 tensor warns that this op runs at LibTorch's fp16
// speed; every call goes to LibTorch's own kernel, Original, unchanged.
template <const char* Name, auto Original>
struct NotCovered;
template <const char* Name, typename R, typename... Args, R (*Original)(Args...)>
struct NotCovered<Name, Original> {
  static R call(Args... args) {
    // The verbosity first: a warning hidden now is shown once it is let through.
    if ((is_half(args) || ...) && wants_fast_path(g_path.load(std::memory_order_relaxed)) &&
        log::enabled(log::Level::kWarning) && !warned.exchange(true))
      TORCH_WARN("mixprec: fp16 on the CPU: aten::", Name,
                 " has no mixprec fast path; it runs LibTorch's own fp16 kernel, at LibTorch's "
                 "fp16 speed (slow on CPUs without FP16 arithmetic). Shown once per op.");
    return Original(std::forward<Args>(args)...);
  }
  static inline std::atomic<bool> warned{false};
};

constexpr char kMmOut[] = "mm.out";
constexpr char kBmmOut[] = "bmm.out";
constexpr char kAddmmOut[] = "addmm.out";
constexpr char kAddmmInplace[] = "addmm_";
constexpr char kBaddbmmOut[] = "baddbmm.out";
constexpr char kBaddbmmInplace[] = "baddbmm_";
constexpr char kAddbmm[] = "addbmm";
constexpr char kAddbmmOut[] = "addbmm.out";
constexpr char kAddbmmInplace[] = "addbmm_";
constexpr char kAddmvOut[] = "addmv.out";
constexpr char kAddmvInplace[] = "addmv_";
constexpr char kAddmmActivation[] = "_addmm_activation";
constexpr char kAddmmActivationOut[] = "_addmm_activation.out";

template <const char* Name, auto Original>
void not_covered(torch::Library& library) {
  library.impl(Name, TORCH_FN((NotCovered<Name, Original>::call)));
}

class SilentWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

void install() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (g_installed.load()) return;
  SilentWarnings silent;
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  // Never destroyed: deregistering at exit would race with other statics.
  static auto* library =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
  library->impl("mm", TORCH_FN(mm));
  library->impl("bmm", TORCH_FN(bmm));
  library->impl("addmm", TORCH_FN(addmm));
  library->impl("baddbmm", TORCH_FN(baddbmm));
  library->impl("convolution", TORCH_FN(convolution));
  library->impl("convolution_backward", TORCH_FN(convolution_backward));
  library->impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_attention));
  library->impl("_scaled_dot_product_flash_attention_for_cpu_backward",
                TORCH_FN(flash_attention_backward));
  library->impl("mv", TORCH_FN(mv));
  library->impl("addmv", TORCH_FN(addmv));
  library->impl("dot", TORCH_FN(dot));
  library->impl("vdot", TORCH_FN(vdot));
  not_covered<kMmOut, &at::cpu::mm_outf>(*library);
  not_covered<kBmmOut, &at::cpu::bmm_outf>(*library);
  not_covered<kAddmmOut, &at::cpu::addmm_outf>(*library);
  not_covered<kAddmmInplace, &at::cpu::addmm_>(*library);
  not_covered<kBaddbmmOut, &at::cpu::baddbmm_outf>(*library);
  not_covered<kBaddbmmInplace, &at::cpu::baddbmm_>(*library);
  not_covered<kAddbmm, &at::cpu::addbmm>(*library);
  not_covered<kAddbmmOut, &at::cpu::addbmm_outf>(*library);
  not_covered<kAddbmmInplace, &at::cpu::addbmm_>(*library);
  not_covered<kAddmvOut, &at::cpu::addmv_outf>(*library);
  not_covered<kAddmvInplace, &at::cpu::addmv_>(*library);
  not_covered<kAddmmActivation, &at::cpu::_addmm_activation>(*library);
  not_covered<kAddmmActivationOut, &at::cpu::_addmm_activation_outf>(*library);
  g_installed.store(true);
}

}  // namespace

void set_fp16_cpu_path(Fp16CpuPath path) {
  g_path.store(path);
  maybe_install_fp16_cpu_fast_path();
}

Fp16CpuPath fp16_cpu_path() { return g_path.load(); }

bool cpu_has_native_fp16() {
  static const bool native = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    auto has = [&](const char* name) {
      auto it = caps.find(name);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    return has("avx512_fp16") || has("amx_fp16");
  }();
  return native;
}

bool fp16_cpu_fast_path_active() { return g_installed.load() && wants_fast_path(g_path.load()); }

void maybe_install_fp16_cpu_fast_path() {
  if (!g_installed.load() && wants_fast_path(g_path.load())) install();
}

int64_t fp16_cpu_fast_path_calls() { return g_calls.load(); }

}  // namespace mixprec::amp
