#pragma once

#include "mixprec/data/collate.h"
#include "mixprec/data/dataset.h"

#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

namespace mixprec::data {

/// How the replicas (ranks) of a DataLoader share each epoch's samples.
enum class Sharding {
  /// torch's DistributedSampler: rank r takes samples r, r + num_replicas, ... of the epoch's
  /// order padded (by repeating it from its start) to a multiple of num_replicas, and batches
  /// them; its last batch may be short.
  kDistributedSampler,
  /// Accelerate's BatchSamplerShard (with even_batches, its default), as its prepared loaders
  /// shard: the epoch's order padded from its start to a multiple of batch_size *
  /// num_replicas, cut in batches of batch_size that go to the ranks in turn, so every batch
  /// is full. (With split_batches, Accelerate cuts each batch of batch_size * num_replicas in
  /// contiguous slices: the same batches.) One replica: the loader's own batches.
  kBatchSamplerShard,
};

/// Where a shuffled DataLoader's order comes from.
enum class ShuffleOrder {
  /// randperm(seed + epoch): torch's DistributedSampler, and Accelerate's SeedableRandomSampler
  /// (use_seedable_sampler, the HF Trainer's default).
  kSeedPlusEpoch,
  /// torch's RandomSampler: each pass draws a new order, from `generator`, continuing it (two
  /// randperms a whole pass, as RandomSampler's), or, without one, from a generator seeded by a
  /// draw from torch's default generator when the pass starts. The epoch number plays no part.
  /// Accelerate's prepared loaders without use_seedable_sampler (its default) shuffle so. With
  /// several replicas, only with Sharding::kBatchSamplerShard (torch has no other).
  kRandomSampler,
};

/// transformers' LengthGroupedSampler on top of a shuffled order (the HF Trainer's
/// train_sampling_strategy "group_by_length"): see get_length_grouped_indices.
struct LengthGrouping {
  std::vector<int64_t> lengths;  // one per sample, e.g. its number of tokens
  /// The sampler's batch_size (the HF Trainer's per-device batch times
  /// gradient_accumulation_steps); 0: the loader's.
  size_t batch_size = 0;
};

/// Options of `DataLoader`. The defaults are `torch.utils.data.DataLoader`'s
/// (batch_size 8 as HF's TrainingArguments) with a `DistributedSampler` of
/// `num_replicas` ranks.
struct DataLoaderOptions {
  size_t batch_size = 8;
  bool shuffle = false;
  /// The shuffle's seed (added to the epoch). Unset: 0, DistributedSampler's default; a loader
  /// prepared by an Accelerator draws it from torch's generator instead, as Accelerate does.
  std::optional<uint64_t> seed = std::nullopt;
  /// Drops the last incomplete batch, and the samples that do not divide
  /// evenly among the replicas (instead of padding with repeats).
  bool drop_last = false;
  /// Background threads that read and collate batches ahead of the caller;
  /// 0 reads in the caller's thread. The order is the same either way.
  size_t num_workers = 0;
  /// Batches read ahead per worker.
  size_t prefetch_factor = 2;
  size_t num_replicas = 1;
  size_t rank = 0;
  Sharding sharding = Sharding::kDistributedSampler;
  ShuffleOrder shuffle_order = ShuffleOrder::kSeedPlusEpoch;
  /// kRandomSampler's generator: torch's `RandomSampler(dataset, generator=...)`, shared as a
  /// torch.Generator. (torch's DataLoader(generator=g) would also draw its base seed from g; this
  /// loader always draws that from torch's default generator.)
  std::optional<at::Generator> generator = std::nullopt;
  /// Each epoch's shuffled order (kSeedPlusEpoch's) grouped by length, so that a batch holds
  /// samples of about the same length and pads little; then shared out to the replicas as
  /// without it: with kBatchSamplerShard, Accelerate's prepared loader of a LengthGroupedSampler
  /// seeded with seed + epoch; with kDistributedSampler, transformers' older
  /// DistributedLengthGroupedSampler(seed).
  std::optional<LengthGrouping> group_by_length = std::nullopt;
};

/// Where a DataLoader stands: the epoch, and how many batches of it were
/// handed out. Saved with a checkpoint, it lets a resumed run yield exactly the
/// remaining batches of the epoch.
struct DataLoaderState {
  int64_t epoch = 0;
  int64_t batches_yielded = 0;
  /// ShuffleOrder::kRandomSampler without a generator: the seed of the pass stopped mid-way.
  std::optional<uint64_t> pass_seed = std::nullopt;
  /// ShuffleOrder::kRandomSampler with a generator: its state when the pass stopped mid-way
  /// began, or, between passes, its state now.
  std::optional<std::vector<uint8_t>> generator_state = std::nullopt;
  bool operator==(const DataLoaderState&) const = default;
};

/// nlohmann::json hooks (found by ADL): {"epoch": 0, "batches_yielded": 0}, and "pass_seed"
/// and "generator_state" (an array of bytes) when set.
template <typename Json>
void to_json(Json& j, const DataLoaderState& state) {
  j = Json{{"epoch", state.epoch}, {"batches_yielded", state.batches_yielded}};
  if (state.pass_seed) j["pass_seed"] = *state.pass_seed;
  if (state.generator_state) j["generator_state"] = *state.generator_state;
}
template <typename Json>
void from_json(const Json& j, DataLoaderState& state) {
  for (const char* key : {"epoch", "batches_yielded"}) {
    TORCH_CHECK(j.is_object() && j.contains(key) && j.at(key).is_number_integer(),
                "DataLoaderState: expected an integer '", key, "' in ", j.dump());
  }
  state.epoch = j.at("epoch").template get<int64_t>();
  state.batches_yielded = j.at("batches_yielded").template get<int64_t>();
  if (j.contains("pass_seed")) {
    TORCH_CHECK(j.at("pass_seed").is_number_unsigned(),
                "DataLoaderState: expected an integer >= 0 'pass_seed', got ",
                j.at("pass_seed").dump());
    state.pass_seed = j.at("pass_seed").template get<uint64_t>();
  }
  if (j.contains("generator_state")) {
    const auto& bytes = j.at("generator_state");
    TORCH_CHECK(bytes.is_array() &&
                    std::all_of(bytes.begin(), bytes.end(),
                                [](const auto& b) { return b.is_number_unsigned() && b <= 255; }),
                "DataLoaderState: expected 'generator_state' to be an array of bytes");
    state.generator_state = bytes.template get<std::vector<uint8_t>>();
  }
}

/// The indices one rank reads in one epoch, in order: exactly
/// `torch.utils.data.DistributedSampler(dataset, num_replicas, rank, shuffle,
/// seed, drop_last)` after `set_epoch(epoch)`. Shuffled, that is
/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))`,
/// padded by repeating from the start to a multiple of num_replicas (or cut
/// to one with drop_last), then `indices[rank::num_replicas]`.
std::vector<size_t> distributed_sampler_indices(size_t dataset_size, size_t num_replicas,
                                                size_t rank, bool shuffle, uint64_t seed,
                                                int64_t epoch, bool drop_last);
/// The indices one rank reads in one epoch with Sharding::kBatchSamplerShard, in order (its
/// batches are consecutive runs of batch_size): exactly Accelerate's
/// `prepare_data_loader(DataLoader(dataset, batch_size, shuffle, drop_last), num_replicas,
/// rank, data_seed=seed)` after `set_epoch(epoch)`; shuffled, its order is DistributedSampler's.
std::vector<size_t> batch_sampler_shard_indices(size_t dataset_size, size_t batch_size,
                                                size_t num_replicas, size_t rank, bool shuffle,
                                                uint64_t seed, int64_t epoch, bool drop_last);

/// A seed drawn from torch's default CPU generator, as torch's RandomSampler and Python's
/// DataLoader draw theirs: `int(torch.empty((), dtype=torch.int64).random_().item())`, its
/// 64 bits as unsigned.
uint64_t draw_seed();

/// transformers' get_length_grouped_indices: torch.randperm(lengths.size(), generator=generator)
/// cut into megabatches of mega_batch_mult * batch_size (by default min(n / (4 * batch_size), 50),
/// at least 1), each sorted by descending length (ties keep their order), and the longest sample
/// of all swapped to the front, so that the largest batch comes first. Without a generator,
/// torch's default one.
std::vector<size_t> get_length_grouped_indices(
    const std::vector<int64_t>& lengths, size_t batch_size,
    std::optional<size_t> mega_batch_mult = std::nullopt,
    std::optional<at::Generator> generator = std::nullopt);

/// Batches of a Dataset, the twin of `torch.utils.data.DataLoader` with a
/// `DistributedSampler` (one replica by default), or, with ShuffleOrder::kRandomSampler, a
/// `RandomSampler`. As torch's, each pass draws a number from torch's default generator when it
/// starts (torch's workers' base seed), so that what follows draws what it would in Python; a
/// pass resumed mid-way by load_state does not (its draws were made before the state was saved).
///
/// ```
/// DataLoader loader(train, {.batch_size = 32, .shuffle = true, .num_workers = 2});
/// for (int64_t epoch = 0; epoch < 3; ++epoch) {
///   loader.set_epoch(epoch);
///   for (const Batch& batch : loader) step(batch.at("input_ids"), batch.at("labels"));
/// }
/// ```
///
/// Without a `collate_fn`, batches are `collate()`'d, or gathered at once by a dataset whose
/// `get_batch()` can (TensorDataset, and a Subset of one). One iteration runs at a time:
/// `begin()` abandons the previous one and starts the epoch over, as Python's `iter()` does,
/// unless `load_state` set a position. The loader must outlive its iterators.
class DataLoader {
 public:
  DataLoader(DatasetPtr dataset, DataLoaderOptions options = {}, CollateFn collate_fn = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    Iterator() = default;
    const Batch& operator*() const { return batch_; }
    const Batch* operator->() const { return &batch_; }
    Iterator& operator++();
    /// Only comparison with end() is meaningful.
    bool operator==(const Iterator& other) const { return done() == other.done(); }

   private:
    friend class DataLoader;
    struct Run;
    bool done() const { return run_ == nullptr; }
    void fetch();

    std::shared_ptr<Run> run_;  // null at the end
    Batch batch_;
  };

  /// Starts the current epoch at its first batch, or at the position load_state set.
  Iterator begin() { return begin_from(0); }
  /// begin(), skipping the first `first_batch` batches of the pass (Accelerate's
  /// skip_first_batches: they are not read). A position load_state set further in wins.
  Iterator begin_from(size_t first_batch);
  Iterator end() { return {}; }

  /// Selects the epoch (kSeedPlusEpoch's order: seed + epoch). Another epoch starts at its
  /// first batch; the current one keeps its position.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  /// Batches per epoch on this rank.
  size_t size() const;
  /// Samples per epoch on this rank (padding included).
  size_t num_samples() const;
  /// How many samples of this rank's last batch are padding repeated to even
  /// out the ranks; drop them before computing metrics (Accelerate's
  /// gather_for_metrics). 0 with drop_last.
  size_t num_padding_samples() const;

  /// Batches handed out in the current epoch so far. When an iteration ends the
  /// position goes back to the start of the epoch.
  DataLoaderState state() const;
  /// The state of a position the caller names, such as a training step behind the batches
  /// read ahead or the end of a pass read to its end. With ShuffleOrder::kRandomSampler:
  /// batches_yielded > 0 is a position in the pass that began last (or that load_state set),
  /// which resumes from that pass's seed or its generator's state at its start (kept until the
  /// next pass begins); 0 is an epoch's start, drawn from the generator's state now.
  DataLoaderState state_at(int64_t epoch, int64_t batches_yielded) const;
  int64_t batches_yielded() const { return batches_yielded_; }
  /// The next `begin()` yields the batches of `state.epoch` after the first
  /// `state.batches_yielded`.
  void load_state(const DataLoaderState& state);

  const DataLoaderOptions& options() const { return options_; }
  /// Whether it shuffles with ShuffleOrder::kRandomSampler (each pass's order drawn anew).
  bool random_sampler() const {
    return options_.shuffle && options_.shuffle_order == ShuffleOrder::kRandomSampler;
  }
  /// Sets options().seed (a resumed run takes its saved one).
  void set_seed(uint64_t seed) { options_.seed = seed; }
  const DatasetPtr& dataset() const { return dataset_; }

 private:
  std::vector<size_t> indices() const;  // this rank's, for the current epoch
  bool shards_batches() const;
  void start_pass(bool resuming);
  // After which batch a whole pass draws RandomSampler's second randperm (-1: before the first).
  int64_t trailing_draw_after() const;
  void draw_trailing_randperm();
  DatasetPtr dataset_;
  DataLoaderOptions options_;
  CollateFn collate_fn_;  // empty: collate(), or the dataset's get_batch()
  int64_t epoch_ = 0;
  int64_t batches_yielded_ = 0;
  bool resume_ = false;      // set by load_state: the next begin() starts at batches_yielded_
  uint64_t generation_ = 0;  // bumped by begin(): an abandoned iterator stops counting
  // kRandomSampler: the current pass's order, and what it was drawn from.
  std::vector<size_t> pass_order_;
  std::optional<uint64_t> pass_seed_;
  std::vector<uint8_t> pass_start_state_;
};

}  // namespace mixprec::data
