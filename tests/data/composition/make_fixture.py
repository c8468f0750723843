"""Build the tiny models of tests/test_composition.py and record TransformerLens' composition scores of them.

TransformerLens is not one of attnprobe's dependencies: run this in a virtualenv of its own,

    python3 -m venv /tmp/tlvenv && /tmp/tlvenv/bin/pip install torch==2.13.0 && \\
        /tmp/tlvenv/bin/pip install transformer-lens==4.3.0
    /tmp/tlvenv/bin/python tests/data/composition/make_fixture.py

It saves two tiny random causal LMs beside itself (gpt2/: LayerNorm, GPT-2's fused c_attn; llama/: RMSNorm,
grouped-query attention, 4 query heads on 2 KV heads), each with a word-level tokenizer, their norms' weights and
biases drawn at random so that folding them matters, and writes tl_scores.json: for each model and mode (Q, K, V)
the [layer, head, layer, head] scores of `TransformerBridge.all_composition_scores` after
`enable_compatibility_mode()` (HookedTransformer's load-time processing: fold_ln, center_writing_weights, ...).
The weights are committed, so the test never needs this script or TransformerLens; rerun it only to change them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "house", ".", ","]
SEED = 41


def save_tokenizer(folder: Path) -> int:
    """A word-level tokenizer over WORDS (with a BOS/EOS token); returns the vocabulary's size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    return len(vocab)


@torch.no_grad()
def randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights around 1 (and biases around 0) instead of exactly 1 and 0, so that folding them changes the
    scores."""
    for module in model.modules():
        if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
            module.weight.copy_(1.0 + 0.5 * torch.randn_like(module.weight))
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(0.3 * torch.randn_like(module.bias))


def make_gpt2(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    vocab = save_tokenizer(folder)
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=3, n_head=4, n_inner=64,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    model = GPT2LMHeadModel(config)
    randomise_norms(model)
    model.save_pretrained(folder)


def make_llama(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED + 1)
    vocab = save_tokenizer(folder)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         initializer_range=0.2, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    randomise_norms(model)
    model.save_pretrained(folder)


def tl_scores(folder: Path) -> dict:
    """TransformerLens' all_composition_scores of the saved model, per mode, as nested lists (float32 values)."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float32)
    bridge.enable_compatibility_mode(disable_warnings=True)
    return {mode: bridge.all_composition_scores(mode).scores.detach().double().tolist() for mode in "QKV"}


def main() -> None:
    import transformer_lens
    import transformers

    record = {"transformer_lens": transformer_lens.__version__ if hasattr(transformer_lens, "__version__") else
              "4.3.0", "transformers": transformers.__version__, "torch": torch.__version__, "models": {}}
    for name, make in (("gpt2", make_gpt2), ("llama", make_llama)):
        folder = HERE / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        make(folder)
        record["models"][name] = tl_scores(folder)
    (HERE / "tl_scores.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
