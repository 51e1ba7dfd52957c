#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::dist {

/// What `torchrun` tells each process it starts (RANK, WORLD_SIZE,
/// LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE).
struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// torchrun's agent already serves the store: every rank connects as a client.
  bool agent_store = false;
};

/// torchrun's environment, or nullopt when WORLD_SIZE is unset (one process,
/// no launcher). A malformed variable is an error that names it.
std::optional<LaunchEnv> launch_env();

/// The process group of a data-parallel run, on c10d (Gloo on CPU), as
/// `torch.distributed.init_process_group` makes it.
class ProcessGroup {
 public:
  explicit ProcessGroup(const LaunchEnv& env);
  ~ProcessGroup();

  /// The process-wide group from torchrun's environment, made on first use;
  /// null in a single process.
  static std::shared_ptr<ProcessGroup> from_environment();

  int64_t rank() const { return env_.rank; }
  int64_t world_size() const { return env_.world_size; }
  int64_t local_rank() const { return env_.local_rank; }

  /// Sums `tensor` over the ranks (or takes their maximum), in place.
  void all_reduce_(at::Tensor& tensor, bool max = false);
  /// Every rank's `tensor` (all of one shape), concatenated along dim 0 in rank order.
  at::Tensor all_gather(const at::Tensor& tensor);
  void broadcast_(at::Tensor& tensor, int64_t root = 0);
  void barrier();
  /// How long a collective waits for the other ranks before it fails (torch's default: 30
  /// minutes), for the operations that follow.
  void set_timeout(std::chrono::milliseconds timeout);

 private:
  friend class GradientReducer;
  struct Impl;  // c10d's group: its headers need gloo's, which users need not have
  LaunchEnv env_;
  std::unique_ptr<Impl> impl_;
};

/// The dtype gradients travel in during the all-reduce. Compression halves
/// the bytes sent; each rank divides by the world size before the sum (no
/// overflow in fp16) and the averaged bucket comes back as fp32.
enum class GradientCompression {
  kNone,  ///< fp32, as DDP without a comm hook
  kFp16,  ///< DDP's `fp16_compress_hook`
  kBf16,  ///< DDP's `bf16_compress_hook`: fp32's range, 8 significant bits
};

/// Options of `GradientReducer`, with DDP's defaults.
struct GradientReducerOptions {
  int64_t bucket_cap_mb = 25;
  GradientCompression compression = GradientCompression::kNone;
  /// Finds, after each forward, the parameters its outputs do not depend on, so that their
  /// buckets do not wait for gradients that never come (DDP's find_unused_parameters). Without
  /// it, when no rank used a parameter, the next forward with gradients is c10d's error (when
  /// only some did, they wait for the others until the timeout). Unlike DDP, an output the loss
  /// does not use still counts as used (DDP's _DDPSink is not reproduced): its parameters then
  /// make the same error.
  bool find_unused_parameters = false;
  /// Before a forward that follows a synced one, the module's buffers (e.g. a batch norm's
  /// running statistics) are set to rank 0's (DDP's broadcast_buffers).
  bool broadcast_buffers = true;
};

/// Python DDP's engine, c10d's `Reducer`, on a module's parameters: gradients
/// are bucketed and all-reduced (averaged) as backward produces them,
/// overlapping the rest of backward. A backward all-reduces only when
/// `prepare_for_backward()` was called before it; otherwise gradients
/// accumulate locally (DDP's no_sync). Call before_forward() before each
/// forward, as DDP's forward does: it rebuilds the buckets once in the order
/// the gradients came, and until then c10d's reducer records that order at
/// every synced backward.
///
///   dist::GradientReducer reducer(model->parameters(), group,
///                                 {.compression = dist::GradientCompression::kBf16});
///   reducer.before_forward();
///   auto loss = model->forward(x);
///   reducer.after_forward(/*sync=*/true, {loss});
///   loss.backward();  // gradients averaged over the ranks, sent as bf16
class GradientReducer {
 public:
  GradientReducer(std::vector<at::Tensor> parameters, std::shared_ptr<ProcessGroup> group,
                  GradientReducerOptions options = {}, std::vector<at::Tensor> buffers = {});
  ~GradientReducer();
  /// DDP's forward around the module's. Before: with gradients, the check that the last synced
  /// backward all-reduced everything; the buffers' broadcast. After, when gradients are on,
  /// `sync_gradients` (not an accumulation step) and require_backward_grad_sync:
  /// prepare_for_backward with the forward's outputs (only read with find_unused_parameters).
  /// Both are collectives when they broadcast: a forward on one process only should call the
  /// module itself, as DDP's `model.module`.
  void before_forward();
  void after_forward(bool sync_gradients, const std::vector<at::Tensor>& outputs);
  /// The next backward all-reduces. With find_unused_parameters, `outputs` must hold the
  /// forward's outputs.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs = {});
  const GradientReducerOptions& options() const;
  /// DDP's require_backward_grad_sync: while false (DDP's no_sync), a prepared
  /// model's forward does not call prepare_for_backward.
  bool require_backward_grad_sync() const { return require_backward_grad_sync_; }
  void set_require_backward_grad_sync(bool sync) { require_backward_grad_sync_ = sync; }
  /// Bytes this process has handed to all-reduce since it was made: the sum
  /// of the buckets as sent (after compression); what Gloo's algorithm then
  /// moves over the wire is a multiple of it.
  int64_t bytes_all_reduced() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool require_backward_grad_sync_ = true;
  bool require_forward_param_sync_ = true;  // DDP's: the last forward was a synced one
};

}  // namespace mixprec::dist
