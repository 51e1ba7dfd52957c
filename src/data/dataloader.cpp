#include "mixprec/data/dataloader.h"

#include "mixprec/log/logging.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <variant>

namespace mixprec::data {

namespace {

// Samples per rank: DistributedSampler's num_samples.
size_t samples_per_replica(size_t n, size_t num_replicas, bool drop_last) {
  return drop_last ? n / num_replicas : (n + num_replicas - 1) / num_replicas;
}

// Rounds of num_replicas full batches per epoch: BatchSamplerShard's batches per rank.
size_t shard_rounds(size_t n, size_t batch_size, size_t num_replicas, bool drop_last) {
  const size_t round = batch_size * num_replicas;
  return drop_last ? n / round : (n + round - 1) / round;
}

void check_rank(size_t num_replicas, size_t rank) {
  TORCH_CHECK(num_replicas >= 1, "Invalid num_replicas ", num_replicas, " (expected >= 1)");
  TORCH_CHECK(rank < num_replicas, "Invalid rank ", rank, ", rank should be in the interval [0, ",
              num_replicas - 1, "]");
}

// torch.randperm(n, generator=generator), as indices.
std::vector<size_t> random_order(size_t n, at::Generator& generator) {
  const auto perm = at::randperm(static_cast<int64_t>(n), generator, at::kLong);
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<size_t>(p, p + n);
}

// The epoch's order of the samples: torch.randperm(n, generator=torch.Generator().manual_seed(
// seed + epoch)) shuffled (seeds wrap modulo 2**64 as in Python), else 0, 1, ...
std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  if (!shuffle) {
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    return order;
  }
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
  return random_order(n, generator);
}

// DistributedSampler's share of `order`: position p of the list padded (by repeating from the
// start) to num_samples * num_replicas is order[p % n]; this rank takes p = rank + j *
// num_replicas.
std::vector<size_t> distributed_share(const std::vector<size_t>& order, size_t num_replicas,
                                      size_t rank, bool drop_last) {
  const size_t n = order.size();
  const size_t num_samples = samples_per_replica(n, num_replicas, drop_last);
  std::vector<size_t> indices(num_samples);
  for (size_t j = 0; j < num_samples; ++j) indices[j] = order[(rank + j * num_replicas) % n];
  return indices;
}

// BatchSamplerShard's share of `order`: batch j of this rank is positions ((j * num_replicas +
// rank) * batch_size + i) of the order padded by repeating it from its start.
std::vector<size_t> batch_shard(const std::vector<size_t>& order, size_t batch_size,
                                size_t num_replicas, size_t rank, bool drop_last) {
  if (num_replicas == 1) return order;
  const size_t n = order.size();
  const size_t rounds = shard_rounds(n, batch_size, num_replicas, drop_last);
  std::vector<size_t> indices;
  indices.reserve(rounds * batch_size);
  for (size_t j = 0; j < rounds; ++j)
    for (size_t i = 0; i < batch_size; ++i)
      indices.push_back(order[((j * num_replicas + rank) * batch_size + i) % n]);
  return indices;
}

// get_length_grouped_indices on the permutation `order`.
std::vector<size_t> group_by_length(std::vector<size_t> order, const std::vector<int64_t>& lengths,
                                    size_t batch_size, std::optional<size_t> mega_batch_mult) {
  const size_t n = order.size();
  if (n == 0) return order;
  const size_t mult =
      std::max<size_t>(mega_batch_mult.value_or(std::min<size_t>(n / (batch_size * 4), 50)), 1);
  const size_t megabatch = mult * batch_size;
  size_t longest = 0;  // the start of the first megabatch holding the longest sample
  for (size_t start = 0; start < n; start += megabatch) {
    const auto first = order.begin() + static_cast<std::ptrdiff_t>(start);
    std::stable_sort(first, first + static_cast<std::ptrdiff_t>(std::min(megabatch, n - start)),
                     [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
    if (lengths[order[start]] > lengths[order[longest]]) longest = start;
  }
  std::swap(order[0], order[longest]);
  return order;
}

std::vector<uint8_t> state_bytes(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  const at::Tensor state = generator.get_state();
  return {state.data_ptr<uint8_t>(), state.data_ptr<uint8_t>() + state.numel()};
}

}  // namespace

uint64_t draw_seed() {
  return static_cast<uint64_t>(at::empty({}, at::kLong).random_().item<int64_t>());
}

std::vector<size_t> distributed_sampler_indices(size_t dataset_size, size_t num_replicas,
                                                size_t rank, bool shuffle, uint64_t seed,
                                                int64_t epoch, bool drop_last) {
  check_rank(num_replicas, rank);
  return distributed_share(epoch_order(dataset_size, shuffle, seed, epoch), num_replicas, rank,
                           drop_last);
}

std::vector<size_t> batch_sampler_shard_indices(size_t dataset_size, size_t batch_size,
                                                size_t num_replicas, size_t rank, bool shuffle,
                                                uint64_t seed, int64_t epoch, bool drop_last) {
  check_rank(num_replicas, rank);
  TORCH_CHECK(batch_size > 0, "Invalid batch_size ", batch_size, " (expected > 0)");
  return batch_shard(epoch_order(dataset_size, shuffle, seed, epoch), batch_size, num_replicas,
                     rank, drop_last);
}

std::vector<size_t> get_length_grouped_indices(const std::vector<int64_t>& lengths,
                                               size_t batch_size,
                                               std::optional<size_t> mega_batch_mult,
                                               std::optional<at::Generator> generator) {
  TORCH_CHECK(batch_size > 0, "get_length_grouped_indices: invalid batch_size 0 (expected > 0)");
  TORCH_CHECK(mega_batch_mult.value_or(1) > 0,
              "get_length_grouped_indices: invalid mega_batch_mult 0 (expected > 0)");
  at::Generator g = generator ? *generator : at::detail::getDefaultCPUGenerator();
  return group_by_length(random_order(lengths.size(), g), lengths, batch_size, mega_batch_mult);
}

// One pass over an epoch: the rank's indices, and the workers reading ahead.
struct DataLoader::Iterator::Run {
  using Result = std::variant<Batch, std::exception_ptr>;

  Run(DataLoader& loader, size_t start)
      : loader(&loader),
        generation(loader.generation_),
        dataset(loader.dataset_),
        collate_fn(loader.collate_fn_),
        batch_size(loader.options_.batch_size),
        indices(loader.indices()),
        num_batches(loader.size()),
        next(start),
        dispatched(start),
        window(loader.options_.num_workers * loader.options_.prefetch_factor) {
    for (size_t w = 0; w < loader.options_.num_workers; ++w)
      workers.emplace_back([this] { work(); });
  }

  ~Run() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    changed.notify_all();
    for (auto& worker : workers) worker.join();
  }

  // Reads and collates batch b; for the default collate(), a dataset that can gathers it at once.
  Batch load(size_t b) const {
    const size_t end = std::min(indices.size(), (b + 1) * batch_size);
    const std::vector<size_t> slice(indices.begin() + static_cast<std::ptrdiff_t>(b * batch_size),
                                    indices.begin() + static_cast<std::ptrdiff_t>(end));
    if (!collate_fn)
      if (auto batch = dataset->get_batch(slice)) return std::move(*batch);
    std::vector<Example> examples;
    examples.reserve(slice.size());
    for (size_t i : slice) examples.push_back(dataset->get(i));
    return collate_fn ? collate_fn(examples) : collate(examples);
  }

  // Worker loop: claims the next batch while fewer than `window` are ahead of the caller.
  void work() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      changed.wait(lock,
                   [&] { return stop || dispatched >= num_batches || dispatched < next + window; });
      if (stop || dispatched >= num_batches) return;
      const size_t b = dispatched++;
      lock.unlock();
      Result result;
      try {
        result = load(b);
      } catch (...) {
        result = std::current_exception();
      }
      lock.lock();
      ready.emplace(b, std::move(result));
      changed.notify_all();
    }
  }

  // Batch `next`, read here or waited for; a worker's exception is rethrown here.
  Batch take() {
    const size_t b = next;
    if (workers.empty()) {
      Batch batch = load(b);
      next = b + 1;
      return batch;
    }
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return ready.count(b) > 0; });
    Result result = std::move(ready.extract(b).mapped());
    next = b + 1;
    lock.unlock();
    changed.notify_all();
    if (auto* error = std::get_if<std::exception_ptr>(&result)) std::rethrow_exception(*error);
    return std::move(std::get<Batch>(result));
  }

  DataLoader* loader;
  uint64_t generation;
  DatasetPtr dataset;
  CollateFn collate_fn;  // empty: collate()
  size_t batch_size;
  std::vector<size_t> indices;
  size_t num_batches;

  std::mutex mutex;
  std::condition_variable changed;
  size_t next;        // the batch the caller gets next
  size_t dispatched;  // the first batch no worker has claimed
  size_t window;
  bool stop = false;
  std::map<size_t, Result> ready;
  std::vector<std::thread> workers;
};

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  fetch();
  return *this;
}

void DataLoader::Iterator::fetch() {
  Run& run = *run_;
  const bool current = run.loader->generation_ == run.generation;
  if (run.next >= run.num_batches) {
    if (current) run.loader->batches_yielded_ = 0;  // the next pass restarts the epoch
    run_.reset();
    batch_.clear();
    return;
  }
  batch_ = run.take();
  if (!current) return;
  run.loader->batches_yielded_ = static_cast<int64_t>(run.next);
  if (run.loader->random_sampler() &&
      static_cast<int64_t>(run.next) - 1 == run.loader->trailing_draw_after())
    run.loader->draw_trailing_randperm();
}

DataLoader::DataLoader(DatasetPtr dataset, DataLoaderOptions options, CollateFn collate_fn)
    : dataset_(std::move(dataset)), options_(options), collate_fn_(std::move(collate_fn)) {
  TORCH_CHECK(dataset_, "DataLoader: no dataset given");
  TORCH_CHECK(options_.batch_size > 0, "DataLoader: invalid batch_size ", options_.batch_size,
              " (expected > 0)");
  TORCH_CHECK(options_.num_replicas >= 1, "DataLoader: invalid num_replicas ",
              options_.num_replicas, " (expected >= 1)");
  TORCH_CHECK(options_.rank < options_.num_replicas, "DataLoader: invalid rank ", options_.rank,
              ", rank should be in the interval [0, ", options_.num_replicas - 1, "]");
  TORCH_CHECK(options_.num_workers == 0 || options_.prefetch_factor > 0,
              "DataLoader: invalid prefetch_factor ", options_.prefetch_factor,
              " (expected > 0 with num_workers > 0)");
  TORCH_CHECK(!options_.generator || options_.shuffle_order == ShuffleOrder::kRandomSampler,
              "DataLoader: a generator is for shuffle_order = ShuffleOrder::kRandomSampler; "
              "kSeedPlusEpoch shuffles by its seed");
  if (const auto& grouping = options_.group_by_length) {
    TORCH_CHECK(options_.shuffle && options_.shuffle_order == ShuffleOrder::kSeedPlusEpoch,
                "DataLoader: group_by_length groups a shuffled order of seed + epoch; set shuffle "
                "= true (with ShuffleOrder::kSeedPlusEpoch)");
    TORCH_CHECK(grouping->lengths.size() == dataset_->size(), "DataLoader: group_by_length has ",
                grouping->lengths.size(), " lengths for a dataset of ", dataset_->size(),
                " samples");
  }
  TORCH_CHECK(options_.shuffle_order != ShuffleOrder::kRandomSampler ||
                  options_.num_replicas == 1 || options_.sharding == Sharding::kBatchSamplerShard,
              "DataLoader: ShuffleOrder::kRandomSampler with several replicas needs "
              "Sharding::kBatchSamplerShard");
}

DataLoader::~DataLoader() = default;

DataLoader::Iterator DataLoader::begin_from(size_t first_batch) {
  TORCH_CHECK(first_batch <= size(), "DataLoader: cannot start at batch ", first_batch,
              " of a pass of ", size());
  ++generation_;
  if (!resume_) batches_yielded_ = 0;
  const bool resuming = resume_ && batches_yielded_ > 0;
  resume_ = false;
  batches_yielded_ = std::max(batches_yielded_, static_cast<int64_t>(first_batch));
  if (!resuming) draw_seed();  // Python's _BaseDataLoaderIter's _base_seed
  if (random_sampler()) start_pass(resuming);
  Iterator it;
  it.run_ = std::make_shared<Iterator::Run>(*this, static_cast<size_t>(batches_yielded_));
  it.fetch();
  return it;
}

// RandomSampler draws the pass's order when the pass starts; a pass resumed mid-way draws the
// same one again, from the seed or generator state load_state restored.
void DataLoader::start_pass(bool resuming) {
  at::Generator generator;
  if (options_.generator) {
    generator = *options_.generator;
    pass_start_state_ = state_bytes(generator);
  } else {
    if (!resuming) pass_seed_ = draw_seed();  // else load_state's
    generator = at::make_generator<at::CPUGeneratorImpl>(*pass_seed_);
  }
  pass_order_ = random_order(dataset_->size(), generator);
  if (batches_yielded_ > trailing_draw_after()) draw_trailing_randperm();
}

// RandomSampler's second randperm (of which it yields nothing) is drawn when its first runs
// out. Accelerate's prepared loaders read a batch ahead, so that happens as the batch before
// the one that reads past the order is handed out: the last batch, or, when the last batch is
// short or padded, the one before it; Python's workers read num_workers * prefetch_factor
// batches further ahead.
int64_t DataLoader::trailing_draw_after() const {
  const size_t n = dataset_->size(), round = options_.batch_size * options_.num_replicas;
  const bool last_reads_the_end = !options_.drop_last && n % round != 0;
  const auto ahead = static_cast<int64_t>(options_.num_workers * options_.prefetch_factor);
  return std::max<int64_t>(-1,
                           static_cast<int64_t>(size()) - 1 - (last_reads_the_end ? 1 : 0) - ahead);
}

void DataLoader::draw_trailing_randperm() {
  if (options_.generator) random_order(dataset_->size(), *options_.generator);
}

void DataLoader::set_epoch(int64_t epoch) {
  if (epoch == epoch_) return;
  epoch_ = epoch;
  batches_yielded_ = 0;
}

std::vector<size_t> DataLoader::indices() const {
  const auto& o = options_;
  std::vector<size_t> order =
      random_sampler() ? pass_order_
                       : epoch_order(dataset_->size(), o.shuffle, o.seed.value_or(0), epoch_);
  if (o.group_by_length)
    order = group_by_length(
        std::move(order), o.group_by_length->lengths,
        o.group_by_length->batch_size > 0 ? o.group_by_length->batch_size : o.batch_size,
        std::nullopt);
  return o.sharding == Sharding::kBatchSamplerShard
             ? batch_shard(order, o.batch_size, o.num_replicas, o.rank, o.drop_last)
             : distributed_share(order, o.num_replicas, o.rank, o.drop_last);
}

bool DataLoader::shards_batches() const {
  return options_.sharding == Sharding::kBatchSamplerShard && options_.num_replicas > 1;
}

size_t DataLoader::num_samples() const {
  if (shards_batches())
    return shard_rounds(dataset_->size(), options_.batch_size, options_.num_replicas,
                        options_.drop_last) *
           options_.batch_size;
  return samples_per_replica(dataset_->size(), options_.num_replicas, options_.drop_last);
}

size_t DataLoader::size() const {
  const size_t n = num_samples();
  const size_t b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

size_t DataLoader::num_padding_samples() const {
  if (options_.drop_last || size() == 0) return 0;
  if (shards_batches()) {  // the last round: this rank's batch of it, against what is left
    const size_t b = options_.batch_size, round = b * options_.num_replicas;
    const size_t left = dataset_->size() - (size() - 1) * round, before = options_.rank * b;
    return b - std::min(b, left > before ? left - before : 0);
  }
  // Sample j of this rank is padding when its place in the padded list is past the dataset.
  size_t padding = 0;
  for (size_t j = (size() - 1) * options_.batch_size; j < num_samples(); ++j)
    padding += options_.rank + j * options_.num_replicas >= dataset_->size();
  return padding;
}

DataLoaderState DataLoader::state() const { return state_at(epoch_, batches_yielded_); }

DataLoaderState DataLoader::state_at(int64_t epoch, int64_t batches_yielded) const {
  DataLoaderState state{epoch, batches_yielded};
  if (!random_sampler()) return state;
  // Before the pass that load_state set begins, the generator holds that pass's start.
  const bool in_last_pass = batches_yielded > 0 && !resume_;
  TORCH_CHECK(
      !in_last_pass || (options_.generator ? !pass_start_state_.empty() : pass_seed_.has_value()),
      "DataLoader::state_at: a position within a pass (batches_yielded ", batches_yielded,
      ") before any pass began");
  if (options_.generator) {
    state.generator_state = in_last_pass ? pass_start_state_ : state_bytes(*options_.generator);
  } else if (batches_yielded > 0) {
    state.pass_seed = pass_seed_;
  }
  return state;
}

void DataLoader::load_state(const DataLoaderState& state) {
  TORCH_CHECK(state.batches_yielded >= 0 && state.batches_yielded <= static_cast<int64_t>(size()),
              "DataLoader::load_state: batches_yielded ", state.batches_yielded,
              " out of range [0, ", size(), "] (batches per epoch on this rank)");
  if (random_sampler() && state.batches_yielded > 0) {
    TORCH_CHECK(
        options_.generator ? state.generator_state.has_value() : state.pass_seed.has_value(),
        "DataLoader::load_state: a state mid-pass without the ",
        options_.generator ? "generator_state" : "pass_seed",
        " that this loader's shuffle (ShuffleOrder::kRandomSampler) resumes from (a prepared "
        "loader's checkpoint from before it was recorded resumes with use_seedable_sampler)");
  }
  if (!random_sampler() && options_.shuffle && state.batches_yielded > 0 &&
      (state.pass_seed || state.generator_state))
    MIXPREC_WARN("DataLoader::load_state: the position (epoch ", state.epoch, ", batch ",
                 state.batches_yielded,
                 ") was saved by a RandomSampler's shuffle (use_seedable_sampler = false), but "
                 "this loader shuffles by seed + epoch: the rest of that epoch can repeat or skip "
                 "samples");
  if (random_sampler() && options_.generator && state.generator_state) {
    const auto& bytes = *state.generator_state;
    at::Tensor restored = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::copy(bytes.begin(), bytes.end(), restored.data_ptr<uint8_t>());
    at::Generator generator = *options_.generator;
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(restored);
  }
  epoch_ = state.epoch;
  batches_yielded_ = state.batches_yielded;
  pass_seed_ = state.pass_seed;
  resume_ = true;
}

}  // namespace mixprec::data
