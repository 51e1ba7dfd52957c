#include "mixprec/io/safetensors.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;
using mixprec::io::load_safetensors;
using mixprec::io::save_safetensors;
using mixprec::testing::error_of;
using mixprec::testing::run_reference_script;
using json = nlohmann::json;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixprec_st_" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path path(const std::string& name) const { return dir_ / name; }
  // A file of an 8-byte header length, the header text, then `data`.
  fs::path craft(const std::string& header, const std::string& data = "",
                 std::optional<uint64_t> claimed = std::nullopt) {
    std::string bytes(8, '\0');
    const uint64_t size = claimed.value_or(header.size());
    std::memcpy(bytes.data(), &size, 8);
    bytes += header + data;
    auto p = path("crafted.safetensors");
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  fs::path dir_;
};

TEST_F(Safetensors, RoundTripsEveryDtype) {
  mixprec::io::TensorMap tensors;
  for (auto type : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                    at::kShort, at::kChar, at::kByte})
    tensors[std::string("t_") + c10::toString(type)] = torch::randn({3, 5}).mul(10).to(type);
  tensors["bool"] = torch::rand({4}) > 0.5;
  tensors["scalar"] = torch::tensor(2.5);
  tensors["empty"] = torch::zeros({0, 7});
  tensors["strided"] = torch::arange(12.0).reshape({3, 4}).t();  // not contiguous
  save_safetensors(path("a.safetensors"), tensors, {{"step", "12"}});
  std::map<std::string, std::string> metadata;
  const auto loaded = load_safetensors(path("a.safetensors"), &metadata);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(loaded.count(name)) << name;
    EXPECT_EQ(loaded.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(loaded.at(name), t)) << name;
  }
  EXPECT_EQ(metadata.at("step"), "12");
  for (const auto& entry : fs::directory_iterator(dir_))  // no temporary left behind
    EXPECT_EQ(entry.path().extension(), ".safetensors") << entry.path();
}

TEST_F(Safetensors, ReadsWhatPythonWrites) {
  const auto file = path("python.safetensors");
  run_reference_script("safetensors_files.py write " + file.string());
  std::map<std::string, std::string> metadata;
  const auto loaded = load_safetensors(file, &metadata);
  EXPECT_EQ(metadata.at("made_by"), "python");
  const auto expected = torch::arange(6).reshape({2, 3});
  for (const auto& [name, type] : std::map<std::string, at::ScalarType>{{"F64", at::kDouble},
                                                                        {"F32", at::kFloat},
                                                                        {"F16", at::kHalf},
                                                                        {"BF16", at::kBFloat16},
                                                                        {"I64", at::kLong},
                                                                        {"I32", at::kInt},
                                                                        {"I16", at::kShort},
                                                                        {"I8", at::kChar},
                                                                        {"U8", at::kByte}}) {
    const auto& t = loaded.at("t_" + name);
    EXPECT_EQ(t.scalar_type(), type) << name;
    EXPECT_TRUE(torch::equal(t, expected.to(type))) << name;
  }
  EXPECT_TRUE(torch::equal(loaded.at("t_BOOL"), (expected % 2).to(at::kBool)));
  EXPECT_EQ(loaded.at("scalar").dim(), 0);
  EXPECT_EQ(loaded.at("scalar").item<float>(), 7.5f);
  EXPECT_EQ(loaded.at("empty").sizes(), (std::vector<int64_t>{0, 4}));
}

TEST_F(Safetensors, PythonReadsWhatWeWrite) {
  const auto file = path("ours.safetensors");
  save_safetensors(file,
                   {{"w", torch::arange(6.0).reshape({2, 3}).to(at::kBFloat16)},
                    {"ids", torch::tensor({3, -1, 4}, torch::kLong)},
                    {"mask", torch::tensor({true, false})}},
                   {{"format", "pt"}});
  const json read = json::parse(run_reference_script("safetensors_files.py read " + file.string()));
  EXPECT_EQ(read["metadata"]["format"], "pt");
  EXPECT_EQ(read["tensors"]["w"]["dtype"], "torch.bfloat16");
  EXPECT_EQ(read["tensors"]["w"]["shape"], json({2, 3}));
  EXPECT_EQ(read["tensors"]["w"]["values"], json({0.0, 1.0, 2.0, 3.0, 4.0, 5.0}));
  EXPECT_EQ(read["tensors"]["ids"]["values"], json({3.0, -1.0, 4.0}));
  EXPECT_EQ(read["tensors"]["mask"]["values"], json({1.0, 0.0}));
}

TEST_F(Safetensors, BadFilesAreClearErrors) {
  auto expect_error = [&](const fs::path& file, const std::string& message) {
    const std::string error = error_of([&] { load_safetensors(file); });
    EXPECT_NE(error.find(file.string()), std::string::npos) << error;
    EXPECT_NE(error.find(message), std::string::npos) << "want '" << message << "' in: " << error;
  };
  const std::string f32 = R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  const std::string eight(8, '\0');
  {
    auto p = path("short.safetensors");
    std::ofstream(p) << "abc";
    expect_error(p, "too short for a safetensors file (3 bytes");
  }
  expect_error(craft(f32, eight, 1'000'000), "header length 1000000 runs past the end");
  expect_error(craft(f32, eight, uint64_t{1} << 62), "runs past the end of the file");
  expect_error(craft("{\"x\": ", eight), "malformed JSON header");
  expect_error(craft("[1, 2]"), "the header is not a JSON object");
  expect_error(craft(R"({"x": {"dtype": "F8", "shape": [2], "data_offsets": [0, 2]}})", "ab"),
               "tensor 'x': unsupported dtype 'F8'");
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", eight),
               "tensor 'x': data_offsets [0, 16] lie outside the data (8 bytes)");
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight),
               "data_offsets span 8 bytes, but shape [3] of F32 takes 12");
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight),
               "holds a non-integer or negative size");
  // A shape whose size overflows 64 bits is refused before any allocation.
  expect_error(
      craft(R"({"x": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})",
            eight),
      "needs more data than the file holds");
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [2]}})", eight),
               "expected {dtype, shape, data_offsets}");
  expect_error(path("missing.safetensors"), "cannot open");
}

TEST_F(Safetensors, ATruncatedFileIsAClearError) {
  const auto file = path("whole.safetensors");
  save_safetensors(file, {{"a", torch::ones({4})}, {"b", torch::ones({8}, torch::kDouble)}});
  const std::string bytes = mixprec::io::read_file(file);
  // Cut inside the data: the last tensor's offsets now run past the end.
  const std::string cut = bytes.substr(0, bytes.size() - 10);
  EXPECT_NE(error_of([&] {
              mixprec::io::parse_safetensors(cut, "cut.safetensors");
            }).find("cut.safetensors: tensor 'b': data_offsets [16, 80] lie outside the data"),
            std::string::npos);
  // Cut inside the header: the header length runs past the end.
  EXPECT_NE(error_of([&] {
              mixprec::io::parse_safetensors(bytes.substr(0, 20), "head");
            }).find("head: header length"),
            std::string::npos);
  EXPECT_EQ(mixprec::io::parse_safetensors(bytes, "whole").size(), 2u);
}

TEST_F(Safetensors, AFailedWriteLeavesTheOldFile) {
  const auto file = path("keep.safetensors");
  save_safetensors(file, {{"x", torch::ones({2})}});
  // A tensor that cannot be stored fails before anything is written.
  EXPECT_NE(error_of([&] {
              save_safetensors(file, {{"x", torch::ones({2}, torch::kComplexFloat)}});
            }).find("cannot be stored in safetensors"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(load_safetensors(file).at("x"), torch::ones({2})));
  // Into a folder that does not exist: an error naming the file.
  EXPECT_NE(error_of([&] {
              save_safetensors(path("no/such/dir/x.safetensors"), {});
            }).find("cannot create"),
            std::string::npos);
}

}  // namespace
