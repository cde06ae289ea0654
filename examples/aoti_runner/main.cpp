// Runs the hybrid model's AOTInductor packages (lowering/aoti.py) with no Python: prefill
// prompts from an empty cache, then greedy decode steps, printing every step's logits. The
// tensors live on the device the packages were built for (their "kda.device" metadata).
//
//   kda_aoti_runner PACKAGE_DIR STEPS IDS [IDS ...]
//
// PACKAGE_DIR holds prefill.pt2 and decode.pt2; each IDS is one prompt's comma-separated
// token ids (all prompts of one length). The packages come from lowering.aoti.package_steps
// (the example model) or kda_ops.integrations.export.package_flat_state_steps (transformers
// models); both take (input_ids, *states) and return (logits, *states). Output, one line each:
//   logits STEP SEQ v0 v1 ...   (the last position's logits; step 0 is the prefill)
//   tokens STEP t0 t1 ...       (the greedy next token of each sequence)
//   time STEP MICROSECONDS      (the package call, to its outputs on the device)

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Metadata keys written by lowering/aoti.py's package_steps.
constexpr const char* kStateSpecs = "kda.state_specs";
constexpr const char* kDevice = "kda.device";
// Written by kda_ops.integrations.export.package_flat_state_steps: the KV buffers' length,
// which the prompt and the generated tokens must fit (a compiled step cannot check it).
constexpr const char* kMaxLength = "kda.max_length";

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "int64") return at::kLong;
  if (name == "int32") return at::kInt;
  throw std::invalid_argument("unknown state dtype in the package metadata: " + name);
}

// An empty cache for `batch` sequences on `device`: one zero tensor per line of the state
// specs ("dtype d1 d2 ...", the shape without the batch dim).
std::vector<at::Tensor> empty_cache(const std::string& specs, int64_t batch, const at::Device& device) {
  std::vector<at::Tensor> states;
  std::istringstream lines(specs);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string dtype;
    fields >> dtype;
    std::vector<int64_t> shape{batch};
    for (int64_t dim; fields >> dim;) shape.push_back(dim);
    states.push_back(at::zeros(shape, at::TensorOptions().dtype(parse_dtype(dtype)).device(device)));
  }
  return states;
}

at::Tensor parse_prompts(char** begin, char** end) {
  std::vector<std::vector<int64_t>> prompts;
  for (char** arg = begin; arg != end; ++arg) {
    std::vector<int64_t> ids;
    std::istringstream tokens(*arg);
    for (std::string token; std::getline(tokens, token, ',');) ids.push_back(std::stoll(token));
    if (ids.empty() || (!prompts.empty() && ids.size() != prompts[0].size())) {
      throw std::invalid_argument("every prompt needs the same, non-zero number of token ids");
    }
    prompts.push_back(ids);
  }
  auto ids = at::empty({static_cast<int64_t>(prompts.size()), static_cast<int64_t>(prompts[0].size())},
                       at::TensorOptions().dtype(at::kLong));
  for (size_t b = 0; b < prompts.size(); ++b) {
    for (size_t t = 0; t < prompts[b].size(); ++t) ids[b][t] = prompts[b][t];
  }
  return ids;
}

// Prints the last position's logits of each sequence and returns the greedy tokens [B, 1].
at::Tensor report(int step, const at::Tensor& logits) {
  auto last = logits.select(1, logits.size(1) - 1).to(at::kCPU).contiguous();  // [B, vocab]
  for (int64_t b = 0; b < last.size(0); ++b) {
    std::printf("logits %d %lld", step, static_cast<long long>(b));
    auto row = last[b];
    for (int64_t v = 0; v < row.size(0); ++v) std::printf(" %.9g", row[v].item<double>());
    std::printf("\n");
  }
  auto next = last.argmax(-1).unsqueeze(1);
  std::printf("tokens %d", step);
  for (int64_t b = 0; b < next.size(0); ++b) {
    std::printf(" %lld", static_cast<long long>(next[b][0].item<int64_t>()));
  }
  std::printf("\n");
  return next;
}

std::vector<at::Tensor> step_inputs(const at::Tensor& ids, const std::vector<at::Tensor>& states) {
  std::vector<at::Tensor> inputs{ids};
  inputs.insert(inputs.end(), states.begin(), states.end());
  return inputs;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PACKAGE_DIR STEPS IDS [IDS ...]\n", argv[0]);
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int steps = std::stoi(argv[2]);
    torch::inductor::AOTIModelPackageLoader prefill(dir + "/prefill.pt2");
    torch::inductor::AOTIModelPackageLoader decode(dir + "/decode.pt2");

    const auto metadata = prefill.get_metadata();
    const auto device_entry = metadata.find(kDevice);
    const at::Device device(device_entry == metadata.end() ? "cpu" : device_entry->second);
    at::Tensor ids = parse_prompts(argv + 3, argv + argc).to(device);
    const auto max_length = metadata.find(kMaxLength);
    if (max_length != metadata.end() && ids.size(1) + steps > std::stoll(max_length->second)) {
      throw std::invalid_argument("prompt length + STEPS exceeds the packages' max_length " +
                                  max_length->second);
    }
    std::vector<at::Tensor> states = empty_cache(metadata.at(kStateSpecs), ids.size(0), device);
    for (int step = 0; step <= steps; ++step) {
      auto& package = step == 0 ? prefill : decode;
      const auto start = std::chrono::steady_clock::now();
      std::vector<at::Tensor> outputs = package.run(step_inputs(ids, states));
      if (device.is_cuda()) torch::cuda::synchronize();
      const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
      std::printf("time %d %.1f\n", step, took.count());
      states.assign(outputs.begin() + 1, outputs.end());
      ids = report(step, outputs[0]).to(device);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "kda_aoti_runner: %s\n", error.what());
    return 1;
  }
  return 0;
}
