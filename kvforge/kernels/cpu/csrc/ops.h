// The ops a compiled decode step calls, declared once: each is defined and registered with torch.library in its
// kernel's file, and called directly by the C entry points of Inductor's C++ wrapper (c_shims.cpp).
#pragma once

#include <torch/extension.h>

namespace kvforge_cpu {

// quant_panels.cpp
torch::Tensor quant_gemm_panels(torch::Tensor x, torch::Tensor weight, int64_t bits, int64_t out_features,
                                double factor);

}  // namespace kvforge_cpu

// paged_decode.cpp
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           c10::optional<torch::Tensor> key_scale, c10::optional<torch::Tensor> value_scale);
void cache_write(torch::Tensor rows, torch::Tensor cache, torch::Tensor slot_mapping);
