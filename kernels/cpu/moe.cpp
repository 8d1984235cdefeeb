// A mixture of experts in two calls (tfq/model/moe.py writes the same arithmetic op by op, the reference):
//
// - moe_route: each row's routes from the router's logits, the recipe of tfq/model/moe.py's `route`: softmax with
//   each exp(logit - max) rounded to the nearest float32 (tfq/nearest.py), their sum one addition after another in
//   float64 rounded once, the `chosen` largest probabilities with ties to the lower id, divided by their float32 sum
//   in rank order when normalized. glibc's float64 exp decides the float32 exactly unless its value lies near a
//   float32 midpoint (or below float32's normals); such a row is returned as unsure (its ids and weights zeros)
//   and Python's route (which asks mpmath) answers for it, so the bits are the same on every machine.
// - moe_mixture: the rows that chose each expert gathered once (the (row, rank) pairs sorted by expert), each
//   expert's MLP on its rows (gate_up, SiLU times up, down: the dense MLP's recipe), and each row's weighted outputs
//   added in its own rank order, one rounding a product and one a sum. Experts kept in GGUF blocks run all their
//   gate_ups in one parallel region, then all their downs (quant.cpp: linear_many, each panel as qlinear does it).
//
// Why: at one lane a decode step spent about a third of a millisecond a layer in Python between these kernels.
#include <torch/library.h>

#include "moe_parts.h"

using tfq::moe::ExpertBank;

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("moe_route(Tensor logits, int chosen, bool normalized) -> (Tensor, Tensor, Tensor)");
  m.class_<ExpertBank>("ExpertBank").def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>>());
  m.def("moe_mixture(Tensor h, Tensor ids, Tensor weights, __torch__.torch.classes.tfq_cpu.ExpertBank bank, "
        "int intermediate, Tensor? clock) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("moe_route", tfq::moe::moe_route);
  m.impl("moe_mixture", [](const at::Tensor& h, const at::Tensor& ids, const at::Tensor& weights,
                           const c10::intrusive_ptr<ExpertBank>& bank, int64_t intermediate,
                           const c10::optional<at::Tensor>& clock) {
    return tfq::moe::moe_mixture(h, ids, weights, bank, intermediate, clock);
  });
}
