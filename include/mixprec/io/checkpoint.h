#pragma once

#include "mixprec/io/safetensors.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::io {

/// A module's parameters and buffers by their dotted names (its state_dict).
TensorMap module_state(const torch::nn::Module& module);
/// module_state in PyTorch's state_dict order (each module's parameters, its buffers, then its
/// children's), a tensor that is also under an earlier name (a tied weight: the same data,
/// dtype and view) left out, as Accelerate's save_model and HF's save_pretrained save them.
std::vector<std::pair<std::string, at::Tensor>> untied_module_state(
    const torch::nn::Module& module);
/// torch's _IncompatibleKeys: what load_module_state(strict = false) left out.
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;     // the module's, not in the state
  std::vector<std::string> unexpected_keys;  // the state's, not in the module
};
/// Copies `state` into the module's parameters and buffers. Shape or dtype mismatches are
/// errors that name the tensor and `source` (the file it came from); so are missing or
/// unexpected names, unless `strict` is false (torch's load_state_dict), which skips them and
/// returns them.
IncompatibleKeys load_module_state(torch::nn::Module& module, const TensorMap& state,
                                   const std::string& source, bool strict = true);

/// An optimizer's per-parameter state as tensors ("state.<index>.<field>",
/// the index counting parameters across groups as PyTorch's state_dict does)
/// and its param groups' hyperparameters as JSON text, under the names of
/// PyTorch's param_groups (lr, betas, eps, weight_decay, amsgrad, maximize;
/// SGD's momentum, dampening, nesterov). Loading sets them on the groups, as
/// PyTorch's load_state_dict does, but not how the optimizer computes (fused),
/// and refuses what the optimizers' constructors refuse (betas of 1).
/// Supports torch::optim::SGD, Adam, AdamW and mixprec::optim::AdamW; any
/// other is an error that names its type.
struct OptimizerState {
  TensorMap tensors;
  std::string groups_json;
};
OptimizerState optimizer_state(const torch::optim::Optimizer& optimizer);
void load_optimizer_state(torch::optim::Optimizer& optimizer, const OptimizerState& state,
                          const std::string& source);

/// LibTorch's CPU generator state (and each CUDA device's), to resume with the
/// same random numbers.
TensorMap rng_state();
void load_rng_state(const TensorMap& state, const std::string& source);

/// Writes a checkpoint folder atomically: files go into a temporary sibling
/// folder, are fsync'd, and the folder is renamed into place only by
/// `commit()`. A crash before that leaves any previous checkpoint intact and
/// no half-written one under the final name.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(std::filesystem::path final_dir);
  ~CheckpointWriter();  // removes the temporary folder unless committed
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  /// Where to write the files now.
  const std::filesystem::path& dir() const { return tmp_dir_; }
  void write_text(const std::string& name, const std::string& text);
  void write_tensors(const std::string& name, const TensorMap& tensors);
  /// Records a checksum of every file (checksums.json), syncs, and moves the
  /// folder into place, replacing an older one of the same name. What the
  /// older one holds that this one does not write stays, as Accelerate's
  /// save_state leaves it (hard links where the file system has them).
  void commit();

 private:
  std::filesystem::path final_dir_, tmp_dir_;
  bool committed_ = false;
};

/// Checks every file of a checkpoint folder against its checksums.json; a
/// damaged or missing file is an error that names it.
void verify_checkpoint(const std::filesystem::path& dir);

/// The `checkpoint-N` folders of `output_dir` (none if it does not exist), as (N, folder)
/// sorted by N; a name whose N does not fit int64 is not one. `prefix` is what comes before
/// N: "checkpoint-" as the HF Trainer names them, "checkpoint_" as Accelerate does.
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints(
    const std::filesystem::path& output_dir, const std::string& prefix = "checkpoint-");

/// The newest `checkpoint-N` folder of `output_dir` that verify_checkpoint
/// accepts; each newer damaged one is skipped with a warning that names it and
/// says what is wrong. nullopt when there is none.
std::optional<std::filesystem::path> last_good_checkpoint(
    const std::filesystem::path& output_dir, const std::string& prefix = "checkpoint-");

/// Removes what a killed writer left in `output_dir`: CheckpointWriter's
/// `*.tmp-PID` and `*.old-PID` folders, except that an `*.old-PID` folder
/// whose final folder is missing and whose `*.tmp-PID` is there (the writer
/// died between the two renames of a replacement) is renamed back. Returns
/// how many it removed.
int remove_unfinished_checkpoints(const std::filesystem::path& output_dir,
                                  const std::string& prefix = "checkpoint-");

/// Deletes an old checkpoint folder; a failure (a file held open elsewhere) is a warning, as HF's
/// rotation ignores it, so that the save that rotated counts as done on every process.
void remove_old_checkpoint(const std::filesystem::path& dir);

}  // namespace mixprec::io
