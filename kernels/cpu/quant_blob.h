// A quantized layer's blob: one or more segments back to back, each a 64-byte header and its panels, whose
// outputs follow each other (q, k and v of different formats in one layer). Two layouts share it: quant.cpp's
// (activations fp32, panels of 64 outputs, magic "TFQ2") and quant_q8.cpp's (activations rounded to 8 bits,
// panels of 16 outputs, magic "TFQ8"). A blob holds segments of one layout.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace tfq::blob {

constexpr int64_t HEADER = 64;
constexpr int32_t MAGIC = 0x32514654;     // "TFQ2"
constexpr int32_t MAGIC_Q8 = 0x38514654;  // "TFQ8"

// How a group's scales are kept: an fp32 number per output (SCALES_FP32), or, for GGUF's K formats, the file's
// two levels: an fp32 super scale per output and super block, times a small integer per output and group
// (SCALES_TWO_LEVEL). The product is exact in fp32 (an fp16 times a 6- or 8-bit integer).
enum ScaleMode : int16_t { SCALES_FP32 = 0, SCALES_TWO_LEVEL = 1 };

struct Header {
  int32_t magic;
  int16_t bits, rounding;
  int32_t group, zero;
  int16_t has_offset, scale_mode, row_bytes, super_groups;  // super_groups: groups under one super scale
  int64_t n, k, panels;
  int32_t group_bytes, super_bytes;  // super_bytes: a panel's super scales, before its groups (two-level)
  int64_t panel_bytes;
};
static_assert(sizeof(Header) == HEADER, "a segment's header is 64 bytes");

// The scales a pack takes (qpack and qpack_q8 alike): s [N, groups] fp32 and o like it; for GGUF's K formats
// also sd [N, supers] fp32 and sq like s int8 (od, oq likewise, with offsets), their products s and o.
struct Scales {
  int64_t supers;  // super blocks per output (0: one level)
  const float *s, *o, *sd, *od;  // o, od: nullptr without offsets; sd, od: nullptr with one level
  const int8_t *sq, *oq;
};

// The scales checked, and their data. `op` names the caller in the messages.
inline Scales checked_scales(const char* op, int64_t N, int64_t groups, const at::Tensor& s,
                              const c10::optional<at::Tensor>& o, const c10::optional<at::Tensor>& sd,
                              const c10::optional<at::Tensor>& sq, const c10::optional<at::Tensor>& od,
                              const c10::optional<at::Tensor>& oq) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == N &&
              s.size(1) == groups, op, ": s [N, K / group] fp32");
  TORCH_CHECK(!o.has_value() || (o->scalar_type() == at::kFloat && o->is_contiguous() && o->sizes() == s.sizes()),
              op, ": o like s");
  const float* offsets = o.has_value() ? o->data_ptr<float>() : nullptr;
  if (!sd.has_value()) return Scales{0, s.data_ptr<float>(), offsets, nullptr, nullptr, nullptr, nullptr};
  TORCH_CHECK(sq.has_value() && od.has_value() == o.has_value() && oq.has_value() == o.has_value(), op,
              ": two-level scales are GGUF's (sd, sq; od, oq with offsets)");
  const int64_t supers = sd->size(1);
  TORCH_CHECK(sd->scalar_type() == at::kFloat && sd->is_contiguous() && sd->dim() == 2 && sd->size(0) == N &&
              supers > 0 && groups % supers == 0 && sq->scalar_type() == at::kChar && sq->is_contiguous() &&
              sq->sizes() == s.sizes(), op, ": sd [N, K / SB] fp32, sq [N, K / G] int8");
  TORCH_CHECK(!o.has_value() || (od->sizes() == sd->sizes() && od->scalar_type() == at::kFloat &&
              od->is_contiguous() && oq->sizes() == sq->sizes() && oq->scalar_type() == at::kChar &&
              oq->is_contiguous()), op, ": od like sd, oq like sq");
  return Scales{supers, s.data_ptr<float>(), offsets, sd->data_ptr<float>(),
                offsets ? od->data_ptr<float>() : nullptr, sq->data_ptr<int8_t>(),
                offsets ? oq->data_ptr<int8_t>() : nullptr};
}

inline int64_t segment_bytes(const Header& h) { return HEADER + h.panels * h.panel_bytes; }

// A segment's header is what the kernels index its panels, groups and rows by: checked against the layout its
// pack writes (qpack: panels of 64 outputs; qpack_q8: of 16, in the groups its kernel takes) and against the
// `room` left in the blob, by divisions (a product of crafted sizes could overflow into a small number).
inline void check_header(const Header& h, int64_t index, int64_t room) {
  const bool q8 = h.magic == MAGIC_Q8, two = h.scale_mode == SCALES_TWO_LEVEL;
  const int64_t out = q8 ? 16 : 64, off = h.has_offset;
  const bool bits = h.bits == 4 || h.bits == 5 || h.bits == 6 || h.bits == 8;
  const bool group = q8 ? h.group == (h.bits == 6 ? 16 : 32)
                        : h.group == 16 || h.group == 32 || h.group == 64 || h.group == 128;
  bool ok = bits && group && (off == 0 || off == 1) && (two || h.scale_mode == SCALES_FP32) && h.n >= 0 &&
            h.k >= 0 && h.k % h.group == 0 && h.rounding >= 0 && h.rounding <= (q8 || two ? 0 : 2) &&
            (q8 || h.row_bytes == out * h.bits / 8);
  if (ok) {  // bits and group known: a group's and a super block's bytes are small numbers
    const int64_t groups = h.k / h.group, per_group = (two ? 1 : 4) * out * (1 + off) + out * h.group * h.bits / 8;
    const int64_t per_super = 4 * out * (1 + off);
    ok = h.group_bytes == per_group && h.panels == h.n / out + (h.n % out != 0) && h.super_bytes >= 0 &&
         (two ? h.super_groups > 0 && groups % h.super_groups == 0 && h.super_bytes % per_super == 0 &&
                    h.super_bytes / per_super == groups / h.super_groups
              : h.super_bytes == 0) &&
         h.panel_bytes >= h.super_bytes && (h.panel_bytes - h.super_bytes) % per_group == 0 &&
         (h.panel_bytes - h.super_bytes) / per_group == groups;
  }
  TORCH_CHECK(ok, "tfq qlinear: the blob's segment ", index, " does not match its panels (", h.bits, " bits, groups of ",
              h.group, ", ", h.n, " x ", h.k, ", ", h.panels, " panels of ", h.panel_bytes, " bytes)");
  TORCH_CHECK(h.panels == 0 || h.panel_bytes == 0 || h.panels <= room / h.panel_bytes, "tfq qlinear: the blob's segment ",
              index, " holds ", h.panels, " panels of ", h.panel_bytes, " bytes, past the ", room,
              " bytes left in the blob");
}

struct Segment {
  Header h;
  const uint8_t* panels;
  int64_t first;  // its first output in the layer
};

inline std::vector<Segment> segments_of(const at::Tensor& blob) {
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.dim() == 1 && blob.is_contiguous() && blob.numel() >= HEADER,
              "tfq qlinear: a blob from qpack");
  std::vector<Segment> out;
  const uint8_t* base = blob.data_ptr<uint8_t>();
  int64_t at = 0, first = 0;
  while (at < blob.numel()) {
    TORCH_CHECK(blob.numel() - at >= HEADER, "tfq qlinear: a blob from qpack");
    Segment seg;
    std::memcpy(&seg.h, base + at, sizeof seg.h);
    TORCH_CHECK(seg.h.magic == MAGIC || seg.h.magic == MAGIC_Q8, "tfq qlinear: a blob from qpack");
    check_header(seg.h, static_cast<int64_t>(out.size()), blob.numel() - at - HEADER);
    TORCH_CHECK(out.empty() || (seg.h.k == out[0].h.k && seg.h.magic == out[0].h.magic),
                "tfq qlinear: a blob's segments share their inputs and their layout");
    seg.panels = base + at + HEADER;
    seg.first = first;
    first += seg.h.n;
    at += segment_bytes(seg.h);
    out.push_back(seg);
  }
  return out;
}

}  // namespace tfq::blob

namespace tfq::quant {
// One product y [M, N] (rows N apart) = x [M, K] W^T (+ bias), W a blob of quant.cpp's layout (fp32 activations)
struct Product {
  const float* x;
  int64_t M;
  const std::vector<blob::Segment>* segs;  // segments_of(W), held by the caller (a copy a product cost a malloc)
  float* y;
  int64_t N;
  const float* bias;  // nullptr: none
};
// The products in one parallel region, each panel of each one job, each computed as qlinear computes it (qlinear
// is this with one product): a mixture's experts at a decode step are 16 small products a layer, and one region
// for all of them saves the threads' start and join, and the wait for the slowest, of each.
void linear_many(const std::vector<Product>& products);
}  // namespace tfq::quant

namespace tfq::q8 {
// y = x W^T + b on a blob of quant_q8.cpp's layout (`segs` from segments_of, y [M, N] to fill)
void linear(const at::Tensor& x, const std::vector<blob::Segment>& segs, const float* bias, float* y, int64_t N);
// silu(gate) * up [M, I] from x [M, K] and a gate_up blob of quant_q8.cpp's layout (2 I outputs: the gate's, then
// the up's), the bits of `linear` then layer_parts.h's silu_mul, without gate_up's output in memory: each thread
// takes a run of gate panels and their up panels and multiplies them in its own buffer. Undefined where
// the blob is not that layout or its panels do not pair (its outputs not 2 I, or I or a segment's outputs not a
// multiple of 16).
at::Tensor linear_glu(const at::Tensor& x, const at::Tensor& blob, int64_t I);
// Whether a gate_up blob's panels pair for linear_glu (quant_q8.cpp's layout, 2 I outputs in whole panels of 16)
bool glu_pairs(const std::vector<blob::Segment>& segs, int64_t I);
// linear_many's products of gate_up blobs that pair, each product's y silu(gate) * up [M, I] (N unused): the bits
// of linear_many then silu_mul
void linear_many_glu(const std::vector<quant::Product>& products, int64_t I);
// quant::linear_many for blobs of quant_q8.cpp's layout: each product's rows rounded once, then every panel of
// every product one job, each thread a contiguous run of them (one stream through its experts' blocks)
void linear_many(const std::vector<quant::Product>& products);
}  // namespace tfq::q8
