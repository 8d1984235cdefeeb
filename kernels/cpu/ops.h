// tfq's ops that the one-call layers and the model's one object call straight, not through torch's dispatcher: the
// functions each op registers (linear.cpp, quant.cpp, rowwise.cpp, attention.cpp), so the same code and the same
// bits. Why: a dispatcher call looks up its kernel and its thread-local keys on every call, a microsecond or two
// on caches a linear layer has just flushed, several times a layer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace tfq::ops {

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blob, const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                  const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile, int64_t split);

}  // namespace tfq::ops
