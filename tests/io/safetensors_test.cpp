#include "mixprec/io/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using mixprec::io::load_safetensors;
using mixprec::io::load_safetensors_metadata;
using mixprec::io::save_safetensors;

const fs::path kReference = fs::path(MIXPREC_REFERENCE_DIR) / "reference.safetensors";
const fs::path kScript = fs::path(MIXPREC_REFERENCE_DIR).parent_path() / "safetensors_reference.py";

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// A fresh folder per test, removed at the end.
class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mixprec_io_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a file made of the 8-byte little-endian length of `header`, `header` and `data`.
  fs::path raw(const std::string& header, const std::string& data = "",
               std::optional<uint64_t> length = std::nullopt) {
    const fs::path path = dir_ / "raw.safetensors";
    std::ofstream out(path, std::ios::binary);
    uint64_t n = length.value_or(header.size());
    for (int i = 0; i < 8; ++i, n >>= 8) out.put(static_cast<char>(n & 0xff));
    out << header << data;
    return path;
  }

  std::string load_error(const fs::path& path) {
    return error_of([&] { load_safetensors(path); });
  }

  fs::path dir_;
};

// The tensors of tests/reference/safetensors_reference.py.
std::map<std::string, torch::Tensor> reference_tensors() {
  auto grid = torch::arange(12, torch::kDouble).reshape({3, 4}) * 0.5 - 1.0;
  return {
      {"f32", grid.to(torch::kFloat)},
      {"f16", grid.to(torch::kHalf)},
      {"bf16", grid.to(torch::kBFloat16)},
      {"f64", torch::arange(5, torch::kDouble) / 3.0},
      {"i64", torch::tensor({int64_t{-3}, int64_t{0}, int64_t{1} << 40})},
      {"i32", torch::tensor({1, -2, 3, -4}, torch::kInt).reshape({2, 2})},
      {"i8", torch::tensor({-128, 0, 127}, torch::kChar)},
      {"u8", torch::tensor({0, 1, 255}, torch::kByte)},
      {"bool", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(3.25f)},
      {"empty", torch::zeros({0, 3})},
  };
}

void expect_same(const std::map<std::string, torch::Tensor>& got,
                 const std::map<std::string, torch::Tensor>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(got.count(name)) << name;
    const auto& g = got.at(name);
    EXPECT_EQ(g.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(g.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(g, t)) << name;
  }
}

TEST_F(Safetensors, RoundTripsEveryDtype) {
  auto tensors = reference_tensors();
  tensors["strided"] = torch::arange(6, torch::kFloat).reshape({2, 3}).t();  // not contiguous
  const auto path = dir_ / "a.safetensors";
  save_safetensors(path, tensors, {{"format", "pt"}});
  expect_same(load_safetensors(path), tensors);
  EXPECT_EQ(load_safetensors_metadata(path),
            (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_FALSE(fs::exists(dir_ / "a.safetensors.tmp"));
  // The data section starts 8-byte aligned, as in files from Python.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST_F(Safetensors, OverwritesAtomically) {
  const auto path = dir_ / "a.safetensors";
  save_safetensors(path, {{"x", torch::ones({2})}});
  save_safetensors(path, {{"y", torch::zeros({3})}});
  auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_TRUE(torch::equal(loaded.at("y"), torch::zeros({3})));
  EXPECT_TRUE(load_safetensors_metadata(path).empty());
}

TEST_F(Safetensors, ReadsFilesFromPython) {
  expect_same(load_safetensors(kReference), reference_tensors());
  EXPECT_EQ(load_safetensors_metadata(kReference),
            (std::map<std::string, std::string>{{"format", "pt"}, {"source", "mixprec"}}));
}

TEST_F(Safetensors, PythonReadsOurFiles) {
  const auto path = dir_ / "ours.safetensors";
  save_safetensors(path, reference_tensors(), {{"format", "pt"}, {"source", "mixprec"}});
  const std::string command =
      std::string(MIXPREC_PYTHON) + " " + kScript.string() + " --verify " + path.string();
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

TEST_F(Safetensors, RejectsUnsupportedDtypesOnSave) {
  auto e = error_of([&] {
    save_safetensors(dir_ / "c.safetensors", {{"z", torch::zeros({2}, torch::kComplexFloat)}});
  });
  EXPECT_NE(e.find("tensor 'z' has dtype ComplexFloat, which safetensors cannot store"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(dir_ / "c.safetensors.tmp"));
}

struct BadCase {
  const char* name;
  std::string header;
  std::string data;
  std::string expected;
};

TEST_F(Safetensors, RejectsBadFilesWithClearErrors) {
  const std::string f32x2 = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\0');
  const BadCase cases[] = {
      {"malformed JSON", R"({"x": {"dtype": )", "", "header is not valid JSON"},
      {"not an object", "[1, 2]", "", "header is not a JSON object but array"},
      {"unknown dtype", R"({"x":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", eight,
       "tensor 'x': unknown dtype 'F17'"},
      {"missing shape", R"({"x":{"dtype":"F32","data_offsets":[0,8]}})", eight,
       "tensor 'x': missing array field 'shape'"},
      {"negative dim", R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight,
       "is not a non-negative integer"},
      {"offsets past the data", R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234",
       "data_offsets [0, 8] are out of range of the 4-byte data section"},
      {"offsets reversed", R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight,
       "data_offsets [8, 0] are out of range"},
      {"size mismatch", R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight,
       "data_offsets [0, 8] hold 8 bytes, but shape [3] of F32 needs 12"},
      {"huge shape",
       R"({"x":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight,
       "needs more than 2^64"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       std::string(12, '\0'), "tensor 'b' at data_offsets [4, 12] overlaps the previous tensor"},
      {"gap",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       std::string(12, '\0'), "tensor 'b' at data_offsets [8, 12] leaves a gap"},
      {"trailing bytes", f32x2, std::string(12, '\0'), "the tensors cover 8 of the 12 data bytes"},
      {"metadata not strings", R"({"__metadata__":{"a":1}})", "",
       "__metadata__ value of 'a' is a number, expected a string"},
  };
  for (const auto& c : cases) {
    const auto path = raw(c.header, c.data);
    const auto e = load_error(path);
    EXPECT_NE(e.find("safetensors file '" + path.string() + "'"), std::string::npos)
        << c.name << ": " << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.name << ": " << e;
  }
}

TEST_F(Safetensors, RejectsBadLengths) {
  {
    const auto path = dir_ / "short.safetensors";
    std::ofstream(path, std::ios::binary) << "abc";
    EXPECT_NE(load_error(path).find("file is 3 bytes, shorter than the 8-byte header length"),
              std::string::npos)
        << load_error(path);
  }
  auto e = load_error(raw("{}", "", 1000));
  EXPECT_NE(e.find("header length 1000 runs past the end of the file (10 bytes)"),
            std::string::npos)
      << e;
  // An absurd length is refused before anything is allocated.
  e = load_error(raw("{}", "", ~uint64_t{0}));
  EXPECT_NE(e.find("header length 18446744073709551615 is larger than the limit"),
            std::string::npos)
      << e;
  e = load_error(dir_ / "missing.safetensors");
  EXPECT_NE(e.find("cannot open for reading"), std::string::npos) << e;
}

}  // namespace
