// release_workers: the calling thread gives back its OpenMP worker threads (OpenMP 5.0's
// omp_pause_resource_all, soft: the runtime starts them again at that thread's next parallel region).
//
// Why: libgomp keeps a pool of workers for every thread that ever ran a parallel region, for the thread's whole
// life, and once it manages more threads than the process has CPUs its workers spin only briefly between
// regions before they sleep. A server builds its engine on one thread (the start-up guard runs the kernels
// there) and steps it on another, so two pools: measured on 2 cores, a decode step of the default model took
// 34-35 ms on the engine thread against 24 ms on the building thread, until the builder gave its pool back
// (25 ms). Returns false where the runtime has no such call (an OpenMP before 5.0, or no OpenMP).
#include <torch/library.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

bool release_workers() {
#if defined(_OPENMP) && (_OPENMP >= 201811 || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9))
  return omp_pause_resource_all(omp_pause_soft) == 0;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) { m.def("release_workers() -> bool", release_workers); }
