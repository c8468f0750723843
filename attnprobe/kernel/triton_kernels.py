"""The Triton kernels of the Triton path (kernel/triton_path.py calls them): `stats_forward`, one pass of online
softmax over key blocks per block of query rows that writes the attention output, each row's logsumexp and the sums
every row statistic is made of, for the map and its value-weighted map; `duplicate_pass`, the mass on the other keys
holding the row's token, over tiles of the positions sorted by token (kernel/duplicates.py plans them) from the saved
logsumexp; and `received_pass`, the key-parallel pass that recomputes p_ij from the saved logsumexp (as
FlashAttention's backward does) and sums each key's column over the real rows.

stats_forward is FlashAttention's loop plus running sums. The tiles of keys that every row of the block may see
whole run unmasked (no compare, no select), the diagonal, window-edge and padding-tail tiles masked, in loops of
their own (Triton's fused-attention tutorial); p = exp2(s log2(e) scale - m) with m in the log2 domain; the entropy
from sum p q.k, the distance from sum p c (c the key's place in its tile) and the tile's mass, so a tile's work per
element is an FFMA and an exp2 beside two sums. The per-key flags (special tokens, punctuation) ride on the tensor
cores as columns of a feature matrix F [batch, key, FEATURES] (column 0 all ones, the consistent normaliser of the
rounded p), acc_f += p @ F. The value-weighted map's sums of p times a per-key quantity (sum_j p w, p w ln w, p w j)
ride there too, as p @ G for 16-bit inputs: p cut in two tensorfloat-32 parts, G's columns in three, so each sum
keeps float32's precision (_weighted_by_tensor_cores); sum_j p w q.k, a product per element, stays on the CUDA cores.
The positional sums (first key, previous, self, the +-2 diagonal, the sinks and the recent window) come after the
loop from the final max, exactly, over the few tiles that hold those keys.

Imported only when the Triton path runs (this module imports triton): under TRITON_INTERPRET=1, set before this
module is first imported, the kernels run on a CPU through Triton's interpreter (the tests). Written for the
compiler: block sizes are constexpr and at least 16 (tl.dot), accumulators float32, no Python branch on a tensor
value; float32 inputs multiply in IEEE float32 (no TF32). Masked lanes get a score of -inf and a weight of exactly 0,
and a row that has seen no key yet keeps a max of -inf (rescaled by 0, never exp(-inf + inf)); sums multiply p by
finite values only, so no -inf * 0 makes a NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Rows of `Stats`, in triton_path.STATS's order: the map's sums, then the value-weighted map's (constexpr: a jitted
# function reads no other global).
(ENTROPY, FIRST, PREVIOUS, SELF, DIAGONAL, DISTANCE, SINK_WINDOW, SPECIAL, PUNCTUATION,
 VW_ENTROPY, VW_FIRST, VW_PREVIOUS, VW_SELF, VW_DIAGONAL, VW_DISTANCE, VW_SINK_WINDOW, VW_TOTAL) = (
    tl.constexpr(k) for k in range(17))
STAT_ROWS = 17
MAP_ROWS = 9  # the map's rows only (Stats holds no more without WEIGHTED)
FEATURES = tl.constexpr(16)  # columns of F: ONES, SPECIAL_COLUMN, PUNCTUATION_COLUMN, then spare (zeros)
ONES, SPECIAL_COLUMN, PUNCTUATION_COLUMN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
WEIGHT_COLUMNS = tl.constexpr(16)  # columns of G [batch, head, 16, key] (triton_path.weight_columns): per key w,
W_SUM, W_LOG, W_PLACE, W_BASE = (tl.constexpr(k) for k in range(4))  # w ln w, w (j mod BLOCK_N), w, in three
# tensorfloat-32 parts (columns k, k + 4, k + 8), then zeros
TF32 = tl.constexpr(-8192)  # 0xFFFFE000: a float32's sign, exponent and top 10 mantissa bits
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """tanh from exp (tl has no tanh before triton 3.3 everywhere): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|); a constexpr on the left would wrap the tensor
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tf32(x):
    """x cut to tensorfloat-32 (the 10 top bits of its mantissa), as the tensor cores read a float32 operand."""
    return (x.to(tl.int32, bitcast=True) & TF32).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST (the interpreter only, whose tl.dot reads bfloat16 as integers): the
    operands in float32 first, which gives the same products (a product of two 8-bit mantissas is exact in float32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _log2_scores(qk, qk_scale, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """The scores in the log2 domain, s log2(e) (soft-capped: softcap tanh(s / softcap) log2(e)), of raw q.k."""
    if HAS_SOFTCAP:
        return (softcap * LOG2E) * _tanh(qk * (scale / softcap))
    return qk * qk_scale


@triton.jit
def _allowed(offs_m, offs_n, length, span, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr):
    """Which keys each row may see [BLOCK_M, BLOCK_N]: real keys, j <= i when causal, and within the window."""
    diff = offs_m[:, None] - offs_n[None, :]  # i - j
    ok = offs_n[None, :] < length  # [1, BLOCK_N]
    if CAUSAL:
        ok = ok & (diff >= 0)
        if HAS_SPAN:
            ok = ok & (diff < span)
    else:
        if HAS_SPAN:
            ok = ok & (diff <= span) & (diff >= -span)
    return ok


@triton.jit
def _down(x, BLOCK: tl.constexpr):
    return (x // BLOCK) * BLOCK


@triton.jit
def _up(x, BLOCK: tl.constexpr):
    return ((x + BLOCK - 1) // BLOCK) * BLOCK


@triton.jit
def _segments(q0, length, span, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """The key tiles of rows q0 .. q0 + BLOCK_M - 1, cut at multiples of BLOCK_N: lo <= a <= bl <= ar <= b <= hi.
    [a, bl) and [ar, b) every row sees whole (left of every row's diagonal; right of it, encoders only): unmasked;
    [lo, a), [bl, ar) and [b, hi) (the window's far edge, the diagonal, the padding tail) masked."""
    zero = length * 0  # a tensor either way (a jitted function returns one type)
    if CAUSAL:
        hi = tl.minimum(length, q0 + BLOCK_M)
        lo = zero
        full_lo = zero
        if HAS_SPAN:  # j > i - span for every row: j >= q0 + BLOCK_M - span
            lo = _down(tl.maximum(zero, q0 - span + 1), BLOCK_N)
            full_lo = _up(tl.maximum(zero, q0 + BLOCK_M - span), BLOCK_N)
        full_hi = _down(tl.minimum(length, q0), BLOCK_N)  # j < q0 <= i and a real key
    else:
        hi = length
        lo = zero
        full_lo = zero
        full_hi = _down(length, BLOCK_N)
        if HAS_SPAN:  # |i - j| <= span for every row
            lo = _down(tl.maximum(zero, q0 - span), BLOCK_N)
            hi = tl.minimum(length, q0 + BLOCK_M + span)
            full_lo = _up(tl.maximum(zero, q0 + BLOCK_M - 1 - span), BLOCK_N)
            full_hi = tl.minimum(full_hi, _down(q0 + span + 1, BLOCK_N))
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    a = tl.maximum(a, lo)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    bl = tl.maximum(a, tl.minimum(b, _down(q0, BLOCK_N)))  # tiles wholly before the block's first row
    ar = tl.maximum(bl, tl.minimum(b, _up(q0 + BLOCK_M, BLOCK_N)))  # tiles wholly after its last row
    return lo, a, bl, ar, b, hi


@triton.jit
def _tile(q, start_n, k_base, v_base, Feats, w_base, g_base, stride_w, stride_kn, stride_vn,
          offs_m, rows_f, d_ok, length, span, qk_scale, scale, softcap,
          m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist,
          MASKED: tl.constexpr, SIGN: tl.constexpr, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr,
          HAS_SOFTCAP: tl.constexpr, WEIGHTED: tl.constexpr, HAS_FEATS: tl.constexpr, NEED_OUT: tl.constexpr,
          EVEN_D: tl.constexpr, WIDE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PERIOD: tl.constexpr):
    """One tile of keys start_n .. start_n + BLOCK_N - 1 of the online softmax: the running max (log2 domain) and
    sums rescaled and added to. MASKED: the mask built and applied (the diagonal, edge and tail tiles), the distance
    from |i - j|; else every key is seen by every row and the distance is SIGN (+1 left of the rows, -1 right) times
    i l_tile - sum p j."""
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N).to(tl.float32)  # a key's place in its tile
    if WIDE:  # n x stride passes 2**31: the tile's start in int64, int32 offsets within it
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn + (tl.arange(0, BLOCK_N)[None, :] * stride_kn
                                                              + tl.arange(0, BLOCK_D)[:, None])  # [BLOCK_D, BLOCK_N]
    else:  # int32 offsets recomputed per tile: fewer registers than holding k_offs across the loop
        k_ptrs = k_base + offs_n[None, :] * stride_kn + tl.arange(0, BLOCK_D)[:, None]
    if MASKED:
        key_ok = offs_n < length
        k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
    qk = _dot(q, k, PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N] raw q.k
    if HAS_SOFTCAP:
        t = _log2_scores(qk, qk_scale, scale, softcap, HAS_SOFTCAP)
        logit = t  # what the entropy sums: log2-domain capped scores
    else:
        t = qk
        logit = qk
    if MASKED:
        if not HAS_SOFTCAP:
            t = qk * qk_scale
        ok = _allowed(offs_m, offs_n, length, span, CAUSAL, HAS_SPAN)
        t = tl.where(ok, t, float("-inf"))
        m_new = tl.maximum(m, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(t - m_safe[:, None])  # [BLOCK_M, BLOCK_N]: exactly 0 where masked
    else:
        if HAS_SOFTCAP:
            m_new = tl.maximum(m, tl.max(t, 1))
            p = tl.exp2(t - m_new[:, None])
        else:  # one FFMA and one exp2 per element
            m_new = tl.maximum(m, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
    l_tile = tl.sum(p, 1)
    total = total * alpha + l_tile
    tensor_cores: tl.constexpr = WEIGHTED and PRECISION != "ieee"  # the value-weighted sums of 16-bit inputs
    if tensor_cores:  # p q.k once for both maps
        p_logit = p * logit
        plogit = plogit * alpha + tl.sum(p_logit, 1)
    else:
        plogit = plogit * alpha + tl.sum(p * logit, 1)
    if MASKED and not CAUSAL:  # an encoder's diagonal tile: keys on both sides of the row
        dist = dist * alpha + tl.sum(p * tl.abs(rows_f[:, None] - (cols[None, :] + start_n)), 1)
    else:  # every key with p > 0 on one side of the row (causal: masked keys have p = 0 exactly)
        placed = tl.sum(p * cols[None, :], 1) + l_tile * start_n  # sum_j p_ij j
        dist = dist * alpha + SIGN * (rows_f * l_tile - placed)
    if tensor_cores:  # w_j = |f_h(x_j)|: sum_j p w q.k, a product per element (no column holds it), here
        keys = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)  # vector loads
        w = tl.load(w_base + keys)  # padded to whole tiles: no mask (p = 0 beyond the length)
        w_plogit = w_plogit * alpha + tl.sum(p_logit * w[None, :], 1)
        if MASKED and not CAUSAL:  # an encoder's diagonal tile: |i - j| per element
            w_dist = w_dist * alpha + tl.sum(p * w[None, :] * tl.abs(rows_f[:, None] - (cols[None, :] + start_n)), 1)
    if HAS_FEATS:
        f_ptrs = Feats + offs_n[:, None] * FEATURES + tl.arange(0, FEATURES)[None, :]  # [BLOCK_N, FEATURES]
        if MASKED:
            f = tl.load(f_ptrs, mask=(offs_n < length)[:, None], other=0.0)
        else:
            f = tl.load(f_ptrs)
        acc_f = acc_f * alpha[:, None] + _dot(p.to(f.dtype), f, PRECISION, UPCAST)
    if WEIGHTED and not tensor_cores:  # float32 inputs: every sum on the CUDA cores, where their products are
        w = tl.load(w_base + offs_n, mask=offs_n < length, other=0.0)  # |f_h(x_j)|
        pw = p * w[None, :]
        w_tile = tl.sum(pw, 1)
        w_l = w_l * alpha + w_tile
        w_plogit = w_plogit * alpha + tl.sum(pw * logit, 1)
        w_log = w_log * alpha + tl.sum(pw * tl.log(tl.where(w > 0, w, 1.0))[None, :], 1)
        if MASKED and not CAUSAL:
            w_dist = w_dist * alpha + tl.sum(pw * tl.abs(rows_f[:, None] - (cols[None, :] + start_n)), 1)
        else:
            w_dist = w_dist * alpha + SIGN * (rows_f * w_tile - tl.sum(pw * cols[None, :], 1) - w_tile * start_n)
    if NEED_OUT:
        if WIDE:
            v_ptrs = v_base + start_n.to(tl.int64) * stride_vn + (tl.arange(0, BLOCK_N)[:, None] * stride_vn
                                                                  + tl.arange(0, BLOCK_D)[None, :])
        else:
            v_ptrs = v_base + offs_n[:, None] * stride_vn + tl.arange(0, BLOCK_D)[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=(offs_n < length)[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    if tensor_cores:  # sum_j p w, p w ln w and p w j
        got = _weighted_by_tensor_cores(p, g_base, stride_w, keys, UPCAST)
        column = tl.arange(0, WEIGHT_COLUMNS)[None, :] % 4  # W_SUM, W_LOG, W_PLACE, W_BASE, in three parts each
        base = (start_n // PERIOD) * PERIOD  # W_PLACE counts the keys' place from here
        if MASKED and not CAUSAL:  # its distance summed above
            gain = tl.where(column < W_PLACE, 1.0, 0.0)
        else:  # the distance sum_j p w (i - j) = (i - base) sum_j p w - sum_j p w (j - base), each term >= 0
            gain = tl.where(column < W_PLACE, 1.0, tl.where(column == W_PLACE, -SIGN, SIGN * (rows_f - base)[:, None]))
        acc_w = acc_w * alpha[:, None] + gain * got
    return m_new, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist


@triton.jit
def _weighted_by_tensor_cores(p, g_base, stride_w, keys, UPCAST: tl.constexpr):
    """p @ G [BLOCK_M, WEIGHT_COLUMNS] of one tile on the tensor cores to float32's precision: p = big + small, each
    a tensorfloat-32 (10 mantissa bits, float32's range; small within 2^-20 of p's remainder), against G's columns
    cut in high and low tf32 parts (triton_path.weight_columns): within 2^-20 of each product. p's keys are taken
    in the tf32 operand's order (in each group of 8: 0, 2, 4, 6, 1, 3, 5, 7, G's order), which is where the float32
    accumulator of q k^T already holds them: no shuffle."""
    rows: tl.constexpr = p.shape[0]
    width: tl.constexpr = p.shape[1]
    p = tl.reshape(tl.permute(tl.reshape(p, [rows, width // 8, 4, 2]), [0, 1, 3, 2]), [rows, width])
    big = _tf32(p)
    small = p - big
    if UPCAST:  # the interpreter multiplies float32 whole: cut small as the tensor cores read it
        small = _tf32(small)
    g = tl.trans(tl.load(g_base + tl.arange(0, WEIGHT_COLUMNS)[:, None] * stride_w + keys[None, :]))  # [keys, W_C]
    return tl.dot(small, g, tl.dot(big, g, input_precision="tf32"), input_precision="tf32")


@triton.jit
def _positional(q, start_n, k_base, stride_kn, w_base, offs_m, d_ok, length, span, sink, window,
                qk_scale, scale, softcap, top, first, previous, own, diagonal, sink_window, w_first, w_previous, w_own,
                w_diagonal, w_sink_window, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                WEIGHTED: tl.constexpr, WIDE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The positional sums of one tile from the row's final max `top` (log2 domain): p_ij = exp2(t_ij - top) exactly,
    nothing to rescale. Key 0, the previous key, the key itself, the +-2 diagonal, and (causal) the first `sink`
    keys or the `window` most recent."""
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < length
    if WIDE:
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn + (tl.arange(0, BLOCK_N)[None, :] * stride_kn
                                                              + tl.arange(0, BLOCK_D)[:, None])  # [BLOCK_D, BLOCK_N]
    else:
        k_ptrs = k_base + offs_n[None, :] * stride_kn + tl.arange(0, BLOCK_D)[:, None]
    k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
    t = _log2_scores(_dot(q, k, PRECISION, UPCAST), qk_scale, scale, softcap, HAS_SOFTCAP)
    ok = _allowed(offs_m, offs_n, length, span, CAUSAL, HAS_SPAN)
    p = tl.where(ok, tl.exp2(tl.where(ok, t, 0.0) - top[:, None]), 0.0)  # [BLOCK_M, BLOCK_N]
    diff = offs_m[:, None] - offs_n[None, :]  # i - j
    at_first = offs_n[None, :] == 0
    near = (diff <= 2) & (diff >= -2)
    in_sink_window = (offs_n[None, :] < sink) | (diff < window)
    first += tl.sum(tl.where(at_first, p, 0.0), 1)
    previous += tl.sum(tl.where(diff == 1, p, 0.0), 1)
    own += tl.sum(tl.where(diff == 0, p, 0.0), 1)
    diagonal += tl.sum(tl.where(near, p, 0.0), 1)
    if CAUSAL:  # an encoder's sink_window is undefined (NaN, set by the caller)
        sink_window += tl.sum(tl.where(in_sink_window, p, 0.0), 1)
    if WEIGHTED:
        w = tl.load(w_base + offs_n, mask=key_ok, other=0.0)
        pw = p * w[None, :]
        w_first += tl.sum(tl.where(at_first, pw, 0.0), 1)
        w_previous += tl.sum(tl.where(diff == 1, pw, 0.0), 1)
        w_own += tl.sum(tl.where(diff == 0, pw, 0.0), 1)
        w_diagonal += tl.sum(tl.where(near, pw, 0.0), 1)
        if CAUSAL:
            w_sink_window += tl.sum(tl.where(in_sink_window, pw, 0.0), 1)
    return first, previous, own, diagonal, sink_window, w_first, w_previous, w_own, w_diagonal, w_sink_window


@triton.jit(do_not_specialize=["n", "stride_fb", "plane"])  # one compile for every sequence length
def stats_forward(
    Q, K, V, Out, Lse, Stats, Lengths, Norms, Weights, Feats, Sinks,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_fb, stride_w,
    heads, groups, n, dim, plane, scale, softcap, span, sink, window,
    CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WEIGHTED: tl.constexpr, HAS_FEATS: tl.constexpr, NEED_OUT: tl.constexpr, EVEN_D: tl.constexpr,
    WIDE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of query rows of one (sequence, head): online softmax over its key tiles, with the statistics'
    running sums rescaled like the output's. Writes Out [batch, q, head, dim] (NEED_OUT), Lse [batch, head, q] and
    Stats [STAT_ROWS, batch, head, q] (sums over keys, divided by the row's total; entropy finished)."""
    bh = tl.program_id(0).to(tl.int64)  # (sequence, head) on the grid's first axis (2**31 - 1; the second: 65,535)
    pid_m = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    kvh = h // groups  # the group's KV head, read in place (never repeated)
    length = tl.load(Lengths + b)
    q0 = pid_m * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < n) & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    feats = Feats + b * stride_fb
    w_base = Norms + bh * stride_w  # [key] of this (sequence, head), padded to whole tiles
    g_base = Weights + bh * (stride_w * WEIGHT_COLUMNS)  # [WEIGHT_COLUMNS, key]
    qk_scale = scale * LOG2E
    rows_f = offs_m.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    tail = tl.zeros([BLOCK_M], tl.float32)  # the sink logit's share of the total, rescaled (0 without sinks)
    if HAS_SINKS:
        m = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + h) * LOG2E
    total = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp2(t_ij - m) over the keys
    plogit = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp2(t_ij - m) q_i.k_j (soft-capped: t_ij)
    dist = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp2(t_ij - m) |i - j|
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc_f = tl.zeros([BLOCK_M, FEATURES], tl.float32)
    acc_w = tl.zeros([BLOCK_M, WEIGHT_COLUMNS], tl.float32)  # the value-weighted map's sums p @ G (W_SUM, ...)
    w_l = tl.zeros([BLOCK_M], tl.float32)  # float32 inputs: sum_j exp2(t_ij - m) w_j ...
    w_log = tl.zeros([BLOCK_M], tl.float32)  # ... ln w_j
    w_plogit = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp2(t_ij - m) w_j q_i.k_j
    w_dist = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp2(t_ij - m) w_j |i - j| of an encoder's diagonal tiles

    if BLOCK_N >= 32:  # the masked and positional tiles in halves: fewer registers where they peak
        HALF_N: tl.constexpr = BLOCK_N // 2
    else:
        HALF_N: tl.constexpr = BLOCK_N
    lo, a, bl, ar, b_end, hi = _segments(q0, length, span, CAUSAL, HAS_SPAN, BLOCK_M, BLOCK_N)
    for start_n in range(a, bl, BLOCK_N):  # the main loop: tiles left of every row, seen whole
        m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist = _tile(
            q, start_n, k_base, v_base, feats, w_base, g_base, stride_w, stride_kn, stride_vn,
            offs_m, rows_f, d_ok, length, span, qk_scale, scale, softcap,
            m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist, False, 1.0, CAUSAL, HAS_SPAN,
            HAS_SOFTCAP, WEIGHTED, HAS_FEATS, NEED_OUT, EVEN_D, WIDE, PRECISION, UPCAST, BLOCK_N, BLOCK_D, BLOCK_N)
    if not CAUSAL:  # tiles right of every row, seen whole
        for start_n in range(ar, b_end, BLOCK_N):
            m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist = _tile(
                q, start_n, k_base, v_base, feats, w_base, g_base, stride_w, stride_kn, stride_vn,
                offs_m, rows_f, d_ok, length, span, qk_scale, scale, softcap,
                m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist, False, -1.0, CAUSAL, HAS_SPAN,
                HAS_SOFTCAP, WEIGHTED, HAS_FEATS, NEED_OUT, EVEN_D, WIDE, PRECISION, UPCAST, BLOCK_N, BLOCK_D, BLOCK_N)
        for start_n in range(bl, ar, HALF_N):  # the diagonal tiles
            m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist = _tile(
                q, start_n, k_base, v_base, feats, w_base, g_base, stride_w, stride_kn, stride_vn,
                offs_m, rows_f, d_ok, length, span, qk_scale, scale, softcap,
                m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist, True, 1.0, CAUSAL, HAS_SPAN,
                HAS_SOFTCAP, WEIGHTED, HAS_FEATS, NEED_OUT, EVEN_D, WIDE, PRECISION, UPCAST, HALF_N, BLOCK_D, BLOCK_N)
    if HAS_SPAN:  # the window's far edge
        for start_n in range(lo, a, HALF_N):
            m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist = _tile(
                q, start_n, k_base, v_base, feats, w_base, g_base, stride_w, stride_kn, stride_vn,
                offs_m, rows_f, d_ok, length, span, qk_scale, scale, softcap,
                m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist, True, 1.0, CAUSAL, HAS_SPAN,
                HAS_SOFTCAP, WEIGHTED, HAS_FEATS, NEED_OUT, EVEN_D, WIDE, PRECISION, UPCAST, HALF_N, BLOCK_D, BLOCK_N)
    for start_n in range(b_end, hi, HALF_N):  # the diagonal (causal), the window's near edge, the padding tail
        m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist = _tile(
            q, start_n, k_base, v_base, feats, w_base, g_base, stride_w, stride_kn, stride_vn,
            offs_m, rows_f, d_ok, length, span, qk_scale, scale, softcap,
            m, total, plogit, dist, acc, acc_f, acc_w, w_l, w_plogit, w_log, w_dist, True, 1.0, CAUSAL, HAS_SPAN,
            HAS_SOFTCAP, WEIGHTED, HAS_FEATS, NEED_OUT, EVEN_D, WIDE, PRECISION, UPCAST, HALF_N, BLOCK_D, BLOCK_N)

    top = tl.where(m == float("-inf"), 0.0, m)
    if HAS_SINKS:
        tail = tl.exp2(tl.load(Sinks + h) * LOG2E - top)
    whole = total + tail  # the softmax's denominator (with the sink's share)
    some = whole > 0
    whole_safe = tl.where(some, whole, 1.0)  # a row that sees no key (padding beyond a window): zeros, never NaN
    lse = (top + tl.log2(whole_safe)) * LN2

    row_ok = offs_m < n  # the loop's results first: acc and acc_f are not live in the positional loops
    tl.store(Lse + bh * n + offs_m, lse, mask=row_ok)
    if NEED_OUT:
        out = acc / whole_safe[:, None]
        tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    logit_scale = scale
    if HAS_SOFTCAP:
        logit_scale = LN2
    rows = Stats + bh * n + offs_m  # `plane` apart: one statistic's [batch, head, q]
    plane = bh * 0 + plane  # int64: STAT_ROWS planes of batch x head x q pass 2**31 elements before one plane does
    tl.store(rows + ENTROPY * plane, (total * lse - plogit * logit_scale) / whole_safe, mask=row_ok)  # -sum p ln p
    tl.store(rows + DISTANCE * plane, dist / whole_safe, mask=row_ok)
    if HAS_FEATS:  # each flag's share of the same rounded p (column ONES), times the keys' share of the whole
        column = tl.arange(0, FEATURES)[None, :]
        ones = tl.sum(tl.where(column == ONES, acc_f, 0.0), 1)
        share = tl.where(ones > 0, total / (whole_safe * tl.where(ones > 0, ones, 1.0)), 0.0)
        tl.store(rows + SPECIAL * plane, tl.sum(tl.where(column == SPECIAL_COLUMN, acc_f, 0.0), 1) * share,
                 mask=row_ok)
        tl.store(rows + PUNCTUATION * plane, tl.sum(tl.where(column == PUNCTUATION_COLUMN, acc_f, 0.0), 1) * share,
                 mask=row_ok)
    else:
        tl.store(rows + SPECIAL * plane, total * 0.0, mask=row_ok)
        tl.store(rows + PUNCTUATION * plane, total * 0.0, mask=row_ok)
    first = tl.zeros([BLOCK_M], tl.float32)
    previous = tl.zeros([BLOCK_M], tl.float32)
    own = tl.zeros([BLOCK_M], tl.float32)
    diagonal = tl.zeros([BLOCK_M], tl.float32)
    sink_window = tl.zeros([BLOCK_M], tl.float32)
    w_first = tl.zeros([BLOCK_M], tl.float32)
    w_previous = tl.zeros([BLOCK_M], tl.float32)
    w_own = tl.zeros([BLOCK_M], tl.float32)
    w_diagonal = tl.zeros([BLOCK_M], tl.float32)
    w_sink_window = tl.zeros([BLOCK_M], tl.float32)
    # The positional sums, over the tiles that hold key 0 and the sinks, then those within the recent window or 2
    # of the block's rows (not again those of the first loop).
    sinks_end = tl.minimum(_up(tl.maximum(sink, 1), BLOCK_N), hi)
    reach = 2
    if CAUSAL:
        reach = tl.maximum(window - 1, 2)
    near_lo = tl.maximum(tl.maximum(_down(tl.maximum(q0 - reach, 0), BLOCK_N), lo), sinks_end)
    near_hi = hi
    if CAUSAL:
        near_hi = tl.minimum(hi, q0 + BLOCK_M)
    else:
        near_hi = tl.minimum(hi, q0 + BLOCK_M + 2)
    for start_n in range(lo, sinks_end, HALF_N):
        first, previous, own, diagonal, sink_window, w_first, w_previous, w_own, w_diagonal, w_sink_window = \
            _positional(q, start_n, k_base, stride_kn, w_base, offs_m, d_ok, length, span, sink,
                        window, qk_scale, scale, softcap, top, first, previous, own, diagonal, sink_window, w_first,
                        w_previous, w_own, w_diagonal, w_sink_window, CAUSAL, HAS_SPAN, HAS_SOFTCAP, WEIGHTED,
                        WIDE, PRECISION, UPCAST, HALF_N, BLOCK_D)
    for start_n in range(near_lo, near_hi, HALF_N):
        first, previous, own, diagonal, sink_window, w_first, w_previous, w_own, w_diagonal, w_sink_window = \
            _positional(q, start_n, k_base, stride_kn, w_base, offs_m, d_ok, length, span, sink,
                        window, qk_scale, scale, softcap, top, first, previous, own, diagonal, sink_window, w_first,
                        w_previous, w_own, w_diagonal, w_sink_window, CAUSAL, HAS_SPAN, HAS_SOFTCAP, WEIGHTED,
                        WIDE, PRECISION, UPCAST, HALF_N, BLOCK_D)

    tl.store(rows + FIRST * plane, first / whole_safe, mask=row_ok)
    tl.store(rows + PREVIOUS * plane, previous / whole_safe, mask=row_ok)
    tl.store(rows + SELF * plane, own / whole_safe, mask=row_ok)
    tl.store(rows + DIAGONAL * plane, diagonal / whole_safe, mask=row_ok)
    tl.store(rows + SINK_WINDOW * plane, sink_window / whole_safe, mask=row_ok)
    if WEIGHTED:  # a~_ij = p_ij w_j / W: H~ = ln W + m - sum_j a~_ij (s_ij + ln w_j), natural logs
        if PRECISION != "ieee":  # each sum's three parts added
            column = tl.arange(0, WEIGHT_COLUMNS)[None, :] % 4
            w_l = tl.sum(tl.where(column == W_SUM, acc_w, 0.0), 1)
            w_log = tl.sum(tl.where(column == W_LOG, acc_w, 0.0), 1)
            w_dist += tl.sum(tl.where(column >= W_PLACE, acc_w, 0.0), 1)  # (i - base) W_BASE - W_PLACE, scaled
        w_safe = tl.where(w_l > 0, w_l, 1.0)
        nothing = tl.where(w_l > 0, 0.0, float("nan"))  # a row whose every key has norm 0: undefined
        tl.store(rows + VW_ENTROPY * plane,
                 top * LN2 + tl.log(w_safe) - (w_plogit * logit_scale + w_log) / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_FIRST * plane, w_first / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_PREVIOUS * plane, w_previous / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_SELF * plane, w_own / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_DIAGONAL * plane, w_diagonal / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_DISTANCE * plane, w_dist / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_SINK_WINDOW * plane, w_sink_window / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_TOTAL * plane, w_l, mask=row_ok)


@triton.jit
def _received_tile(qt_ptrs, lse_ptrs, start_m, stride_qm, k, offs_n, d_ok, length, span, qk_scale, scale, softcap,
                   got, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """One tile of rows start_m .. start_m + BLOCK_M - 1 of the received pass, transposed: the tile [key, row] of
    k.q^T, p^T = exp2(t - lse log2(e)), each key's sum a row reduction."""
    start_m = tl.multiple_of(start_m, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    ptrs = qt_ptrs + start_m.to(tl.int64) * stride_qm  # [BLOCK_D, BLOCK_M]
    if MASKED:
        row_ok = offs_m < length
        qt = tl.load(ptrs, mask=row_ok[None, :] & d_ok[:, None], other=0.0)
        lse2 = tl.load(lse_ptrs + start_m + tl.arange(0, BLOCK_M), mask=row_ok, other=0.0) * LOG2E
    else:
        if EVEN_D:
            qt = tl.load(ptrs)
        else:
            qt = tl.load(ptrs, mask=d_ok[:, None], other=0.0)
        lse2 = tl.load(lse_ptrs + start_m + tl.arange(0, BLOCK_M)) * LOG2E
    t = _log2_scores(_dot(k, qt, PRECISION, UPCAST), qk_scale, scale, softcap, HAS_SOFTCAP)  # [BLOCK_N, BLOCK_M]
    if MASKED:
        ok = tl.trans(_allowed(offs_m, offs_n, length, span, CAUSAL, HAS_SPAN)) & row_ok[None, :]
        p = tl.where(ok, tl.exp2(tl.where(ok, t, 0.0) - lse2[None, :]), 0.0)
    else:
        p = tl.exp2(t - lse2[None, :])
    return got + tl.sum(p, 1)


@triton.jit(do_not_specialize=["n"])
def received_pass(
    Q, K, Lse, Received, Lengths,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    heads, groups, n, dim, scale, softcap, span,
    CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of keys of one (sequence, head): the mass each receives, sum_i p_ij over the real rows i, with p_ij
    recomputed from the saved logsumexp, shaped like FlashAttention's backward (dK/dV): the rows every key of the
    block may be seen by run unmasked, the diagonal, window-edge and padding-tail rows masked. Writes Received
    [batch, head, key] (0 on padded keys)."""
    bh = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements at long context
    pid_n = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    kvh = h // groups
    length = tl.load(Lengths + b)
    k0 = pid_n * BLOCK_N
    offs_n = k0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    key_ok = offs_n < length
    k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D], read once
    qt_ptrs = Q + b * stride_qb + h * stride_qh + tl.arange(0, BLOCK_M)[None, :] * stride_qm + offs_d[:, None]
    lse_ptrs = Lse + bh * n
    qk_scale = scale * LOG2E
    zero = length * 0
    hi = length  # real rows only
    lo = zero
    full_lo = zero
    full_hi = _down(length, BLOCK_M)
    if CAUSAL:  # rows i >= j of every key: i >= k0 + BLOCK_N - 1
        lo = _down(k0, BLOCK_M)
        full_lo = _up(k0 + BLOCK_N - 1, BLOCK_M)
        if HAS_SPAN:  # and i < j + span: i <= k0 + span - 1
            hi = tl.minimum(length, k0 + BLOCK_N + span)
            full_hi = tl.minimum(full_hi, _down(k0 + span, BLOCK_M))
    else:
        if HAS_SPAN:  # |i - j| <= span for every key
            lo = _down(tl.maximum(zero, k0 - span), BLOCK_M)
            hi = tl.minimum(length, k0 + BLOCK_N + span)
            full_lo = _up(tl.maximum(zero, k0 + BLOCK_N - 1 - span), BLOCK_M)
            full_hi = tl.minimum(full_hi, _down(k0 + span + 1, BLOCK_M))
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b_end = tl.maximum(tl.minimum(full_hi, hi), a)
    got = tl.zeros([BLOCK_N], tl.float32)
    for start_m in range(a, b_end, BLOCK_M):  # the main loop: rows that see every key of the block
        got = _received_tile(qt_ptrs, lse_ptrs, start_m, stride_qm, k, offs_n, d_ok, length, span, qk_scale, scale,
                             softcap, got, False, CAUSAL, HAS_SPAN, HAS_SOFTCAP, EVEN_D, PRECISION, UPCAST, BLOCK_M)
    for start_m in range(lo, a, BLOCK_M):
        got = _received_tile(qt_ptrs, lse_ptrs, start_m, stride_qm, k, offs_n, d_ok, length, span, qk_scale, scale,
                             softcap, got, True, CAUSAL, HAS_SPAN, HAS_SOFTCAP, EVEN_D, PRECISION, UPCAST, BLOCK_M)
    for start_m in range(b_end, hi, BLOCK_M):
        got = _received_tile(qt_ptrs, lse_ptrs, start_m, stride_qm, k, offs_n, d_ok, length, span, qk_scale, scale,
                             softcap, got, True, CAUSAL, HAS_SPAN, HAS_SOFTCAP, EVEN_D, PRECISION, UPCAST, BLOCK_M)
    tl.store(Received + bh * n + offs_n, tl.where(key_ok, got, 0.0), mask=offs_n < n)


@triton.jit(do_not_specialize=["n"])
def duplicate_pass(
    Q, K, Lse, Duplicate, Positions, Groups, Tiles,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    heads, groups, n, dim, scale, softcap, span,
    CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One tile of the positions sorted by token (duplicates.TokenTiles) of one head: rows Positions[r0:r1] against
    keys Positions[c0:c1] of the same sentence, p_ij = exp2(t_ij - lse_i log2(e)) summed over the pairs of one group
    (the same token) that the layer's mask allows, j != i. Writes Duplicate [batch, head, q] at the tile's rows (each
    position is a row of one tile only)."""
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(Tiles + tile * 5).to(tl.int64)
    r0 = tl.load(Tiles + tile * 5 + 1)
    r1 = tl.load(Tiles + tile * 5 + 2)
    c0 = tl.load(Tiles + tile * 5 + 3)
    c1 = tl.load(Tiles + tile * 5 + 4)
    kvh = h // groups
    bh = b * heads + h
    at = r0 + tl.arange(0, BLOCK_M)
    row_ok = at < r1
    i = tl.load(Positions + at, mask=row_ok, other=0)  # [BLOCK_M] positions in the sentence
    group = tl.load(Groups + at, mask=row_ok, other=-1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + i[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(Lse + bh * n + i, mask=row_ok, other=0.0) * LOG2E
    k_base = K + b * stride_kb + kvh * stride_kh
    qk_scale = scale * LOG2E
    mass = tl.zeros([BLOCK_M], tl.float32)
    for start in range(c0, c1, BLOCK_N):
        at_k = start + tl.arange(0, BLOCK_N)
        key_ok = at_k < c1
        j = tl.load(Positions + at_k, mask=key_ok, other=0)
        key_group = tl.load(Groups + at_k, mask=key_ok, other=-2)
        k = tl.load(k_base + j[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        t = _log2_scores(_dot(q, k, PRECISION, UPCAST), qk_scale, scale, softcap, HAS_SOFTCAP)
        diff = i[:, None] - j[None, :]
        same = (group[:, None] == key_group[None, :]) & (diff != 0) & row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            same = same & (diff > 0)
            if HAS_SPAN:
                same = same & (diff < span)
        else:
            if HAS_SPAN:
                same = same & (diff <= span) & (diff >= -span)
        mass += tl.sum(tl.where(same, tl.exp2(tl.where(same, t, 0.0) - lse2[:, None]), 0.0), 1)
    tl.store(Duplicate + bh * n + i, mass, mask=row_ok)
