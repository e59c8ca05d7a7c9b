// What a 2 MiB huge page costs to fault in, call after call, depending on
// which CPU freed the previous call's pages and which CPU faults the next
// ones in: the mechanism behind issue 46 (benchmarks/results/notes/2026-12-04.md).
//
// Each call maps a fresh block as glibc maps a large output (mmap), advises
// its 2 MiB-aligned interior MADV_HUGEPAGE (or not), faults it in with
// MADV_POPULATE_WRITE on a thread pinned to FAULT_CPU, writes it, and unmaps
// it from the main thread, pinned to FREE_CPU. It prints, per call, the
// faulting thread's CPU time per MiB (CLOCK_THREAD_CPUTIME_ID: time it was
// not running does not count). The kernel keeps a freed huge page on the
// freeing CPU's per-CPU free list, so when the next fault comes from the
// other CPU it takes one from elsewhere.
//
//   cc -O2 -pthread benchmarks/probes/huge_page_recycling.c -o huge_page_recycling
//   ./huge_page_recycling LOG2 CALLS FREE_CPU FAULT_CPU [HUGE=1]
//   e.g. ./huge_page_recycling 23 20 0 0; ./huge_page_recycling 23 20 0 1
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static long ns(clockid_t c) {
  struct timespec t;
  clock_gettime(c, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static char* g_lo;
static size_t g_len;
static int g_cpu;
static long g_cost;

static void* fault_in(void* unused) {
  (void)unused;
  pin(g_cpu);
  long c0 = ns(CLOCK_THREAD_CPUTIME_ID);
  madvise(g_lo, g_len, MADV_POPULATE_WRITE);
  g_cost = ns(CLOCK_THREAD_CPUTIME_ID) - c0;
  memset(g_lo, 1, g_len);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s LOG2 CALLS FREE_CPU FAULT_CPU [HUGE=1]\n", argv[0]);
    return 2;
  }
  int log2 = atoi(argv[1]), calls = atoi(argv[2]), free_cpu = atoi(argv[3]);
  g_cpu = atoi(argv[4]);
  int huge = argc > 5 ? atoi(argv[5]) : 1;
  pin(free_cpu);
  size_t bytes = 4UL << log2;  // float32 elements
  for (int k = 0; k < calls; ++k) {
    size_t len = bytes + 4096;
    char* m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uintptr_t lo = ((uintptr_t)m + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1);
    uintptr_t hi = ((uintptr_t)m + len) & ~(uintptr_t)((2u << 20) - 1);
    if (huge) madvise((void*)lo, hi - lo, MADV_HUGEPAGE);
    g_lo = (char*)lo;
    g_len = hi - lo;
    pthread_t t;
    pthread_create(&t, NULL, fault_in, NULL);
    pthread_join(t, NULL);
    munmap(m, len);
    printf("%.0f ", g_cost / 1e3 / ((hi - lo) / 1048576.0));
  }
  printf(" us CPU/MiB (%s pages, freed on cpu %d, faulted on cpu %d)\n", huge ? "huge" : "4 KiB",
         free_cpu, g_cpu);
  return 0;
}
