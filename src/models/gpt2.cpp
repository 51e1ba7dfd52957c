#include "mixprec/models/gpt2.h"

#include "mixprec/io/safetensors.h"
#include "mixprec/models/attention.h"
#include "mixprec/models/cross_entropy.h"
#include "mixprec/models/gelu.h"
#include "mixprec/models/layer_norm.h"
#include "mixprec/models/linear.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <set>
#include <sstream>

namespace mixprec::models {

namespace {

using nlohmann::json;

std::string in_file(const std::filesystem::path& path) {
  return "config.json '" + path.string() + "': ";
}

int64_t required_int(const json& j, const char* key, const std::filesystem::path& path) {
  TORCH_CHECK(j.contains(key), in_file(path), "missing key '", key,
              "' (expected a positive integer)");
  const auto& v = j[key];
  TORCH_CHECK(v.is_number_integer(), in_file(path), "key '", key, "' is ", v.dump(),
              ", expected a positive integer");
  return v.get<int64_t>();
}

double optional_number(const json& j, const char* key, double fallback,
                       const std::filesystem::path& path) {
  if (!j.contains(key)) return fallback;
  const auto& v = j[key];
  TORCH_CHECK(v.is_number(), in_file(path), "key '", key, "' is ", v.dump(), ", expected a number");
  return v.get<double>();
}

std::string token_error(const char* key, const json& v, const std::filesystem::path& path) {
  return c10::str(in_file(path), "key '", key, "' is ", v.dump(),
                  ", expected a token id (an integer >= 0)",
                  std::string_view(key) == "eos_token_id" ? ", a list of them" : "", " or null");
}

bool is_token(const json& v) { return v.is_number_integer() && v.get<int64_t>() >= 0; }

// A token id, or null for none.
std::optional<int64_t> optional_token(const json& j, const char* key,
                                      std::optional<int64_t> fallback,
                                      const std::filesystem::path& path) {
  if (!j.contains(key)) return fallback;
  const auto& v = j[key];
  if (v.is_null()) return std::nullopt;
  TORCH_CHECK(is_token(v), token_error(key, v, path));
  return v.get<int64_t>();
}

// HF's eos_token_id: a token id, a list of them, or null.
std::vector<int64_t> end_tokens(const json& j, std::vector<int64_t> fallback,
                                const std::filesystem::path& path) {
  if (!j.contains("eos_token_id")) return fallback;
  const auto& v = j["eos_token_id"];
  if (v.is_null()) return {};
  if (is_token(v)) return {v.get<int64_t>()};
  TORCH_CHECK(v.is_array() && std::ranges::all_of(v, is_token),
              token_error("eos_token_id", v, path));
  return v.get<std::vector<int64_t>>();
}

// An HF option this model does not implement must hold its default value (or be absent).
void expect_default(const json& j, const char* key, const json& value,
                    const std::filesystem::path& path) {
  if (!j.contains(key)) return;
  TORCH_CHECK(j[key] == value, in_file(path), "key '", key, "' is ", j[key].dump(), ", but only ",
              value.dump(), " is supported");
}

// A lower bound on the parameters of a GPT-2 of this config (embeddings and the
// layers' weight matrices), in a double so that no config overflows it.
double min_parameter_count(const GPT2Config& c) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  return (d(c.vocab_size) + d(c.n_positions)) * d(c.n_embd) +
         d(c.n_layer) * 12.0 * d(c.n_embd) * d(c.n_embd);
}

std::string shape_of(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// GPT2Config

GPT2Config GPT2Config::from_json_file(const std::filesystem::path& path) {
  const std::string text = io::read_file(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, in_file(path), "not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), in_file(path), "not a JSON object but ", j.type_name());
  if (j.contains("model_type"))
    TORCH_CHECK(j["model_type"] == "gpt2", in_file(path), "model_type is ", j["model_type"].dump(),
                ", expected \"gpt2\"");
  GPT2Config c;
  c.vocab_size = required_int(j, "vocab_size", path);
  c.n_positions = required_int(j, "n_positions", path);
  c.n_embd = required_int(j, "n_embd", path);
  c.n_layer = required_int(j, "n_layer", path);
  c.n_head = required_int(j, "n_head", path);
  c.layer_norm_epsilon = optional_number(j, "layer_norm_epsilon", c.layer_norm_epsilon, path);
  c.resid_pdrop = optional_number(j, "resid_pdrop", c.resid_pdrop, path);
  c.embd_pdrop = optional_number(j, "embd_pdrop", c.embd_pdrop, path);
  c.attn_pdrop = optional_number(j, "attn_pdrop", c.attn_pdrop, path);
  if (j.contains("activation_function")) {
    TORCH_CHECK(j["activation_function"].is_string(), in_file(path),
                "key 'activation_function' is ", j["activation_function"].dump(),
                ", expected a string");
    c.activation_function = j["activation_function"].get<std::string>();
  }
  c.initializer_range = optional_number(j, "initializer_range", c.initializer_range, path);
  c.eos_token_id = end_tokens(j, c.eos_token_id, path);
  c.pad_token_id = optional_token(j, "pad_token_id", c.pad_token_id, path);
  expect_default(j, "tie_word_embeddings", true, path);
  expect_default(j, "scale_attn_weights", true, path);
  expect_default(j, "scale_attn_by_inverse_layer_idx", false, path);
  expect_default(j, "reorder_and_upcast_attn", false, path);
  expect_default(j, "add_cross_attention", false, path);
  try {
    c.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, in_file(path), e.what_without_backtrace());
  }
  if (j.contains("n_inner") && !j["n_inner"].is_null())
    expect_default(j, "n_inner", 4 * c.n_embd, path);
  return c;
}

void GPT2Config::save_json_file(const std::filesystem::path& path) const {
  validate();
  const json j = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"activation_function", activation_function},
      {"attn_pdrop", attn_pdrop},
      {"embd_pdrop", embd_pdrop},
      {"resid_pdrop", resid_pdrop},
      {"layer_norm_epsilon", layer_norm_epsilon},
      {"initializer_range", initializer_range},
      {"n_embd", n_embd},
      {"n_head", n_head},
      {"n_inner", nullptr},
      {"n_layer", n_layer},
      {"n_positions", n_positions},
      {"vocab_size", vocab_size},
      {"eos_token_id", eos_token_id.empty()       ? json(nullptr)
                       : eos_token_id.size() == 1 ? json(eos_token_id[0])
                                                  : json(eos_token_id)},
      {"pad_token_id", pad_token_id ? json(*pad_token_id) : json(nullptr)},
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"reorder_and_upcast_attn", false},
      {"tie_word_embeddings", true},
  };
  io::write_file_atomically(path, j.dump(2) + "\n");  // as the weights: fsynced, renamed
}

void GPT2Config::validate() const {
  for (auto [name, value] : {std::pair{"vocab_size", vocab_size},
                             {"n_positions", n_positions},
                             {"n_embd", n_embd},
                             {"n_layer", n_layer},
                             {"n_head", n_head}})
    TORCH_CHECK(value > 0, "Invalid ", name, ": ", value, " (expected > 0)");
  TORCH_CHECK(min_parameter_count(*this) < 1e15, "Invalid config: vocab_size ", vocab_size,
              ", n_positions ", n_positions, ", n_embd ", n_embd, " and n_layer ", n_layer,
              " make more than 10^15 parameters");
  TORCH_CHECK(n_embd % n_head == 0, "Invalid n_embd ", n_embd, ": not divisible by n_head ",
              n_head);
  TORCH_CHECK(layer_norm_epsilon > 0, "Invalid layer_norm_epsilon: ", layer_norm_epsilon,
              " (expected > 0)");
  TORCH_CHECK(initializer_range >= 0 && std::isfinite(initializer_range),
              "Invalid initializer_range: ", initializer_range, " (expected >= 0)");
  for (auto [name, p] : {std::pair{"resid_pdrop", resid_pdrop},
                         {"embd_pdrop", embd_pdrop},
                         {"attn_pdrop", attn_pdrop}})
    TORCH_CHECK(p >= 0 && p < 1, "Invalid ", name, ": ", p, " (expected in [0, 1))");
  TORCH_CHECK(activation_function == "gelu_new" || activation_function == "gelu_pytorch_tanh",
              "Invalid activation_function: '", activation_function,
              "' (expected 'gelu_new' or 'gelu_pytorch_tanh')");
}

// ---------------------------------------------------------------------------------------------
// Modules

Conv1DImpl::Conv1DImpl(int64_t in_features, int64_t out_features, double init_std) {
  weight = register_parameter("weight", torch::empty({in_features, out_features}));
  bias = register_parameter("bias", torch::zeros({out_features}));
  torch::nn::init::normal_(weight, 0.0, init_std);
}

torch::Tensor Conv1DImpl::forward(const torch::Tensor& x) {
  return models::linear(x, weight, bias, WeightLayout::kInOut);
}

GPT2AttentionImpl::GPT2AttentionImpl(const GPT2Config& config)
    : n_head_(config.n_head), attn_pdrop_(config.attn_pdrop) {
  c_attn =
      register_module("c_attn", Conv1D(config.n_embd, 3 * config.n_embd, config.initializer_range));
  c_proj =
      register_module("c_proj", Conv1D(config.n_embd, config.n_embd, config.initializer_range));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(config.resid_pdrop));
}

torch::Tensor GPT2AttentionImpl::forward(const torch::Tensor& x) {
  const auto y = packed_self_attention(c_attn(x), n_head_,
                                       /*dropout_p=*/is_training() ? attn_pdrop_ : 0.0,
                                       /*is_causal=*/true);  // (B, T, C)
  return resid_dropout(c_proj(y));
}

GPT2MLPImpl::GPT2MLPImpl(const GPT2Config& config) {
  c_fc =
      register_module("c_fc", Conv1D(config.n_embd, 4 * config.n_embd, config.initializer_range));
  c_proj =
      register_module("c_proj", Conv1D(4 * config.n_embd, config.n_embd, config.initializer_range));
  dropout = register_module("dropout", torch::nn::Dropout(config.resid_pdrop));
}

torch::Tensor GPT2MLPImpl::forward(const torch::Tensor& x) {
  auto h = c_fc(x);  // (B, T, 4C)
  // "gelu_new" and "gelu_pytorch_tanh" are the same function (HF's activations.py). HF computes
  // gelu_new op by op (8 kernels forward, ~15 backward, each rounding in 16 bits); a fused
  // kernel computes it in fp32 and rounds once, and is at least as accurate. gelu_tanh's is
  // ~3x faster again than LibTorch's fused one (models/gelu.h).
  h = gelu_tanh(h);
  return dropout(c_proj(h));
}

GPT2BlockImpl::GPT2BlockImpl(const GPT2Config& config) {
  auto ln = torch::nn::LayerNormOptions({config.n_embd}).eps(config.layer_norm_epsilon);
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(ln));
  attn = register_module("attn", GPT2Attention(config));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(ln));
  mlp = register_module("mlp", GPT2MLP(config));
}

namespace {

// ln(x) for a block's attention or MLP. Under CPU autocast their first matmul would round it
// to 16 bits: layer_norm's fused kernel makes it in that dtype at once (models/layer_norm.h).
torch::Tensor norm_for_matmul(torch::nn::LayerNorm& ln, const torch::Tensor& x) {
  if (!x.is_cpu() || x.scalar_type() != at::kFloat || !at::autocast::is_autocast_enabled(at::kCPU))
    return ln(x);
  return layer_norm(x, ln->weight, ln->bias, ln->options.eps(),
                    at::autocast::get_autocast_dtype(at::kCPU));
}

}  // namespace

torch::Tensor GPT2BlockImpl::forward(const torch::Tensor& x) {
  auto h = x + attn(norm_for_matmul(ln_1, x));
  return h + mlp(norm_for_matmul(ln_2, h));
}

GPT2ModelImpl::GPT2ModelImpl(const GPT2Config& config) : n_positions_(config.n_positions) {
  wte = register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(config.n_positions, config.n_embd));
  drop = register_module("drop", torch::nn::Dropout(config.embd_pdrop));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(GPT2Block(config));
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(
                  torch::nn::LayerNormOptions({config.n_embd}).eps(config.layer_norm_epsilon)));
}

torch::Tensor GPT2ModelImpl::forward(const torch::Tensor& input_ids) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong,
              "GPT-2: input_ids must be (B, T) int64, got ", input_ids.scalar_type(), " of shape ",
              input_ids.sizes());
  TORCH_CHECK(input_ids.size(0) >= 1, "GPT-2: input_ids holds no sequence (shape ",
              input_ids.sizes(), ")");
  const int64_t T = input_ids.size(1);
  TORCH_CHECK(T >= 1 && T <= n_positions_, "GPT-2: sequence length ", T,
              " is outside [1, n_positions = ", n_positions_, "]");
  {  // LibTorch's embedding says only "index out of range in self" (on CUDA, a device assert)
    const auto [lo, hi] = at::aminmax(input_ids);
    const auto range = at::stack({lo, hi}).cpu();
    const int64_t min_id = range[0].item<int64_t>(), max_id = range[1].item<int64_t>();
    const int64_t V = wte->weight.size(0);
    TORCH_CHECK(min_id >= 0 && max_id < V, "GPT-2: token id ", min_id < 0 ? min_id : max_id,
                " in input_ids is out of range: vocab_size is ", V, " (ids in [0, ", V, "))");
  }
  auto pos = torch::arange(T, input_ids.options());  // (T)
  auto embeddings = wte(input_ids);                  // (B, T, C)
  if (neftune_noise_alpha_ && wte->is_training())
    embeddings = add_neftune_noise(embeddings, *neftune_noise_alpha_);
  auto x = drop(embeddings + wpe(pos));
  const bool checkpointing =
      checkpoint_every_n_layers_ > 0 && is_training() && torch::GradMode::is_enabled();
  for (int64_t i = 0; i < static_cast<int64_t>(h->size()); ++i) {
    auto block = h->ptr<GPT2BlockImpl>(i);
    if (checkpointing && i % checkpoint_every_n_layers_ == 0)
      x = activation_checkpoint([block](const torch::Tensor& t) { return block->forward(t); }, x,
                                block->parameters(), checkpoint_preserve_rng_state_);
    else
      x = block->forward(x);
  }
  return ln_f(x);
}

void GPT2ModelImpl::set_neftune_noise_alpha(std::optional<double> alpha) {
  TORCH_CHECK(!alpha || *alpha >= 0, "GPT-2: neftune_noise_alpha must be >= 0, got ",
              alpha.value_or(0));
  neftune_noise_alpha_ = alpha;
}

void GPT2ModelImpl::activation_checkpointing_enable(int64_t every_n_layers,
                                                    bool preserve_rng_state) {
  TORCH_CHECK(every_n_layers >= 1, "GPT-2: activation_checkpointing_enable: every_n_layers is ",
              every_n_layers, ", expected >= 1");
  checkpoint_every_n_layers_ = every_n_layers;
  checkpoint_preserve_rng_state_ = preserve_rng_state;
}

GPT2LMHeadModelImpl::GPT2LMHeadModelImpl(GPT2Config config) : config_(std::move(config)) {
  config_.validate();
  transformer = register_module("transformer", GPT2Model(config_));
  // HF's _init_weights: N(0, initializer_range) everywhere, residual projections
  // N(0, initializer_range / sqrt(2 L)).
  torch::NoGradGuard no_grad;
  const double init_std = config_.initializer_range;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    if (name.ends_with("wte.weight") || name.ends_with("wpe.weight"))
      p.normal_(0.0, init_std);
    else if (name.ends_with("c_proj.weight"))
      p.normal_(0.0, init_std / std::sqrt(2.0 * config_.n_layer));
  }
}

ModelOutput GPT2LMHeadModelImpl::forward(const torch::Tensor& input_ids,
                                         const torch::Tensor& labels,
                                         std::optional<int64_t> num_items_in_batch) {
  auto x = transformer(input_ids);  // (B, T, C)
  ModelOutput out;
  out.logits = models::linear(x, transformer->wte->weight);  // (B, T, V), tied lm_head
  if (labels.defined()) {
    TORCH_CHECK(labels.sizes() == input_ids.sizes() && labels.scalar_type() == at::kLong,
                "GPT-2: labels must be int64 of the shape of input_ids ", input_ids.sizes(),
                ", got ", labels.scalar_type(), " of shape ", labels.sizes());
    // Position t predicts labels[t + 1]; the last position has no target and is ignored. HF
    // slices the logits to (B, T-1, V) instead, which costs a copy of them forward and a zero
    // fill plus a copy backward; the loss is the same.
    const int64_t B = input_ids.size(0), T = input_ids.size(1), V = config_.vocab_size;
    auto targets = at::cat({labels.narrow(1, 1, T - 1), at::full({B, 1}, -100, labels.options())},
                           /*dim=*/1);  // (B, T)
    // In fp32 for 16-bit logits, as HF's loss (which casts them first).
    out.loss = cross_entropy(out.logits.view({-1, V}), targets.view({-1}),
                             /*ignore_index=*/-100, num_items_in_batch);
  }
  return out;
}

torch::Tensor GPT2LMHeadModelImpl::generate(const torch::Tensor& input_ids, int64_t max_new_tokens,
                                            const GenerateOptions& options) {
  TORCH_CHECK(max_new_tokens > 0, "generate: `max_new_tokens` must be greater than 0, but is ",
              max_new_tokens, ".");  // HF's message
  TORCH_CHECK(input_ids.dim() == 2, "generate: input_ids must be (B, T), got shape ",
              input_ids.sizes());
  TORCH_CHECK(max_new_tokens <= config_.n_positions - input_ids.size(1), "generate: input length ",
              input_ids.size(1), " + max_new_tokens ", max_new_tokens,
              " exceeds n_positions = ", config_.n_positions);
  if (options.do_sample) {
    TORCH_CHECK(options.temperature > 0, "generate: temperature is ", options.temperature,
                ", expected > 0");
    TORCH_CHECK(options.top_k >= 0, "generate: top_k is ", options.top_k, ", expected >= 0");
  }
  // As HF's: with end tokens, a sequence that generates one is finished (one in the prompt
  // ends nothing) and gets the pad token from then on; all finished, generation stops.
  std::vector<int64_t> eos = config_.eos_token_id;
  if (options.eos_token_id)
    eos = *options.eos_token_id >= 0 ? std::vector{*options.eos_token_id} : std::vector<int64_t>{};
  const int64_t pad = options.pad_token_id.value_or(
      config_.pad_token_id.value_or(eos.empty() ? int64_t{0} : eos[0]));
  // A pad token is run through the model with the rest of the batch.
  const bool can_end = std::ranges::any_of(eos, [&](int64_t t) { return t < config_.vocab_size; });
  TORCH_CHECK(!can_end || (pad >= 0 && pad < config_.vocab_size), "generate: pad_token_id ", pad,
              " is not a token of the vocabulary (", config_.vocab_size,
              "), and an end token can end a sequence");
  const auto end_tokens = at::tensor(eos, input_ids.options());
  std::optional<at::Generator> generator;
  if (options.seed) generator = at::make_generator<at::CPUGeneratorImpl>(*options.seed);
  torch::NoGradGuard no_grad;
  auto ids = input_ids;  // (B, T)
  auto unfinished = at::ones({input_ids.size(0), 1}, input_ids.options().dtype(at::kBool));
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    // Without a KV cache each step reruns the whole prefix: fine for tests and small models.
    auto logits = forward(ids).logits.select(1, -1).to(at::kFloat);  // (B, V)
    torch::Tensor next;                                              // (B, 1)
    if (!options.do_sample) {
      next = logits.argmax(-1, /*keepdim=*/true);
    } else {
      logits = logits / options.temperature;
      if (options.top_k > 0 && options.top_k < logits.size(-1)) {
        auto kth = std::get<0>(logits.topk(options.top_k)).narrow(-1, options.top_k - 1, 1);
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = at::multinomial(logits.softmax(-1), 1, /*replacement=*/false, generator);
    }
    next = next.to(ids.device());
    if (can_end) {
      next = at::where(unfinished, next, pad);
      unfinished = unfinished.logical_and(at::isin(next, end_tokens).logical_not());
    }
    ids = at::cat({ids, next}, 1);
    if (can_end && !unfinished.any().item<bool>()) break;
  }
  return ids;
}

void GPT2LMHeadModelImpl::save_pretrained(const std::filesystem::path& dir) const {
  std::filesystem::create_directories(dir);
  config_.save_json_file(dir / "config.json");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : named_parameters()) tensors.emplace(item.key(), item.value().detach());
  io::save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
}

GPT2LMHeadModel GPT2LMHeadModel::from_pretrained(const std::filesystem::path& dir) {
  const GPT2Config config = GPT2Config::from_json_file(dir / "config.json");
  auto file = dir / "model.safetensors";
  if (!std::filesystem::exists(file) &&
      std::filesystem::exists(dir / "model.safetensors.index.json"))
    file = dir / "model.safetensors.index.json";  // sharded
  auto tensors = io::load_sharded_safetensors(dir);
  const std::string at = "from_pretrained: '" + file.string() + "': ";
  // The model is allocated from config.json's sizes: check first that the
  // weights file can fill it, so a wrong config cannot ask for any memory it likes.
  double values = 0;
  for (const auto& [name, t] : tensors) values += static_cast<double>(t.numel());
  // Within twice the file (plus 1M) the model is built, so that a missing or
  // misshapen tensor is reported by name below.
  TORCH_CHECK(min_parameter_count(config) <= 2 * values + 1e6, at, "holds ",
              static_cast<int64_t>(values), " values, far fewer than the ",
              static_cast<int64_t>(min_parameter_count(config)),
              " parameters (at least) of the model that config.json describes (vocab_size ",
              config.vocab_size, ", n_positions ", config.n_positions, ", n_embd ", config.n_embd,
              ", n_layer ", config.n_layer, ")");
  GPT2LMHeadModel model(config);
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    auto it = tensors.find(name);
    if (it == tensors.end()) it = tensors.find(name.substr(std::string("transformer.").size()));
    TORCH_CHECK(it != tensors.end(), at, "missing tensor '", name, "' (expected shape ",
                shape_of(p.sizes()), ")");
    TORCH_CHECK(it->second.sizes() == p.sizes(), at, "tensor '", it->first, "' has shape ",
                shape_of(it->second.sizes()), ", but the config needs ", shape_of(p.sizes()));
    TORCH_CHECK(at::isFloatingType(it->second.scalar_type()), at, "tensor '", it->first,
                "' has dtype ", it->second.scalar_type(), ", expected a floating type");
    p.copy_(it->second);
    used.insert(it->first);
  }
  for (const auto& [name, t] : tensors) {
    if (used.count(name)) continue;
    // The tied head (HF drops it when saving, older files keep it) and old mask buffers.
    if (name == "lm_head.weight") {
      TORCH_CHECK(t.sizes() == model->transformer->wte->weight.sizes(), at,
                  "tensor 'lm_head.weight' has shape ", shape_of(t.sizes()),
                  ", but the config needs ", shape_of(model->transformer->wte->weight.sizes()));
      continue;
    }
    if (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) continue;
    TORCH_CHECK(false, at, "unexpected tensor '", name, "' of shape ", shape_of(t.sizes()),
                " (not a GPT2LMHeadModel parameter)");
  }
  model->eval();  // as HF's from_pretrained: dropout off until train()
  return model;
}

}  // namespace mixprec::models
