#include "mixprec/dist/process_group.h"

#include "mixprec/optim/optimizer_in_backward.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <mutex>

namespace mixprec::dist {

namespace {

int64_t int_from_env(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0', "environment variable ", name,
              ": expected an integer, got '", value, "'");
  return parsed;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

}  // namespace

std::optional<LaunchEnv> launch_env() {
  if (std::getenv("WORLD_SIZE") == nullptr) return std::nullopt;
  LaunchEnv env;
  env.world_size = int_from_env("WORLD_SIZE", 1);
  env.rank = int_from_env("RANK", 0);
  env.local_rank = int_from_env("LOCAL_RANK", env.rank);
  if (const char* addr = std::getenv("MASTER_ADDR")) env.master_addr = addr;
  env.master_port = static_cast<int>(int_from_env("MASTER_PORT", 29500));
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent != nullptr && std::string(agent) == "True";
  TORCH_CHECK(env.world_size >= 1, "WORLD_SIZE must be >= 1, got ", env.world_size);
  TORCH_CHECK(env.rank >= 0 && env.rank < env.world_size,
              "RANK must be in [0, WORLD_SIZE = ", env.world_size, "), got ", env.rank);
  TORCH_CHECK(env.master_port > 0 && env.master_port < 65536,
              "MASTER_PORT must be a port number, got ", env.master_port);
  return env;
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

ProcessGroup::ProcessGroup(const LaunchEnv& env) : env_(env), impl_(std::make_unique<Impl>()) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  // Under torchrun the agent serves the store; without it rank 0 does.
  store_options.isServer = !env.agent_store && env.rank == 0;
  store_options.numWorkers = env.world_size;
  // torch's default_pg_timeout: main_process_first may wait out a long preprocessing.
  store_options.timeout = std::chrono::minutes(30);
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("mixprec/", store);

  auto gloo_options = c10d::ProcessGroupGloo::Options::create(std::chrono::minutes(30));
  // A single-machine run talks over loopback only.
  gloo_options->devices.push_back(is_loopback(env.master_addr)
                                      ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                      : c10d::ProcessGroupGloo::createDefaultDevice());
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
      prefixed, static_cast<int>(env.rank), static_cast<int>(env.world_size), gloo_options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, static_cast<int>(env.rank),
                                                       static_cast<int>(env.world_size));
  group->setBackend(c10::kCPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  impl_->group = std::move(group);
}

ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::from_environment() {
  static std::mutex mutex;
  static std::shared_ptr<ProcessGroup> group;
  std::lock_guard<std::mutex> lock(mutex);
  if (!group) {
    const auto env = launch_env();
    if (!env || env->world_size == 1) return nullptr;
    group = std::make_shared<ProcessGroup>(*env);
  }
  return group;
}

void ProcessGroup::all_reduce_(at::Tensor& tensor, bool max) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  impl_->group->allreduce(tensors, options)->wait();
}

at::Tensor ProcessGroup::all_gather(const at::Tensor& tensor) {
  const at::Tensor input = tensor.contiguous();
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < world_size(); ++r) outputs[0].push_back(at::empty_like(input));
  std::vector<at::Tensor> inputs{input};
  impl_->group->allgather(outputs, inputs)->wait();
  return at::cat(outputs[0], 0);
}

void ProcessGroup::broadcast_(at::Tensor& tensor, int64_t root) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  impl_->group->broadcast(tensors, options)->wait();
}

void ProcessGroup::barrier() { impl_->group->barrier()->wait(); }

void ProcessGroup::set_timeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "ProcessGroup: the timeout must be positive, got ",
              timeout.count(), " ms");
  impl_->group->setTimeout(timeout);
}

namespace {

// DDP's allreduce / fp16_compress / bf16_compress hooks in one: the bucket,
// cast to the wire dtype and divided by the world size, is summed over the
// ranks and copied back into the bucket (fp32), which the Reducer then copies
// into the gradients. Every mode goes through it, so the byte count is exact.
class CompressedAllReduceHook
    : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  CompressedAllReduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group, at::ScalarType wire,
                          std::shared_ptr<std::atomic<int64_t>> bytes)
      : CppCommHookInterface(std::move(group)), wire_(wire), bytes_(std::move(bytes)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();  // a handle on the bucket's storage
    // Divide before the sum, as DDP's hooks do: fp16 would overflow sooner otherwise.
    at::Tensor sent = buffer.to(wire_).div_(state_->getSize());  // in place when wire is fp32
    *bytes_ += static_cast<int64_t>(sent.nbytes());
    std::vector<at::Tensor> tensors{sent};
    return state_->allreduce(tensors)->getFuture()->then(
        [buffer, sent](c10::ivalue::Future&) {
          if (!sent.is_same(buffer)) buffer.copy_(sent);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }

 private:
  at::ScalarType wire_;
  std::shared_ptr<std::atomic<int64_t>> bytes_;
};

at::ScalarType wire_dtype(GradientCompression compression) {
  switch (compression) {
    case GradientCompression::kFp16:
      return at::kHalf;
    case GradientCompression::kBf16:
      return at::kBFloat16;
    case GradientCompression::kNone:
      break;
  }
  return at::kFloat;
}

}  // namespace

struct GradientReducer::Impl {
  std::shared_ptr<ProcessGroup> group;
  GradientReducerOptions options;
  std::vector<at::Tensor> buffers;
  std::shared_ptr<std::atomic<int64_t>> bytes = std::make_shared<std::atomic<int64_t>>(0);
  std::unique_ptr<c10d::Reducer> reducer;
};

GradientReducer::GradientReducer(std::vector<at::Tensor> parameters,
                                 std::shared_ptr<ProcessGroup> group,
                                 GradientReducerOptions options, std::vector<at::Tensor> buffers)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(group, "GradientReducer: no process group");
  TORCH_CHECK(options.bucket_cap_mb > 0, "GradientReducer: bucket_cap_mb must be > 0, got ",
              options.bucket_cap_mb);
  impl_->group = std::move(group);
  impl_->options = options;
  impl_->buffers = std::move(buffers);
  optim::check_not_updated_in_backward(parameters, "GradientReducer",
                                       "which would update it before the all-reduce");
  const int64_t cap = options.bucket_cap_mb * 1024 * 1024;
  const std::vector<bool> sparse(parameters.size(), false);
  // DDP's buckets (torch 2.13's BucketCapacityConfig): without find_unused_parameters, one
  // bucket until the first synced backward, after which rebuild_buckets() makes them in the order
  // the gradients came (a 1 MiB first one, then `cap`); with it, no rebuild, so those sizes from
  // the start, in reverse order of the parameters (backward reaches the last ones first, and the
  // reducer starts the buckets in order).
  const auto first = static_cast<size_t>(c10d::kDefaultFirstBucketBytes);
  auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
      parameters,
      options.find_unused_parameters ? std::vector<size_t>{first, static_cast<size_t>(cap)}
                                     : std::vector<size_t>{std::numeric_limits<size_t>::max()},
      sparse);
  std::ranges::reverse(buckets);
  std::unordered_map<size_t, std::string> names;
  for (size_t i = 0; i < parameters.size(); ++i) names[i] = "param" + std::to_string(i);
  impl_->reducer = std::make_unique<c10d::Reducer>(
      std::move(parameters), std::move(buckets), impl_->group->impl_->group, sparse, cap,
      options.find_unused_parameters, /*gradient_as_bucket_view=*/false, std::move(names),
      static_cast<int64_t>(first), /*skip_all_reduce_unused_params=*/false,
      /*use_python_reducer=*/false, /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
  impl_->reducer->register_comm_hook(std::make_unique<CompressedAllReduceHook>(
      impl_->group->impl_->group, wire_dtype(options.compression), impl_->bytes));
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::before_forward() {
  if (at::GradMode::is_enabled()) {
    // As DDP's forward: the last synced backward must have all-reduced every bucket, which a
    // parameter without a gradient (and not found unused) prevents; c10d's reducer alone would
    // go on without that bucket's all-reduce.
    try {
      impl_->reducer->check_finalized();
    } catch (const c10::Error& e) {
      // c10d's message names DDP's Python keyword; say where mixprec takes it.
      TORCH_CHECK(impl_->options.find_unused_parameters, e.what_without_backtrace(),
                  "\nmixprec: set GradientReducerOptions::find_unused_parameters (the "
                  "Accelerator's ddp option, the Trainer's ddp_find_unused_parameters)");
      throw;
    }
    // As DDP's forward (on every process alike): once, the buckets in the order the first
    // synced backward's gradients came; until then, the reducer records that order each step.
    impl_->reducer->rebuild_buckets();
  }
  if (!require_forward_param_sync_ || !impl_->options.broadcast_buffers) return;
  at::NoGradGuard no_grad;
  for (auto& buffer : impl_->buffers) impl_->group->broadcast_(buffer);
}

void GradientReducer::after_forward(bool sync_gradients, const std::vector<at::Tensor>& outputs) {
  require_forward_param_sync_ =
      sync_gradients && require_backward_grad_sync_ && at::GradMode::is_enabled();
  if (require_forward_param_sync_) prepare_for_backward(outputs);
}

void GradientReducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  TORCH_CHECK(!impl_->options.find_unused_parameters || !outputs.empty(),
              "GradientReducer: find_unused_parameters needs the forward's outputs as tensors (a "
              "Tensor, a ModelOutput, or tuples, pairs, vectors, optionals or maps of them) to "
              "find the parameters they "
              "depend on");
  impl_->reducer->prepare_for_backward(outputs);
}

const GradientReducerOptions& GradientReducer::options() const { return impl_->options; }

int64_t GradientReducer::bytes_all_reduced() const { return *impl_->bytes; }

}  // namespace mixprec::dist
