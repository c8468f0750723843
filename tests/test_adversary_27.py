"""Issue 27's adversary cases: each once exited 0 with wrong results or ended in a traceback."""

from __future__ import annotations

import json

import pytest
from conftest import CORPUS_PATH, make_gpt2, restamp

from attnprobe.errors import AttnprobeError


def run_cli(args: list[str]):
    from typer.testing import CliRunner

    from attnprobe.cli import app

    return CliRunner().invoke(app, args)


def one_error_line(result) -> str:
    """The CLI failed with one plain error line (no traceback), its last; notes may come before it."""
    text = result.output.strip()
    assert result.exit_code != 0, text
    assert "Traceback" not in text and isinstance(result.exception, SystemExit), text
    errors = [line for line in text.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and text.splitlines()[-1] == errors[0], text
    return errors[0]


# ---- case 3: the truncation warning counts the tokens beyond the limit, never as a negative number ---------------


def test_truncation_counts_tokens_beyond_the_limit_and_says_more_than_for_a_clipped_line(gpt2_dir, tmp_path):
    from attnprobe.analysis import analyze_loaded, truncation_message
    from attnprobe.corpus import CHARS_PER_TOKEN, read_corpus
    from attnprobe.model import load_model

    loaded = load_model(str(gpt2_dir), "cpu")
    over = 7
    words = loaded.max_length + over  # "cat" is one token of the word-level tokenizer, no special tokens
    huge = "cat " * (loaded.max_length * CHARS_PER_TOKEN)  # far beyond the characters kept before tokenizing
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["Rain fell.", " ".join(["cat"] * words), huge]) + "\n", encoding="utf-8")
    run = analyze_loaded(loaded, read_corpus(corpus), resamples=10).run
    exact, clipped = run["truncated_lines"]
    assert exact == {"line": 2, "tokens_cut": over, "at_least": False}
    assert clipped["line"] == 3 and clipped["at_least"] and 0 < clipped["tokens_cut"] < len(huge.split())
    message = truncation_message(run)
    assert f"line 2 ({over} tokens over the limit)" in message
    assert f"line 3 (more than {clipped['tokens_cut']} tokens over the limit)" in message
    assert "(-" not in message


# ---- case 6: weights that do not fill the model the config describes are refused, not made up -------------------


def _with_config(source, target, **changes):
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def gpt2_two(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("gpt2-two"), layers=2)


@pytest.mark.parametrize("case", ["more layers", "fewer layers", "llama config", "missing tensor"])
def test_weights_that_do_not_match_the_config_are_refused(gpt2_two, llama_dir, tmp_path, case):
    from safetensors.torch import load_file, save_file

    from attnprobe.model import load_model

    if case == "more layers":
        folder, named = _with_config(gpt2_two, tmp_path / "m", n_layer=3), "lacks h.2."
    elif case == "fewer layers":
        folder, named = _with_config(gpt2_two, tmp_path / "m", n_layer=1), "has extra h.1."
    elif case == "llama config":
        llama = json.loads((llama_dir / "config.json").read_text())
        folder, named = _with_config(gpt2_two, tmp_path / "m"), "lacks embed_tokens.weight"
        (folder / "config.json").write_text(json.dumps(llama))
    else:
        folder = _with_config(gpt2_two, tmp_path / "m")
        tensors = load_file(folder / "model.safetensors")
        del tensors["h.1.attn.c_proj.weight"]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        named = "lacks h.1.attn.c_proj.weight,"
    with pytest.raises(AttnprobeError, match="weights do not match its config.json") as caught:
        load_model(str(folder), "cpu")
    assert named in str(caught.value) and "\n" not in str(caught.value)
    result = run_cli(["analyze", "--model", str(folder), "--corpus", str(CORPUS_PATH), "--out", str(tmp_path / "o"),
                      "--limit", "4", "--resamples", "5", "--device", "cpu"])
    assert named in one_error_line(result)
    assert not (tmp_path / "o" / "heads.csv").exists()


def test_matching_weights_still_load_with_and_without_a_head(gpt2_two, llama_dir, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnprobe.model import load_model

    assert load_model(str(gpt2_two), "cpu").num_layers == 2
    assert load_model(str(gpt2_two), "cpu", lm_head=True).lm_head is not None  # tied to the embeddings
    assert load_model(str(llama_dir), "cpu").num_layers == 2
    torch.manual_seed(0)  # a causal-LM checkpoint under the base model: its lm_head.weight is no layer of it
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path / "clm"
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((llama_dir / name).read_bytes())
    assert load_model(str(folder), "cpu").num_layers == 2
    assert load_model(str(folder), "cpu", lm_head=True).lm_head is not None
    with pytest.raises(AttnprobeError, match="lacks lm_head.weight"):  # a base checkpoint has no head to ablate with
        load_model(str(llama_dir), "cpu", lm_head=True)


# ---- case 7: NaN in a head's value or output-projection weights is refused, not left as empty scores -------------


@pytest.mark.parametrize("where", ["value", "output projection"])
def test_nan_in_value_or_output_projection_weights_is_refused(tmp_path, where):
    from safetensors.torch import load_file, save_file

    from attnprobe.analysis import analyze_loaded
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model

    folder = make_gpt2(tmp_path / "m", layers=2, heads=4)
    tensors = load_file(folder / "model.safetensors")
    embd, head_dim = 32, 8
    if where == "value":  # c_attn [embd, 3*embd]: Q, K, V columns; head 2's value columns of the last layer
        tensors["h.1.attn.c_attn.weight"][:, 2 * embd + 2 * head_dim] = float("nan")
    else:  # c_proj [embd, embd]: rows are the heads' outputs
        tensors["h.1.attn.c_proj.weight"][2 * head_dim] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(folder), "cpu")
    with pytest.raises(AttnprobeError, match=r"layer 1, head 2 .*value or output-projection weights of that head "
                                             r"hold NaN"):
        analyze_loaded(loaded, read_corpus(CORPUS_PATH).head(4), resamples=5)
    result = run_cli(["analyze", "--model", str(folder), "--corpus", str(CORPUS_PATH), "--out", str(tmp_path / "o"),
                      "--limit", "4", "--resamples", "5", "--device", "cpu"])
    assert "layer 1, head 2" in one_error_line(result)
    assert not (tmp_path / "o" / "heads.csv").exists()


# ---- case 8: `related` measures the weights the run measured, and reads back only a zero diagonal ---------------


def _analyze(model, out, *extra):
    result = run_cli(["analyze", "--model", str(model), "--corpus", str(CORPUS_PATH), "--out", str(out), "--limit",
                      "12", "--resamples", "5", "--device", "cpu", *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "run.json").read_text())


def test_related_refuses_a_model_resaved_since_the_run(tmp_path):
    model = make_gpt2(tmp_path / "m", layers=2)
    run = _analyze(model, tmp_path / "out")
    assert run["model"]["weights"].startswith("sha256:")
    make_gpt2(model, layers=2, seed=1)  # re-saved at the same path: other weights, same shape
    result = run_cli(["related", "--out", str(tmp_path / "out"), "--sentences", "4", "--device", "cpu"])
    assert "weights fingerprint" in one_error_line(result)
    assert not (tmp_path / "out" / "head_similarity.npz").exists()


def test_related_loads_the_folder_the_run_resolved_not_a_namesake_here(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    make_gpt2(tmp_path / "a" / "m", layers=2)
    make_gpt2(tmp_path / "b" / "m", layers=2, seed=1)  # ./m from b: the same shape, other weights
    monkeypatch.chdir(tmp_path / "a")
    _analyze("./m", tmp_path / "out")
    import numpy as np

    measured = {}
    for here in ("a", "b"):  # from b, ./m is another model: related must still measure a/m, the run's
        monkeypatch.chdir(tmp_path / here)
        result = run_cli(["related", "--out", str(tmp_path / "out"), "--sentences", "4", "--device", "cpu"])
        assert result.exit_code == 0, result.output
        with np.load(tmp_path / "out" / "head_similarity.npz") as data:
            measured[here] = data["js"]
    np.testing.assert_array_equal(measured["a"], measured["b"])


def test_a_similarity_whose_diagonal_is_not_zero_is_refused(tmp_path):
    import numpy as np

    model = make_gpt2(tmp_path / "m", layers=2)
    out = tmp_path / "out"
    _analyze(model, out)
    assert run_cli(["related", "--out", str(out), "--sentences", "4", "--device", "cpu"]).exit_code == 0
    with np.load(out / "head_similarity.npz") as data:
        arrays = {key: data[key] for key in data.files}
    np.fill_diagonal(arrays["js"], 0.3)
    np.savez(out / "head_similarity.npz", **arrays)
    assert "0 on its diagonal" in one_error_line(run_cli(["plot", "--out", str(out)]))


# ---- case 10: one run at a time in a results folder; only temporary files whose writer is gone are cleaned ------


def _holder(out):
    """Another process holding `out`'s lock, as a second attnprobe run would; it prints its pid once it holds."""
    import os
    import subprocess
    import sys

    code = ("import sys, time; from attnprobe import lock; lock.take(sys.argv[1]); print('held', flush=True); "
            "time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(CORPUS_PATH.parent.parent)}
    process = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_run_into_a_busy_folder_is_refused_and_a_stale_lock_taken_over(gpt2_dir, tmp_path):
    from attnprobe.lock import LOCK_FILE

    out = tmp_path / "out"
    holder = _holder(out)
    try:
        live = out / f".sentences.parquet.{holder.pid}-abcd1234.tmp"  # the first run's rows being written
        live.write_bytes(b"rows")
        result = run_cli(["analyze", "--model", str(gpt2_dir), "--corpus", str(CORPUS_PATH), "--out", str(out),
                          "--limit", "4", "--resamples", "5", "--device", "cpu"])
        assert f"in use by another attnprobe run (pid {holder.pid})" in one_error_line(result)
        assert live.exists() and not (out / "heads.csv").exists()
    finally:
        holder.kill()
        holder.wait()
    assert (out / LOCK_FILE).exists()  # a killed run's lock is left behind, stale
    _analyze(gpt2_dir, out)
    assert not live.exists()  # its writer is gone
    assert not (out / LOCK_FILE).exists()


def test_a_temporary_file_is_removed_only_once_its_writer_is_gone(tmp_path):
    import os
    import subprocess
    import time

    from attnprobe import io

    writer = subprocess.Popen(["sleep", "60"])
    try:
        old = time.time() - 3600
        names = [f".heads.csv.{writer.pid}-abcd1234.tmp", ".heads.csv.999999999-abcd1234.tmp"]
        for name in names:
            (tmp_path / name).write_bytes(b"x")
            os.utime(tmp_path / name, (old, old))
        assert io.remove_stale_temps(tmp_path, time.time()) == [names[1]]  # pid 999999999: no such process
        assert (tmp_path / names[0]).exists()
    finally:
        writer.kill()
        writer.wait()
    assert io.remove_stale_temps(tmp_path, time.time()) == [names[0]]


# ---- case 11: --limit and --threads have upper bounds, each refused in one line ---------------------------------


@pytest.mark.parametrize("command", ["analyze", "ablate", "rollout"])
@pytest.mark.parametrize("limit", ["9223372036854775808", "99999999999999999999999"])
def test_a_limit_beyond_what_can_be_counted_is_one_line(gpt2_dir, tmp_path, command, limit):
    result = run_cli([command, "--model", str(gpt2_dir), "--corpus", str(CORPUS_PATH), "--out", str(tmp_path / "o"),
                      "--limit", limit, "--device", "cpu"])
    assert f"--limit {limit} is above 9,223,372,036,854,775,807" in one_error_line(result)


def test_the_largest_limit_is_taken(gpt2_dir):
    import sys

    from attnprobe.corpus import read_corpus

    corpus = read_corpus(CORPUS_PATH)
    assert len(corpus.head(sys.maxsize)) == len(corpus)


@pytest.mark.parametrize("threads", ["100000", "99999999999999999999999"])
def test_threads_beyond_four_per_cpu_is_one_line(gpt2_dir, tmp_path, threads):
    import os

    result = run_cli(["analyze", "--model", str(gpt2_dir), "--corpus", str(CORPUS_PATH), "--out", str(tmp_path / "o"),
                      "--limit", "4", "--threads", threads, "--device", "cpu"])
    assert f"{threads} is above {4 * os.cpu_count()} (4 x this machine" in one_error_line(result)
    from attnprobe.threads import parse

    assert parse(str(4 * os.cpu_count())) == 4 * os.cpu_count()


# ---- case 12: control and bidi characters of the corpus reach the report's page only as visible escapes ---------


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_corpus_control_and_bidi_characters_are_escaped_in_the_report(gpt2_dir, tmp_path):
    import re
    import unicodedata

    from conftest import SENTENCES

    from attnprobe.naming import visible

    corpus = tmp_path / "c.txt"
    hostile = "evil\u202etxt.exe"
    lines = ["# category: plain", *SENTENCES[:4], f"# category: {hostile}",
             *(f"{s[:-1]} \x00 bell\x07 \u202eright{s[-1]}" for s in SENTENCES[4:])]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = run_cli(["analyze", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out),
                      "--resamples", "5", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    result = run_cli(["report", "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text(encoding="utf-8")
    found = re.search(r'<script[^>]*id="attnprobe-data"[^>]*>(.*?)</script>', page, re.S)
    data = json.loads(found.group(1))
    shown = list(_strings(data))

    def hidden(text):
        return [ch for ch in text if ch not in "\n\t" and (unicodedata.category(ch) == "Cc" or ch != visible(ch))]

    assert not [s for s in shown if hidden(s)], [s for s in shown if hidden(s)][:3]
    assert not hidden(page.replace("\n", "").replace("\t", ""))
    assert visible(hostile) in [line["name"] for line in data["categories"]["lines"]]
    sentences = [example["sentence"] for example in data["examples"]]
    assert any("\\x00" in s and "\\u202e" in s for s in sentences) or any(
        example["category"] == visible(hostile) for example in data["examples"])


# ---- case 13: plot skips, with a warning line, a figure whose score column holds no value -----------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished analyze run of a tiny GPT-2 (for tests that change a copy of its files: conftest's copy_of)."""
    root = tmp_path_factory.mktemp("run27")
    out = root / "out"
    _analyze(make_gpt2(root / "m", layers=2), out)
    return out


def _all_nan(folder, column):
    import pandas as pd

    heads = pd.read_csv(folder / "heads.csv")
    heads[column] = float("nan")
    heads.to_csv(folder / "heads.csv", index=False)
    restamp(folder)  # stands for a run whose score came out undefined everywhere: analyze's own heads.csv


def test_plot_skips_a_figure_whose_score_is_all_nan(copy_of):
    _all_nan(copy_of, "entropy")
    result = run_cli(["plot", "--out", str(copy_of)])
    assert result.exit_code == 0, result.output
    assert "Warning: entropy_heatmap not drawn: heads.csv's entropy holds no value (all NaN)" in \
        " ".join(result.output.split())
    assert not (copy_of / "entropy_heatmap.png").exists() and (copy_of / "layer_gradient.png").exists()


def test_head_patterns_leaves_out_a_type_whose_picking_score_is_all_nan(copy_of):
    from attnprobe.classify import classify
    from attnprobe.plotting import representatives

    _all_nan(copy_of, "entropy_unforced")  # picks the mixed heads' most typical one
    import pandas as pd

    heads = pd.read_csv(copy_of / "heads.csv")
    assert "mixed" in set(classify(heads)["head_type"])
    assert "mixed" not in representatives(classify(heads), heads)
    result = run_cli(["plot", "--out", str(copy_of)])
    assert result.exit_code == 0, result.output
    assert (copy_of / "head_patterns.png").exists()


# ---- case 16: a stop is heard during the counting pass; a killed run's offload folder goes at the next load ------


def test_a_stop_during_the_counting_pass_is_acted_on_at_once(gpt2_dir, tmp_path, monkeypatch):
    from attnprobe import batching
    from attnprobe.analysis import analyze_loaded
    from attnprobe.batching import TOKENIZE_CHUNK
    from attnprobe.corpus import read_corpus
    from attnprobe.model import load_model
    from attnprobe.resume import Checkpointing, Stopped

    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n" * (5 * TOKENIZE_CHUNK), encoding="utf-8")
    loaded = load_model(str(gpt2_dir), "cpu")
    calls = []
    tokenizer = loaded.tokenizer

    class Counting:
        def __call__(self, texts, *args, **kwargs):
            calls.append(len(texts))
            return tokenizer(texts, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    loaded.tokenizer = Counting()
    monkeypatch.setattr(batching, "STOP_CHECK_SECONDS", 0.0)  # ask between every two chunks
    asked = []
    checkpointing = Checkpointing(save=lambda state: None, should_stop=lambda: bool(calls) and not asked.append(1))
    with pytest.raises(Stopped, match="while counting the corpus"):
        analyze_loaded(loaded, read_corpus(corpus), resamples=5, checkpointing=checkpointing)
    assert sum(calls) <= 2 * TOKENIZE_CHUNK  # the first chunk only (kept, and its full lengths if cut)


def test_a_killed_runs_offload_folder_goes_at_the_next_load_without_device_map(gpt2_dir):
    import subprocess
    import tempfile
    from pathlib import Path

    from attnprobe.model import OFFLOAD_PREFIX, load_model

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"{OFFLOAD_PREFIX}{gone.pid}-"))  # as a SIGKILLed run leaves it
    load_model(str(gpt2_dir), "cpu")
    assert not stale.exists()
