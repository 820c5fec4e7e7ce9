"""The split-K kernel's table configs built for an H100/H200 (sm_90) without a GPU: Triton's own
compiler and ptxas, as on the GPU machine, in a child process (the kernels are interpreted in this
one). Each must build without spilling and fit two programs on one SM (`PROGRAMS_PER_SM`: 227 KB
of shared memory, 64K registers), as `pick_config` assumes."""
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kernels.small_gemm import PROGRAMS_PER_SM, TILES

SM90_SHARED_BYTES = 227 * 1024
SM90_REGISTERS = 64 * 1024
POINTERS = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "part_ptr", "count_ptr")
UNIT_STRIDES = ("stride_xk", "stride_wk", "stride_on")
ROOT = Path(__file__).resolve().parents[2]


def build(rows: int, even_k: bool, bias: bool, dtype: str) -> dict:
    """Compile TILES[rows] for sm_90 (in a process that does not interpret Triton): its shared
    memory, registers and stack a thread, and whether it took wgmma."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.small_gemm import _splitk_gemm_kernel

    cfg = TILES[rows]
    names = list(inspect.signature(_splitk_gemm_kernel.fn).parameters)
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "EVEN_K": even_k,
                  "HAS_BIAS": bias, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    constexprs |= dict.fromkeys(UNIT_STRIDES, 1)  # what the launcher specializes for contiguous rows
    signature = {n: "constexpr" if n in constexprs else "*fp32" if n == "part_ptr" else "*i32" if n == "count_ptr"
                 else f"*{dtype}" if n in POINTERS else "i32" for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n in POINTERS or n in ("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om")}
    src = ASTSource(fn=_splitk_gemm_kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {"shared": kernel.metadata.shared, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "wgmma": "wgmma" in kernel.asm["ptx"]}


def _build_in_child(rows: int, even_k: bool, bias: bool, dtype: str) -> dict:
    code = (f"import json, test_small_gemm_build as t; "
            f"print(json.dumps(t.build({rows}, {even_k}, {bias}, {dtype!r})))")
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rows", sorted(TILES))
def test_table_configs_build_for_sm90_two_programs_per_sm(rows):
    cfg = TILES[rows]
    got = _build_in_child(rows, even_k=True, bias=False, dtype="bf16")
    assert got["wgmma"] == (cfg.block_m >= 64)  # Hopper's tensor-core path where the tile allows it
    assert got["stack"] == 0, f"{cfg} spills {got['stack']} bytes a thread"
    assert PROGRAMS_PER_SM * got["shared"] <= SM90_SHARED_BYTES
    assert PROGRAMS_PER_SM * got["registers"] * 32 * cfg.num_warps <= SM90_REGISTERS


@pytest.mark.parametrize("even_k, bias, dtype", [(False, True, "bf16"), (True, False, "fp32")])
def test_the_other_variants_build(even_k, bias, dtype):
    """A short last K step and a bias; float32 (IEEE products)."""
    assert _build_in_child(max(TILES), even_k, bias, dtype)["stack"] == 0
