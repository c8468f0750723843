"""The model zoo: one tiny random model per architecture of transformers, saved like a user's checkpoint.

Each entry is a config class and its settings: 2 layers, 4 heads of size 8 (key/value heads fewer where the
architecture groups them), a sliding window of 4 where it has one, so that the test sentences (up to 16
tokens) run past it. `make(name, folder)` saves the model and a word-level tokenizer and returns the folder.
"""

from __future__ import annotations

from pathlib import Path

from conftest import SENTENCES, save_tokenizer

H = 32  # hidden size: 4 heads of 8
COMMON = {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
          "max_position_embeddings": 128}
GROUPED = {**COMMON, "num_key_value_heads": 2}
WINDOW = 4

# name -> (config class in transformers, settings). Names are what a researcher would call the model.
ZOO: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", {"n_embd": H, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "llama": ("LlamaConfig", GROUPED),
    "bert": ("BertConfig", COMMON),
    "gpt_neox": ("GPTNeoXConfig", COMMON),
    "opt": ("OPTConfig", {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64,
                          "max_position_embeddings": 128, "word_embed_proj_dim": H}),
    "qwen2": ("Qwen2Config", GROUPED),
    "qwen3": ("Qwen3Config", {**GROUPED, "head_dim": 8}),
    "mistral": ("MistralConfig", {**GROUPED, "sliding_window": None}),
    "mistral (sliding window)": ("MistralConfig", {**GROUPED, "sliding_window": WINDOW}),
    "gemma": ("GemmaConfig", {**COMMON, "num_key_value_heads": 1, "head_dim": 8}),
    "gemma2": ("Gemma2Config", {**GROUPED, "head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                                "attn_logit_softcapping": 5.0}),
    "gemma3_text": ("Gemma3TextConfig", {**GROUPED, "head_dim": 8, "sliding_window": WINDOW,
                                         "query_pre_attn_scalar": 16}),
    "phi": ("PhiConfig", COMMON),
    "phi3": ("Phi3Config", GROUPED),
    "olmo": ("OlmoConfig", COMMON),
    "olmo2": ("Olmo2Config", COMMON),
    "stablelm": ("StableLmConfig", {**COMMON, "num_key_value_heads": 4, "partial_rotary_factor": 0.5}),
    "starcoder2": ("Starcoder2Config", {**GROUPED, "sliding_window": WINDOW}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"n_embd": H, "n_layer": 2, "n_head": 4, "n_positions": 128,
                                         "multi_query": True}),
    "cohere": ("CohereConfig", GROUPED),
    "granite": ("GraniteConfig", GROUPED),
    "gpt_oss": ("GptOssConfig", {**GROUPED, "head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1,
                                 "sliding_window": WINDOW}),
    "roberta": ("RobertaConfig", {**COMMON, "max_position_embeddings": 130}),
    "xlm-roberta": ("XLMRobertaConfig", {**COMMON, "max_position_embeddings": 130}),
    "distilbert": ("DistilBertConfig", {"dim": H, "n_layers": 2, "n_heads": 4, "hidden_dim": 64,
                                        "max_position_embeddings": 128}),
    "electra": ("ElectraConfig", {**COMMON, "embedding_size": H}),
    "albert": ("AlbertConfig", {**COMMON, "embedding_size": 16}),
    "modernbert": ("ModernBertConfig", {**COMMON, "global_attn_every_n_layers": 2, "local_attention": WINDOW}),
    "gptj": ("GPTJConfig", {"n_embd": H, "n_layer": 2, "n_head": 4, "n_positions": 128, "rotary_dim": 4}),
    "falcon": ("FalconConfig", {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4}),
    "falcon (alibi)": ("FalconConfig", {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
                                        "alibi": True}),
    "bloom": ("BloomConfig", {"hidden_size": H, "n_layer": 2, "n_head": 4}),
    "mpt": ("MptConfig", {"d_model": H, "n_layers": 2, "n_heads": 4, "max_seq_len": 128}),
}


def make(name: str, folder: Path, seed: int = 0, lm_head: bool = False, **overrides) -> Path:
    """Save the zoo's `name` (random weights, initializer range 0.4 for sharp, varied heads) to `folder`;
    `overrides` change its settings (the long-document benchmark asks for more positions and a wider window);
    `lm_head`: the causal-LM class with its head (what ablate and retrieval load)."""
    import torch
    import transformers

    class_name, settings = ZOO[name]
    vocab = save_tokenizer(folder, SENTENCES)
    torch.manual_seed(seed)
    config = getattr(transformers, class_name)(vocab_size=max(vocab, 64), pad_token_id=0,
                                               **{**settings, **overrides})
    config.initializer_range = 0.4
    auto = transformers.AutoModelForCausalLM if lm_head else transformers.AutoModel
    model = auto.from_config(config, attn_implementation="eager")
    model.save_pretrained(folder)
    return folder


def computes_own_attention(name: str) -> bool:
    """Whether the installed transformers' model class of the zoo's `name` computes its attention itself instead of
    through AttentionInterface (transformers' own test, `_can_set_attn_implementation`): GPT-J, Falcon, BLOOM and MPT
    did in 5.23; GPT-J uses the interface from 5.24 on."""
    import transformers

    config_class = getattr(transformers, ZOO[name][0])
    return not transformers.AutoModel._model_mapping[config_class]._can_set_attn_implementation()


OWN_ATTENTION = {name for name in ZOO if computes_own_attention(name)}


def builds_own_mask(name: str) -> bool:
    """Whether the zoo's `name` runs through AttentionInterface but adds a bias of its own to the mask it builds:
    Falcon with ALiBi from transformers 5.25 on (before, it computed its attention itself). attnprobe's statistics
    paths refuse such a mask and `auto` takes the eager hooks."""
    return name == "falcon (alibi)" and name not in OWN_ATTENTION


OWN_MASK = {name for name in ZOO if builds_own_mask(name)}


def architecture_row(name: str, loaded) -> tuple[str, str]:
    """The row of the docs' architecture table (docs/long-documents.md) for the zoo's `name`: the path `auto`
    takes on long documents and the features `kernel.discover` reports."""
    from attnprobe import kernel

    found = kernel.discover(loaded)
    fused = len(found.fused_layers()) if found.features else 0
    path = "eager (hooks)" if found.reason else "fused" if fused == loaded.num_layers else \
        "fused + blocked" if fused else "blocked"
    features = ", ".join(found.labels()) or "-"
    if name in OWN_ATTENTION or name in OWN_MASK:
        features = "ALiBi" if "alibi" in name or name in ("bloom", "mpt") else "-"
    return path, features


def blank_gpt2(folder: Path):
    """A 2-layer GPT-2 (4 heads of 4, hidden 16) with a word-level tokenizer of a, b, c saved in folder, every weight
    zero but the norms' gains (1) and the token embeddings (token t: 4 on channel t, -1 on channel 4): the blank a
    test plants one route into (tests/test_patch.py's and test_circuit.py's planted heads). Returns (model, hidden);
    the caller plants, then saves it into folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    folder.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "a": 1, "b": 2, "c": 3}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(folder)
    hidden = 16
    config = GPT2Config(vocab_size=4, n_embd=hidden, n_layer=2, n_head=4, n_positions=8, pad_token_id=0,
                        tie_word_embeddings=False)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight") or name.startswith("transformer.ln_f.weight"):
                p.fill_(1.0)
        model.transformer.wte.weight[:, :4] = torch.eye(4) * 4  # token t: 4 on channel t
        model.transformer.wte.weight[:, 4] = -1.0
    return model, hidden
