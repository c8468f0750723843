"""The Triton kernels of the Triton path (kernel/triton_path.py calls them): `stats_forward`, one pass of online
softmax over key blocks per block of query rows that writes the attention output, each row's logsumexp and the sums
every row statistic is made of, for the map and its value-weighted map; and `received_pass`, the key-parallel pass
that recomputes p_ij = exp(s_ij - lse_i) from the saved logsumexp (as FlashAttention's backward does) and sums each
key's column over the real rows.

Imported only when the Triton path runs (this module imports triton): under TRITON_INTERPRET=1, set before this
module is first imported, the kernels run on a CPU through Triton's interpreter (the tests). Written for the
compiler: block sizes are constexpr and at least 16 (tl.dot), accumulators float32, no Python branch on a tensor
value; float32 inputs multiply in IEEE float32 (no TF32). Masked lanes keep a finite score and a weight of 0 (tl.where),
so no -inf * 0 makes a NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Rows of `Stats`, in triton_path.STATS's order: the map's sums, then the value-weighted map's (constexpr: a jitted
# function reads no other global).
(ENTROPY, FIRST, PREVIOUS, SELF, DIAGONAL, DISTANCE, SINK_WINDOW, SPECIAL, PUNCTUATION, DUPLICATE, HAS_DUPLICATE,
 VW_ENTROPY, VW_FIRST, VW_PREVIOUS, VW_SELF, VW_DIAGONAL, VW_DISTANCE, VW_SINK_WINDOW, VW_TOTAL) = (
    tl.constexpr(k) for k in range(19))
STAT_ROWS = 19
MAP_ROWS = 11  # the map's rows only (Stats holds no more without WEIGHTED)


@triton.jit
def _tanh(x):
    """tanh from exp (tl has no tanh before triton 3.3 everywhere): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST (the interpreter only, whose tl.dot reads bfloat16 as integers): the
    operands in float32 first, which gives the same products (a product of two 8-bit mantissas is exact in float32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(q, k_ptrs, key_ok, scale, softcap, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr):
    """The scaled (and soft-capped) scores of a tile, float32 [BLOCK_M, BLOCK_N]; k_ptrs point at [BLOCK_D, BLOCK_N]."""
    k = tl.load(k_ptrs, mask=key_ok, other=0.0)
    s = _dot(q, k, PRECISION, UPCAST) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@triton.jit
def _allowed(offs_m, offs_n, length, span, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr):
    """Which keys each row may see [BLOCK_M, BLOCK_N]: real keys, j <= i when causal, and within the window."""
    diff = offs_m[:, None] - offs_n[None, :]  # i - j
    ok = (offs_n[None, :] < length) & (offs_m[:, None] >= 0)  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        ok = ok & (diff >= 0)
        if HAS_SPAN:
            ok = ok & (diff < span)
    else:
        if HAS_SPAN:
            ok = ok & (diff <= span) & (diff >= -span)
    return ok


@triton.jit
def _key_range(q0, length, span, CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The first (aligned to BLOCK_N) and one past the last key a block of rows q0 .. q0 + BLOCK_M - 1 may see."""
    hi = length
    lo = length * 0  # a tensor either way (a jitted function returns one type)
    if CAUSAL:
        hi = tl.minimum(length, q0 + BLOCK_M)
        if HAS_SPAN:
            lo = tl.maximum(0, q0 - span + 1)
    else:
        if HAS_SPAN:
            lo = tl.maximum(0, q0 - span)
            hi = tl.minimum(length, q0 + BLOCK_M + span)
    lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit(do_not_specialize=["n", "stride_tok", "plane"])  # one compile for every sequence length
def stats_forward(
    Q, K, V, Out, Lse, Stats, Lengths, Norms, Special, Punct, Ids, Sinks,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_tok,
    heads, groups, n, dim, plane, scale, softcap, span, sink, window,
    CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WEIGHTED: tl.constexpr, HAS_SPECIAL: tl.constexpr, HAS_TOKENS: tl.constexpr, NEED_OUT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of query rows of one (sequence, head): online softmax over its key blocks, with the statistics'
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

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
    tail = tl.zeros([BLOCK_M], tl.float32)  # the sink logit's share of the total, rescaled (0 without sinks)
    if HAS_SINKS:
        m = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + h)
        tail = tl.zeros([BLOCK_M], tl.float32) + 1.0
    total = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp(s_ij - m) over the keys
    plogit = tl.zeros([BLOCK_M], tl.float32)  # sum_j exp(s_ij - m) s_ij
    first = tl.zeros([BLOCK_M], tl.float32)
    previous = tl.zeros([BLOCK_M], tl.float32)
    own = tl.zeros([BLOCK_M], tl.float32)
    diagonal = tl.zeros([BLOCK_M], tl.float32)
    distance = tl.zeros([BLOCK_M], tl.float32)
    sink_window = tl.zeros([BLOCK_M], tl.float32)
    special = tl.zeros([BLOCK_M], tl.float32)
    punct = tl.zeros([BLOCK_M], tl.float32)
    duplicate = tl.zeros([BLOCK_M], tl.float32)
    has_duplicate = tl.zeros([BLOCK_M], tl.float32)  # a count of such keys, not rescaled
    w_total = tl.zeros([BLOCK_M], tl.float32)  # the value-weighted map's sums: sum_j exp(s_ij - m) w_j ...
    w_plogit = tl.zeros([BLOCK_M], tl.float32)
    w_first = tl.zeros([BLOCK_M], tl.float32)
    w_previous = tl.zeros([BLOCK_M], tl.float32)
    w_own = tl.zeros([BLOCK_M], tl.float32)
    w_diagonal = tl.zeros([BLOCK_M], tl.float32)
    w_distance = tl.zeros([BLOCK_M], tl.float32)
    w_sink_window = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_ids = tl.zeros([BLOCK_M], tl.int64)
    if HAS_TOKENS:
        row_ids = tl.load(Ids + b * stride_tok + offs_m, mask=offs_m < n, other=-1).to(tl.int64)

    lo, hi = _key_range(q0, length, span, CAUSAL, HAS_SPAN, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < length
        s = _scores(q, k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
                    key_ok[None, :] & d_ok[:, None], scale, softcap, HAS_SOFTCAP, PRECISION, UPCAST)
        ok = _allowed(offs_m, offs_n, length, span, CAUSAL, HAS_SPAN)
        s = tl.where(ok, s, 0.0)  # finite everywhere: p is 0 where masked, so p * s is 0 there (never -inf * 0)
        m_new = tl.maximum(m, tl.max(tl.where(ok, s, float("-inf")), 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
        alpha = tl.exp(m - m_safe)
        p = tl.where(ok, tl.exp(s - m_safe[:, None]), 0.0)  # [BLOCK_M, BLOCK_N]
        diff = offs_m[:, None] - offs_n[None, :]  # i - j
        dist = tl.abs(diff).to(tl.float32)
        tail = tail * alpha
        total = total * alpha + tl.sum(p, 1)
        plogit = plogit * alpha + tl.sum(p * s, 1)
        distance = distance * alpha + tl.sum(p * dist, 1)
        if HAS_SPECIAL:
            flags = tl.load(Special + b * stride_tok + offs_n, mask=key_ok, other=0.0)
            special = special * alpha + tl.sum(p * flags[None, :], 1)
        if HAS_TOKENS:
            flags = tl.load(Punct + b * stride_tok + offs_n, mask=key_ok, other=0.0)
            punct = punct * alpha + tl.sum(p * flags[None, :], 1)
            key_ids = tl.load(Ids + b * stride_tok + offs_n, mask=key_ok, other=-2).to(tl.int64)
            same = (row_ids[:, None] == key_ids[None, :]) & (diff != 0) & ok
            duplicate = duplicate * alpha + tl.sum(tl.where(same, p, 0.0), 1)
            has_duplicate = has_duplicate + tl.sum(tl.where(same, 1.0, 0.0), 1)
        pw = p  # the value-weighted map's weights exp(s_ij - m) |f_h(x_j)| (WEIGHTED)
        if WEIGHTED:
            w = tl.load(Norms + bh * n + offs_n, mask=key_ok, other=0.0)  # |f_h(x_j)|
            pw = p * w[None, :]
            log_w = tl.log(tl.where(w > 0, w, 1.0))
            w_total = w_total * alpha + tl.sum(pw, 1)
            w_plogit = w_plogit * alpha + tl.sum(pw * (s + log_w[None, :]), 1)
            w_distance = w_distance * alpha + tl.sum(pw * dist, 1)
        # The positional sums touch few tiles (key 0's; those within 2 of the block's rows; the sink's and the recent
        # window's): rescaled in every tile, summed only in those.
        first, w_first = first * alpha, w_first * alpha
        previous, own, diagonal = previous * alpha, own * alpha, diagonal * alpha
        w_previous, w_own, w_diagonal = w_previous * alpha, w_own * alpha, w_diagonal * alpha
        sink_window, w_sink_window = sink_window * alpha, w_sink_window * alpha
        if start_n == 0:
            at_first = offs_n[None, :] == 0
            first += tl.sum(tl.where(at_first, p, 0.0), 1)
            if WEIGHTED:
                w_first += tl.sum(tl.where(at_first, pw, 0.0), 1)
        if (start_n <= q0 + BLOCK_M + 1) & (start_n + BLOCK_N >= q0 - 1):
            at_previous = diff == 1
            at_self = diff == 0
            near = (diff <= 2) & (diff >= -2)
            previous += tl.sum(tl.where(at_previous, p, 0.0), 1)
            own += tl.sum(tl.where(at_self, p, 0.0), 1)
            diagonal += tl.sum(tl.where(near, p, 0.0), 1)
            if WEIGHTED:
                w_previous += tl.sum(tl.where(at_previous, pw, 0.0), 1)
                w_own += tl.sum(tl.where(at_self, pw, 0.0), 1)
                w_diagonal += tl.sum(tl.where(near, pw, 0.0), 1)
        if CAUSAL:  # an encoder's sink_window is undefined (NaN, set by the caller)
            if (start_n < sink) | (start_n + BLOCK_N > q0 - window + 1):
                in_sink_window = (offs_n[None, :] < sink) | (diff < window)
                sink_window += tl.sum(tl.where(in_sink_window, p, 0.0), 1)
                if WEIGHTED:
                    w_sink_window += tl.sum(tl.where(in_sink_window, pw, 0.0), 1)
        if NEED_OUT:
            v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                        mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m = m_new

    m_safe = tl.where(m == float("-inf"), 0.0, m)
    whole = total + tail  # the softmax's denominator (with the sink's share)
    some = whole > 0
    whole_safe = tl.where(some, whole, 1.0)  # a row that sees no key (padding beyond a window): zeros, never NaN
    lse = m_safe + tl.log(whole_safe)
    row_ok = offs_m < n
    tl.store(Lse + bh * n + offs_m, lse, mask=row_ok)
    if NEED_OUT:
        out = acc / whole_safe[:, None]
        tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    rows = Stats + bh * n + offs_m  # `plane` apart: one statistic's [batch, head, q]
    plane = bh * 0 + plane  # int64: STAT_ROWS planes of batch x head x q pass 2**31 elements before one plane does
    tl.store(rows + ENTROPY * plane, (lse * total - plogit) / whole_safe, mask=row_ok)  # -sum p ln p
    tl.store(rows + FIRST * plane, first / whole_safe, mask=row_ok)
    tl.store(rows + PREVIOUS * plane, previous / whole_safe, mask=row_ok)
    tl.store(rows + SELF * plane, own / whole_safe, mask=row_ok)
    tl.store(rows + DIAGONAL * plane, diagonal / whole_safe, mask=row_ok)
    tl.store(rows + DISTANCE * plane, distance / whole_safe, mask=row_ok)
    tl.store(rows + SINK_WINDOW * plane, sink_window / whole_safe, mask=row_ok)
    tl.store(rows + SPECIAL * plane, special / whole_safe, mask=row_ok)
    tl.store(rows + PUNCTUATION * plane, punct / whole_safe, mask=row_ok)
    tl.store(rows + DUPLICATE * plane, duplicate / whole_safe, mask=row_ok)
    tl.store(rows + HAS_DUPLICATE * plane, has_duplicate, mask=row_ok)
    if WEIGHTED:  # a~_ij = exp(s_ij - m) w_j / w_total: H~ = ln w_total + m - sum_j a~_ij (s_ij + ln w_j)
        w_safe = tl.where(w_total > 0, w_total, 1.0)
        nothing = tl.where(w_total > 0, 0.0, float("nan"))  # a row whose every key has norm 0: undefined
        tl.store(rows + VW_ENTROPY * plane, m_safe + tl.log(w_safe) - w_plogit / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_FIRST * plane, w_first / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_PREVIOUS * plane, w_previous / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_SELF * plane, w_own / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_DIAGONAL * plane, w_diagonal / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_DISTANCE * plane, w_distance / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_SINK_WINDOW * plane, w_sink_window / w_safe + nothing, mask=row_ok)
        tl.store(rows + VW_TOTAL * plane, w_total, mask=row_ok)


@triton.jit(do_not_specialize=["n"])
def received_pass(
    Q, K, Lse, Received, Lengths,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    heads, groups, n, dim, scale, softcap, span,
    CAUSAL: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One block of keys of one (sequence, head): the mass each receives, sum_i p_ij over the real rows i, with p_ij
    recomputed from the saved logsumexp. Writes Received [batch, head, key] (0 on padded keys)."""
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
    k_ptrs = K + b * stride_kb + kvh * stride_kh + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None]
    k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N], read once
    lo = length * 0
    hi = length  # real rows only
    if CAUSAL:
        lo = k0
        if HAS_SPAN:
            hi = tl.minimum(length, k0 + BLOCK_N + span)
    else:
        if HAS_SPAN:
            lo = tl.maximum(0, k0 - span)
            hi = tl.minimum(length, k0 + BLOCK_N + span)
    lo = (lo // BLOCK_M) * BLOCK_M
    got = tl.zeros([BLOCK_N], tl.float32)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < length
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(Lse + bh * n + offs_m, mask=row_ok, other=0.0)
        s = _dot(q, k, PRECISION, UPCAST) * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        ok = _allowed(offs_m, offs_n, length, span, CAUSAL, HAS_SPAN) & row_ok[:, None]
        p = tl.where(ok, tl.exp(tl.where(ok, s, 0.0) - lse[:, None]), 0.0)
        got += tl.sum(p, 0)
    tl.store(Received + bh * n + offs_n, got, mask=offs_n < n)
