"""The io package's shared pieces (issue 36): maps.map_fault, the one check of stored and checkpointed attention maps,
and run.json's `files` record parsed once per text, never answered from memory after the file changes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from attnprobe import io
from attnprobe.errors import AttnprobeError
from attnprobe.maps import map_fault, map_problem


def uniform(layers: int = 2, heads: int = 3, n: int = 4) -> np.ndarray:
    """[layer, head, n, n] maps whose every row spreads 1 evenly over its n keys: attention maps exactly."""
    return np.full((layers, heads, n, n), 1 / n, dtype=np.float32)


def test_maps_that_are_attention_maps_pass():
    assert map_problem(uniform()) is None
    assert map_fault(uniform().astype(np.float64), 0.0, 1e-6, whole_rows=True) is None
    assert map_problem(np.zeros((0, 0, 0, 0), dtype=np.float32)) is None


@pytest.mark.parametrize(("bad", "words"), [(np.nan, "1 of its 96 weights are not finite numbers"),
                                            (np.inf, "1 of its 96 weights are not finite numbers"),
                                            (-0.5, "its weights run from -0.5 to 0.25"),
                                            (7.0, "its weights run from 0.25 to 7")])
def test_map_problem_names_the_weight_at_fault(bad, words):
    maps = uniform()
    maps[1, 2, 3, 0] = bad
    fault = map_fault(maps, 0.0, 0.0)
    assert fault is not None and not fault.in_rows and fault.bad.sum() == 1 and fault.bad[1, 2, 3, 0]
    assert words in map_problem(maps)


def test_map_problem_allows_float16_rounding_and_no_more():
    """A stored map may sum above 1 by float16's rounding over its row (4 eps16 per key: 4 * 2**-10 * 4 = 2**-6 for
    4 keys); a weight or a row past that is refused, the row as its sum."""
    slack = 4 * 2**-10 * 4
    maps = uniform()
    maps[0, 0, 0] = [1 + slack, 0, 0, 0]  # one weight at the bound exactly: a probability rounded in float16
    assert map_problem(maps) is None
    maps[0, 0, 0] = [0.5 + slack, 0.5, 0, 0]  # a row summing to 1 + slack: still allowed
    assert map_problem(maps) is None
    maps[0, 0, 0] = [0.5 + slack, 0.5 + slack, 0, 0]  # a row summing to 1 + 2 slack
    assert map_problem(maps) == f"a row of its weights sums to {1 + 2 * slack:.3g}, more than 1"
    maps[0, 0, 0] = [1 + 2 * slack, 0, 0, 0]  # a weight past the bound is named as a weight
    assert "its weights run from 0 to" in map_problem(maps)


def test_whole_rows_must_sum_to_one_cut_rows_at_most_one():
    """A checkpoint's maps (resume.check_example_maps): whole rows sum to 1 within the tolerance; an encoder's cut
    rows (whole_rows False) may sum to less, never to more; a weight above 1 is refused with no slack at all."""
    maps = uniform().astype(np.float64)
    maps[1, 0, 2] *= 0.5  # one row sums to 0.5
    fault = map_fault(maps, 0.0, 1e-6, whole_rows=True)
    assert fault is not None and fault.in_rows and fault.bad.sum() == 1 and fault.values[1, 0, 2] == 0.5
    assert map_fault(maps, 0.0, 1e-6, whole_rows=False) is None
    maps[1, 0, 2] = [1 + 1e-9, 0, 0, 0]
    assert not map_fault(maps, 0.0, 1e-6).in_rows


def write_record(folder, digest: str) -> None:
    (folder / io.RUN_FILE).write_text(json.dumps({"model": "m", io.RUN_FILES_KEY: {io.HEADS_FILE: digest}}),
                                      encoding="utf-8")


def test_a_changed_record_is_read_afresh_even_at_the_same_size_and_time(tmp_path):
    """The parsed record is remembered by run.json's text, not by its size and time: a copy from another run of the
    same length written within the same clock tick is seen as the new record."""
    write_record(tmp_path, "a" * 64)
    stat = (tmp_path / io.RUN_FILE).stat()
    assert io.recorded_files(tmp_path) == {io.HEADS_FILE: "a" * 64}
    write_record(tmp_path, "b" * 64)
    os.utime(tmp_path / io.RUN_FILE, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (tmp_path / io.RUN_FILE).stat().st_size == stat.st_size
    assert io.recorded_files(tmp_path) == {io.HEADS_FILE: "b" * 64}
    write_record(tmp_path, "not a sha256")
    with pytest.raises(AttnprobeError, match="not a file name -> sha256 object"):
        io.recorded_files(tmp_path)
    (tmp_path / io.RUN_FILE).unlink()
    assert io.recorded_files(tmp_path) is None


def test_a_caller_changing_the_record_changes_no_later_answer(tmp_path):
    write_record(tmp_path, "c" * 64)
    io.recorded_files(tmp_path)[io.HEADS_FILE] = "d" * 64
    assert io.recorded_files(tmp_path) == {io.HEADS_FILE: "c" * 64}
