"""Compile the Triton path's kernels for a GPU without one: Triton's own compiler, TTIR to PTX to a cubin with the
ptxas its wheel ships, for an NVIDIA target (sm_90, H100/H200, unless told). The interpreter runs what the compiler
would refuse (a global that is not constexpr, types that change across a loop, a dot of the wrong shapes); this
catches those here, and says how much shared memory each variant takes.

Run:  python tests/triton_compile.py [--arch 90] [--all]   (TRITON_INTERPRET must be unset: it is dropped here)
Prints one line per variant, `OK name: shared=<bytes>` or `FAIL name: <error>`; exits 1 on a failure.
tests/test_triton.py runs it for the richest variants (every feature, bfloat16 and float32, and the received pass).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton_kernels defines its kernels

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

KERNELS = Path(__file__).resolve().parent.parent / "attnprobe" / "kernel" / "triton_kernels.py"
_spec = importlib.util.spec_from_file_location("triton_kernels", KERNELS)  # by path: no torch, no attnprobe needed,
triton_kernels = importlib.util.module_from_spec(_spec)  # so any venv with triton alone checks a triton version
_spec.loader.exec_module(triton_kernels)

FLOATS = {"scale", "softcap"}


def _source(fn, pointers: dict[str, str], constants: dict) -> ASTSource:
    """An ASTSource of `fn`: pointer arguments typed by `pointers`, `scale`/`softcap` fp32, other arguments i32."""
    signature = {name: "constexpr" if name in constants else "*" + pointers[name] if name in pointers
                 else "fp32" if name in FLOATS else "i32" for name in fn.arg_names}
    return ASTSource(fn, signature, constants)


def forward(dtype: str, dim: int, rows: int, keys: int, features: bool, causal: bool = True,
            need_out: bool = True) -> ASTSource:
    """stats_forward with every feature (or none) on, for inputs of `dtype` and a head block of `dim`."""
    pointers = {"Q": dtype, "K": dtype, "V": dtype, "Out": dtype, "Lse": "fp32", "Stats": "fp32", "Lengths": "i32",
                "Norms": "fp32", "Special": "fp32", "Punct": "fp32", "Ids": "i32", "Sinks": "fp32"}
    constants = dict(CAUSAL=causal, HAS_SPAN=features, HAS_SOFTCAP=features, HAS_SINKS=features, WEIGHTED=features,
                     HAS_SPECIAL=features, HAS_TOKENS=features, NEED_OUT=need_out,
                     PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False, BLOCK_M=rows, BLOCK_N=keys,
                     BLOCK_D=dim)
    return _source(triton_kernels.stats_forward, pointers, constants)


def received(dtype: str, dim: int, rows: int, keys: int) -> ASTSource:
    pointers = {"Q": dtype, "K": dtype, "Lse": "fp32", "Received": "fp32", "Lengths": "i32"}
    constants = dict(CAUSAL=True, HAS_SPAN=True, HAS_SOFTCAP=True, PRECISION="ieee" if dtype == "fp32" else None,
                     UPCAST=False, BLOCK_M=rows, BLOCK_N=keys, BLOCK_D=dim)
    return _source(triton_kernels.received_pass, pointers, constants)


def variants(every: bool) -> dict[str, ASTSource]:
    """The richest variants (the block sizes triton_path._blocks chooses), or with --all more head sizes."""
    found = {"bfloat16, every feature, head 128": forward("bf16", 128, 64, 64, True),
             "float32, every feature, head 128": forward("fp32", 128, 32, 32, True),
             "received, bfloat16, head 128": received("bf16", 128, 64, 64)}
    if every:
        found.update({"bfloat16, plain, head 64": forward("bf16", 64, 64, 64, False),
                      "float16, every feature, head 256": forward("fp16", 256, 64, 64, True),
                      "float32, every feature, head 64": forward("fp32", 64, 64, 64, True),
                      "float32, every feature, head 256": forward("fp32", 256, 16, 32, True),
                      "bfloat16, encoder, no output, head 128": forward("bf16", 128, 64, 64, True, False, False),
                      "received, float32, head 64": received("fp32", 64, 64, 64)})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the NVIDIA compute capability, e.g. 80, 90")
    parser.add_argument("--all", action="store_true", help="more head sizes and dtypes (minutes)")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, source in variants(args.all).items():
        try:
            compiled = triton.compile(source, target=target)
            print(f"OK {name}: shared={compiled.metadata.shared}", flush=True)
        except Exception as err:  # report every variant, then fail
            failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {str(err).strip()[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
