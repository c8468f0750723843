"""The Triton path: the attention output, each row's logsumexp and every row statistic from one Triton kernel
(kernel/triton_kernels.py) that forms p_ij block by block in its online softmax and sums the statistics beside the
output, for the map and its value-weighted map: no [n, n] map, no extra attention pass per statistic. The mass on
the keys holding the row's token is a second kernel over the positions sorted by token (about 1% of the pairs), the
mass each key receives a third, key-parallel one, both from the saved logsumexp; the latter runs only when a caller
reads it. What every layer of a batch hands the kernels alike (lengths, the feature matrix, the token tiles, the
rows' geometry) is made once per batch (Batch.shared).

It covers every feature the blocked path does (causal and bidirectional, right padding, grouped-query heads read in
place, sliding windows, soft-capping, learned sinks); `reason` names what it does not (then the layer runs on the
fused or blocked path). It runs on CUDA, or on a CPU under Triton's interpreter (TRITON_INTERPRET=1, the tests).
triton_kernels, which imports triton, is imported only when a layer runs here: a run on another path never loads
triton, and the interpreter's switch is read when it is first imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from attnprobe import values
from attnprobe.errors import AttnprobeError
from attnprobe.kernel.batch import Batch
from attnprobe.kernel.duplicates import batch_plan
from attnprobe.kernel.features import LayerFeatures
from attnprobe.kernel.fused import ReceivedOnRead
from attnprobe.metrics import RowMasses, SentenceSums, row_stats, value_weighted
from attnprobe.scores import OUTPUT_NORM

BLOCK_M: int | None = None  # query rows per program, keys per step of the online softmax (tl.dot needs 16 or more);
BLOCK_N: int | None = None  # None: _blocks chooses by the inputs' width (the tests set them)
AUTO_ON_CUDA = True  # --attention auto takes this path on a CUDA GPU: `make gpu-check` ran the compiled kernel on an
# H200 (triton 3.6) and found it equal to the blocked path on every family tested, float32 and bfloat16. The kernel
# has since been restructured (split loops, exp2, feature columns); that form is proven under Triton's interpreter
# and compiled offline for sm_90 with triton 3.6 and 3.9, and a launch that fails under auto falls back (fallback_note)
TF32_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # keys of a group of 8 as a tf32 operand takes p's (triton_kernels)
MAX_REGISTERS = 168  # a cap that fits three blocks of 4 warps on an SM (65,536 registers): register_cap
FP_FUSION = True  # a * b + c as one FFMA (the kernels' exp2(s scale log2(e) - m)): triton 3.10 turns it off by default
WIDE_OFFSETS = 2**31  # keys x a key's stride from here on: the kernel offsets its tiles in int64 (WIDE), else int32
MAX_GRID_Y = 65_535  # CUDA's limit on a launch grid's second axis (the first takes 2**31 - 1): the row blocks go there
MAX_HEAD_SIZE = 256  # larger heads fall back (a block of rows and keys no longer fits a GPU's registers)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRET = "TRITON_INTERPRET"  # Triton's switch to its interpreter (a CPU runs the kernels through it)
STATS = ("entropy", "first", "previous", "self", "diagonal", "distance", "sink_window", "special", "punctuation",
         "vw_entropy", "vw_first", "vw_previous", "vw_self", "vw_diagonal", "vw_distance", "vw_sink_window",
         "vw_total")  # the rows of the kernel's Stats, in its order


def unavailable(device: torch.device) -> str | None:
    """Why the Triton path cannot run on `device` (one line naming the fix), or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "--attention triton needs the triton package (CUDA builds of torch bring it): pip install triton"
    if device.type == "cuda":
        try:
            importlib.import_module("triton")
        except Exception as err:  # a broken install: the other paths still run
            return f"--attention triton could not import triton ({type(err).__name__}: {err}): reinstall triton"
        return None
    if device.type == "cpu" and os.environ.get(INTERPRET) == "1":
        return _old_interpreter()
    if device.type == "cpu":
        return (f"--attention triton runs on a CUDA GPU; on a CPU only under Triton's interpreter ({INTERPRET}=1, "
                "for tests): use --attention auto, fused or blocked, or --device cuda")
    return f"--attention triton runs on a CUDA GPU, not {device.type}: use --attention auto, fused or blocked"


def _old_interpreter() -> str | None:
    """Why Triton's interpreter cannot run the kernels, or None: before 3.9 (torch 2.11 pins triton 3.6) it cannot
    loop over a range whose bounds are tensors, which the compiler can (tests/triton_compile.py compiles them)."""
    version = importlib.import_module("triton").__version__
    if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < (3, 9):
        return (f"Triton's interpreter before 3.9 cannot run the Triton path's kernels (triton {version} here): use "
                "--attention auto, fused or blocked")
    return None


class LaunchFailed(AttnprobeError):
    """Triton could not compile or launch a kernel here (one line naming the fix): under --attention auto the layer
    falls back to the fused or blocked path instead (remember_failure), under --attention triton the run stops."""


FAILED: dict[tuple[torch.dtype, int], str] = {}  # (dtype, head size) -> why its kernel failed in this process


def remember_failure(features: LayerFeatures, dtype: torch.dtype, err: LaunchFailed) -> None:
    """Keep why the kernel of this dtype and head size failed: `reason` names it from then on (run.json's
    not_triton), so every later layer and batch of that shape takes the fused or blocked path without retrying."""
    FAILED[(dtype, features.head_size)] = f"the Triton kernel failed here under --attention auto ({err})"


def reason(features: LayerFeatures, dtype: torch.dtype) -> str | None:
    """What of a layer the Triton kernel does not cover (that layer then runs on the fused or blocked path), or None."""
    if (dtype, features.head_size) in FAILED:
        return FAILED[(dtype, features.head_size)]
    if features.head_size > MAX_HEAD_SIZE:
        return f"a head size of {features.head_size} (the Triton kernel takes up to {MAX_HEAD_SIZE})"
    if dtype not in DTYPES:
        return f"{str(dtype).removeprefix('torch.')} activations (the Triton kernel takes float32, float16, bfloat16)"
    return None


def _kernels() -> ModuleType:
    """kernel/triton_kernels, imported on first use (it imports triton; see the module's docstring)."""
    return importlib.import_module("attnprobe.kernel.triton_kernels")


def triton_attend(
    query: Tensor, key: Tensor, value: Tensor, padding: Tensor | None, scaling: float | None, causal: bool,
    info: Batch, need_output: bool = True, span: int | None = None, softcap: float | None = None,
    sinks: Tensor | None = None, factors: Tensor | None = None,
) -> tuple[SentenceSums, Tensor | None, Tensor | None]:
    """blocked.attend's results from the Triton kernel: the statistics of every row (the value-weighted ones and
    `output_norm` too when `factors` [head, k, dim] is given), the example maps, and the attention output
    [batch, query, head, dim] (None when not needed). `query` [batch, head, q, dim]; `key`, `value` [batch, kv head,
    key, dim]; `span`, `softcap`, `sinks` [head] as attend takes them."""
    batch, heads, n, dim = query.shape
    scale = dim**-0.5 if scaling is None else scaling
    real, lengths = info.padding(padding, batch, n, query.device)  # [batch, key], [batch]
    geometry = info.geometry(lengths, n, causal, span)  # made once per batch: no host sync per layer
    norms = None if factors is None else values.key_norms(value, factors)  # [batch, head, key]: |f_h(x_j)|
    wanted = need_output or factors is not None
    lse, stats, out = _forward(query, key, value, lengths, scale, causal, info, span, softcap, sinks, norms, wanted)
    found = dict(zip(STATS, stats))  # [batch, head, q] each
    masses = _masses(found, "", causal, info)
    if info.tokens is not None:
        masses.punctuation = found["punctuation"]
        masses.duplicate, masses.has_duplicate = _duplicates(query, key, lse, info, lengths, scale, causal, span,
                                                             softcap)
    per_row = row_stats(masses, 0, lengths, causal, span, geometry)
    if norms is not None:
        per_row.update(value_weighted(row_stats(_masses(found, "vw_", causal, info), 0, lengths, causal, span,
                                                geometry)))
        per_row[OUTPUT_NORM] = values.head_norms(out.transpose(1, 2), factors)  # [batch, head, q]
    keep = {} if info.keep_rows else None
    sums = SentenceSums(rows=keep) if info.tokens is None else ReceivedOnRead(
        lambda: received(query, key, lse, lengths, scale, causal, span, softcap), rows=keep)
    sums.add(per_row, 0, lengths, info.bins, geometry)
    example = _example(info, query, key, lse, real, scale, causal, span, softcap)
    return sums, example, out if need_output else None


def _masses(found: dict[str, Tensor], prefix: str, causal: bool, info: Batch) -> RowMasses:
    """The RowMasses of the map (prefix "") or of its value-weighted map ("vw_") from the kernel's rows."""
    sink_window = found[prefix + "sink_window"]  # [batch, head, q]
    sink_window[..., : info.sink + info.window] = torch.nan  # rows whose sink and window keys are every key
    if not causal:
        sink_window.fill_(torch.nan)  # an encoder keeps no KV cache
    return RowMasses(
        entropy=found[prefix + "entropy"], diagonal=found[prefix + "diagonal"], first=found[prefix + "first"],
        previous=found[prefix + "previous"], self=found[prefix + "self"], distance=found[prefix + "distance"],
        sink_window=sink_window, special=found["special"] if not prefix and info.special is not None else None,
    )


def _blocks(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(rows, keys) of a block: 64 x 64; 32 x 32 where float32 rows are wider than 64 channels, 16 x 32 where they
    are wider than 128 (tests/triton_compile.py, offline for sm_90 and sm_80 with triton 3.9: 64 x 64 float32 blocks
    of 128 channels take 176 KiB of shared memory, of 256 channels 336 KiB, above an H100's 227 KiB; 32 x 32 of 256
    channels 164 KiB, above an A100's 163 KiB). BLOCK_M / BLOCK_N, when set, win."""
    wide = dtype == torch.float32 and block_d > 64
    rows = 16 if wide and block_d > 128 else 32 if wide else 64
    return BLOCK_M or rows, BLOCK_N or (32 if wide else 64)


def stages(block_d: int) -> int:
    """Software-pipeline stages of stats_forward's key tiles: 3 (Triton's default), 2 for heads over 128 channels
    (tests/triton_compile.py: 16-bit heads of 256 with every feature take 235,520 B of shared memory in 3 stages,
    above an H100's 227 KiB)."""
    return 2 if block_d > 128 else 3


def register_cap(dtype: torch.dtype, block_d: int, weighted: bool) -> dict[str, int]:
    """stats_forward's launch option capping its registers: MAX_REGISTERS for 16-bit heads of up to 64 channels
    without value weighting (tests/triton_compile.py: analyze's default features compile to 167 registers, no spill,
    so three blocks of 4 warps fit an SM instead of two; uncapped, ptxas takes ~245), none otherwise (wider
    accumulators would spill)."""
    small = dtype in (torch.float16, torch.bfloat16) and block_d <= 64 and not weighted
    return {"maxnreg": MAX_REGISTERS} if small else {}


def _block_d(dim: int) -> int:
    """The kernel's head-size block: a power of two of at least 16 (tl.dot); channels beyond `dim` are masked."""
    return max(16, 1 << (dim - 1).bit_length())


def _interpreted(device: torch.device) -> bool:
    """Whether the kernels run in Triton's interpreter (a CPU tensor): its tl.dot then gets float32 operands."""
    return device.type == "cpu"


def _precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input precision: IEEE float32 for float32 inputs (never TF32's 10-bit mantissa); Triton's default
    (None) for bfloat16 and float16, whose products are exact in the float32 accumulator anyway."""
    return "ieee" if dtype == torch.float32 else None


def _forward(
    query: Tensor, key: Tensor, value: Tensor, lengths: Tensor, scale: float, causal: bool, info: Batch,
    span: int | None, softcap: float | None, sinks: Tensor | None, norms: Tensor | None, wanted: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run stats_forward: the logsumexp [batch, head, q], the statistics' rows [STATS, batch, head, q] (float32) and
    the output [batch, q, head, dim] in the model's dtype (None unless `wanted`)."""
    kernels = _kernels()
    batch, heads, n, dim = query.shape
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))  # channels adjacent
    device = query.device
    lse = torch.empty(batch, heads, n, device=device)  # [batch, head, q]
    planes = kernels.STAT_ROWS if norms is not None else kernels.MAP_ROWS  # the kernel writes every element
    stats = torch.empty(planes, batch, heads, n, device=device)  # [stat, batch, head, q]
    out = torch.empty(batch, n, heads, dim, dtype=query.dtype, device=device) if wanted else lse  # [b, q, h, dim]
    lengths32, feats = _batch_inputs(info, lengths, n, query.dtype)  # [batch], [batch, n, FEATURES] or None
    rows, keys = _blocks(query.dtype, _block_d(dim))
    norm_rows, weights = (lse, lse) if norms is None else weight_columns(norms, keys)  # [b, h, key'], [b, h, G, key']
    sink_logits = lse if sinks is None else sinks.float().contiguous()  # [head]
    with _launching("statistics", query.dtype, dim), _on(device):
        kernels.stats_forward[launch_grid(n, rows, batch, heads)](
            query, key, value, out, lse, stats, lengths32, norm_rows, weights, lse if feats is None else feats,
            sink_logits,
            *query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
            *((out.stride(0), out.stride(2), out.stride(1)) if wanted else (0, 0, 0)),
            0 if feats is None else feats.stride(0), norm_rows.stride(1),
            heads, heads // key.shape[1], n, dim, batch * heads * n, scale, float(softcap or 1.0),
            int(span or 0), info.sink, info.window,
            CAUSAL=causal, HAS_SPAN=span is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
            WEIGHTED=norms is not None, HAS_FEATS=feats is not None, NEED_OUT=wanted, EVEN_D=dim == _block_d(dim),
            WIDE=n * max(key.stride(2), value.stride(2)) >= WIDE_OFFSETS,
            PRECISION=_precision(query.dtype), UPCAST=_interpreted(device), BLOCK_M=rows, BLOCK_N=keys,
            BLOCK_D=_block_d(dim), num_stages=stages(_block_d(dim)), enable_fp_fusion=FP_FUSION,
            **register_cap(query.dtype, _block_d(dim), norms is not None),
        )
    return lse, stats, out if wanted else None


@contextmanager
def _launching(which: str, dtype: torch.dtype, dim: int) -> Iterator[None]:
    """A kernel that Triton cannot compile or launch on this GPU (out of shared memory or registers on a smaller
    card, an older triton) is one line naming the fix, never a Triton traceback."""
    try:
        yield
    except Exception as err:
        if not type(err).__module__.startswith("triton"):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise LaunchFailed(
            f"the Triton {which} kernel could not run here ({type(err).__name__}: {first[:200]}; "
            f"{str(dtype).removeprefix('torch.')}, head size {dim}): use --attention fused or blocked") from err


def _on(device: torch.device) -> AbstractContextManager:
    """Launch on the tensors' own GPU (Triton launches on the current one: a model spread over several GPUs), a
    no-op on a CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def launch_grid(n: int, block: int, batch: int, heads: int) -> tuple[int, int]:
    """A kernel's grid: (sequence, head) pairs on the first axis, which takes 2**31 - 1 programs (4,096 sentences x
    64 heads fit), and blocks of `block` rows or keys of the n on the second, which takes MAX_GRID_Y."""
    return batch * heads, triton_cdiv(n, block)


def _batch_inputs(info: Batch, lengths: Tensor, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """What every layer of the batch hands the kernel alike, made by the first and kept (Batch.shared): the lengths
    (int32) and the feature matrix (_features, None without special tokens or token classes)."""
    return info.shared("triton inputs", lengths, lambda: (lengths.to(torch.int32).contiguous(),
                                                          _features(info, lengths, n, dtype)), n, dtype)


def _features(info: Batch, lengths: Tensor, n: int, dtype: torch.dtype) -> Tensor | None:
    """The per-key columns the kernel sums on the tensor cores, [batch, n, FEATURES] contiguous: all ones (the
    normaliser), special tokens, punctuation, zeros; in the dtype p meets them in (the model's: exact for 0 and 1).
    None where the batch has neither flag."""
    if info.special is None and info.tokens is None:
        return None
    kernels = _kernels()
    feats = torch.zeros(lengths.shape[0], n, int(kernels.FEATURES), dtype=dtype, device=lengths.device)  # [b, n, F]
    feats[..., int(kernels.ONES)] = 1
    if info.special is not None:
        feats[..., int(kernels.SPECIAL_COLUMN)] = info.special[:, :n].to(dtype)
    if info.tokens is not None:
        feats[..., int(kernels.PUNCTUATION_COLUMN)] = info.tokens.punctuation[:, :n].to(dtype)
    return feats


def weight_columns(norms: Tensor, period: int) -> tuple[Tensor, Tensor]:
    """What stats_forward's value-weighted sums read, zero-padded to whole tiles of `period` keys (no mask in the
    loop): the norms w_j = |f_h(x_j)| [batch, head, key'] float32, and G [batch, head, WEIGHT_COLUMNS, key'], the
    per-key columns it sums on the tensor cores for 16-bit inputs (p @ G): w, w ln w (0 where w = 0), w (j mod
    period) and w again, each as three tensorfloat-32 parts (columns 0-3 its top 11 bits, 4-7 the next, 8-11 the
    rest; their sum is the float32 exactly), then zeros. In each group of 8 keys G's keys are in the order
    TF32_ORDER, the order in which the tensor cores take p as a tf32 operand (triton_kernels._weighted_by_tensor_cores).
    `norms` [batch, head, key]."""
    kernels = _kernels()
    batch, heads, n = norms.shape
    padded = triton_cdiv(n, period) * period
    w = torch.zeros(batch, heads, padded, device=norms.device)  # [batch, head, key']
    w[..., :n] = norms
    place = torch.arange(padded, device=norms.device) % period  # [key']: j mod BLOCK_N
    sums = torch.stack((w, w * torch.where(w > 0, w, 1.0).log(), w * place, w), dim=-2)  # [batch, head, 4, key']
    high = _tf32(sums)  # [batch, head, 4, key']
    middle = _tf32(sums - high)  # [batch, head, 4, key']: each difference exact in float32
    low = sums - high - middle  # [batch, head, 4, key']: at most 2 bits left, a tf32
    found = torch.cat((high, middle, low, torch.zeros_like(high)), dim=-2)  # [batch, head, 16, key']
    assert found.shape[-2] == int(kernels.WEIGHT_COLUMNS)
    order = torch.tensor(TF32_ORDER, device=norms.device)  # [8]
    keys = (torch.arange(0, padded, 8, device=norms.device)[:, None] + order).flatten()  # [key']
    return w, found[..., keys].contiguous()


def _tf32(x: Tensor) -> Tensor:
    """float32 `x` cut to tensorfloat-32: its sign, exponent and top 10 mantissa bits (what the tensor cores read)."""
    return (x.view(torch.int32) & -8192).view(torch.float32)  # [...]


def _duplicates(query: Tensor, key: Tensor, lse: Tensor, info: Batch, lengths: Tensor, scale: float, causal: bool,
                span: int | None, softcap: float | None) -> tuple[Tensor, Tensor]:
    """The mass on the other keys holding the row's token [batch, head, q] and whether the row has such a key
    [batch, 1, q], from duplicate_pass over the batch's TokenTiles (planned once per batch, kept)."""
    kernels = _kernels()
    batch, heads, n, dim = query.shape
    rows, keys = _blocks(query.dtype, _block_d(dim))
    plan, has = batch_plan(info, lengths, n, causal, rows, span)
    mass = torch.zeros(batch, heads, n, device=query.device)  # [batch, head, q]: rows of no tile stay 0
    if len(plan.tiles):
        with _launching("duplicate-token", query.dtype, dim), _on(query.device):
            kernels.duplicate_pass[(len(plan.tiles), heads)](
                query, key, lse, mass, plan.positions, plan.group, plan.tiles, *query.stride()[:3],
                *key.stride()[:3], heads, heads // key.shape[1], n, dim, scale, float(softcap or 1.0),
                int(span or 0), CAUSAL=causal, HAS_SPAN=span is not None, HAS_SOFTCAP=softcap is not None,
                PRECISION=_precision(query.dtype), UPCAST=_interpreted(query.device), BLOCK_M=rows, BLOCK_N=keys,
                BLOCK_D=_block_d(dim), enable_fp_fusion=FP_FUSION,
            )
    return mass, has


def received(query: Tensor, key: Tensor, lse: Tensor, lengths: Tensor, scale: float, causal: bool,
             span: int | None = None, softcap: float | None = None) -> Tensor:
    """The mass each key receives, sum_i p_ij over the real rows, from received_pass: [batch, head, key] float32."""
    kernels = _kernels()
    batch, heads, n, dim = query.shape
    query, key = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key))
    found = torch.empty(batch, heads, n, device=query.device)  # [batch, head, key]: every element written
    rows, keys = _blocks(query.dtype, _block_d(dim))
    with _launching("received-mass", query.dtype, dim), _on(query.device):
        kernels.received_pass[launch_grid(n, keys, batch, heads)](
            query, key, lse.contiguous(), found, lengths.to(torch.int32).contiguous(), *query.stride()[:3],
            *key.stride()[:3], heads, heads // key.shape[1], n, dim, scale, float(softcap or 1.0), int(span or 0),
            CAUSAL=causal, HAS_SPAN=span is not None, HAS_SOFTCAP=softcap is not None, EVEN_D=dim == _block_d(dim),
            PRECISION=_precision(query.dtype), UPCAST=_interpreted(query.device), BLOCK_M=rows, BLOCK_N=keys,
            BLOCK_D=_block_d(dim), enable_fp_fusion=FP_FUSION,
        )
    return found


def triton_cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a launch grid."""
    return -(-a // b)


def _example(info: Batch, query: Tensor, key: Tensor, lse: Tensor, real: Tensor, scale: float, causal: bool,
             span: int | None, softcap: float | None) -> Tensor | None:
    """The example sentence's first tokens' maps, exp(s_ij - lse_i) under the layer's mask: [head, kept, kept]."""
    if info.example is None:
        return None
    row, kept = info.example
    groups = query.shape[1] // key.shape[1]
    keys = key[row, :, :kept].float().repeat_interleave(groups, dim=0)  # [head, kept, dim]: a few tokens only
    logits = scale * (query[row, :, :kept].float() @ keys.transpose(-1, -2))  # [head, kept, kept]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)  # [head, kept, kept]
    i = torch.arange(kept, device=query.device)  # [kept]
    offset = i[None, :] - i[:, None]  # [kept, kept]: j - i
    allowed = real[row, None, :kept].expand(kept, kept)  # [kept, kept]
    if causal:
        allowed = allowed & (offset <= 0)
    if span is not None:
        allowed = allowed & ((offset > -span) if causal else (offset.abs() <= span))
    return torch.where(allowed, (logits - lse[row, :, :kept, None]).exp(), 0.0)  # [head, kept, kept]


def record(features: tuple[LayerFeatures, ...] | None, dtype: torch.dtype) -> dict[str, Any]:
    """run.json's account of the Triton path: the layers it runs, and those it leaves to the fused or blocked path
    with the reason (reason -> layers)."""
    layers, left = [], {}
    for k, layer in enumerate(features or ()):
        why = reason(layer, dtype)
        if why is None:
            layers.append(k)
        else:
            left.setdefault(why, []).append(k)
    return {"triton_layers": layers, "not_triton": left or None}
