/* Flush-to-zero and denormals-are-zero (x86's MXCSR bits FTZ 0x8000 and DAZ 0x0040) on the calling thread and on
 * every thread of an OpenMP team of `threads` (the pool torch's and the kernels' parallel regions run on, kept
 * between regions), so a model's calls do not meet the microcode assists Intel cores take on each denormal
 * operand or result: a chunkwise delta rule's prefill with strong decays ran 3x slower on a Sapphire Rapids host
 * (benchmarks/RESULTS.md). ftz_set(on, threads, was): *was = whether the calling thread had both bits before.
 * Elsewhere than x86 it does nothing (*was = 1: nothing to restore). kernels/fpenv.py scopes it. */

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLAGS 0x8040u

static void apply(int on) {
    const unsigned c = _mm_getcsr();
    _mm_setcsr(on ? (c | FLAGS) : (c & ~FLAGS));
}

void ftz_set(int on, int threads, int *was) {
    *was = (_mm_getcsr() & FLAGS) == FLAGS;
#pragma omp parallel num_threads(threads)
    apply(on);
    apply(on);
}
#else
void ftz_set(int on, int threads, int *was) {
    (void)on, (void)threads;
    *was = 1;
}
#endif
