"""Names of the value-weighted scores, in a module without torch (report and classify read them at start-up)."""

POSITION_METRICS = ("entropy", "entropy_norm", "first_token", "diagonal", "distance", "sink_window")
# Value-weighted scores (attnprobe.values): the same statistics of a~_ij = a_ij |f_h(x_j)| / sum_k a_ik |f_h(x_k)|,
# each over the rows its raw score uses, as `<score>_vw`; and `output_norm`, the mean of |sum_j a_ij f_h(x_j)|.
VALUE_WEIGHTED = (
    "entropy", "entropy_norm", "diagonal", "first_token", "previous_token", "self", "distance", "sink_window",
    "entropy_unforced", "diagonal_unforced", "first_token_unforced",
)
VW = "_vw"
OUTPUT_NORM = "output_norm"
VW_METRICS = (*(name + VW for name in VALUE_WEIGHTED), OUTPUT_NORM)
VW_POSITION_METRICS = (*(name + VW for name in POSITION_METRICS), OUTPUT_NORM)
