#include "mixprec/io/safetensors.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

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

std::vector<std::string> names_of(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::ranges::sort(names);
  return names;
}

// The dtypes safetensors stores, by their names there.
std::map<std::string, at::ScalarType> stored_dtypes() {
  std::map<std::string, at::ScalarType> dtypes{{"F64", at::kDouble},
                                               {"F32", at::kFloat},
                                               {"F16", at::kHalf},
                                               {"BF16", at::kBFloat16},
                                               {"I64", at::kLong},
                                               {"I32", at::kInt},
                                               {"I16", at::kShort},
                                               {"I8", at::kChar},
                                               {"U8", at::kByte},
                                               {"U16", at::kUInt16},
                                               {"U32", at::kUInt32},
                                               {"U64", at::kUInt64},
                                               {"C64", at::kComplexFloat},
                                               {"F8_E4M3", at::kFloat8_e4m3fn},
                                               {"F8_E5M2", at::kFloat8_e5m2},
                                               {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
                                               {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz}};
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
  dtypes["F8_E8M0"] = at::kFloat8_e8m0fnu;
#endif
  return dtypes;
}

// The same dtype, shape and bytes (torch::equal does not take every dtype: uint32, float8).
testing::AssertionResult same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes())
    return testing::AssertionFailure()
           << a.scalar_type() << a.sizes() << " vs " << b.scalar_type() << b.sizes();
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  if (ca.nbytes() > 0 && std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) != 0)
    return testing::AssertionFailure() << "different bytes";
  return testing::AssertionSuccess();
}

// What tests/reference/safetensors_files.py writes.
mixprec::io::TensorMap python_tensors() {
  mixprec::io::TensorMap tensors;
  const auto values = torch::arange(6).reshape({2, 3});
  for (const auto& [name, type] : stored_dtypes()) tensors["t_" + name] = values.to(type);
  tensors["t_BOOL"] = (values % 2).to(at::kBool);
  tensors["scalar"] = torch::tensor(7.5);
  tensors["empty"] = torch::zeros({0, 4});
  return tensors;
}

// This process's resident memory now (statm) and at its peak (getrusage), in bytes.
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}
int64_t peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// Each tensor is read straight into its memory: loading a file takes about its size, where a
// whole-file buffer (and a stringstream's copy of it) took two to three times more.
TEST_F(Safetensors, LoadingTakesAboutTheFilesSizeInMemory) {
#if defined(__SANITIZE_ADDRESS__) || !defined(__linux__)
  GTEST_SKIP() << "ASan's allocator keeps what is freed; statm is Linux's";
#endif
  constexpr int64_t kFloats = int64_t{16} << 20;  // 64 MB of data
  const std::string header =
      json{{"big", {{"dtype", "F32"}, {"shape", {kFloats}}, {"data_offsets", {0, 4 * kFloats}}}}}
          .dump();
  const auto file = path("big.safetensors");
  {
    std::ofstream out(file, std::ios::binary);
    const uint64_t size = header.size();
    out.write(reinterpret_cast<const char*>(&size), 8);
    out << header;
    const std::vector<float> piece(1 << 20, 0.5f);  // written in pieces: no copy of the file
    for (int64_t i = 0; i < kFloats; i += static_cast<int64_t>(piece.size()))
      out.write(reinterpret_cast<const char*>(piece.data()),
                static_cast<std::streamsize>(piece.size() * sizeof(float)));
  }
  (void)load_safetensors(
      craft(R"({"warm": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
            std::string(4, '\0')));  // the first ATen calls' own memory
  const int64_t before = resident_bytes();
  if (peak_resident_bytes() > before + 4 * kFloats)  // other tests ran in this process
    GTEST_SKIP() << "an earlier peak would hide this one; run it alone";
  const auto tensors = load_safetensors(file);
  EXPECT_EQ(tensors.at("big")[kFloats - 1].item<float>(), 0.5f);
  EXPECT_LT(peak_resident_bytes() - before, 4 * kFloats * 5 / 4)
      << "a file of " << 4 * kFloats << " bytes";
}

TEST_F(Safetensors, RoundTripsEveryDtype) {
  mixprec::io::TensorMap tensors;
  for (const auto& [name, type] : stored_dtypes())
    tensors["t_" + name] = torch::rand({3, 5}).mul(10).to(type);
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
    EXPECT_TRUE(same_bytes(loaded.at(name), t.contiguous())) << name;
  }
  EXPECT_EQ(metadata.at("step"), "12");
  for (const auto& entry : fs::directory_iterator(dir_))  // no temporary left behind
    EXPECT_EQ(entry.path().extension(), ".safetensors") << entry.path();
}

// A pipe has no size to read tensors at offsets from: it is read whole, then parsed.
TEST_F(Safetensors, APipeIsReadWhole) {
  const mixprec::io::TensorMap tensors{{"a", torch::arange(10.0)}, {"b", torch::ones({2, 3})}};
  save_safetensors(path("a.safetensors"), tensors);
  const std::string bytes = mixprec::io::read_file(path("a.safetensors"));
  ASSERT_EQ(::mkfifo(path("pipe").c_str(), 0600), 0) << std::strerror(errno);
  mixprec::io::TensorMap loaded;
  {
    std::jthread writer([&] { std::ofstream(path("pipe"), std::ios::binary) << bytes; });
    loaded = load_safetensors(path("pipe"));
  }
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_TRUE(torch::equal(loaded.at("a"), tensors.at("a")));
  EXPECT_TRUE(torch::equal(loaded.at("b"), tensors.at("b")));
  EXPECT_EQ(error_of([&] { load_safetensors(dir_); }),
            dir_.string() + ": is a directory, expected a file");
}

TEST_F(Safetensors, ReadsWhatPythonWrites) {
  const auto file = path("python.safetensors");
  run_reference_script("safetensors_files.py write " + file.string());
  std::map<std::string, std::string> metadata;
  const auto loaded = load_safetensors(file, &metadata);
  EXPECT_EQ(metadata.at("made_by"), "python");
  const auto expected = python_tensors();
  ASSERT_EQ(loaded.size(), expected.size());
  for (const auto& [name, t] : expected) EXPECT_TRUE(same_bytes(loaded.at(name), t)) << name;
}

// The same tensors give the same file as Python's writer: the same order of the data (wider
// dtypes first, so every tensor is aligned), the same header, the same padding.
TEST_F(Safetensors, WritesTheBytesPythonWrites) {
  const auto python = path("python.safetensors"), ours = path("ours.safetensors");
  run_reference_script("safetensors_files.py write " + python.string());
  save_safetensors(ours, python_tensors(), {{"made_by", "python"}});
  EXPECT_EQ(mixprec::io::read_file(ours), mixprec::io::read_file(python));
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
  // Nothing to read, but no tensor can have a size above int64's.
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [0, 18446744073709551615],
                         "data_offsets": [0, 0]}})"),
               "has a size above int64's range");
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [2]}})", eight),
               "expected {dtype, shape, data_offsets}");
  expect_error(path("missing.safetensors"), "cannot open");
  // The tensors must tile the data, as the reference reader requires: no gap, no overlap, no
  // byte left over, no name twice (each would let a small file claim much memory, or hide data).
  const std::string sixteen(16, '\0');
  expect_error(craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                     std::string(12, '\0')),
               "tensor 'b': data_offsets [8, 12] leave a gap after the data before it, which "
               "ends at byte 4");
  expect_error(craft(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                     std::string(12, '\0')),
               "tensor 'b': data_offsets [4, 12] overlap another tensor's data, which ends at "
               "byte 8");
  expect_error(craft(f32, sixteen),
               "the tensors' data ends at byte 8 of 16; the rest belongs "
               "to no tensor");
  expect_error(craft(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                     eight),
               "the header names 'x' twice");
  expect_error(craft(R"({"__metadata__": {"step": 3}, "x": {"dtype": "F32", "shape": [2],
                         "data_offsets": [0, 8]}})",
                     eight),
               "__metadata__ 'step' is not a string");
  // As the reference reader: null metadata, and tensors in any order.
  const auto loaded = load_safetensors(craft(R"({"__metadata__": null,
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
      "c": {"dtype": "I32", "shape": [1], "data_offsets": [4, 8]}})",
                                             eight));
  EXPECT_EQ(loaded.size(), 3u);
}

TEST_F(Safetensors, ATruncatedFileIsAClearError) {
  const auto file = path("whole.safetensors");
  save_safetensors(file, {{"a", torch::ones({4})}, {"b", torch::ones({8}, torch::kDouble)}});
  const std::string bytes = mixprec::io::read_file(file);
  // Cut inside the data: the last tensor's offsets now run past the end ('b', an F64, comes
  // first, as in Python's writer).
  const std::string cut = bytes.substr(0, bytes.size() - 10);
  EXPECT_NE(error_of([&] {
              mixprec::io::parse_safetensors(cut, "cut.safetensors");
            }).find("cut.safetensors: tensor 'a': data_offsets [64, 80] lie outside the data"),
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
              save_safetensors(file, {{"x", torch::ones({2}, torch::kComplexDouble)}});
            }).find("cannot be stored in safetensors"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(load_safetensors(file).at("x"), torch::ones({2})));
  // Into a folder that does not exist: an error naming the file.
  EXPECT_NE(error_of([&] {
              save_safetensors(path("no/such/dir/x.safetensors"), {});
            }).find("cannot create"),
            std::string::npos);
}

// A sharded save writes its files under other names first: one that fails half-way leaves the
// earlier model as it was, and nothing of its own. What a killed save left goes at the next.
TEST_F(Safetensors, AFailedShardedSaveLeavesTheEarlierModel) {
  using mixprec::io::save_sharded_safetensors;
  const auto model = path("model");
  fs::create_directories(model);
  const std::vector<std::pair<std::string, at::Tensor>> earlier{{"a", torch::full({8}, 1.0)},
                                                                {"b", torch::full({8}, 2.0)}};
  save_sharded_safetensors(model, earlier, 40);  // two shards of 32 bytes
  auto listing = [&] {
    std::map<std::string, std::string> files;
    for (const auto& entry : fs::directory_iterator(model))
      files[entry.path().filename()] = mixprec::io::read_file(entry.path());
    return files;
  };
  const auto before = listing();
  ASSERT_EQ(before.size(), 3u);
  // Its last file cannot be written: in as many shards (of the same names), in more, in one.
  const std::vector<std::pair<std::string, at::Tensor>> failing{
      {"a", torch::zeros({8})},
      {"c", torch::zeros({8})},
      {"b", torch::zeros({1}, at::kComplexDouble)}};
  for (const int64_t limit : {70, 40, 1000}) {
    SCOPED_TRACE(limit);
    EXPECT_NE(error_of([&] {
                save_sharded_safetensors(model, failing, limit);
              }).find("cannot be stored in safetensors"),
              std::string::npos);
    EXPECT_EQ(listing(), before);
  }
  std::ofstream(model / "model-00001-of-00002.safetensors.staged-4242") << "killed";
  std::ofstream(model / "model.safetensors.index.json.tmp.4242") << "killed";
  std::ofstream(model / "notes.txt") << "not the model's";
  EXPECT_EQ(save_sharded_safetensors(model, earlier, 1000),
            std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(names_of(model), (std::vector<std::string>{"model.safetensors", "notes.txt"}));
  EXPECT_TRUE(
      torch::equal(mixprec::io::load_sharded_safetensors(model).at("b"), torch::full({8}, 2.0)));
}

TEST(ParseSize, OutOfRangeIsAClearError) {
  EXPECT_EQ(mixprec::io::parse_size("0.5KB"), 500);
  EXPECT_EQ(mixprec::io::parse_size("1e-400KB"), 0);
  EXPECT_NE(
      error_of([] { mixprec::io::parse_size("1e999GB"); }).find("size '1e999GB' is too large"),
      std::string::npos);
}

}  // namespace
