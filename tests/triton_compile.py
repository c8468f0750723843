"""Compile the Triton path's kernels for a GPU without one: Triton's own compiler, TTIR to PTX to a cubin with the
ptxas its wheel ships, for an NVIDIA target (sm_90, H100/H200, unless told). The interpreter runs what the compiler
would refuse (a global that is not constexpr, types that change across a loop, a dot of the wrong shapes); this
catches those here, says how much shared memory each variant takes, and measures each variant's machine code: the
registers and spill bytes ptxas reports, and the SASS instructions of the kernel's main loop, which each thread runs
once per tile of keys (a warp issues each instruction once for its 32 threads).

Run:  python tests/triton_compile.py [--arch 90] [--all]   (TRITON_INTERPRET must be unset: it is dropped here)
Prints one line per variant, `OK name: shared=<bytes> registers=<n> spills=<bytes> loop=<instructions> ...` or
`FAIL name: <error>`; exits 1 on a failure. tests/test_triton.py runs it for the default variants and holds the
"default features, bfloat16, head 64" variant (what `attnprobe analyze` runs by default on a bfloat16 model) to
TARGETS.

How the main loop is found (`loops`): nvdisasm prints the SASS with its branch labels; a loop is a branch back to an
earlier label, its body the instructions from that label to the branch. The main loop is the first loop of more than
one instruction (after EXIT the listing ends in a branch to itself, no loop): stats_forward's loop over the interior
tiles of keys (unmasked) comes first in the source and in the SASS, before the masked diagonal and edge tiles and the
positional loops (ptxas keeps the source's order of loops); received_pass's over the blocks of rows. `loop` is
its body; `path` the fewest instructions from its head to its back branch (every conditional block skipped: a
tile's common path); `loops` every loop's body, in program order. The launch's defaults: 4 warps, 3 stages, and the
JIT's divisibility-by-16 hints on the pointers, the strides and the head size (those of the benchmark's shapes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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
DIVISIBLE = re.compile(r"stride_(?!tok)\w+|dim")  # integer arguments the JIT sees as multiples of 16 (benchmark)
TARGET_VARIANT = "default features, bfloat16, head 64"
TARGETS = {"registers": 168, "spills": 0, "loop": 500}  # TARGET_VARIANT's goal: the most of each
REACHED = {"registers": 167, "spills": 0, "loop": 467}  # triton 3.9 (3.6: 167, 0, 418): TARGETS met
MMA = re.compile(r"\b(HGMMA|HMMA)\b")
LOCAL = re.compile(r"\b(LDL|STL)\b")


def _source(fn, pointers: dict[str, str], constants: dict) -> ASTSource:
    """An ASTSource of `fn`: pointer arguments typed by `pointers`, `scale`/`softcap` fp32, other arguments i32;
    the pointers, strides and head size hinted divisible by 16 as the JIT finds them."""
    signature = {name: "constexpr" if name in constants else "*" + pointers[name] if name in pointers
                 else "fp32" if name in FLOATS else "i32" for name in fn.arg_names}
    attrs = {(k,): [["tt.divisibility", 16]] for k, name in enumerate(fn.arg_names)
             if name not in constants and (name in pointers or DIVISIBLE.fullmatch(name))}
    return ASTSource(fn, signature, constants, attrs)


def forward(dtype: str, dim: int, rows: int, keys: int, features: bool, causal: bool = True,
            need_out: bool = True, **chosen: bool) -> ASTSource:
    """stats_forward with every feature (or none) on, for inputs of `dtype` and a head block of `dim`; `chosen`
    overrides single features (HAS_SPECIAL=True, ...)."""
    pointers = {"Q": dtype, "K": dtype, "V": dtype, "Out": dtype, "Lse": "fp32", "Stats": "fp32", "Lengths": "i32",
                "Norms": "fp32", "Weights": "fp32", "Feats": dtype, "Sinks": "fp32"}
    constants = dict(CAUSAL=causal, HAS_SPAN=features, HAS_SOFTCAP=features, HAS_SINKS=features, WEIGHTED=features,
                     HAS_FEATS=features, NEED_OUT=need_out, EVEN_D=True, WIDE=False,
                     PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False, BLOCK_M=rows, BLOCK_N=keys,
                     BLOCK_D=dim)
    constants.update(chosen)
    return _source(triton_kernels.stats_forward, pointers, constants)


def received(dtype: str, dim: int, rows: int, keys: int, features: bool = True) -> ASTSource:
    pointers = {"Q": dtype, "K": dtype, "Lse": "fp32", "Received": "fp32", "Lengths": "i32"}
    constants = dict(CAUSAL=True, HAS_SPAN=features, HAS_SOFTCAP=features, EVEN_D=True,
                     PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False, BLOCK_M=rows, BLOCK_N=keys,
                     BLOCK_D=dim)
    return _source(triton_kernels.received_pass, pointers, constants)


def duplicate(dtype: str, dim: int, rows: int, keys: int, features: bool = True) -> ASTSource:
    pointers = {"Q": dtype, "K": dtype, "Lse": "fp32", "Duplicate": "fp32", "Positions": "i32", "Groups": "i32",
                "Tiles": "i32"}
    constants = dict(CAUSAL=True, HAS_SPAN=features, HAS_SOFTCAP=features,
                     PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False, BLOCK_M=rows, BLOCK_N=keys,
                     BLOCK_D=dim)
    return _source(triton_kernels.duplicate_pass, pointers, constants)


def variants(every: bool) -> dict[str, ASTSource]:
    """The richest variants and analyze's default (the block sizes triton_path._blocks chooses), or with --all more
    head sizes and the lighter ones."""
    found = {TARGET_VARIANT: forward("bf16", 64, 64, 64, False, HAS_FEATS=True),
             "bfloat16, every feature, head 128": forward("bf16", 128, 64, 64, True),
             "float32, every feature, head 128": forward("fp32", 128, 32, 32, True),
             "received, bfloat16, head 128": received("bf16", 128, 64, 64),
             "duplicate, bfloat16, head 128": duplicate("bf16", 128, 64, 64)}
    if every:
        found.update({"bfloat16, plain, head 64": forward("bf16", 64, 64, 64, False),
                      "value-weighted + default features, bfloat16, head 64": forward(
                          "bf16", 64, 64, 64, False, HAS_FEATS=True, WEIGHTED=True),
                      "default features, float16, head 128": forward("fp16", 128, 64, 64, False, HAS_FEATS=True),
                      "bfloat16, every feature, head 64": forward("bf16", 64, 64, 64, True),
                      "float16, every feature, head 256": forward("fp16", 256, 64, 64, True),
                      "float32, every feature, head 64": forward("fp32", 64, 64, 64, True),
                      "float32, every feature, head 256": forward("fp32", 256, 16, 32, True),
                      "bfloat16, encoder, no output, head 128": forward("bf16", 128, 64, 64, True, False, False),
                      "received, bfloat16, head 64": received("bf16", 64, 64, 64, False),
                      "duplicate, float32, head 64": duplicate("fp32", 64, 64, 64),
                      "received, float32, head 64": received("fp32", 64, 64, 64)})
    return found


def launch_options(source: ASTSource) -> dict:
    """triton_path's launch options for a variant: 4 warps, FP fusion, 3 stages (2 for stats_forward over 128
    channels: triton_path.stages), and stats_forward's registers capped at 168 for 16-bit heads of up to 64 channels
    without value weighting (triton_path.register_cap)."""
    constant = {source.fn.arg_names[k[0]]: value for k, value in source.constants.items()}
    options = {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": True}
    if source.fn.__name__ == "stats_forward":
        options["num_stages"] = 2 if constant["BLOCK_D"] > 128 else 3
        if source.signature["Q"] in ("*bf16", "*fp16") and constant["BLOCK_D"] <= 64 and not constant["WEIGHTED"]:
            options["maxnreg"] = 168
    return options


def tools(arch: int) -> tuple[str, str] | None:
    """(ptxas, nvdisasm) of Triton's wheel for `arch`, or None where the wheel has none."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch).path
    except Exception:  # another triton layout: no counts, the compile check still runs
        return None
    nvdisasm = Path(ptxas).parent / "nvdisasm"
    return (ptxas, str(nvdisasm)) if nvdisasm.exists() else None


def resources(ptxas: str, ptx: str, arch: int) -> dict[str, int]:
    """Registers per thread and spill bytes (stores + loads) as ptxas -v reports them for Triton's PTX."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}",
                               str(source), "-o", str(Path(folder) / "kernel.o")], capture_output=True, text=True,
                              check=True)
    log = done.stdout + done.stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return {"registers": registers, "spills": spills}


@dataclass
class Loop:
    body: int  # instructions from the loop's head label to its back branch, both included
    path: int  # the fewest of them from head to back branch (forward branches taken where they skip)
    mma: int  # tensor-core instructions in the body (HGMMA on sm_90, HMMA on sm_80; none for IEEE float32)
    local: int  # local-memory loads and stores in the body (LDL, STL: spilled registers)


def loops(sass: str) -> list[Loop]:
    """Every loop of nvdisasm's listing (a branch back to an earlier label), in program order; NOPs not counted."""
    code, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(code)
        elif re.match(r"^/\*[0-9a-f]+\*/", line.strip()):
            text = line.strip().split("*/", 1)[1].strip().rstrip(";").strip()
            if not text.startswith("NOP"):
                code.append(text)
    found = []
    for end, text in enumerate(code):
        target = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), end + 1) <= end:
            start = labels[target.group(1)]
            found.append(Loop(end - start + 1, _shortest(code, labels, start, end),
                              sum(1 for x in code[start:end + 1] if MMA.search(x)),
                              sum(1 for x in code[start:end + 1] if LOCAL.search(x))))
    return found


def _shortest(code: list[str], labels: dict[str, int], start: int, end: int) -> int:
    """The fewest instructions on a path from code[start] to code[end] through forward edges."""
    best = {start: 1}
    for k in range(start, end):
        if k not in best:
            continue
        text = code[k]
        branch = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", text)
        unconditional = branch and not text.startswith("@")
        nexts = [] if unconditional or text.startswith("EXIT") else [k + 1]
        if branch and start < labels.get(branch.group(1), -1) <= end:
            nexts.append(labels[branch.group(1)])
        for j in nexts:
            best[j] = min(best.get(j, 1 << 30), best[k] + 1)
    return best.get(end, 0)


def measure(compiled, arch: int) -> str:
    """`registers=... spills=... loop=... path=... loops=[...]` of a compiled kernel ('' without the tools)."""
    counts = counted(compiled, arch)
    if counts is None:
        return ""
    return (f" registers={counts['registers']} spills={counts['spills']} loop={counts['loop']} path={counts['path']} "
            f"mma={counts['mma']} loop_spills={counts['loop_spills']} loops={counts['loops']}")


def counted(compiled, arch: int) -> dict | None:
    """A compiled kernel's registers, spill bytes and main loop (instructions per tile, shortest path, tensor-core
    and local-memory instructions, every loop's length); None without ptxas and nvdisasm."""
    found = tools(arch)
    if found is None:
        return None
    ptxas, nvdisasm = found
    counts = resources(ptxas, compiled.asm["ptx"], arch)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    every = loops(sass)
    main = next((loop for loop in every if loop.body > 1), None)
    loop, path, mma, local = (main.body, main.path, main.mma, main.local) if main else (0, 0, 0, 0)
    return {**counts, "loop": loop, "path": path, "mma": mma, "loop_spills": local, "loops": [x.body for x in every]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the NVIDIA compute capability, e.g. 80, 90")
    parser.add_argument("--all", action="store_true", help="more head sizes and dtypes (minutes)")
    parser.add_argument("--json", help="also write every variant's counts, the targets and triton's version here "
                        "(make figures reads it)")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed, found = 0, {}
    for name, source in variants(args.all).items():
        try:
            compiled = triton.compile(source, target=target, options=launch_options(source))
            counts = counted(compiled, args.arch)
            found[name] = {"shared": compiled.metadata.shared, **(counts or {})}
            print(f"OK {name}: shared={compiled.metadata.shared}{measure(compiled, args.arch)}", flush=True)
        except Exception as err:  # report every variant, then fail
            failed += 1
            found[name] = {"error": f"{type(err).__name__}: {str(err).strip()[:200]}"}
            print(f"FAIL {name}: {type(err).__name__}: {str(err).strip()[:2000]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "targets": TARGETS,
                                               "reached": REACHED, "variants": found}, indent=1), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
