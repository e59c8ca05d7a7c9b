"""The CUDA vector kernels move 16 bytes per load and store (issue 14), read
from the PTX nvcc emits for sm_90; runs wherever nvcc is (CI compiles the CUDA
kernels), no GPU needed. The device script reads the SASS the same way."""

from __future__ import annotations

import os
import shutil

import pytest

from conftest import REPO, load_bench_script

vector_access = load_bench_script("probes/vector_access")

SASS_SAMPLE = """
        Function : _ZN7jaxfuse12_GLOBAL__N_116AddReluVecKernelEv
        /*0080*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0090*/                   LDG.E.128.CONSTANT R8, desc[UR4][R6.64] ;
        /*00f0*/                   STG.E.128 desc[UR4][R12.64], R4 ;
        Function : _ZN7jaxfuse12_GLOBAL__N_113AddReluKernelEv
        /*0080*/                   LDG.E.CONSTANT R4, desc[UR4][R2.64] ;
        /*00f0*/                   STG.E desc[UR4][R12.64], R4 ;
"""


def test_sass_accesses_are_counted_per_kernel():
    rows = dict(vector_access.per_kernel(SASS_SAMPLE, vector_access.SASS_FUNC, vector_access.SASS_ACCESS))
    assert len(rows) == 2
    vec = next(v for k, v in rows.items() if "AddReluVecKernel" in k)
    scalar = next(v for k, v in rows.items() if "AddReluKernel" in k)
    assert vec == {"LDG.E.128.CONSTANT": 2, "STG.E.128": 1}
    assert scalar == {"LDG.E.CONSTANT": 1, "STG.E": 1}


@pytest.fixture(scope="module")
def ptx_rows():
    if not shutil.which("nvcc") or not shutil.which("c++filt"):
        pytest.skip("needs nvcc and c++filt")
    text = vector_access.ptx_text("sm_90", os.path.join(REPO, "csrc", "add_relu_cuda.cu"))
    return vector_access.per_kernel(text, vector_access.PTX_FUNC, vector_access.PTX_ACCESS,
                                    vector_access.PTX_BOUNDARY)


TYPE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def vector_bytes(access: str) -> int:
    """Bytes one PTX access moves: `st.global.v2.f64` -> 16, `ld.global.nc.f32` -> 4."""
    parts = access.split(".")
    lanes = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
    return lanes * TYPE_BYTES[parts[-1][1:]]


def _kernel(rows, name):
    hits = [c for k, c in rows if k == name]
    assert len(hits) == 1, f"{name}: {len(hits)} kernels of that name in the PTX"
    return hits[0]


@pytest.mark.parametrize("op", ["F32Op", "F64Op", "BF16Op", "F16Op", "BF16HwOp", "F16HwOp"])
def test_vector_kernels_load_and_store_16_bytes(ptx_rows, op):
    # Same-shape operands (modes 0, 0): every variant's vector kernel.
    for name, streamed in ((f"AddReluVecKernel<{op}, 0, 0>", False),
                           (f"AddReluVec2Kernel<{op}, 0, 0, false>", False),
                           (f"AddReluVec2Kernel<{op}, 0, 0, true>", True)):
        counts = _kernel(ptx_rows, name)
        wide = {k: v for k, v in counts.items() if vector_bytes(k) > TYPE_BYTES[k.split(".")[-1][1:]]}
        loads = {k: v for k, v in wide.items() if k.startswith("ld.")}
        stores = {k: v for k, v in wide.items() if k.startswith("st.")}
        assert all(vector_bytes(k) == 16 for k in wide), (name, counts)
        assert sum(loads.values()) >= 2 and all(".nc." in k for k in loads), (name, counts)
        assert stores and all((".cs." in k) == streamed for k in stores), (name, counts)
