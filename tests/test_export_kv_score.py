"""export's kv score (analyze only): the far share (1 - sink_window) / (1 - first_token), against a hand computation."""

import numpy as np
import pandas as pd
import pytest

from attnprobe.errors import AttnprobeError
from attnprobe.export import far_share, kv_scores, pool_kv_heads


def heads_table(sink_window, first_token):
    """heads.csv's rows for a model of len(values) / 2 layers x 2 heads."""
    count = len(sink_window)
    return pd.DataFrame({"layer": [i // 2 for i in range(count)], "head": [i % 2 for i in range(count)],
                         "sink_window": sink_window, "first_token": first_token})


def test_kv_score_is_the_far_share_of_the_attention_not_on_the_first_token():
    heads = heads_table([0.9, np.nan, 0.25, 1.0, 0.6, 0.5], [0.5, 0.2, np.nan, 1.0, 0.8, 1.0])
    expected = [[0.1 / 0.5, 1.0],  # 0.1 of far mass among 0.5 not on the first token; undefined sink_window: keep
                [0.75 / 1.0, 0.0],  # undefined first_token counts as 0; all on the first token, nothing far: 0
                [1.0, 1.0]]  # 0.4 / 0.2 = 2 is clipped to 1; far mass but none off the first token: 1
    assert np.allclose(kv_scores(heads, 3, 2), expected)
    assert np.allclose(pool_kv_heads(kv_scores(heads, 3, 2), 1), [[1.0], [0.75], [1.0]])  # one KV head a layer


def test_a_head_that_parks_on_the_first_token_outranks_a_local_one():
    # A retrieval head on ordinary text: most attention on the first token, the rest far back. A local head: nothing
    # on the first token, most in the recent window. 1 - sink_window ranks the local head higher (0.2 > 0.1).
    heads = heads_table([0.9, 0.8], [0.85, 0.0])
    assert np.allclose(kv_scores(heads, 1, 2), [[0.1 / 0.15, 0.2]])


def test_without_first_token_the_score_is_one_minus_sink_window():
    heads = heads_table([0.9, 0.25], [0.5, 0.5]).drop(columns="first_token")
    assert np.allclose(kv_scores(heads, 1, 2), [[0.1, 0.75]])
    assert np.allclose(far_share(np.array([0.3]), np.array([0.0])), [0.7])


def test_a_first_token_outside_zero_one_or_not_a_number_is_a_one_line_error():
    with pytest.raises(AttnprobeError, match="first_token outside") as error:
        kv_scores(heads_table([0.9, 0.25], [0.5, 1.5]), 1, 2)
    assert "\n" not in str(error.value)
    heads = heads_table([0.9, 0.25], [0.5, 0.5])
    heads["first_token"] = ["half", "half"]
    with pytest.raises(AttnprobeError, match="not numbers in first_token"):
        kv_scores(heads, 1, 2)
