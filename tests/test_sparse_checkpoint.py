"""Checkpoints keep only the top-token rows a run has met, and a resumed run keeps them sparse (issue 28, item 5a):
the [vocab, layer, head] top-token sums are saved as the rows of the token ids tokcount counts plus their ids
(`tokrows`), validated against tokcount on resume, and written back row by row."""

import ctypes
import mmap
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint_validation import analyze, arrays, assert_refused, corpus, stop, stopped, whole  # noqa: F401


def test_the_checkpoint_holds_the_rows_of_the_tokens_met_only(stopped):  # noqa: F811
    fields = arrays(stopped["late"])
    met = np.flatnonzero(fields["sum:tokcount"])
    vocab = len(fields["sum:tokcount"])
    assert 0 < len(met) < vocab  # the tiny model's 65 ids: its corpus meets 63
    assert fields["tokrows"].dtype == np.int64 and (fields["tokrows"] == met).all()
    assert fields["sum:tokmass"].shape[0] == len(met) and fields["sum:tokuniform"].shape[0] == len(met)
    assert (np.abs(fields["sum:tokmass"]).reshape(len(met), -1).sum(axis=1) > 0).all()  # each row met holds mass


def dense(fields):
    """The layout of attnprobe before `tokrows`: the top-token sums whole, [vocab, ...]."""
    rows, vocab = fields.pop("tokrows"), len(fields["sum:tokcount"])
    for key in ("sum:tokmass", "sum:tokuniform"):
        whole_table = np.zeros((vocab, *fields[key].shape[1:]))
        whole_table[rows] = fields[key]
        fields[key] = whole_table


def tampered(stopped, tmp_path, change):  # noqa: F811
    out = tmp_path / "out"
    shutil.copytree(stopped["late"], out)
    fields = arrays(out)
    change(fields)
    np.savez_compressed(out / "checkpoint.npz", **fields)
    return out


def test_a_checkpoint_with_the_sums_whole_still_resumes_to_the_same_results(gpt2_dir, corpus, stopped, whole,  # noqa: F811
                                                                             tmp_path):
    out = tampered(stopped, tmp_path, dense)
    result = analyze(gpt2_dir, corpus, out, "--resume")
    assert result.exit_code == 0, result.output
    for name in ("heads.csv", "top_tokens.csv"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


def test_whole_sums_with_mass_at_a_token_never_met_are_refused(gpt2_dir, corpus, stopped, tmp_path):  # noqa: F811
    def change(fields):
        dense(fields)
        never = int(np.flatnonzero(fields["sum:tokcount"] == 0)[0])
        fields["sum:tokmass"][never, 1, 0] = 0.25

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "tokmass holds mass at token id", "tokcount counts no key position")


@pytest.mark.parametrize("how", ["drop", "shift", "swap"])
def test_token_rows_that_disagree_with_tokcount_are_refused(gpt2_dir, corpus, stopped, tmp_path, how):  # noqa: F811
    def change(fields):
        rows = fields["tokrows"]
        if how == "drop":  # one id fewer, and its rows with it: the shapes agree, tokcount does not
            fields["tokrows"] = rows[1:]
            fields["sum:tokmass"], fields["sum:tokuniform"] = fields["sum:tokmass"][1:], fields["sum:tokuniform"][1:]
        elif how == "shift":
            rows[-1] += 1
        else:
            rows[[0, 1]] = rows[[1, 0]]

    out = tampered(stopped, tmp_path, change)
    assert_refused(gpt2_dir, corpus, out, "tokrows lists", "tokcount counts")


def test_token_rows_of_another_length_than_the_sums_are_refused(gpt2_dir, corpus, stopped, tmp_path):  # noqa: F811
    out = tampered(stopped, tmp_path, lambda f: f.update(tokrows=f["tokrows"][1:]))
    assert_refused(gpt2_dir, corpus, out, "sum tokmass has shape")


def test_token_rows_that_are_not_ids_are_refused(gpt2_dir, corpus, stopped, tmp_path):  # noqa: F811
    out = tampered(stopped, tmp_path, lambda f: f.update(tokrows=f["tokrows"].astype(np.float64)))
    assert_refused(gpt2_dir, corpus, out, "damaged", "tokrows is not a list of token ids")


def resident_bytes(array: np.ndarray) -> int:
    """The bytes of `array`'s pages that are mapped in (Linux mincore)."""
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = array.ctypes.data - array.ctypes.data % mmap.PAGESIZE
    length = array.ctypes.data + array.nbytes - start
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0
    return sum(v & 1 for v in vector) * mmap.PAGESIZE


RESTORE_SCRIPT = """
import json, mmap, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_sparse_checkpoint import resident_bytes
from attnprobe.accumulate import Accumulator, Shape
from attnprobe.allocator import reuse_freed_memory
reuse_freed_memory()  # as the CLI does before a resume
shape = Shape(("entropy",), (), 4, 8, 1, 10, 0, (), vocab=200_000)  # tokmass: 51 MB whole
saved = Accumulator(shape)
met = np.array([5, 70_000, 199_999])
saved.sums["tokmass"][met] = 1.0
saved.sums["tokuniform"][met] = 2.0
saved.sums["tokcount"][met] = 3.0
restored = Accumulator(shape)
sums = {key: value.copy() for key, value in saved.state().items()}
sums.update(tokmass=sums["tokmass"][met], tokuniform=sums["tokuniform"][met])
restored.restore(sums, met)
table = restored.state()["tokmass"]
resident = resident_bytes(table)  # before anything reads the table (reading maps pages)
print(json.dumps({"resident": resident, "page": mmap.PAGESIZE, "met": bool((table[met] == 1.0).all()),
                  "sum": float(table.sum()), "uniform": float(restored.state()["tokuniform"].sum())}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")
def test_a_restored_accumulator_maps_in_only_the_rows_met():
    """In a fresh process, as a resumed CLI run is (a long test session's heap and allocator state are not a run's):
    the restored top-token table maps in a page or two per row met, not 51 MB."""
    import json
    import subprocess

    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", RESTORE_SCRIPT, tests], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["resident"] <= 16 * found["page"], found
    assert found["met"] and found["sum"] == 3 * 32 and found["uniform"] == 24
