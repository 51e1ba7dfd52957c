#include "mixprec/models/gpt2.h"

#include "mixprec/amp/autocast.h"
#include "mixprec/io/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using mixprec::models::GPT2Config;
using mixprec::models::GPT2LMHeadModel;
using nlohmann::json;

const fs::path kTiny = fs::path(MIXPREC_REFERENCE_DIR) / "gpt2_tiny";
const fs::path kScript = fs::path(MIXPREC_REFERENCE_DIR).parent_path() / "gpt2_reference.py";

// Tolerances against transformers 5.24 on the same inputs (|logits| < 1 here, mean 0.14).
// fp32: the same function; what is left is rounding inside kernels (summation order, GELU).
constexpr double kFp32Tol = 1e-5;
// Under autocast the GEMMs run in 16 bits. The op sequence is HF's (addmm, SDPA) except that
// HF's gelu_new rounds each of its 8 ops in 16 bits where LibTorch's fused kernel rounds once,
// and that attention on these short sequences computes in fp32 (models/attention.h), so the
// logits differ by about an ulp (measured: 2^-8 in bf16, 2^-11 in fp16); the tolerances leave
// 4 ulps of a logit in [0.5, 1): bf16 keeps 8 significant bits (ulp 2^-8 there), fp16 11
// (ulp 2^-11). The loss is computed in fp32 from those logits.
constexpr double kBf16Tol = 1.6e-2;
constexpr double kFp16Tol = 2e-3;
constexpr double kBf16LossTol = 1e-3;
constexpr double kFp16LossTol = 1e-4;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

#define EXPECT_ERROR(statement, part)                                   \
  do {                                                                  \
    const std::string e_ = error_of([&] { statement; });                \
    EXPECT_NE(e_.find(part), std::string::npos) << "error was: " << e_; \
  } while (0)

const json& reference() {
  static const json j = json::parse(std::ifstream(kTiny / "reference.json"));
  return j;
}

torch::Tensor tensor_of(const json& j, torch::Dtype dtype) {
  std::vector<int64_t> shape;
  for (const json* p = &j; p->is_array(); p = &(*p)[0]) shape.push_back(p->size());
  std::vector<double> values;
  std::function<void(const json&)> walk = [&](const json& x) {
    if (x.is_array())
      for (const auto& y : x) walk(y);
    else
      values.push_back(x.get<double>());
  };
  walk(j);
  return torch::tensor(values, torch::kDouble).reshape(shape).to(dtype);
}

class GPT2 : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mixprec_models_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A copy of gpt2_tiny with config.json edited by `edit`.
  fs::path tiny_with_config(const std::function<void(json&)>& edit) {
    auto config = json::parse(std::ifstream(kTiny / "config.json"));
    edit(config);
    std::ofstream(dir_ / "config.json") << config.dump();
    fs::copy_file(kTiny / "model.safetensors", dir_ / "model.safetensors",
                  fs::copy_options::overwrite_existing);
    return dir_;
  }

  // A copy of gpt2_tiny with its tensors edited by `edit`.
  fs::path tiny_with_tensors(const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
    auto tensors = mixprec::io::load_safetensors(kTiny / "model.safetensors");
    edit(tensors);
    mixprec::io::save_safetensors(dir_ / "model.safetensors", tensors);
    fs::copy_file(kTiny / "config.json", dir_ / "config.json",
                  fs::copy_options::overwrite_existing);
    return dir_;
  }

  fs::path dir_;
};

struct Parity {
  double max_logit_diff;
  double loss_diff;
  torch::Dtype logits_dtype;
  // Mean |logits - HF's fp32 logits rounded once to the 16-bit dtype|, ours and HF's own 16-bit
  // run's: a model computed in fp32 that only casts its logits would be near 0 (fp16, bf16).
  double mean_from_rounded_fp32 = 0, reference_mean_from_rounded_fp32 = 0;
};

Parity parity(GPT2LMHeadModel& model, const std::string& mode) {
  const auto& ref = reference();
  auto input_ids = tensor_of(ref["input_ids"], torch::kLong);
  auto labels = tensor_of(ref["labels"], torch::kLong);
  torch::NoGradGuard no_grad;
  mixprec::models::ModelOutput out;
  if (mode == "fp32") {
    out = model->forward(input_ids, labels);
  } else {
    mixprec::amp::Autocast autocast(torch::kCPU, mode == "bf16" ? torch::kBFloat16 : torch::kHalf);
    out = model->forward(input_ids, labels);
  }
  const int64_t slice = ref["logit_slice"].get<int64_t>();
  auto expected = tensor_of(ref[mode]["logits"], torch::kDouble);
  auto got = out.logits.narrow(-1, 0, slice).to(torch::kDouble);
  Parity p{(got - expected).abs().max().item<double>(),
           std::abs(out.loss.item<double>() - ref[mode]["loss"].get<double>()),
           out.logits.scalar_type()};
  if (mode != "fp32") {
    const auto rounded = tensor_of(ref["fp32"]["logits"], torch::kDouble)
                             .to(out.logits.scalar_type())
                             .to(torch::kDouble);
    p.mean_from_rounded_fp32 = (got - rounded).abs().mean().item<double>();
    p.reference_mean_from_rounded_fp32 = (expected - rounded).abs().mean().item<double>();
  }
  return p;
}

// from_pretrained's model is in eval mode, as HF's (the tiny model's dropout is 0.1).
TEST_F(GPT2, Fp32MatchesTransformers) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  EXPECT_FALSE(model->is_training());
  auto p = parity(model, "fp32");
  EXPECT_LE(p.max_logit_diff, kFp32Tol);
  EXPECT_LE(p.loss_diff, kFp32Tol);
  EXPECT_EQ(p.logits_dtype, torch::kFloat);
}

// NEFTune in training mode (dropout off) from a seeded generator: transformers' hook's noise,
// drawn alike, gives the same logits. With the embedding in eval mode the noise is off.
TEST_F(GPT2, NEFTuneNoiseMatchesTransformers) {
  const auto& ref = reference();
  auto model = GPT2LMHeadModel::from_pretrained(tiny_with_config([](json& c) {
    c["attn_pdrop"] = 0.0;
    c["resid_pdrop"] = 0.0;
    c["embd_pdrop"] = 0.0;
  }));
  model->train();
  model->set_neftune_noise_alpha(ref["neftune"]["alpha"].get<double>());
  torch::manual_seed(ref["neftune"]["seed"].get<uint64_t>());
  mixprec::models::ModelOutput out;
  {
    torch::NoGradGuard no_grad;
    out = model->forward(tensor_of(ref["input_ids"], torch::kLong),
                         tensor_of(ref["labels"], torch::kLong));
  }
  const auto expected = tensor_of(ref["neftune"]["logits"], torch::kDouble);
  const auto got = out.logits.narrow(-1, 0, expected.size(-1)).to(torch::kDouble);
  EXPECT_LE((got - expected).abs().max().item<double>(), kFp32Tol);
  EXPECT_NEAR(out.loss.item<double>(), ref["neftune"]["loss"].get<double>(), kFp32Tol);
  // The noise moved the loss well past the tolerance, so a noiseless forward fails the above.
  EXPECT_GT(std::abs(ref["neftune"]["loss"].get<double>() - ref["fp32"]["loss"].get<double>()),
            100 * kFp32Tol);
  // wte's mode decides, as HF's hook reads its module's.
  model->transformer->wte->eval();
  EXPECT_LE(parity(model, "fp32").max_logit_diff, kFp32Tol);
  EXPECT_ERROR(model->set_neftune_noise_alpha(-1.0), "neftune_noise_alpha must be >= 0, got -1");
}

TEST_F(GPT2, Bf16AutocastMatchesTransformers) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  model->eval();
  auto p = parity(model, "bf16");
  std::cout << "bf16: max |logits diff| " << p.max_logit_diff << ", |loss diff| " << p.loss_diff
            << "\n";
  EXPECT_LE(p.max_logit_diff, kBf16Tol);
  EXPECT_LE(p.loss_diff, kBf16LossTol);
  EXPECT_EQ(p.logits_dtype, torch::kBFloat16);
  // Rounded inside, as HF's bf16 run is (the tolerances alone would pass an fp32 run).
  EXPECT_GE(p.mean_from_rounded_fp32, 0.5 * p.reference_mean_from_rounded_fp32)
      << p.mean_from_rounded_fp32 << " vs HF's " << p.reference_mean_from_rounded_fp32;
}

TEST_F(GPT2, Fp16AutocastMatchesTransformers) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  model->eval();
  auto p = parity(model, "fp16");
  std::cout << "fp16: max |logits diff| " << p.max_logit_diff << ", |loss diff| " << p.loss_diff
            << "\n";
  EXPECT_LE(p.max_logit_diff, kFp16Tol);
  EXPECT_LE(p.loss_diff, kFp16LossTol);
  EXPECT_EQ(p.logits_dtype, torch::kHalf);
  // Rounded inside, as HF's fp16 run is (the tolerances alone would pass an fp32 run).
  EXPECT_GE(p.mean_from_rounded_fp32, 0.5 * p.reference_mean_from_rounded_fp32)
      << p.mean_from_rounded_fp32 << " vs HF's " << p.reference_mean_from_rounded_fp32;
}

TEST_F(GPT2, GreedyGenerateMatchesTransformers) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  model->eval();
  const auto& gen = reference()["generate"];
  auto expected = tensor_of(gen["greedy"], torch::kLong);
  auto prompt = tensor_of(reference()["input_ids"], torch::kLong)
                    .narrow(1, 0, gen["prompt_len"].get<int64_t>());
  auto got = model->generate(prompt, gen["max_new_tokens"].get<int64_t>());
  EXPECT_TRUE(torch::equal(got, expected)) << got << "\n" << expected;
}

// With an end token, as HF's generate: the finished row padded while the other goes on, and
// one row alone stopping early (padded with the end token, the config having no pad token). A
// token in the prompt ends nothing. -1 turns the stop off; the config's own (50256) is not in
// this vocabulary, so the plain greedy test above never stops.
TEST_F(GPT2, GreedyGenerateStopsAtTheEndTokenAsTransformers) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  const auto& gen = reference()["generate"];
  const int64_t eos = gen["eos_token_id"].get<int64_t>();
  const int64_t new_tokens = gen["max_new_tokens"].get<int64_t>();
  const auto prompt = tensor_of(reference()["input_ids"], torch::kLong)
                          .narrow(1, 0, gen["prompt_len"].get<int64_t>());
  EXPECT_EQ(model->config().eos_token_id, std::vector<int64_t>{50256});
  auto got = model->generate(prompt, new_tokens, {.eos_token_id = eos, .pad_token_id = 0});
  EXPECT_TRUE(torch::equal(got, tensor_of(gen["with_eos"], torch::kLong))) << got;
  got = model->generate(prompt.narrow(0, 0, 1), new_tokens, {.eos_token_id = eos});
  EXPECT_TRUE(torch::equal(got, tensor_of(gen["one_row_with_eos"], torch::kLong))) << got;
  got = model->generate(prompt, new_tokens, {.eos_token_id = -1});
  EXPECT_TRUE(torch::equal(got, tensor_of(gen["greedy"], torch::kLong))) << got;
  EXPECT_ERROR(model->generate(prompt, 2, {.eos_token_id = eos, .pad_token_id = 256}),
               "generate: pad_token_id 256 is not a token of the vocabulary (256)");
  // The config's end tokens, a list as HF allows (any of them ends), and its pad token.
  auto listed = GPT2LMHeadModel::from_pretrained(tiny_with_config([&](json& c) {
    c["eos_token_id"] = {300, eos};
    c["pad_token_id"] = 0;
  }));
  EXPECT_EQ(listed->config().eos_token_id, (std::vector<int64_t>{300, eos}));
  got = listed->generate(prompt, new_tokens);
  EXPECT_TRUE(torch::equal(got, tensor_of(gen["with_eos"], torch::kLong))) << got;
}

TEST_F(GPT2, SamplingIsSeededAndStaysInTopK) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  model->eval();
  auto prompt = tensor_of(reference()["input_ids"], torch::kLong).narrow(1, 0, 4);
  mixprec::models::GenerateOptions options{
      .do_sample = true, .top_k = 5, .temperature = 0.7, .seed = 42};
  auto a = model->generate(prompt, 6, options);
  auto b = model->generate(prompt, 6, options);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{2, 10}));
  // The first new token is one of the 5 most likely after the prompt.
  torch::NoGradGuard no_grad;
  auto top5 = std::get<1>(model->forward(prompt).logits.select(1, -1).topk(5));  // (B, 5)
  EXPECT_TRUE((top5 == a.select(1, 4).unsqueeze(1)).any(1).all().item<bool>());
}

TEST_F(GPT2, SavePretrainedLoadsInTransformers) {
  auto model = GPT2LMHeadModel::from_pretrained(kTiny);
  model->save_pretrained(dir_ / "saved");
  EXPECT_FALSE(fs::exists(dir_ / "saved" / "model.safetensors.tmp"));
  auto again = GPT2LMHeadModel::from_pretrained(dir_ / "saved");
  again->eval();
  EXPECT_LE(parity(again, "fp32").max_logit_diff, kFp32Tol);
  const std::string command = std::string(MIXPREC_PYTHON) + " " + kScript.string() +
                              " --verify-saved " + (dir_ / "saved").string() + " " + kTiny.string();
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

TEST_F(GPT2, TrainsWithDropoutOnlyInTrainMode) {
  GPT2Config config{.vocab_size = 32, .n_positions = 16, .n_embd = 16, .n_layer = 1, .n_head = 2};
  torch::manual_seed(0);
  GPT2LMHeadModel model(config);
  auto ids = torch::randint(0, 32, {2, 8});
  model->eval();
  EXPECT_TRUE(torch::equal(model->forward(ids).logits, model->forward(ids).logits));
  EXPECT_FALSE(model->forward(ids).loss.defined());
  model->train();
  EXPECT_FALSE(torch::equal(model->forward(ids).logits, model->forward(ids).logits));
  auto out = model->forward(ids, ids);
  EXPECT_NEAR(out.loss.item<double>(), std::log(32.0), 0.5);  // near uniform at init
  out.loss.backward();
  EXPECT_TRUE(model->transformer->wte->weight.grad().defined());
  // Tied head: named_parameters holds the embedding once, no lm_head.
  for (const auto& p : model->named_parameters())
    EXPECT_EQ(p.key().find("lm_head"), std::string::npos);
}

// initializer_range (HF's config key) sets the weights' spread: the same draws, scaled.
TEST_F(GPT2, InitializerRangeScalesTheInitialWeights) {
  GPT2Config config{.vocab_size = 32, .n_positions = 16, .n_embd = 16, .n_layer = 2, .n_head = 2};
  torch::manual_seed(0);
  GPT2LMHeadModel narrow(config);
  config.initializer_range = 0.2;
  torch::manual_seed(0);
  GPT2LMHeadModel wide(config);
  const auto a = narrow->named_parameters(), b = wide->named_parameters();
  for (const auto& p : a) {
    const bool drawn = p.key().ends_with(".weight") && p.key().find("ln_") == std::string::npos;
    EXPECT_TRUE(torch::allclose(p.value() * (drawn ? 10 : 1), b[p.key()], 1e-6, 1e-7)) << p.key();
  }
  wide->save_pretrained(dir_ / "wide");
  EXPECT_EQ(GPT2Config::from_json_file(dir_ / "wide" / "config.json").initializer_range, 0.2);
  // The end and pad tokens go through config.json too, null for none.
  config.eos_token_id = {};
  config.pad_token_id = 3;
  config.save_json_file(dir_ / "tokens.json");
  const auto tokens = GPT2Config::from_json_file(dir_ / "tokens.json");
  EXPECT_TRUE(tokens.eos_token_id.empty());
  EXPECT_EQ(tokens.pad_token_id, 3);
  EXPECT_ERROR(GPT2LMHeadModel(GPT2Config{.initializer_range = -1}),
               "Invalid initializer_range: -1");
}

TEST_F(GPT2, BadConfigsAreClearErrors) {
  EXPECT_ERROR(GPT2Config::from_json_file(dir_ / "none.json"),
               "none.json: cannot open (No such file or directory)");
  EXPECT_ERROR(GPT2Config::from_json_file(dir_), "is a directory, expected a file");
  EXPECT_ERROR(
      GPT2LMHeadModel::from_pretrained(tiny_with_config([](json& c) { c.erase("n_embd"); })),
      "missing key 'n_embd' (expected a positive integer)");
  EXPECT_ERROR(
      GPT2LMHeadModel::from_pretrained(tiny_with_config([](json& c) { c["n_head"] = "4"; })),
      "key 'n_head' is \"4\", expected a positive integer");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(tiny_with_config([](json& c) { c["n_head"] = 5; })),
               "Invalid n_embd 64: not divisible by n_head 5");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_config([](json& c) { c["activation_function"] = "relu"; })),
               "Invalid activation_function: 'relu'");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_config([](json& c) { c["tie_word_embeddings"] = false; })),
               "key 'tie_word_embeddings' is false, but only true is supported");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_config([](json& c) { c["model_type"] = "llama"; })),
               "model_type is \"llama\", expected \"gpt2\"");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_config([](json& c) { c["eos_token_id"] = "</s>"; })),
               "key 'eos_token_id' is \"</s>\", expected a token id (an integer >= 0), a list of "
               "them or null");
  // A config.json that asks for a model larger than its weights file is refused
  // before the model is allocated (the tiny model has ~100k parameters).
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_config([](json& c) { c["vocab_size"] = int64_t{1} << 30; })),
               "far fewer than the 68719579136 parameters (at least) of the model that config.json "
               "describes (vocab_size 1073741824");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_config([](json& c) { c["n_embd"] = int64_t{1} << 60; })),
               "make more than 10^15 parameters");
  std::ofstream(dir_ / "overflow.json") << R"({"vocab_size": 1e400})";
  EXPECT_ERROR(GPT2Config::from_json_file(dir_ / "overflow.json"), "not valid JSON");
  const auto e = error_of([&] { GPT2Config::from_json_file(dir_ / "config.json"); });
  EXPECT_NE(e.find("config.json '" + (dir_ / "config.json").string() + "'"), std::string::npos)
      << e;
}

TEST_F(GPT2, BadCheckpointsNameTheKeyAndShapes) {
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(
                   tiny_with_tensors([](auto& t) { t.erase("transformer.h.1.mlp.c_fc.weight"); })),
               "missing tensor 'transformer.h.1.mlp.c_fc.weight' (expected shape [64, 256])");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(tiny_with_tensors([](auto& t) {
                 t["transformer.h.0.attn.c_attn.weight"] = torch::zeros({192, 64});
               })),
               "tensor 'transformer.h.0.attn.c_attn.weight' has shape [192, 64], but the config "
               "needs [64, 192]");
  EXPECT_ERROR(GPT2LMHeadModel::from_pretrained(tiny_with_tensors(
                   [](auto& t) { t["transformer.h.2.ln_1.weight"] = torch::ones({64}); })),
               "unexpected tensor 'transformer.h.2.ln_1.weight' of shape [64]");
  // GPT2Model checkpoints (no "transformer." prefix) and an explicit tied head load.
  auto model = GPT2LMHeadModel::from_pretrained(tiny_with_tensors([](auto& t) {
    std::map<std::string, at::Tensor> bare;
    for (auto& [k, v] : t) bare[k.substr(std::string("transformer.").size())] = v;
    bare["lm_head.weight"] = bare.at("wte.weight");
    t = bare;
  }));
  model->eval();
  EXPECT_LE(parity(model, "fp32").max_logit_diff, kFp32Tol);
}

TEST_F(GPT2, RejectsBadInputs) {
  GPT2Config config{.vocab_size = 32, .n_positions = 8, .n_embd = 16, .n_layer = 1, .n_head = 2};
  GPT2LMHeadModel model(config);
  EXPECT_ERROR(model->forward(torch::zeros({2, 9}, torch::kLong)),
               "sequence length 9 is outside [1, n_positions = 8]");
  EXPECT_ERROR(model->forward(torch::zeros({2, 4})), "input_ids must be (B, T) int64");
  EXPECT_ERROR(
      model->forward(torch::zeros({2, 4}, torch::kLong), torch::zeros({2, 3}, torch::kLong)),
      "labels must be int64 of the shape of input_ids");
  EXPECT_ERROR(model->generate(torch::zeros({1, 4}, torch::kLong), 5), "exceeds n_positions = 8");
  EXPECT_ERROR(model->generate(torch::zeros({1, 4}, torch::kLong), INT64_MAX),
               "exceeds n_positions = 8");
  EXPECT_ERROR(model->generate(torch::zeros({1, 4}, torch::kLong), 0),
               "`max_new_tokens` must be greater than 0, but is 0.");
  EXPECT_ERROR(model->generate(torch::zeros({4}, torch::kLong), 2),
               "input_ids must be (B, T), got shape [4]");
  EXPECT_ERROR(model->forward(torch::zeros({0, 4}, torch::kLong)),
               "input_ids holds no sequence (shape [0, 4])");
  EXPECT_ERROR(model->forward(torch::tensor({{1, 32, 2}})),
               "token id 32 in input_ids is out of range: vocab_size is 32 (ids in [0, 32))");
  EXPECT_ERROR(model->forward(torch::tensor({{1, -1, 40}})), "token id -1 in input_ids");
  EXPECT_ERROR(model->generate(torch::tensor({{1, 33}}), 2), "token id 33 in input_ids");
  EXPECT_ERROR(GPT2LMHeadModel(GPT2Config{.n_embd = 10, .n_head = 3}), "not divisible by n_head 3");
}

}  // namespace
