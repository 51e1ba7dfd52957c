#pragma once

#include "mixprec/models/activation_checkpoint.h"
#include "mixprec/models/model_output.h"
#include "mixprec/models/neftune.h"

#include <torch/nn.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace mixprec::models {

/// GPT-2's hyperparameters with Hugging Face's names and defaults (`transformers.GPT2Config`).
struct GPT2Config {
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  double layer_norm_epsilon = 1e-5;
  double resid_pdrop = 0.1;
  double embd_pdrop = 0.1;
  double attn_pdrop = 0.1;
  std::string activation_function = "gelu_new";  ///< or "gelu_pytorch_tanh"
  double initializer_range = 0.02;               ///< the weights' initial standard deviation (HF's)
  /// The tokens that end a text, where generate() stops a sequence (HF's GPT2Config: 50256,
  /// "<|endoftext|>"; config.json holds one, a list or null); and the one that fills a finished
  /// sequence while others go on (none: the first end token, as HF's generate).
  std::vector<int64_t> eos_token_id = {50256};
  std::optional<int64_t> pad_token_id = std::nullopt;

  /// Reads an HF `config.json`. vocab_size, n_positions, n_embd, n_layer and n_head are
  /// required; the rest default as in HF. Missing or mistyped keys, and HF options this model
  /// does not implement (tie_word_embeddings = false, n_inner != 4 * n_embd, ...), are errors
  /// naming the file and the key.
  static GPT2Config from_json_file(const std::filesystem::path& path);
  /// Writes an HF `config.json` that `transformers.GPT2LMHeadModel.from_pretrained` reads.
  void save_json_file(const std::filesystem::path& path) const;
  /// Checks the values (positive sizes, n_embd divisible by n_head, dropouts in [0, 1), ...).
  void validate() const;
};

/// HF's `Conv1D`: a linear layer whose weight is stored (in, out), so checkpoints load without a
/// transpose; `models::linear` with WeightLayout::kInOut (HF's addmm; oneDNN's GEMMs for fp32
/// CPU tensors outside autocast and for bf16 ones, under bf16 autocast too).
class Conv1DImpl : public torch::nn::Module {
 public:
  Conv1DImpl(int64_t in_features, int64_t out_features, double init_std = 0.02);
  torch::Tensor forward(const torch::Tensor& x);  // (..., in) -> (..., out)
  torch::Tensor weight;                           // (in, out)
  torch::Tensor bias;                             // (out)
};
TORCH_MODULE(Conv1D);

/// Causal multi-head self-attention (HF's `GPT2Attention`, SDPA path).
class GPT2AttentionImpl : public torch::nn::Module {
 public:
  explicit GPT2AttentionImpl(const GPT2Config& config);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)
  Conv1D c_attn{nullptr}, c_proj{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};

 private:
  int64_t n_head_;
  double attn_pdrop_;
};
TORCH_MODULE(GPT2Attention);

/// The feed-forward block: c_fc, GELU (tanh approximation), c_proj, dropout.
class GPT2MLPImpl : public torch::nn::Module {
 public:
  explicit GPT2MLPImpl(const GPT2Config& config);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)
  Conv1D c_fc{nullptr}, c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(GPT2MLP);

/// One pre-LayerNorm transformer block.
class GPT2BlockImpl : public torch::nn::Module {
 public:
  explicit GPT2BlockImpl(const GPT2Config& config);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GPT2Attention attn{nullptr};
  GPT2MLP mlp{nullptr};
};
TORCH_MODULE(GPT2Block);

/// The transformer body (HF's `GPT2Model`): embeddings, blocks, final LayerNorm.
class GPT2ModelImpl : public torch::nn::Module,
                      public SupportsActivationCheckpointing,
                      public SupportsNEFTune {
 public:
  explicit GPT2ModelImpl(const GPT2Config& config);
  torch::Tensor forward(const torch::Tensor& input_ids);  // (B, T) int64 -> (B, T, C)
  /// Blocks 0, n, 2n, ... run under `activation_checkpoint` in training mode with grad mode on.
  void activation_checkpointing_enable(int64_t every_n_layers = 1,
                                       bool preserve_rng_state = true) override;
  void activation_checkpointing_disable() override { checkpoint_every_n_layers_ = 0; }
  bool is_activation_checkpointing() const override { return checkpoint_every_n_layers_ > 0; }
  /// NEFTune noise on wte's output (HF's input embeddings, before the positions are added)
  /// while wte is in training mode.
  void set_neftune_noise_alpha(std::optional<double> alpha) override;
  std::optional<double> neftune_noise_alpha() const override { return neftune_noise_alpha_; }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  int64_t n_positions_;
  int64_t checkpoint_every_n_layers_ = 0;  // 0: off
  bool checkpoint_preserve_rng_state_ = true;
  std::optional<double> neftune_noise_alpha_;
};
TORCH_MODULE(GPT2Model);

/// Options of `GPT2LMHeadModel::generate`: greedy by default, or top-k sampling at a
/// temperature with an optional seed (HF's `do_sample`, `top_k`, `temperature`).
struct GenerateOptions {
  bool do_sample = false;
  int64_t top_k = 50;  ///< 0 keeps the whole vocabulary
  double temperature = 1.0;
  std::optional<uint64_t> seed =
      std::nullopt;  ///< a private generator with this seed; else torch's default
  /// HF's eos_token_id: a sequence that generates it is finished; unset, the config's (any of
  /// them); -1, none (HF's eos_token_id=None). Generation stops when every sequence is.
  std::optional<int64_t> eos_token_id = std::nullopt;
  /// HF's pad_token_id: what a finished sequence gets while others go on; unset, the config's,
  /// else the end token (as HF).
  std::optional<int64_t> pad_token_id = std::nullopt;
};

/// GPT-2 with its language-model head tied to the token embedding (HF's `GPT2LMHeadModel`).
/// Parameter names are HF's (`transformer.h.0.attn.c_attn.weight`, ...), so checkpoints move
/// between the two with `from_pretrained` / `save_pretrained`.
///
/// ```
/// auto model = mixprec::models::GPT2LMHeadModel::from_pretrained("gpt2_tiny");
/// auto out = model->forward(input_ids, /*labels=*/input_ids);   // out.loss, out.logits (B, T, V)
/// auto ids = model->generate(input_ids, 20);                     // greedy, (B, T + 20)
/// ```
class GPT2LMHeadModelImpl : public torch::nn::Module,
                            public SupportsActivationCheckpointing,
                            public SupportsNEFTune {
 public:
  /// Random initialisation as in HF (normal(0, 0.02), c_proj scaled by 1/sqrt(2 n_layer)).
  explicit GPT2LMHeadModelImpl(GPT2Config config);

  /// input_ids (B, T) int64, T <= n_positions; labels (B, T) int64 or undefined. With labels,
  /// the loss is HF's: logits in fp32, predict labels[:, t + 1] from position t, ignore -100;
  /// their mean, or with `num_items_in_batch` (HF's loss kwarg, which the Trainer passes) their
  /// sum divided by it.
  ModelOutput forward(const torch::Tensor& input_ids, const torch::Tensor& labels = {},
                      std::optional<int64_t> num_items_in_batch = std::nullopt);

  /// Appends up to `max_new_tokens` (> 0) tokens to input_ids (B, T) -> (B, T + new), without
  /// gradients: fewer when every sequence has generated an end token (options.eos_token_id,
  /// else the config's), as HF's. The prompts are whole (no attention mask: a pad token in one
  /// is attended to, where HF would mask it). Dropout follows the module's mode, as in HF
  /// (from_pretrained's model is in eval mode).
  torch::Tensor generate(const torch::Tensor& input_ids, int64_t max_new_tokens,
                         const GenerateOptions& options = {});

  /// Activation checkpointing of the blocks (GPT2ModelImpl's), as HF's GPT-2.
  void activation_checkpointing_enable(int64_t every_n_layers = 1,
                                       bool preserve_rng_state = true) override {
    transformer->activation_checkpointing_enable(every_n_layers, preserve_rng_state);
  }
  void activation_checkpointing_disable() override {
    transformer->activation_checkpointing_disable();
  }
  bool is_activation_checkpointing() const override {
    return transformer->is_activation_checkpointing();
  }
  /// NEFTune on the body's input embeddings (GPT2ModelImpl's).
  void set_neftune_noise_alpha(std::optional<double> alpha) override {
    transformer->set_neftune_noise_alpha(alpha);
  }
  std::optional<double> neftune_noise_alpha() const override {
    return transformer->neftune_noise_alpha();
  }

  /// Writes `config.json` and `model.safetensors` (HF's names, lm_head omitted as it is tied).
  void save_pretrained(const std::filesystem::path& dir) const;

  const GPT2Config& config() const { return config_; }

  GPT2Model transformer{nullptr};

 private:
  GPT2Config config_;
};

/// `TORCH_MODULE(GPT2LMHeadModel)` plus the loader.
class GPT2LMHeadModel : public torch::nn::ModuleHolder<GPT2LMHeadModelImpl> {
 public:
  using torch::nn::ModuleHolder<GPT2LMHeadModelImpl>::ModuleHolder;
  using torch::nn::ModuleHolder<GPT2LMHeadModelImpl>::get;

  /// Reads `dir/config.json` and `dir/model.safetensors` (or its shards and their index) as
  /// written by HF's `save_pretrained` (keys with or without the `transformer.` prefix). A
  /// missing key, a shape that does not match the config, or an unknown key is an error
  /// naming the key and the shapes. The weights are fp32 (master weights for mixed precision)
  /// whatever the file's dtype; the model is in eval mode, as HF's.
  static GPT2LMHeadModel from_pretrained(const std::filesystem::path& dir);
};

}  // namespace mixprec::models
