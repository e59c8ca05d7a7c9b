"""The fused primitive against XLA's own `max(a + b, 0)`: values, rules, lowering, errors."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.ops import kernels as _kernels, lowering as _lowering
from jaxfuse.ops.primitive import add_relu_p

from conftest import TESTS, assert_bitwise_equal, random_operand, skip_without_float16

pytestmark = pytest.mark.exactness

DTYPES = [np.float32, np.float64, jnp.float16, jnp.bfloat16]
DTYPE_IDS = ["f32", "f64", "f16", "bf16"]

# (a shape, b shape): same shape, bias adds, two-sided broadcasts, scalars,
# odd sizes and empty arrays.
SHAPES = [
    ((), ()),
    ((1,), (1,)),
    ((7,), (7,)),
    ((1000003,), (1000003,)),
    ((4, 8), (1, 8)),
    ((1, 8), (4, 8)),
    ((7, 1), (1, 9)),
    ((1, 1), (5, 6)),
    ((2, 3, 5, 7), (1, 1, 1, 7)),
    ((2, 3, 5, 7), (2, 1, 5, 1)),
    ((3, 17, 33), ()),
    ((), (3, 17, 33)),
    ((0,), (0,)),
    ((0, 3), (1, 3)),
    ((4, 0), (4, 1)),
    ((129, 65), (129, 65)),
    ((64, 1000), (1000,)),  # rank promotion: numpy-style bias
]


def x64(dtype):
    return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


def reference(a, b):
    return jax.jit(lambda a, b: jnp.maximum(a + b, 0))(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("a_shape,b_shape", SHAPES, ids=str)
def test_values_bitwise_equal_xla(rng, dtype, a_shape, b_shape):
    with x64(dtype):
        a, b = random_operand(rng, a_shape, dtype), random_operand(rng, b_shape, dtype)
        out = jax.jit(jaxfuse.add_relu)(a, b)
        assert_bitwise_equal(out, reference(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_special_pair(dtype):
    """Each pair of special values, both operand orders, against XLA."""
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 3.5e-45, 65504.0, 7e4])
    with x64(dtype), np.errstate(over="ignore"):  # 7e4 overflows float16 to inf: intended
        a = np.repeat(specials, specials.size).astype(dtype)
        b = np.tile(specials, specials.size).astype(dtype)
        got, want = jax.jit(jaxfuse.add_relu)(a, b), reference(a, b)
        # Same-shape wide types: one NaN operand's bits survive, so match them.
        # With both operands NaN, XLA's choice follows its codegen (the first's
        # targeting AVX2, the second's held to SSE4.2): NaN-ness only.
        strict = np.dtype(dtype) in (np.float32, np.float64)
        both = np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64))
        got, want = np.asarray(got), np.asarray(want)
        assert_bitwise_equal(got[~both], want[~both], nan_bits=strict)
        assert np.isnan(got[both].astype(np.float64)).all() and np.isnan(want[both].astype(np.float64)).all()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_rounding_of_narrow_types_is_done_once(rng, dtype):
    """f16/bf16: sums that round differently if rounded twice or not at all."""
    a = rng.uniform(0.5, 4, size=4096).astype(dtype)
    b = (rng.uniform(-1, 1, size=4096) * 2.0**-9).astype(dtype)
    assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(a, b), reference(a, b))


def test_large_array_uses_all_paths(rng):
    n = (1 << 22) + 5  # large enough for the threaded path, with a ragged tail
    a, b = random_operand(rng, (n,), np.float32), random_operand(rng, (n,), np.float32)
    assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(a, b), reference(a, b))
    m = random_operand(rng, (2048, 2049), np.float32)
    bias = random_operand(rng, (1, 2049), np.float32)
    assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(m, bias), reference(m, bias))


NEEDS_HOOKS = ("needs the CPU kernel built with its test hooks (JAXFUSE_TEST_HOOKS=ON, as "
               "README's test command builds it)")
CHUNK = 1 << 16  # elements per claim in the CPU kernel (csrc/epilogue_cpu.cc, kChunk)


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
@pytest.mark.parametrize("threads,regions", [(0, 0), (0, 3), (0, 7), (1, 2), (1, 5)],
                         ids=["pool", "pool-3regions", "pool-7regions", "caller-alone-2regions",
                              "caller-alone-5regions"])
@pytest.mark.parametrize("streaming", [0, 1], ids=["plain", "streamed"])
def test_work_split_gets_every_element_right(rng, threads, regions, streaming):
    """Chunk counts that split unevenly into regions, ragged tails, rows that
    straddle chunks and the tie output, bit for bit, whatever the split: one
    region per pool thread, more regions than threads (the pool takes some of
    them from the others), and a caller whose helpers are never asked (thread
    cap 1), which must drain every region itself."""
    from jaxfuse.ops import kernels as _kernels
    from jaxfuse.ops.primitive import epilogue_p, epilogue_reference

    if regions == 0 and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: XLA's pool has one thread and the kernel never splits a call")
    module = _kernels._modules["cpu"]
    before = module.settings()
    try:
        module.configure(threads, before["huge_pages"], streaming, before["prefault"])
        module.force_regions_for_tests(regions)
        calls = module.last_split()["calls"]
        sizes = (4 * CHUNK + 1, 5 * CHUNK - 3, 7 * CHUNK + CHUNK // 2)
        for n in sizes:
            a, b = random_operand(rng, (n,), np.float32), random_operand(rng, (n,), np.float32)
            assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(a, b), reference(a, b))
        x = random_operand(rng, (1031, 509), np.float32)  # 9 chunks, the last short; rows across chunk ends
        bias = random_operand(rng, (509,), np.float32)
        assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(x, bias), reference(x, bias))
        h = random_operand(rng, (777, 1030), jnp.bfloat16)
        hb = random_operand(rng, (1030,), jnp.bfloat16)
        assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(h, hb), reference(h, hb))
        s, t = random_operand(rng, (1, 509), np.float32), random_operand(rng, (1, 509), np.float32)
        t[:, ::3] = 0.0
        x[:, ::3] = 0.0  # x * s + t == 0 exactly: ties in every chunk
        params = dict(mean=False, scale=True, residual=False, tie=True, grad_at_zero=0.0)
        out, tie = jax.jit(lambda *o: epilogue_p.bind(*o, **params))(x, s, t)
        want_out, want_tie = jax.jit(lambda *o: epilogue_reference(*o, **params))(x, s, t)
        assert_bitwise_equal(out, want_out)
        np.testing.assert_array_equal(tie, want_tie)
        assert np.asarray(tie).any()
        # Streaming stores come with the AVX2 path (jaxfuse/ops/isa.py: where XLA may use AVX2).
        vector = module.settings()["vector_path"] == "avx2"
        assert module.last_store()["streamed"] == (streaming == 1 and vector)
        # The calls above really were split the way this case asks.
        split = module.last_split()
        assert split["calls"] - calls == len(sizes) + 3
        if threads == 1:
            assert split["workers"] == 1 and split["regions"] == regions
        elif regions:
            assert split["regions"] == regions
        else:
            assert split["workers"] >= 2 and split["regions"] == split["workers"]
    finally:
        module.force_regions_for_tests(0)
        module.configure(before["max_threads"], before["huge_pages"], before["streaming"],
                         before["prefault"])


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
@pytest.mark.parametrize("dtype,per_worker", [(np.float32, 2 * CHUNK), (np.float64, 2 * CHUNK),
                                              (jnp.bfloat16, CHUNK), (jnp.float16, CHUNK)],
                         ids=["float32", "float64", "bfloat16", "float16"])
def test_a_helper_is_asked_only_for_enough_elements(rng, dtype, per_worker):
    """A call is offered to a second thread only when each thread gets
    ``per_worker`` elements: two chunks for the memory-bound 4- and 8-byte
    loops, one for the 2-byte ones (csrc/epilogue_cpu.cc, kMinChunkWide /
    kMinChunkNarrow); either way the values are XLA's."""
    from jaxfuse.ops import kernels as _kernels

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: XLA's pool has one thread and the kernel never splits a call")
    module = _kernels._modules["cpu"]
    fn = jax.jit(jaxfuse.add_relu)
    for n, split in ((2 * per_worker - 1, False), (2 * per_worker, True)):
        a, b = random_operand(rng, (n,), dtype), random_operand(rng, (n,), dtype)
        calls = module.last_split()["calls"]
        assert_bitwise_equal(fn(a, b), reference(a, b))
        after = module.last_split()
        assert after["calls"] - calls == int(split), (n, after)
        if split:
            assert after["workers"] == 2


MIB = 1 << 20


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
def test_reuse_distance_counts_bytes_since_the_output_was_written():
    """The tracker behind JAXFUSE_CPU_STREAMING=auto (csrc/output_reuse.h)
    on the patterns XLA's allocator produces: the same buffer every call, two
    buffers in turn, a block carved from part of an old one, and ranges it no
    longer remembers."""
    from jaxfuse.ops import kernels as _kernels

    distances = _kernels._modules["cpu"].reuse_distances_for_tests
    a, b, c = 1 << 32, (1 << 32) + 64 * MIB, (1 << 32) + 128 * MIB
    # Waiting for each call: the same 8 MiB output, 24 MiB touched per call.
    assert distances([(a, 8 * MIB, 24 * MIB)] * 3) == [-1, 24 * MIB, 24 * MIB]
    # Two calls in flight: two buffers in turn, each written two calls ago.
    assert distances([(a, 8 * MIB, 24 * MIB), (b, 8 * MIB, 24 * MIB)] * 2) == [
        -1, -1, 48 * MIB, 48 * MIB]
    # A smaller block inside an old output, after a call elsewhere: the bytes
    # since that output, not since the call in between.
    assert distances([(a, 8 * MIB, 24 * MIB), (c, MIB, 3 * MIB),
                      (a + 4 * MIB, MIB, 3 * MIB)]) == [-1, -1, 6 * MIB]
    # Overlapping ranges: the latest write to any part counts, and a range
    # partly rewritten keeps its other part.
    assert distances([(a, 8 * MIB, 8 * MIB), (a + 2 * MIB, 8 * MIB, 8 * MIB),
                      (a, 4 * MIB, 4 * MIB), (a + 8 * MIB, 2 * MIB, 2 * MIB)]) == [
        -1, 8 * MIB, 4 * MIB, 6 * MIB]
    # Sixteen ranges are remembered; the seventeenth call back is forgotten.
    ring = [(a + k * MIB, MIB, MIB) for k in range(17)]
    assert distances(ring + [ring[1]])[-1] == 16 * MIB
    assert distances(ring + [ring[0]])[-1] == -1
    assert distances([(a, 0, 0), (a, 0, 0)]) == [-1, -1]  # empty outputs overlap nothing


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
def test_auto_streams_only_outputs_written_well_over_a_cache_ago():
    from jaxfuse.ops import kernels as _kernels

    should_stream = _kernels._modules["cpu"].should_stream
    cache = 32 * MIB
    assert not should_stream(24 * MIB, 24 * MIB, cache)  # the same buffer back: still cached
    assert not should_stream(40 * MIB, 40 * MIB, cache)  # past the cache's size, still found there
    assert should_stream(48 * MIB, 24 * MIB, cache)      # two 24 MiB calls in flight: evicted
    assert not should_stream(-1, 24 * MIB, cache)        # unknown, the call fits the cache
    assert should_stream(-1, 48 * MIB, cache)            # unknown, the call alone overflows it
    assert not should_stream(-1, 0, cache)


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe is mincore(2)")
def test_auto_finds_pages_not_yet_faulted_in():
    """auto never streams into memory fresh from the operating system: the
    first touch zeroes each page through the cache, so plain stores find it."""
    from jaxfuse.ops import kernels as _kernels

    fresh = _kernels._modules["cpu"].fresh_pages_for_tests
    # An anonymous mapping of its own: np.empty may be served from heap memory
    # an earlier test already touched.
    mapping = mmap.mmap(-1, 64 * MIB)
    block = np.frombuffer(mapping, np.uint8)
    try:
        assert fresh(block.ctypes.data, block.nbytes)
        block[:] = 1
        assert not fresh(block.ctypes.data, block.nbytes)
    finally:
        del block
        mapping.close()
    small = np.ones(16, np.float32)
    assert not fresh(small.ctypes.data, small.nbytes)


PREFAULT_CONFIGS = [(True, False), (True, True), (False, True), (False, False)]
PREFAULT_IDS = ["prefault", "prefault-huge", "touch-huge", "touch"]
# Outputs of 8 MiB or more, none ending on a page, a 2 MiB block or a chunk.
PREFAULT_CASES = (((1 << 23) + 5, np.float32), ((1 << 24) - 3 * CHUNK // 2, jnp.bfloat16),
                  ((1 << 22) + 17, np.float64))


def _large_calls(module, rng, threads, regions):
    """(prefaulted, fresh) of each large call, case by case and within a case
    configuration by configuration, each checked against XLA's bits. A case's
    operands and XLA's result are made once for all its configurations (only
    the outputs need to be new, and each call's is), and one case's at a time."""
    seen = []
    for n, dtype in PREFAULT_CASES:
        with x64(dtype):
            a, b = random_operand(rng, (n,), dtype), random_operand(rng, (n,), dtype)
            expected = np.asarray(reference(a, b))
            for prefault, huge in PREFAULT_CONFIGS:
                module.configure(threads, huge, -1, prefault)
                module.force_regions_for_tests(regions)
                out = jax.block_until_ready(jax.jit(jaxfuse.add_relu)(a, b))
                st = module.last_store()  # once the call has run: dispatch is asynchronous
                assert_bitwise_equal(out, expected)
                del out
                want = ("huge" if huge else "small") if prefault and st["fresh_pages"] else ""
                assert st["prefaulted"] == want, (prefault, huge, n, st)
                seen.append((st["prefaulted"], st["fresh_pages"]))
    return seen


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) prefaulting")
@pytest.mark.parametrize("threads,regions", [(0, 0), (1, 0), (0, 5)],
                         ids=["pool", "one-thread", "pool-5regions"])
def test_large_outputs_prefaulted_or_not_are_exact(rng, threads, regions):
    """An output of 8 MiB or more that is not yet faulted in is faulted in by
    the kernel ahead of its loop, 2 MiB at a time, in 4 KiB pages unless huge
    pages are asked for (csrc/epilogue_cpu.cc, "Pages for large outputs"); one
    the allocator hands back already faulted in (heap memory earlier tests
    freed) is left alone. Either way, however the call is split: XLA's bits."""
    module = _kernels._modules["cpu"]
    before = module.settings()
    try:
        _large_calls(module, rng, threads, regions)
        small = random_operand(rng, (1 << 20,), np.float32)  # 4 MiB: always left to the loop
        assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(small, small), reference(small, small))
        assert module.last_store()["prefaulted"] == ""
    finally:
        module.force_regions_for_tests(0)
        module.configure(before["max_threads"], before["huge_pages"], before["streaming"],
                         before["prefault"])


@pytest.mark.skipif(not _kernels.test_hooks(), reason=NEEDS_HOOKS)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) prefaulting")
def test_a_fresh_process_prefaults_its_large_outputs():
    """In a process of its own with glibc's mmap threshold pinned at 1 MiB and
    its heap trimmed above 1 MiB (as benchmarks/probes/peak_rss.py runs), every
    one of these outputs is mapped fresh and unmapped when freed, so each is
    prefaulted as configured. (With the defaults a block the heap can serve is
    served from there, whatever its size.)"""
    import subprocess

    code = (
        "import json, sys, numpy as np\n"
        "sys.path[:0] = sys.argv[1:]\n"
        "import test_primitive as t\n"
        "from jaxfuse.ops import kernels as _kernels\n"
        "seen = t._large_calls(_kernels._modules['cpu'], np.random.default_rng(0), 0, 0)\n"
        "print(json.dumps(seen))\n")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", code, tests_dir, TESTS], capture_output=True,
                          text=True, timeout=600, cwd=tests_dir, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [tuple(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]
    pages = [("huge" if huge else "small") if prefault else ""
             for _ in PREFAULT_CASES for prefault, huge in PREFAULT_CONFIGS]
    assert [p for p, _ in seen] == pages
    # Found fresh wherever it was probed for prefaulting (without prefaulting
    # only auto's stream rule probes, for 4- and 8-byte types).
    assert all(fresh for p, fresh in seen if p)


def test_eager_call_matches(rng):
    a, b = random_operand(rng, (5, 3), np.float32), random_operand(rng, (3,), np.float32)
    assert_bitwise_equal(jaxfuse.add_relu(a, b), reference(a, b))


def test_works_under_disable_jit(rng):
    a, b = random_operand(rng, (4, 3), np.float32), random_operand(rng, (3,), np.float32)
    with jax.disable_jit():
        out = jaxfuse.add_relu(a, b)
        g = jax.grad(lambda a: jnp.sum(jaxfuse.add_relu(a, b, grad_at_zero=0.5)))(a)
    assert_bitwise_equal(out, reference(a, b))
    assert_bitwise_equal(g, jax.grad(lambda a: jnp.sum(jnp.maximum(a + b, 0)))(a))


def test_numpy_inputs_are_canonicalized_like_jnp():
    # float64 numpy data meets float32 jax data: under x32 both are float32, as in jnp
    out = jaxfuse.add_relu(np.ones(3), jnp.ones(3, jnp.float32))
    assert out.dtype == jnp.float32


def test_python_scalars_are_weakly_typed_like_jnp():
    skip_without_float16()
    half = jnp.ones(3, jnp.float16)
    assert (jaxfuse.add_relu(2.0, 3.0) + half).dtype == jnp.float16
    weak = jax.make_jaxpr(lambda x: jaxfuse.add_relu(x, 2.0))(1.0).jaxpr.outvars[0].aval
    assert weak.weak_type


@pytest.mark.parametrize("other", [1.0, 2, np.float32(1.5), jnp.float32(1.5), np.ones(3, np.float32)],
                         ids=["py-float", "py-int", "np-float32", "jnp-float32", "f32-array"])
def test_operands_promote_like_jnp_under_jit_and_grad(rng, other):
    skip_without_float16()
    x = random_operand(rng, (3,), jnp.float16)
    want = jax.jit(lambda x, y: jnp.maximum(x + y, 0))(x, other)
    for f in (jaxfuse.add_relu, jax.jit(jaxfuse.add_relu)):
        got = f(x, other)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert_bitwise_equal(got, want)
    g = jax.grad(lambda x: jnp.sum(jaxfuse.add_relu(x, other).astype(jnp.float32)))(x.astype(jnp.float32))
    assert g.dtype == jnp.float32


def test_python_scalar_operand_takes_array_dtype(rng):
    a = random_operand(rng, (6,), jnp.bfloat16)
    out = jaxfuse.add_relu(a, 1.0)
    assert out.dtype == jnp.bfloat16
    assert_bitwise_equal(out, reference(a, jnp.asarray(1.0, jnp.bfloat16)))


# ------------------------------------------------------------------ abstract eval
def test_abstract_eval_keeps_shape_dtype_and_weak_type():
    def f(x, y):
        return add_relu_p.bind(x, y, grad_at_zero=0.0)
    out = jax.eval_shape(f, jax.ShapeDtypeStruct((4, 1), jnp.bfloat16), jax.ShapeDtypeStruct((1, 5), jnp.bfloat16))
    assert out.shape == (4, 5) and out.dtype == jnp.bfloat16
    weak = jax.make_jaxpr(f)(1.0, 2.0).jaxpr.outvars[0].aval
    assert weak.weak_type, "two weakly typed operands give a weakly typed result, as add does"
    strong = jax.make_jaxpr(f)(1.0, jnp.float32(2.0)).jaxpr.outvars[0].aval
    assert not strong.weak_type


# --------------------------------------------------------------------- gradients
def _tie_inputs(rng, shape):
    a = random_operand(rng, shape, np.float32, specials=False)
    b = -a.copy()  # a + b == 0 exactly on the first half
    half = a.size // 2
    b.reshape(-1)[half:] = random_operand(rng, (a.size - half,), np.float32, specials=False)
    return a, b


@pytest.mark.parametrize(
    "grad_at_zero,reference_fn",
    [(0.0, lambda a, b: jax.nn.relu(a + b)), (0.5, lambda a, b: jnp.maximum(a + b, 0))],
    ids=["relu", "maximum"],
)
def test_grad_matches_both_tie_conventions(rng, grad_at_zero, reference_fn):
    a, b = _tie_inputs(rng, (6, 7))
    w = random_operand(rng, (6, 7), np.float32, specials=False)
    def fused(a, b):
        return jnp.sum(w * jaxfuse.add_relu(a, b, grad_at_zero=grad_at_zero))
    def plain(a, b):
        return jnp.sum(w * reference_fn(a, b))
    got = jax.jit(jax.grad(fused, (0, 1)))(a, b)
    want = jax.jit(jax.grad(plain, (0, 1)))(a, b)
    for g, r in zip(got, want, strict=False):
        assert_bitwise_equal(g, r)
    # the tie convention really shows: at exact ties the gradient is g * w
    ties = (a + b) == 0
    assert ties.sum() >= a.size // 2
    np.testing.assert_array_equal(np.asarray(got[0])[ties], grad_at_zero * w[ties])


@pytest.mark.parametrize("grad_at_zero", [0.0, 0.5])
def test_grad_through_bias_broadcast_and_specials(rng, grad_at_zero):
    x = random_operand(rng, (16, 9), np.float32)
    bias = random_operand(rng, (9,), np.float32)
    spelled = jax.nn.relu if grad_at_zero == 0.0 else (lambda y: jnp.maximum(y, 0))
    def fused(x, b):
        return jnp.sum(jaxfuse.add_relu(x, b, grad_at_zero=grad_at_zero) ** 2)
    def plain(x, b):
        return jnp.sum(spelled(x + b) ** 2)
    got = jax.jit(jax.grad(fused, (0, 1)))(x, bias)
    want = jax.jit(jax.grad(plain, (0, 1)))(x, bias)
    for g, r in zip(got, want, strict=False):
        assert_bitwise_equal(g, r)


def test_jacfwd_and_jacrev(rng):
    a, b = _tie_inputs(rng, (3, 4))
    for jac in (jax.jacfwd, jax.jacrev):
        got = jac(lambda a: jaxfuse.add_relu(a, b, grad_at_zero=0.5))(a)
        want = jac(lambda a: jnp.maximum(a + b, 0))(a)
        assert_bitwise_equal(got, want)
        got = jac(lambda b: jaxfuse.add_relu(a, b))(b)
        want = jac(lambda b: jax.nn.relu(a + b))(b)
        assert_bitwise_equal(got, want)


def test_second_order_grad_is_zero_like_relu(rng):
    a = random_operand(rng, (5,), np.float32, specials=False)
    h = jax.hessian(lambda a: jnp.sum(jaxfuse.add_relu(a, a) * a))(a)
    want = jax.hessian(lambda a: jnp.sum(jax.nn.relu(a + a) * a))(a)
    np.testing.assert_array_equal(h, want)


# ---------------------------------------------------------------------- batching
@pytest.mark.parametrize(
    "in_axes,a_shape,b_shape",
    [
        ((0, 0), (5, 3, 4), (5, 3, 4)),
        ((1, None), (3, 5, 4), (3, 4)),
        ((None, 2), (3, 4), (3, 4, 5)),
        ((0, None), (5, 3, 4), (1, 4)),
        ((2, 0), (3, 4, 5), (5, 1, 4)),
        ((0, None), (5, 3), ()),
        ((0, 0), (5,), (5,)),
        ((None, 0), (3, 4), (5,)),
    ],
    ids=str,
)
def test_vmap(rng, in_axes, a_shape, b_shape):
    a, b = random_operand(rng, a_shape, np.float32), random_operand(rng, b_shape, np.float32)
    got = jax.jit(jax.vmap(jaxfuse.add_relu, in_axes=in_axes))(a, b)
    want = jax.vmap(lambda a, b: jnp.maximum(a + b, 0), in_axes=in_axes)(a, b)
    assert_bitwise_equal(got, want)
    # the batching rule re-binds the fused op rather than looping
    jaxpr = jax.make_jaxpr(jax.vmap(jaxfuse.add_relu, in_axes=in_axes))(a, b)
    prims = [e.primitive for e in jaxpr.eqns]
    assert prims.count(add_relu_p) == 1 and not any(p.name in ("scan", "while") for p in prims)


def test_vmap_of_grad_and_nested_vmap(rng):
    a, b = _tie_inputs(rng, (4, 6))
    def f(a, b):
        return jnp.sum(jaxfuse.add_relu(a, b, grad_at_zero=0.5) * a)
    def g(a, b):
        return jnp.sum(jnp.maximum(a + b, 0) * a)
    assert_bitwise_equal(jax.vmap(jax.grad(f))(a, b), jax.vmap(jax.grad(g))(a, b))
    nested = jax.vmap(jax.vmap(jaxfuse.add_relu, in_axes=(0, None)), in_axes=(None, 0))
    assert_bitwise_equal(nested(a[0], b), jax.vmap(jax.vmap(lambda x, y: jnp.maximum(x + y, 0), (0, None)), (None, 0))(a[0], b))


# ---------------------------------------------------------------------- lowering
def test_cpu_kernel_is_built_and_registered():
    k = jaxfuse.kernels()
    assert set(k) == {"cpu", "cuda"}
    assert k["cpu"] is True, f"the CPU kernel must be built here: {jaxfuse.ops.kernels.why_not('cpu')}"


def test_lowered_module_holds_our_custom_call(rng):
    a, b = random_operand(rng, (4, 8), np.float32), random_operand(rng, (8,), np.float32)
    text = jax.jit(jaxfuse.add_relu).lower(a, b).as_text()
    assert "stablehlo.custom_call @jaxfuse_add_relu" in text
    assert "stablehlo.maximum" not in text
    compiled = jax.jit(jaxfuse.add_relu).lower(a, b).compile().as_text()
    assert "jaxfuse_add_relu" in compiled


def test_disabled_kernels_lower_to_xla_and_stay_quiet(rng):
    a, b = random_operand(rng, (33, 5), np.float32), random_operand(rng, (1, 5), np.float32)
    with _lowering.kernels_disabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = jax.jit(lambda a, b: jaxfuse.add_relu(a, b))
        text = f.lower(a, b).as_text()
        out = f(a, b)
    assert "custom_call" not in text and "stablehlo.maximum" in text
    assert_bitwise_equal(out, reference(a, b))
    assert not [w for w in caught if "jaxfuse" in str(w.message)]  # asked for: nothing to say


def test_missing_kernel_warns_once_at_the_users_line(rng, monkeypatch):
    a, b = random_operand(rng, (33, 5), np.float32), random_operand(rng, (1, 5), np.float32)
    monkeypatch.setattr(jaxfuse.ops.kernels, "why_not", lambda p: "not built (test)")
    monkeypatch.setattr(_lowering, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.jit(lambda a, b: jaxfuse.add_relu(a, b)).lower(a, b).as_text()  # <site>
        jax.jit(lambda a, b: jaxfuse.add_relu(b, a)).lower(a, b)
    assert "custom_call" not in text and "stablehlo.maximum" in text
    hits = [w for w in caught if "jaxfuse: no kernel for cpu (not built (test))" in str(w.message)]
    assert len(hits) == 1, [str(w.message) for w in caught]
    line = next(i + 1 for i, text in enumerate(open(__file__).read().splitlines()) if text.endswith("# <site>"))
    assert (hits[0].filename, hits[0].lineno) == (__file__, line)


def test_other_platforms_lower_to_the_fallback():
    a = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = jax.jit(jaxfuse.add_relu).trace(a, a).lower(lowering_platforms=("tpu",)).as_text()
    assert "custom_call" not in text and "stablehlo.maximum" in text


def test_grad_lowering_still_uses_kernel(rng):
    a, b = random_operand(rng, (4, 8), np.float32), random_operand(rng, (4, 8), np.float32)
    text = jax.jit(jax.grad(lambda a: jnp.sum(jaxfuse.add_relu(a, b)))).lower(a).as_text()
    assert "@jaxfuse_add_relu" in text


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "a,b,exc,words",
    [
        (np.ones(3, np.int32), np.ones(3, np.int32), TypeError, ["int32", "not served"]),
        (np.ones(3, np.complex64), np.ones(3, np.complex64), TypeError, ["complex64"]),
        (np.ones(3, bool), np.ones(3, bool), TypeError, ["bool"]),
        (np.ones((3, 4), np.float32), np.ones((3, 5), np.float32), ValueError, ["(3, 4)", "(3, 5)"]),
        (np.ones((2, 3), np.float32), np.ones((4,), np.float32), ValueError, ["do not broadcast"]),
    ],
    ids=["int", "complex", "bool", "shape", "rank-promoted-shape"],
)
def test_bad_input_raises_at_trace_time(a, b, exc, words):
    with pytest.raises(exc) as info:
        jax.make_jaxpr(jaxfuse.add_relu)(a, b)
    for w in words:
        assert w in str(info.value)


def test_primitive_rejects_unequal_ranks():
    with pytest.raises(ValueError, match="equal rank"):
        jax.make_jaxpr(lambda a, b: add_relu_p.bind(a, b, grad_at_zero=0.0))(
            np.ones((2, 3), np.float32), np.ones((3,), np.float32)
        )


@pytest.mark.parametrize("g", [-0.1, 1.5, "relu", None])
def test_bad_grad_at_zero(g):
    with pytest.raises(ValueError, match="grad_at_zero"):
        jaxfuse.add_relu(np.ones(2, np.float32), np.ones(2, np.float32), grad_at_zero=g)
