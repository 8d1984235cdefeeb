// Where weights live. A decode step streams every weight once, so their pages matter as much as the kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tfq {

constexpr int64_t HUGE_PAGE = int64_t(2) << 20;

// `bytes` of memory for weights, in 2 MiB pages where the system allows it (Linux's transparent huge pages,
// asked for with madvise): with 4 KiB pages the stream walks the page tables every 4 KiB; measured here, huge
// pages make it 7-10% faster. The start is 2 MiB-aligned and only whole 2 MiB pages are asked for, so a tail
// costs no more memory than it uses. Under 2 MiB that gives 4 KiB pages: use lasting_memory for a blob kept.
at::Tensor weights_memory(int64_t bytes);

// Memory for a blob the model keeps: weights_memory from 2 MiB up; a smaller one (a mixture's expert, 1-2 MB) is
// carved, 64-byte aligned, from a block of 2 MiB pages shared with the blobs made before and after it, and the
// block is freed with the last of its blobs. A 30B-A3B's experts read 15% faster so than each on its own pages.
// Only for what is kept: a temporary holds its block's space until the block's last blob goes.
at::Tensor lasting_memory(int64_t bytes);

// Blocks of lasting_memory alive now (the tests watch them freed)
int64_t lasting_blocks();

}  // namespace tfq
