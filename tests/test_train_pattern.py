"""`attnprobe train-pattern`: DuoAttention's gates against what is known.

At gate 1 a head is the model's own attention (streamheads with no head streaming, bit for bit), at gate 0 the
streaming head of `ablate --method streaming --client duo-attention` (bit for bit); the gradient of the loss is that
of central finite differences in float64; on a model built so that one head must read far back and another reads
only its previous token, the first gate stays up and the second goes to 0. Architectures: GPT-2 (multi-head), a
grouped-query Llama (4 query heads over 2 KV heads), Qwen2 with a sliding-window layer (Mistral's attention), Gemma 2
(a sliding-window layer, soft-capped scores), and a Mistral whose every layer has a window (refused).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FLOAT32_TOLERANCE, SENTENCES, make_bert, make_gpt2, make_llama, save_tokenizer
from test_cli import assert_one_line_error, run
from test_gpu import cuda_test
from zoo import OWN_ATTENTION, make

from attnprobe import io, passkeys, streamheads
from attnprobe import trainpattern as tp
from attnprobe.errors import AttnprobeError
from attnprobe.model import forward_kwargs, load_model

SINK, RECENT = 2, 4
HAYSTACK = " ".join(SENTENCES * 40)
SMALL = ("--lengths", "80,96", "--sink-size", str(SINK), "--recent-size", str(RECENT), "--passkeys", "1",
         "--passkey-words", "2", "--device", "cpu", "--threads", "1")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-pattern")
    return {
        "gpt2": load_model(str(make_gpt2(root / "gpt2", n_positions=128)), "cpu"),
        "llama-gqa": load_model(str(make_llama(root / "llama")), "cpu"),
        "qwen2-window": load_model(str(make("qwen2", root / "qwen2", use_sliding_window=True, sliding_window=5,
                                            max_window_layers=1)), "cpu"),
        "gemma2-window": load_model(str(make("gemma2", root / "gemma2", sliding_window=5)), "cpu"),
    }


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("train-llama"))


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    path = tmp_path_factory.mktemp("train-haystack") / "hay.txt"
    path.write_text(HAYSTACK, encoding="utf-8")
    return path


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 40, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, n]


def gated_rows(loaded) -> dict[int, int]:
    """Each layer without its own window -> its row of the gates (trainpattern.layer_spans)."""
    spans = tp.layer_spans(loaded, SINK, RECENT)
    return {layer: k for k, layer in enumerate(layer for layer, span in enumerate(spans) if span is None)}


def hidden(loaded, ids, gates, rows) -> torch.Tensor:
    with torch.no_grad(), tp.gating(loaded, gates, rows, SINK, RECENT):
        return tp.last_hidden(loaded, ids)  # [1, n, hidden]


def streamed(loaded, ids, mask) -> torch.Tensor:
    with torch.no_grad(), streamheads.streaming(loaded, mask, SINK, RECENT):
        return tp.last_hidden(loaded, ids)  # [1, n, hidden]


ARCHITECTURES = ["gpt2", "llama-gqa", "qwen2-window", "gemma2-window"]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gate_one_is_the_model_itself(models, name):
    loaded = models[name]
    ids = ids_of(30)
    rows = gated_rows(loaded)
    got = hidden(loaded, ids, torch.ones(len(rows), loaded.num_kv_heads), rows)
    none = np.zeros((loaded.num_layers, loaded.num_kv_heads), dtype=bool)
    assert torch.equal(got, streamed(loaded, ids, none))  # bit for bit: the reference the loss is taken against
    with torch.no_grad():
        own = loaded.model(**forward_kwargs(loaded.model, ids, torch.ones_like(ids))).last_hidden_state
    np.testing.assert_allclose(got.numpy(), own.numpy(), rtol=0, atol=FLOAT32_TOLERANCE * max(1, own.abs().max()))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gate_zero_is_the_streaming_head(models, name):
    """Gates of 0 and 1 mixed: the gate-0 KV heads are `ablate --method streaming`'s streaming heads (DuoAttention's
    client: sink + recent at every position), the others full, bit for bit."""
    loaded = models[name]
    ids = ids_of(30, seed=1)
    rows = gated_rows(loaded)
    mask = np.zeros((loaded.num_layers, loaded.num_kv_heads), dtype=bool)
    for layer in rows:
        mask[layer, layer % loaded.num_kv_heads] = True  # one KV head streaming in each gated layer
    gates = torch.tensor(np.where(mask[list(rows)], 0.0, 1.0), dtype=torch.float32)
    got = hidden(loaded, ids, gates, rows)
    assert torch.equal(got, streamed(loaded, ids, mask))
    assert not torch.equal(got, streamed(loaded, ids, np.zeros_like(mask)))  # the streaming heads changed something


def test_a_bfloat16_model_keeps_its_gates_and_loss_in_float32(tmp_path, models):
    loaded = load_model(models["llama-gqa"].source, "cpu", "bfloat16")
    ids, span = ids_of(24), torch.arange(24) >= 16
    settings = tp.Settings(lengths=(24,), sink=SINK, recent=RECENT)
    full = tp.full_hidden(loaded, ids, span, settings)
    assert full.dtype == torch.float32
    rows = gated_rows(loaded)
    gates = torch.nn.Parameter(torch.full((len(rows), loaded.num_kv_heads), 0.5))
    with tp.gating(loaded, gates, rows, SINK, RECENT), tp.checkpointed(tp.decoder_layers(loaded)):
        distill, penalty = tp.loss_terms(loaded, gates, ids, span, full, 0.05)
        (distill + penalty).backward()
    assert distill.dtype == torch.float32 and gates.grad.dtype == torch.float32 and distill > 0
    ones = torch.ones(len(rows), loaded.num_kv_heads)
    assert torch.equal(hidden(loaded, ids, ones, rows), streamed(loaded, ids, np.zeros((2, 2), dtype=bool)))


def test_a_bfloat16_models_loss_is_the_float32_models_within_its_hidden_states_rounding(models):
    """The distillation loss of a bfloat16 model is the float32 mean of its own hidden states' squared difference
    (the loss adds no rounding of its own), and its root differs from the float32 model's by no more than the two
    hidden states' bfloat16 rounding: |sqrt(L16) - sqrt(L32)| <= rms(full16 - full32) + rms(gated16 - gated32) (the
    triangle inequality of the root mean square), so a larger bfloat16 loss than float32's at the same gates is the
    model's rounding, which float32 gates and loss cannot remove."""
    model32 = models["llama-gqa"]
    model16 = load_model(model32.source, "cpu", "bfloat16")
    ids, span = ids_of(40, seed=2), torch.arange(40) >= 24
    settings = tp.Settings(lengths=(40,), sink=SINK, recent=RECENT)
    rows = gated_rows(model32)
    gates = torch.tensor([[0.5, 0.75]] * len(rows))  # exact in bfloat16 too: no gate is rounded on either side
    found = {}
    for name, loaded in (("32", model32), ("16", model16)):
        full = tp.full_hidden(loaded, ids, span, settings)  # [span, hidden] float32
        with torch.no_grad(), tp.gating(loaded, gates, rows, SINK, RECENT):
            gated = tp.last_hidden(loaded, ids)[0, span].float()  # [span, hidden]
            distill, _ = tp.loss_terms(loaded, gates, ids, span, full, 0.05)
        found[name] = (full.double(), gated.double(), float(distill))
    (full32, gated32, loss32), (full16, gated16, loss16) = found["32"], found["16"]
    terms = int(span.sum()) * full16.shape[-1]
    own = float((full16 - gated16).square().mean())
    assert loss16 == pytest.approx(own, rel=terms * 2.0**-24)  # float32 sums of `terms` squares: n u at most
    assert loss16 > 0 and loss32 > 0
    bound = float((full16 - full32).square().mean().sqrt() + (gated16 - gated32).square().mean().sqrt())
    gap = abs(loss16**0.5 - loss32**0.5)
    assert gap <= bound * (1 + 1e-6) + terms * 2.0**-24 * loss32**0.5, (gap, bound)


@pytest.mark.parametrize("name, eps, rel", [
    ("gpt2", 1e-6, 1e-6),
    ("llama-gqa", 1e-3, 1e-3),  # Llama's RMSNorm and rotary embedding compute in float32 even in a float64 model
])
def test_gradient_matches_central_differences_in_float64(models, name, eps, rel):
    """d loss / d gate (autograd through the checkpointed layers and blocks) against (L(g + e) - L(g - e)) / 2e, in
    float64, at gates inside (0, 1), for every gate of the first two layers."""
    loaded = load_model(models[name].source, "cpu", "float32")
    loaded.model.double()
    ids, span = ids_of(40, seed=2), torch.arange(40) >= 28
    settings = tp.Settings(lengths=(40,), sink=SINK, recent=RECENT)
    full = tp.full_hidden(loaded, ids, span, settings)
    assert full.dtype == torch.float64
    rows = gated_rows(loaded)
    layers = tp.decoder_layers(loaded)
    start = torch.tensor(np.random.default_rng(0).uniform(0.15, 0.85, (len(rows), loaded.num_kv_heads)))

    def loss(gates: torch.Tensor) -> torch.Tensor:
        with tp.gating(loaded, gates, rows, SINK, RECENT), tp.checkpointed(layers):
            distill, penalty = tp.loss_terms(loaded, gates, ids, span, full, 0.05)
            total = distill + penalty
            if gates.requires_grad:
                total.backward()
        return total.detach()

    gates = start.clone().requires_grad_(True)
    loss(gates)
    for index in list(np.ndindex(*start.shape))[:8]:
        up, down = start.clone(), start.clone()
        up[index] += eps
        down[index] -= eps
        numeric = float(loss(up) - loss(down)) / (2 * eps)
        assert float(gates.grad[index]) == pytest.approx(numeric, rel=rel, abs=1e-9), index
    assert gates.grad.abs().min() > 1e-4  # every gate matters here: the check compares numbers, not zeros


def test_the_backward_pass_finds_the_gates_from_another_thread(models):
    """On CUDA autograd runs the backward pass, and with it every checkpointed block's recomputation, on a thread of
    its own: the gated attention must find the open gating context from there too (a ContextVar did not)."""
    import threading

    loaded = models["llama-gqa"]
    ids, span = ids_of(30, seed=3), torch.arange(30) >= 20
    settings = tp.Settings(lengths=(30,), sink=SINK, recent=RECENT)
    full = tp.full_hidden(loaded, ids, span, settings)
    rows = gated_rows(loaded)
    gates = torch.full((len(rows), loaded.num_kv_heads), 0.5, requires_grad=True)
    failed: list[BaseException] = []
    with tp.gating(loaded, gates, rows, SINK, RECENT), tp.checkpointed(tp.decoder_layers(loaded)):
        distill, penalty = tp.loss_terms(loaded, gates, ids, span, full, 0.05)

        def backward() -> None:
            try:
                (distill + penalty).backward()
            except BaseException as err:  # noqa: BLE001 (reported below)
                failed.append(err)

        worker = threading.Thread(target=backward)
        worker.start()
        worker.join()
    assert not failed, failed
    assert gates.grad is not None and bool(gates.grad.abs().sum() > 0)


def make_far_and_local_gpt2(folder: Path, far_scale: float = 2.0, local_scale: float = 16.0) -> Path:
    """A one-layer GPT-2 of two heads over one-hot tokens (dims 0-63) and one-hot positions (dims 64-127):

    - head 0 reads far back by content: query and key are the token part, so position i attends evenly to every
      earlier position holding its token (itself included); its value is the position part, so where its token
      occurred far back, losing those keys changes its output;
    - head 1 reads only its previous token: query e_i and key e_(j+1) from the position part, scaled so that every
      other key's weight is exp(-128) or less, 0 in float32: its streaming output is its full output exactly.

    After ln_1 a one is about 7.9 and a zero about -0.13. The MLP is zero."""
    from transformers import GPT2Config, GPT2Model

    save_tokenizer(folder, SENTENCES)
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=128, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2Model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.wte.weight[:, :64] = torch.eye(64)
        model.wpe.weight[:, 64:] = torch.eye(64)
        block = model.h[0]
        block.ln_1.weight.fill_(1.0)
        block.ln_2.weight.fill_(1.0)
        model.ln_f.weight.fill_(1.0)
        weight = block.attn.c_attn.weight  # [in, q | k | v], heads of 64 side by side
        for d in range(64):
            weight[d, d] = far_scale  # head 0 query: the token
            weight[d, 128 + d] = 1.0  # head 0 key: the token
            weight[64 + d, 256 + d] = 1.0  # head 0 value: the position
            weight[64 + d, 64 + d] = local_scale  # head 1 query: e_i
            if d >= 1:
                weight[64 + d - 1, 192 + d] = 1.0  # head 1 key: e_(j + 1)
            weight[d, 320 + d] = 1.0  # head 1 value: the token
        block.attn.c_proj.weight[:] = torch.eye(128)  # each head's output into the residual as it is
    model.save_pretrained(folder)
    return folder


def copy_task(step: int) -> passkeys.Sample:
    """36 distinct tokens, then 12 that repeat those at positions 2-13 (far past the sink and the recent window);
    the loss is taken on the 12."""
    rng = np.random.default_rng(step)
    first = rng.permutation(np.arange(1, 64))[:36]
    ids = np.concatenate([first, first[2:14]])  # [48]
    span = np.arange(48) >= 36  # [48]
    return passkeys.Sample(ids, span, (), ())


def test_a_far_reading_head_keeps_its_gate_and_a_local_head_loses_it(tmp_path):
    loaded = load_model(str(make_far_and_local_gpt2(tmp_path / "planted")), "cpu")
    ids = torch.as_tensor(copy_task(0).ids)[None]
    with torch.no_grad(), streamheads.streaming(loaded, np.array([[False, True]]), SINK, RECENT):
        local_streaming = tp.last_hidden(loaded, ids)
    assert torch.equal(local_streaming, streamed(loaded, ids, np.zeros((1, 2), dtype=bool)))  # head 1 is local
    assert not torch.equal(streamed(loaded, ids, np.array([[True, False]])), local_streaming)  # head 0 reads far
    settings = tp.Settings(lengths=(48,), steps=40, lr=0.1, sink=SINK, recent=RECENT)
    trained = tp.train_pattern_loaded(loaded, "", settings, samples=copy_task)
    far, local = trained.gates["gate"].tolist()
    assert far > 0.9 and local == 0.0, (far, local)
    assert trained.log["distill_loss"].iloc[0] == 0.0  # at gates of 1 the gated model is the model itself
    assert all(p.requires_grad for p in loaded.model.parameters())  # frozen while training, put back after


def test_layers_with_their_own_window_get_no_gate(models):
    loaded = models["qwen2-window"]
    assert tp.layer_spans(loaded, SINK, RECENT) == [None, 5]
    settings = tp.Settings(lengths=(80,), steps=2, sink=SINK, recent=RECENT, passkeys=1, passkey_words=2)
    trained = tp.train_pattern_loaded(loaded, HAYSTACK, settings)
    assert trained.gates["trained"].tolist() == [True, True, False, False]
    assert trained.gates["gate"].tolist()[2:] == [1.0, 1.0]
    assert trained.run["windowed_layers"] == [1] and trained.run["gated_layers"] == [0]
    assert any("sliding window" in note and "no gate" in note for note in trained.run["notes"])


def test_samples_follow_duoattentions_layout(models):
    loaded = models["llama-gqa"]
    parts = passkeys.pieces(loaded.tokenizer, [0], HAYSTACK, 128, 2)
    passkeys.check_lengths(parts, (100, 128), 3, "the haystack")
    sample = passkeys.sample_at(parts, (100, 128), 3, seed=7, step=5)
    assert len(sample.ids) in (100, 128) and sample.ids[0] == 0
    answers = [[t for w in key for t in parts.words[w]] for key in sample.passkeys]
    qa = [t for q, a in zip(parts.questions, answers) for t in q + a + parts.separator]
    assert sample.ids[sample.span].tolist() == qa  # the supervised span: every question and answer, in order
    context = sample.ids[~sample.span].tolist()
    for needle, answer in zip(parts.needles, answers):
        inserted = parts.separator + needle + answer + parts.separator
        assert any(context[k : k + len(inserted)] == inserted for k in range(len(context)))
    assert list(sample.depths) == sorted(sample.depths) and 0.05 <= min(sample.depths) <= max(sample.depths) <= 0.95
    again = passkeys.sample_at(parts, (100, 128), 3, seed=7, step=5)
    assert np.array_equal(again.ids, sample.ids)  # a function of (seed, step) alone
    lengths = [passkeys.length_at((80, 96), 7, k) for k in range(6)]
    assert sorted(lengths[:2]) == sorted(lengths[2:4]) == [80, 96]  # every length once a round


def test_the_learning_rate_schedule_is_duoattentions():
    steps = 2000  # DuoAttention's LambdaLR: min(1, max((s + 1) / 400, 0.1), max((2000 - s) / 400, 0.1))
    for s in (0, 39, 200, 399, 1000, 1600, 1999):
        want = min(1, max((s + 1) / (steps // 5), 0.1), max((steps - s) / (steps // 5), 0.1))
        assert tp.lr_factor(s, steps) == want
    assert tp.lr_factor(0, 3) == 1.0  # below 5 steps DuoAttention would divide by 0


def test_a_stopped_run_resumes_to_identical_results(models):
    loaded = models["llama-gqa"]
    settings = tp.Settings(lengths=(80, 96), steps=6, sink=SINK, recent=RECENT, passkeys=1, passkey_words=2)
    whole = tp.train_pattern_loaded(loaded, HAYSTACK, settings)
    saved = []
    calls = iter(range(100))
    stopping = tp.Checkpointing(save=saved.append, every=2, should_stop=lambda: next(calls) >= 2)
    with pytest.raises(tp.Stopped, match="stopped after 3 of 6 steps"):
        tp.train_pattern_loaded(loaded, HAYSTACK, settings, checkpointing=stopping)
    assert [s.done for s in saved] == [2, 3]
    assert saved[-1].threads == torch.get_num_threads()  # the threads it ran with, for a resume under auto
    state = tp.State.from_arrays(saved[-1].to_arrays())  # through the file's arrays
    assert state.threads == saved[-1].threads
    resumed = tp.train_pattern_loaded(loaded, HAYSTACK, settings,
                                      checkpointing=tp.Checkpointing(save=saved.append, resume_from=state))
    pd.testing.assert_frame_equal(resumed.gates, whole.gates, check_exact=True)
    pd.testing.assert_frame_equal(resumed.log, whole.log, check_exact=True)
    with pytest.raises(AttnprobeError, match="made with lr = 0.02, this run has 0.03"):
        other = tp.Settings(**{**settings.__dict__, "lr": 0.03})
        tp.train_pattern_loaded(loaded, HAYSTACK, other, checkpointing=tp.Checkpointing(save=saved.append,
                                                                                         resume_from=state))


def start(model, haystack, out, *extra, threads="1"):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    small = [*SMALL[:-1], threads]  # SMALL ends with --threads 1
    return subprocess.Popen([sys.executable, "-m", "attnprobe", "train-pattern", "--model", str(model), "--haystack",
                             str(haystack), "--out", str(out), *small, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_killed_process_resumes_to_identical_files(llama_dir, haystack, tmp_path):
    steps = ("--steps", "300")
    reference = start(llama_dir, haystack, tmp_path / "whole", *steps)
    assert reference.wait(timeout=600) == 0, reference.stderr.read()
    out = tmp_path / "cut"
    process = start(llama_dir, haystack, out, *steps, "--checkpoint-every", "1")
    deadline = time.monotonic() + 300
    while not (out / io.TRAINED_CHECKPOINT_FILE).exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not (out / tp.GATES_FILE).exists() and (out / io.TRAINED_CHECKPOINT_FILE).exists()
    # resumed under --threads auto, which keeps the stopped run's 1 thread whatever the machine's load says now
    resumed = start(llama_dir, haystack, out, *steps, "--checkpoint-every", "1", "--resume", threads="auto")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert not (out / io.TRAINED_CHECKPOINT_FILE).exists()  # the run is complete
    for name in (tp.GATES_FILE, tp.LOG_FILE):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    record = json.loads((out / tp.RUN_FILE).read_text())
    assert record["resumed_at_step"] >= 1
    assert record["threads"]["requested"] == "auto" and record["threads"]["resumed"] == 1


@pytest.fixture(scope="module")
def trained_dir(llama_dir, haystack, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    result = run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, "--steps", "4", *SMALL)
    assert result.exit_code == 0, result.output
    assert "4 KV heads gated" in " ".join(result.stdout.split())  # the title folds by the temporary path's length
    return out


def test_cli_writes_gates_log_figure_and_record(trained_dir):
    gates = pd.read_csv(trained_dir / tp.GATES_FILE)
    assert list(gates.columns) == ["layer", "kv_head", "gate", "trained"] and len(gates) == 4
    assert gates["gate"].between(0, 1).all()
    log = pd.read_csv(trained_dir / tp.LOG_FILE)
    assert list(log.columns) == list(tp.LOG_COLUMNS) and log["step"].tolist() == [1, 2, 3, 4]
    assert log["distill_loss"][0] == 0.0 and log["penalty"][0] == pytest.approx(0.05)
    assert log["mean_gate"].iloc[-1] == pytest.approx(gates["gate"].mean())
    assert (trained_dir / tp.FIGURE_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_record = json.loads((trained_dir / tp.RUN_FILE).read_text())
    assert run_record["settings"]["lengths"] == [80, 96] and run_record["settings"]["lr"] == 0.02
    assert run_record["model"]["weights"] and run_record["haystack"]["sha256"]
    assert run_record["peak_memory_mib"]["rss"] > 0 and set(run_record["files"]) == {tp.GATES_FILE, tp.LOG_FILE,
                                                                                     tp.FIGURE_FILE}
    assert not (trained_dir / io.TRAINED_CHECKPOINT_FILE).exists()


def test_export_writes_the_gates_as_duoattentions_table(trained_dir, tmp_path, llama_dir):
    gates = pd.read_csv(trained_dir / tp.GATES_FILE).pivot(index="layer", columns="kv_head", values="gate")
    result = run("export", "--out", trained_dir, "--format", "duo-attention", "--to", tmp_path / "duo")
    assert result.exit_code == 0, result.output
    assert "per KV head" in result.stdout and f"sink {SINK}, recent {RECENT}" in result.stdout
    table = np.loadtxt(tmp_path / "duo" / "full_attention_heads.tsv", dtype=float, delimiter="\t")  # kvpress's read
    assert table.shape == (2, 2)
    np.testing.assert_allclose(table, gates.to_numpy(), atol=0.5 / 5)  # ties broken by at most half a gap
    assert (np.argsort(table, axis=None, kind="stable") == np.argsort(gates.to_numpy(), axis=None,
                                                                      kind="stable")).all()
    pattern = streamheads.read_pattern(tmp_path / "duo")
    assert (pattern.sink, pattern.recent) == (SINK, RECENT)
    assert streamheads.check_pattern(pattern, load_model(str(llama_dir), "cpu")) == []  # the model, by its weights
    direct = streamheads.read_pattern(trained_dir)  # the train-pattern folder itself, as `ablate --pattern`
    np.testing.assert_array_equal(direct.scores, pattern.scores)


def test_export_writes_each_query_head_with_its_kv_heads_gate(trained_dir, tmp_path):
    gates = pd.read_csv(trained_dir / tp.GATES_FILE)
    result = run("export", "--out", trained_dir, "--format", "retrieval-head", "--to", tmp_path / "rh")
    assert result.exit_code == 0, result.output
    assert "one per KV head: each query head gets its KV head's gate" in result.stdout
    (path,) = [p for p in (tmp_path / "rh").glob("*.json") if p.name != "attnprobe.json"]
    scores = json.loads(path.read_text())
    assert len(scores) == 8  # 2 layers x 4 query heads
    for row in gates.itertuples():
        for head in (2 * row.kv_head, 2 * row.kv_head + 1):  # query head h reads KV head h // 2
            assert scores[f"{row.layer}-{head}"] == [row.gate]


def test_export_refuses_gates_of_another_run(trained_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained_dir, copy)
    (copy / tp.GATES_FILE).write_text((copy / tp.GATES_FILE).read_text().replace(",True", ",True ", 1))
    result = run("export", "--out", copy, "--to", tmp_path / "duo")
    assert_one_line_error(result, "gates.csv", "was not written by the run")


@pytest.mark.parametrize("args, fragments", [
    (("--lengths", "6"), ["--lengths 6 is not longer than --sink-size 2 + --recent-size 4 = 6"]),
    (("--steps", "0"), ["--steps 0", "at least 1 step"]),
    (("--lengths", "20"), ["--lengths 20 leaves no room for the haystack"]),
    (("--lengths", "500"), ["--lengths 500 is longer than", "context of 128 tokens"]),
    (("--lr", "nan"), ["--lr nan is not a finite number"]),
    (("--passkeys", "21"), ["--passkeys 21 is outside 1-20"]),
])
def test_cli_bad_settings_are_one_line(llama_dir, haystack, tmp_path, args, fragments):
    result = run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", tmp_path / "o", *SMALL, *args)
    assert_one_line_error(result, *fragments)


def test_cli_a_haystack_too_short_is_one_line(llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("The cat sat on the mat.", encoding="utf-8")
    result = run("train-pattern", "--model", llama_dir, "--haystack", short, "--out", tmp_path / "o", *SMALL)
    assert_one_line_error(result, "short.txt has 7 tokens, too short for --lengths 96", "--haystack")


def test_cli_models_it_cannot_gate_are_one_line(tmp_path, haystack):
    bert = make_bert(tmp_path / "bert")
    assert_one_line_error(run("train-pattern", "--model", bert, "--haystack", haystack, "--out", tmp_path / "o",
                              *SMALL), "is an encoder", "no pattern to train")
    windowed = make("mistral (sliding window)", tmp_path / "mistral", sliding_window=5)
    assert_one_line_error(run("train-pattern", "--model", windowed, "--haystack", haystack, "--out", tmp_path / "o",
                              *SMALL), "every layer", "sliding window already")
    if OWN_ATTENTION:
        own = make(sorted(OWN_ATTENTION)[0], tmp_path / "own")
        assert_one_line_error(run("train-pattern", "--model", own, "--haystack", haystack, "--out", tmp_path / "o",
                                  *SMALL), "train-pattern cannot gate", "AttentionInterface")


def test_cli_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(llama_dir, haystack, tmp_path,
                                                                          monkeypatch):
    real, calls = tp.loss_terms, []

    def failing(*args, **kwargs):  # the third step's loss is NaN: train_step itself must leave the gates alone
        distill, penalty = real(*args, **kwargs)
        calls.append(1)
        return (distill * float("nan"), penalty) if len(calls) == 3 else (distill, penalty)

    monkeypatch.setattr(tp, "loss_terms", failing)
    out = tmp_path / "o"
    result = run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, "--steps", "5",
                 "--checkpoint-every", "5", *SMALL)
    assert_one_line_error(result, "not a number", "at step 3", "checkpoint of step 2, the last good one, is kept")
    state = tp.State.from_arrays(dict(np.load(out / io.TRAINED_CHECKPOINT_FILE)))
    assert state.done == 2 and not (out / tp.GATES_FILE).exists()
    # the gates of step 2, not those of the step that failed: row 2's mean gate is theirs
    assert state.rows[-1, tp.LOG_COLUMNS.index("mean_gate")] == float(state.gates.astype(np.float64).mean())


def test_a_haystack_under_a_result_name_in_out_is_refused_and_stale_temps_go(llama_dir, haystack, tmp_path):
    """train-pattern's files are result names to io: a --haystack that one of them would overwrite is refused in one
    line, and a temporary file a killed train-pattern left (its writer gone) is removed by the next run."""
    out = tmp_path / "apart"
    out.mkdir()
    (out / "gates.csv").write_text(Path(haystack).read_text())
    assert_one_line_error(run("train-pattern", "--model", llama_dir, "--haystack", out / "gates.csv", "--out", out,
                              *SMALL), "would be overwritten", "gates.csv")
    stale = tmp_path / "stale"
    stale.mkdir()
    left = stale / ".gates.csv.999999999-abcdefgh.tmp"  # a writer's pid that no process has
    left.write_text("partial")
    assert io.remove_stale_temps(stale, 0.0) == [left.name]


def test_cli_resume_without_a_checkpoint_and_a_stopped_run_are_one_line(llama_dir, haystack, tmp_path):
    out = tmp_path / "o"
    assert_one_line_error(run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, *SMALL,
                              "--resume"), "nothing to resume")
    out.mkdir()
    (out / io.TRAINED_CHECKPOINT_FILE).write_bytes(b"not a zip")
    assert_one_line_error(run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, *SMALL),
                          "holds a stopped training", "--resume")
    assert_one_line_error(run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, *SMALL,
                              "--resume"), "unreadable or damaged")


def test_the_default_haystack_is_not_kvpress_checks(tmp_path):
    text, name = passkeys.default_haystack()
    assert len(text) > 200_000 and "pydoc_data" in name
    assert "Mozilla Public License" not in text


@cuda_test
def test_cuda_bfloat16_gates_are_the_model_and_the_streaming_head(llama_dir):
    loaded = load_model(str(llama_dir), "cuda", "bfloat16")
    ids = ids_of(60).cuda()
    rows = gated_rows(loaded)
    none = np.zeros((2, 2), dtype=bool)
    assert torch.equal(hidden(loaded, ids, torch.ones(2, 2, device="cuda"), rows), streamed(loaded, ids, none))
    mask = np.array([[True, False], [False, True]])
    gates = torch.tensor(np.where(mask, 0.0, 1.0), dtype=torch.float32, device="cuda")
    assert torch.equal(hidden(loaded, ids, gates, rows), streamed(loaded, ids, mask))


@cuda_test
def test_cuda_cli_trains_in_bfloat16(llama_dir, haystack, tmp_path):
    out = tmp_path / "cuda"
    small = [a for a in SMALL if a not in ("--device", "cpu")]
    result = run("train-pattern", "--model", llama_dir, "--haystack", haystack, "--out", out, "--steps", "3",
                 *small, "--device", "cuda", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    record = json.loads((out / tp.RUN_FILE).read_text())
    assert record["device"].startswith("cuda") and record["dtype"] == "bfloat16"
    assert record["peak_memory_mib"]["cuda"] > 0
    assert pd.read_csv(out / tp.GATES_FILE)["gate"].between(0, 1).all()


def test_a_checkpoint_with_a_row_that_is_not_a_number_is_refused():
    """Only finite rows are ever appended to the log, so a checkpoint holding NaN or inf in its rows was damaged or
    tampered with: resuming it would write those numbers into training.csv."""
    gates = np.full((2, 2), 0.5, dtype=np.float32)
    rows = np.array([[1, 80, 0.0, 0.05, 0.05, 0.99, 0.0, 0.004], [2, 96, 0.1, 0.05, 0.15, 0.98, 0.0, 0.008]])
    good = tp.State({"model": "m"}, 2, gates, np.zeros_like(gates), np.zeros_like(gates), rows)
    assert tp.State.from_arrays(good.to_arrays()).done == 2
    for bad in (np.nan, np.inf):
        damaged = rows.copy()
        damaged[1, 2] = bad
        state = tp.State({"model": "m"}, 2, gates, np.zeros_like(gates), np.zeros_like(gates), damaged)
        with pytest.raises(ValueError, match="training rows"):
            tp.State.from_arrays(state.to_arrays())


@pytest.mark.parametrize(("value", "fine"), [(3, True), (None, True), (-1, False), (True, False), ("2", False)])
def test_a_checkpoint_threads_record_is_a_count_or_absent(value, fine):
    """threads: what torch ran with (0 or absent: not recorded); anything else is a damaged checkpoint."""
    gates = np.full((2, 2), 0.5, dtype=np.float32)
    rows = np.array([[1, 80, 0.0, 0.05, 0.05, 0.99, 0.0, 0.004]])
    arrays = tp.State({"model": "m"}, 1, gates, np.zeros_like(gates), np.zeros_like(gates), rows).to_arrays()
    record = json.loads(str(arrays["meta"]))
    if value is None:
        del record["threads"]
    else:
        record["threads"] = value
    arrays["meta"] = np.array(json.dumps(record))
    if fine:
        assert tp.State.from_arrays(arrays).threads == (value or 0)
    else:
        with pytest.raises(ValueError, match="is not a whole number of threads"):
            tp.State.from_arrays(arrays)


def test_export_refuses_gates_whose_record_lost_its_hashes(trained_dir, tmp_path):
    """train-pattern always records the sha256 of gates.csv in train_pattern.json: a record without them (edited)
    cannot vouch for the gates beside it."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained_dir, copy)
    record = json.loads((copy / tp.RUN_FILE).read_text())
    del record["files"]
    (copy / tp.RUN_FILE).write_text(json.dumps(record))
    (copy / tp.GATES_FILE).write_text((copy / tp.GATES_FILE).read_text().replace(",True", ",True ", 1))
    result = run("export", "--out", copy, "--to", tmp_path / "duo")
    assert_one_line_error(result, tp.RUN_FILE, "sha256")
