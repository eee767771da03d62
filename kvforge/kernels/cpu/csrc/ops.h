// The ops a compiled decode step calls, declared once: each is defined and registered with torch.library in its
// kernel's file, and called directly by the C entry points of Inductor's C++ wrapper (c_shims.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

namespace kvforge_cpu {

// quant_panels.cpp
at::Tensor quant_gemm_panels(at::Tensor x, at::Tensor weight, int64_t bits, int64_t out_features,
                                double factor);

}  // namespace kvforge_cpu

// paged_decode.cpp
at::Tensor paged_decode(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, double scale,
                           c10::optional<at::Tensor> key_scale, c10::optional<at::Tensor> value_scale,
                           int64_t sliding_window, double softcap, c10::optional<at::Tensor> sinks);
void cache_write(at::Tensor rows, at::Tensor cache, at::Tensor slot_mapping);
