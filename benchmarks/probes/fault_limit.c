// The limit for `out = max(a + b, 0)` over float32 when `out` is fresh memory
// each call, as XLA:CPU hands a large output (glibc maps every block of 32 MiB
// or more with mmap and unmaps it when freed), against a buffer reused call
// after call. The loop is the kernel's in spirit (plain stores, 2^16-element
// chunks, one contiguous region per thread); what varies is how the output's
// pages come to exist:
//
//   reused      one buffer, faulted in once before timing
//   fresh4k     a new mapping each call, 4 KiB page faults on first touch
//   huge        a new mapping advised MADV_HUGEPAGE, 2 MiB faults
//   populate    a new mapping, MADV_POPULATE_WRITE of the whole range first
//   popregion   a new mapping, each thread MADV_POPULATE_WRITE of its own
//               region before its loop
//   popchunk    a new mapping, MADV_POPULATE_WRITE of each 2^16-element chunk
//               just before the loop writes it (the zeroed lines still cached)
//   pop2m       the same, 2 MiB at a time
//   hugepop     MADV_HUGEPAGE, then MADV_POPULATE_WRITE of each chunk
//
// Per mode: median ms per call over the calls, minor faults per call
// (getrusage, the process's), and the /proc/vmstat counters thp_fault_alloc,
// thp_fault_fallback and compact_stall per call (system-wide).
//
//   cc -O2 -mavx2 -pthread benchmarks/probes/fault_limit.c -o fault_limit
// A gap (milliseconds slept after each call, outside the timing) lets the
// system do what it does with freed memory between calls, as a program that
// calls once in a while sees.
//
//   cc -O2 -mavx2 -pthread benchmarks/probes/fault_limit.c -o fault_limit
//   ./fault_limit LOG2 [THREADS] [CALLS] [MODES] [GAP_MS]   e.g. ./fault_limit 24 2 15
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

enum { kChunk = 1 << 16 };
static float *g_a, *g_b, *g_out;
static long g_n;
static int g_threads;
static long g_pop;  // bytes populated ahead at a time: 0 none, -1 the thread's region

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static long vmstat(const char* key) {
  FILE* f = fopen("/proc/vmstat", "r");
  char k[128];
  long v = 0, got = -1;
  while (f && fscanf(f, "%127s %ld", k, &v) == 2) {
    if (strcmp(k, key) == 0) { got = v; break; }
  }
  if (f) fclose(f);
  return got;
}

static long minflt(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

static void* work(void* arg) {
  long t = (long)arg;
  long nchunks = (g_n + kChunk - 1) / kChunk;
  long lo = nchunks * t / g_threads, hi = nchunks * (t + 1) / g_threads;
  uintptr_t popped = 0;  // populated up to here
  for (long c = lo; c < hi; ++c) {
    long i0 = c * kChunk, i1 = i0 + kChunk < g_n ? i0 + kChunk : g_n;
    uintptr_t e = (uintptr_t)(g_out + i1);
    if (g_pop != 0 && popped < e) {
      uintptr_t p = popped > (uintptr_t)(g_out + i0) ? popped : (uintptr_t)(g_out + i0);
      p &= ~(uintptr_t)4095;
      uintptr_t end = g_pop < 0 ? (uintptr_t)(g_out + (hi * kChunk < g_n ? hi * kChunk : g_n))
                                : p + (uintptr_t)g_pop;
      if (end < e) end = e;
      end = (end + 4095) & ~(uintptr_t)4095;
      madvise((void*)p, end - p, MADV_POPULATE_WRITE);
      popped = end;
    }
    for (long i = i0; i < i1; ++i) {
      float v = g_a[i] + g_b[i];
      g_out[i] = v > 0 ? v : 0;
    }
  }
  return NULL;
}

static void run(void) {
  pthread_t th[64];
  for (long t = 1; t < g_threads; ++t) pthread_create(&th[t], NULL, work, (void*)t);
  work((void*)0);
  for (long t = 1; t < g_threads; ++t) pthread_join(th[t], NULL);
}

static int cmp(const void* x, const void* y) {
  double a = *(const double*)x, b = *(const double*)y;
  return (a > b) - (a < b);
}

int main(int argc, char** argv) {
  int log2 = argc > 1 ? atoi(argv[1]) : 24;
  g_threads = argc > 2 ? atoi(argv[2]) : 2;
  int calls = argc > 3 ? atoi(argv[3]) : 15;
  const char* modes =
      argc > 4 ? argv[4] : "reused,fresh4k,huge,populate,popregion,popchunk,pop2m,hugepop";
  int gap_ms = argc > 5 ? atoi(argv[5]) : 0;
  g_n = 1L << log2;
  size_t bytes = g_n * sizeof(float);
  g_a = aligned_alloc(64, bytes);
  g_b = aligned_alloc(64, bytes);
  for (long i = 0; i < g_n; ++i) {
    g_a[i] = (float)((i * 2654435761u) % 1000) / 500.f - 1.f;
    g_b[i] = (float)((i * 40503u) % 1000) / 500.f - 1.f;
  }
  float* reused = aligned_alloc(64, bytes);
  memset(reused, 1, bytes);
  char list[256];
  snprintf(list, sizeof list, "%s", modes);
  printf("2^%d float32, %d thread(s), %d calls a mode, %d ms between calls\n", log2, g_threads,
         calls, gap_ms);
  for (char* mode = strtok(list, ","); mode; mode = strtok(NULL, ",")) {
    double* ms = calloc(calls, sizeof(double));
    long f0 = minflt(), h0 = vmstat("thp_fault_alloc"), fb0 = vmstat("thp_fault_fallback"),
         c0 = vmstat("compact_stall");
    for (int k = 0; k < calls; ++k) {
      double t0 = now();
      void* m = NULL;
      size_t len = bytes + 4096;  // as glibc maps it: a header page's worth more
      g_pop = 0;
      if (strcmp(mode, "reused") == 0) {
        g_out = reused;
      } else {
        m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        g_out = (float*)((char*)m + 64);
        if (strncmp(mode, "huge", 4) == 0) {
          uintptr_t lo = ((uintptr_t)g_out + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1);
          uintptr_t hi = ((uintptr_t)g_out + bytes) & ~(uintptr_t)((2u << 20) - 1);
          if (hi > lo) madvise((void*)lo, hi - lo, MADV_HUGEPAGE);
        }
        if (strcmp(mode, "populate") == 0) madvise(m, len, MADV_POPULATE_WRITE);
        if (strcmp(mode, "popregion") == 0) g_pop = -1;
        if (strcmp(mode, "popchunk") == 0 || strcmp(mode, "hugepop") == 0) g_pop = kChunk * 4;
        if (strcmp(mode, "pop2m") == 0) g_pop = 2 << 20;
      }
      run();
      if (m) munmap(m, len);
      ms[k] = 1e3 * (now() - t0);
      if (gap_ms > 0) usleep(gap_ms * 1000);
    }
    long f1 = minflt(), h1 = vmstat("thp_fault_alloc"), fb1 = vmstat("thp_fault_fallback"),
         c1 = vmstat("compact_stall");
    qsort(ms, calls, sizeof(double), cmp);
    printf("%-9s median %7.2f ms (min %7.2f max %7.2f)  %6.2f GB/s  faults/call %7.1f  "
           "thp_alloc/call %5.1f  fallback/call %5.1f  compact_stall/call %5.1f\n",
           mode, ms[calls / 2], ms[0], ms[calls - 1], 3.0 * bytes / ms[calls / 2] / 1e6,
           (double)(f1 - f0) / calls, (double)(h1 - h0) / calls, (double)(fb1 - fb0) / calls,
           (double)(c1 - c0) / calls);
    free(ms);
  }
  return 0;
}
