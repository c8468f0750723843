"""Load a model with eager attention and stream its attention maps, one layer at a time."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from attnprobe.errors import AttnprobeError
from attnprobe.pids import alive
from attnprobe.quiet import quiet_transformers
from attnprobe.sources import resolve

Device = Literal["auto", "cpu", "cuda", "mps"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: the checkpoint's own dtype, as transformers 5 loads by default

LayerCallback = Callable[[int, Tensor], None]  # (layer index, attention [batch, head, query, key])
Status = Callable[[str], None]  # told what a slow step (a GGUF conversion) is doing; the library itself prints nothing
HUB_TIMEOUT = 3.0  # seconds to open a connection to the model hub before attnprobe reads only its local cache
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@dataclass
class LoadedModel:
    spec: str  # what the user passed to --model
    source: str  # resolved local folder, or the hub id
    origin: dict[str, Any]  # alias, package, gguf file and hash, when they apply
    revision: str | None  # hub commit hash when known
    model: nn.Module  # the base model (no LM head), eager attention, eval mode
    tokenizer: Any
    device: torch.device
    causal: bool
    max_length: int  # longest input the model accepts, in tokens
    dtype: str = "float32"  # the model's weights and activations as they ran; statistics are always float32
    lm_head: nn.Module | None = None  # the causal-LM head, when loaded with lm_head=True (decoders only)
    offload: str | None = None  # the temporary folder load_model made for --device-map's disk offload
    bos: str = "auto"  # --bos: auto (the tokenizer's own), always or never (tokens.encode)
    dtype_requested: str | None = None  # what --dtype asked for ("auto", ...); None: the caller loaded the model

    @property
    def num_layers(self) -> int:
        return len(attention_modules(self.model))

    @property
    def num_heads(self) -> int:
        return int(self.model.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer: fewer than the query heads under grouped-query attention."""
        return int(getattr(self.model.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)


def parse_max_memory(text: str | None) -> dict | None:
    """`--max-memory 0=20GiB,1=20GiB,cpu=60GiB` -> {0: "20GiB", 1: "20GiB", "cpu": "60GiB"}."""
    if not text:
        return None
    limits: dict = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key.strip() or not value.strip():
            raise AttnprobeError(f"--max-memory {text!r}: write device=size pairs, e.g. 0=20GiB,cpu=60GiB")
        key = key.strip()
        limits[int(key) if key.isdigit() else key] = value.strip()
    return limits


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA, then MPS, then CPU; an explicit device must exist."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda")
    if device.startswith("cuda:") and device[5:].isdigit() and torch.cuda.is_available():
        if int(device[5:]) >= torch.cuda.device_count():
            raise AttnprobeError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(int(device[5:]))  # one GPU per torchrun rank
        return torch.device(device)
    if device == "mps" and torch.backends.mps.is_available():
        return torch.device("mps")
    if device in ("cuda", "mps"):
        raise AttnprobeError(f"--device {device} is not available on this machine: use --device cpu or auto")
    raise AttnprobeError(f"unknown --device {device!r}: use auto, cpu, cuda or mps")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The torch dtype --dtype asks for; None for `auto` (the checkpoint's own: `checkpoint_dtype`)."""
    if dtype not in DTYPE_CHOICES:
        raise AttnprobeError(f"unknown --dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    if dtype == "float16" and device.type == "cpu":
        raise AttnprobeError("--dtype float16 needs a GPU: on CPU use auto (default), float32 or bfloat16")
    return None if dtype == "auto" else DTYPES[dtype]


def runnable_dtype(saved: Any, device: torch.device) -> torch.dtype | None:
    """--dtype auto: the dtype a checkpoint saved in `saved` (config.json's `dtype`, or `torch_dtype` before
    transformers 5; a torch dtype or its name) runs in on `device`. bfloat16 and float32 run as saved; float16 only on
    a GPU (on CPU attnprobe refuses float16, so it runs in float32); anything else (float64, none recorded: None)
    in float32, the precision the statistics keep."""
    if isinstance(saved, str):
        saved = getattr(torch, saved.removeprefix("torch."), None)
    if saved in (torch.float32, torch.bfloat16) or (saved == torch.float16 and device.type != "cpu"):
        return saved
    return None if saved is None else torch.float32


def checkpoint_dtype(config: Any) -> Any:
    """What config.json says the weights were saved in: `dtype` (transformers 5) or `torch_dtype` (4.x); None if
    neither."""
    return getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)


def weights_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point weight (what its activations run in)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def load_model(
    spec: str, device: str = "auto", dtype: str = "auto", device_map: str | dict | None = None,
    max_memory: dict | None = None, offload_folder: str | None = None, lm_head: bool = False,
    on_status: Status | None = None,
) -> LoadedModel:
    """Load the base model and tokenizer from a local folder or a hub id, with eager attention.

    A hub id is looked up on the hub only when a connection to it opens within HUB_TIMEOUT seconds;
    otherwise (and under HF_HUB_OFFLINE=1) only the local Hugging Face cache is read, so an unreachable
    hub fails at once instead of after minutes of retries. `on_status` hears what a first-time GGUF
    conversion is doing (it takes a minute or more).

    `lm_head=True` loads a decoder's causal-LM class and keeps its head as `LoadedModel.lm_head`
    (`model` is still the base model); an encoder is loaded as usual, without a head.

    `device_map` ("auto", or a module -> device dict) spreads a model too large for one device over
    several GPUs, the CPU and the disk with accelerate's big-model loading; `max_memory` caps each
    device ({0: "20GiB", "cpu": "60GiB"}). The inputs then go to the device of the embeddings.

    `dtype`: "auto" (default) runs the checkpoint in its own dtype (config.json's `dtype`, else its weights'), as
    transformers 5 loads by default: bfloat16 stays bfloat16, float32 float32, float16 too on a GPU (float32 on CPU,
    where attnprobe refuses float16). "float32", "bfloat16" or "float16" cast the weights. `LoadedModel.dtype` is
    what ran, `dtype_requested` what was asked; the statistics are float32 either way.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)  # None: auto
    remove_stale_offload()
    made = offload_dir() if device_map is not None and offload_folder is None else None
    placement = {} if device_map is None else {
        "device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder or made,
    }
    resolved = resolve(spec, on_status)
    source = resolved.location
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    cache_only = {} if resolved.local or hub_offline() or hub_reachable() else {"local_files_only": True}
    with quiet_transformers():
        try:
            if resolved.local and not _has_tokenizer_files(source):
                raise _no_tokenizer(spec, source)
            tokenizer = AutoTokenizer.from_pretrained(source, **cache_only)
            if _empty_tokenizer(tokenizer):
                raise _no_tokenizer(spec, source)
            config = AutoConfig.from_pretrained(source, **cache_only)
            with_head = lm_head and not _is_encoder(config)
            if torch_dtype is None:  # auto: as saved, where it runs here; "auto" lets transformers read the weights'
                torch_dtype = runnable_dtype(checkpoint_dtype(config), torch_device) or "auto"
            # weights_only: a pickled checkpoint is read by torch's safe loader, never unpickled freely
            model, info = (AutoModelForCausalLM if with_head else AutoModel).from_pretrained(
                source, attn_implementation="eager", dtype=torch_dtype, weights_only=True, output_loading_info=True,
                **placement, **cache_only
            )
            check_weights_match(source, model, info)
        except (SafetensorError, pickle.UnpicklingError, EOFError) as err:
            raise _weights_error(spec, source, resolved.local, resolved.origin, err) from err
        except RuntimeError as err:
            if "ignore_mismatched_sizes" in str(err):  # transformers' load report: a tensor of another shape
                raise AttnprobeError(
                    f"cannot load model from {source}: a tensor in its weights has another shape than its config.json "
                    "gives (weights and config of different models, or a tensor saved wrong): re-save the model "
                    "with save_pretrained"
                ) from err
            if not str(err).startswith("PytorchStreamReader"):  # torch's zip reader: a truncated .bin
                raise
            raise _weights_error(spec, source, resolved.local, resolved.origin, err) from err
        except ImportError as err:
            if device_map is None:
                raise
            raise AttnprobeError(f"--device-map needs accelerate ({err}): pip install accelerate") from err
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
            if cache_only:
                raise AttnprobeError(
                    f"cannot reach the model hub ({hub_endpoint()}) and {spec!r} is not in the local Hugging Face "
                    "cache: pass a local folder saved with save_pretrained, or a short name such as smollm2-135m"
                ) from err
            raise _load_error(spec, source, resolved.local, err) from err
    model.eval()
    ran = weights_dtype(model)
    if device_map is None:
        wanted = runnable_dtype(ran, torch_device) or torch.float32  # auto read from the weights: float64 -> float32
        model.to(torch_device, wanted)  # a no-op cast where it already runs so
        ran = wanted
    else:
        torch_device = model.get_input_embeddings().weight.device  # where the inputs go
        if torch_device.type == "meta":  # the embeddings themselves were offloaded
            torch_device = torch.device("cpu")
    head = model.get_output_embeddings() if with_head else None
    model = model.base_model if with_head else model
    names = {value: name for name, value in DTYPES.items()}
    loaded = _loaded(spec, source, resolved.origin, model, tokenizer, torch_device, names.get(ran, str(ran)), head)
    loaded.offload = made
    loaded.dtype_requested = dtype
    return loaded


KEYS_NAMED = 4  # weight names a mismatch error shows


def check_weights_match(source: str, model: nn.Module, info: dict[str, Any]) -> None:
    """Refuse weights that do not fill the model its config.json describes.

    transformers initialises the tensors a checkpoint lacks (a config with more layers than the weights, another
    architecture's config) and drops those the model has no place for (fewer layers), and only logs it, which
    attnprobe quiets: the results would be of made-up or missing layers. Keys transformers itself expects to be
    absent (tied weights, `_keys_to_ignore_on_load_missing`) are not in `missing_keys`, and a checkpoint saved with a
    head that this base model does not hold (`lm_head.weight` under AutoModel) is fine: only an unexpected key
    under one of the model's own submodules is refused.
    """
    missing = [k for k in info.get("missing_keys", []) if not _ignored(k, model, "_keys_to_ignore_on_load_missing")
               and k not in _tied_keys(model)]
    unexpected = [k for k in info.get("unexpected_keys", []) if _own_key(k, model)
                  and not _ignored(k, model, "_keys_to_ignore_on_load_unexpected")]
    if not missing and not unexpected:
        return
    parts = [f"{what} {_some(keys)}" for what, keys in (("lacks", missing), ("has extra", unexpected)) if keys]
    raise AttnprobeError(
        f"cannot load model from {source}: its weights do not match its config.json "
        f"({type(model).__name__}, {getattr(model.config, 'num_hidden_layers', '?')} layers): the checkpoint "
        f"{' and '.join(parts)}, which would be made up (freshly initialised) or dropped: "
        "use the config.json saved with these weights (save_pretrained writes both), or re-save the model"
    )


def _some(keys: list[str]) -> str:
    """The first KEYS_NAMED of `keys`, sorted, and how many in all."""
    names = sorted(keys)
    more = f" and {len(names) - KEYS_NAMED} more" if len(names) > KEYS_NAMED else ""
    return ", ".join(names[:KEYS_NAMED]) + more


def _ignored(key: str, model: nn.Module, attribute: str) -> bool:
    """Whether a pattern of the model class's (and its base model's) `attribute` matches `key`."""
    import re

    patterns = set(getattr(model, attribute, None) or ()) | set(getattr(model.base_model, attribute, None) or ())
    return any(re.search(pattern, key) for pattern in patterns)


def _tied_keys(model: nn.Module) -> set[str]:
    """Parameter names that a tied model fills from another weight (the LM head from the embeddings)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    tied = getattr(model, "_tied_weights_keys", None) or ()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def _own_key(key: str, model: nn.Module) -> bool:
    """Whether `key` names a place inside one of the model's own submodules (a layer it lacks, say)."""
    children = {name for name, _ in model.named_children()} | {name for name, _ in model.base_model.named_children()}
    prefix = f"{model.base_model_prefix}."
    first = (key[len(prefix):] if key.startswith(prefix) else key).split(".")[0]
    return first in children


OFFLOAD_PREFIX = "attnprobe-offload-"  # + pid + "-" + mkdtemp's random part, in the temporary folder


def remove_stale_offload() -> None:
    """Remove the offload folders of processes that are gone (a SIGKILLed --device-map run cannot remove its own):
    every load does this, with or without --device-map, so a killed run's folder (empty or gigabytes) does not
    wait for the next --device-map run."""
    import shutil

    for folder in Path(tempfile.gettempdir()).glob(f"{OFFLOAD_PREFIX}*"):
        pid = folder.name[len(OFFLOAD_PREFIX):].split("-")[0]
        if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def offload_dir() -> str:
    """A temporary folder for --device-map's disk offload, named by this process; removed by `release_offload`
    (or at exit)."""
    import atexit
    import shutil

    made = tempfile.mkdtemp(prefix=f"{OFFLOAD_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, made, True)
    return made


def release_offload(loaded: LoadedModel | None) -> None:
    """Remove the offload folder load_model made for `loaded` (the model cannot run afterwards if it used it)."""
    import shutil

    if loaded is not None and loaded.offload:
        shutil.rmtree(loaded.offload, ignore_errors=True)
        loaded.offload = None


def _loaded(
    spec: str, source: str, origin: dict[str, Any], model: nn.Module, tokenizer: Any, device: torch.device,
    dtype: str, head: nn.Module | None,
) -> LoadedModel:
    """A LoadedModel of a base model in eval mode; refused when attnprobe cannot read its attention."""
    modules = attention_modules(model)
    if not modules:
        raise AttnprobeError(
            f"model {spec} ({type(model).__name__}) exposes no attention weights that attnprobe can read"
        )
    return LoadedModel(
        spec=spec,
        source=source,
        origin=origin,
        revision=getattr(model.config, "_commit_hash", None),
        model=model,
        tokenizer=tokenizer,
        device=device,
        causal=bool(getattr(modules[0][0], "is_causal", not _is_encoder(model.config)))
        and getattr(model.config, "is_causal", None) is not False,  # a config may ask for a bidirectional mask
        max_length=_max_length(model.config, tokenizer),
        dtype=dtype,
        lm_head=head,
    )


MODEL_KINDS = ("a model name or path (str), a LoadedModel from attnprobe.load_model, or a (transformers model, "
               "tokenizer) pair")


def as_loaded(model: Any, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """What the notebook API accepts as a model: a LoadedModel as it is, a name or path loaded with
    `load_model(model, device, dtype)`, or a transformers model and its tokenizer (`from_transformers`)."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load_model(os.fspath(model), device, dtype)
    if isinstance(model, (tuple, list)) and len(model) == 2 and isinstance(model[0], nn.Module):
        return from_transformers(*model)
    if isinstance(model, nn.Module):
        raise AttnprobeError(f"model: a {type(model).__name__} needs its tokenizer: pass (model, tokenizer)")
    raise AttnprobeError(f"model: expected {MODEL_KINDS}; got {type(model).__name__}")


def from_transformers(model: nn.Module, tokenizer: Any, spec: str | None = None) -> LoadedModel:
    """A transformers model and its tokenizer, loaded by the caller, as a LoadedModel.

    A model with an LM head is measured through its base model (its head is kept as `lm_head`). The
    model is put in eval mode and, when it runs another attention implementation, switched to eager
    (`set_attn_implementation("eager")`: the same outputs, and the maps attnprobe reads).
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None or not hasattr(config, "model_type"):
        raise AttnprobeError(f"model: expected a transformers model (with a .config); got {type(model).__name__}")
    if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise AttnprobeError(f"tokenizer: expected a transformers tokenizer; got {type(tokenizer).__name__}")
    dtypes = {value: name for name, value in DTYPES.items()}
    weights = next((p for p in model.parameters() if p.is_floating_point()), None)
    if weights is None or weights.dtype not in dtypes:
        found = "no floating-point weights" if weights is None else str(weights.dtype)
        raise AttnprobeError(f"model: {found}; attnprobe runs float32, bfloat16 or float16 models "
                             "(e.g. model.to(torch.float32))")
    if getattr(config, "_attn_implementation", "eager") != "eager":
        try:
            model.set_attn_implementation("eager")
        except (AttributeError, ValueError) as err:
            raise AttnprobeError(f"model {type(model).__name__} cannot run eager attention: {err}") from err
    model.eval()
    base = getattr(model, "base_model", model)
    head = model.get_output_embeddings() if base is not model and hasattr(model, "get_output_embeddings") else None
    name = spec or getattr(config, "_name_or_path", "") or type(model).__name__
    return _loaded(name, name, {"loaded_by": "caller"}, base, tokenizer, weights.device, dtypes[weights.dtype], head)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1): the hub client reads only its cache."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def hub_reachable(timeout: float = HUB_TIMEOUT) -> bool:
    """Whether the hub (HF_ENDPOINT) answers an HTTP request within `timeout` seconds, all told.

    Behind a proxy the proxy decides, so this says True. Without the check, an unreachable hub costs
    about a minute of the hub client's retries before any error. The `timeout` bounds every step (once,
    `analyze --model gpt2` took 22 s to fail without a network, where the docs say at once): the name lookup,
    which socket's own timeout does not cover (a resolver that gets no answer waits 5 s a try), the connection,
    and an answer to a HEAD request (a firewall that accepts connections and then says nothing left the hub
    client two 10 s waits, one for the tokenizer and one for the config). So the probe runs in a thread that is
    given up on after `timeout`. Any HTTP answer will do; the certificate is not checked, since no data is
    exchanged and the hub client checks its own.
    """
    import http.client
    import ssl
    import threading
    from urllib.parse import urlsplit

    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    endpoint = urlsplit(hub_endpoint())
    if not endpoint.hostname:
        return True  # not a URL we can check: let the hub client try
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    answered: list[bool] = []

    def probe() -> None:
        if endpoint.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                endpoint.hostname, port, timeout=timeout, context=ssl._create_unverified_context())
        else:
            connection = http.client.HTTPConnection(endpoint.hostname, port, timeout=timeout)
        try:
            connection.request("HEAD", "/", headers={"User-Agent": "attnprobe-hub-check"})
            connection.getresponse()
            answered.append(True)
        except (OSError, http.client.HTTPException):  # no DNS, refused, unreachable, timed out, not HTTP
            answered.append(False)
        finally:
            connection.close()

    thread = threading.Thread(target=probe, name="attnprobe-hub-probe", daemon=True)  # a daemon: exit never waits
    thread.start()
    thread.join(timeout)
    return bool(answered) and answered[0]


def attention_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The self-attention modules in layer order, each with the index of its weights in its output.

    Follows the model's own `_can_record_outputs["attentions"]` declaration, the one
    transformers uses for `output_attentions`.
    """
    spec = getattr(type(model), "_can_record_outputs", None) or {}
    target = spec.get("attentions")
    if target is None:
        return _own_attention_modules(model)
    target_class = getattr(target, "target_class", target)
    class_name = getattr(target, "class_name", None)
    layer_name = getattr(target, "layer_name", None)
    index = getattr(target, "index", 1) if hasattr(target, "target_class") else 1
    found = []
    for name, module in model.named_modules():
        by_class = isinstance(target_class, type) and isinstance(module, target_class)
        by_name = class_name is not None and name.endswith(class_name)
        in_layer = layer_name is None or f".{layer_name.strip('.')}." in f".{name}."
        if (by_class or by_name) and in_layer:
            found.append((module, index))
    return found


def _own_attention_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The attention modules of a model that computes attention itself (GPT-J, Falcon, BLOOM, MPT): the outermost
    modules whose class is named *Attention, in layer order; each returns (output, weights) when the model runs
    with `output_attentions=True` (forward_kwargs asks for it)."""
    if "output_attentions" not in inspect.signature(model.forward).parameters:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return [(module, 1) for _, module in found]


def asks_for_attentions(model: nn.Module) -> bool:
    """Whether the model returns its attention weights only when asked (`output_attentions=True`)."""
    spec = getattr(type(model), "_can_record_outputs", None) or {}
    return spec.get("attentions") is None and bool(_own_attention_modules(model))


class LastLayerDone(Exception):
    """Raised from the last attention hook: the rest of the network (MLP, final norm) is not needed."""


@torch.inference_mode()
def stream_attention(
    loaded: LoadedModel, input_ids: Tensor, attention_mask: Tensor, on_layer: LayerCallback
) -> None:
    """Run one batch; hand each layer's attention to `on_layer` as it is computed, keep none.

    The forward pass stops right after the last layer's attention: what follows it cannot
    change any map.
    """
    modules = attention_modules(loaded.model)
    seen: list[int] = []

    def hook_for(layer: int, index: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            weights = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
            if isinstance(weights, Tensor) and weights.dim() == 4:
                seen.append(layer)
                on_layer(layer, weights)  # [batch, head, query, key]
            if layer == len(modules) - 1:
                raise LastLayerDone

        return hook

    handles = [m.register_forward_hook(hook_for(layer, index)) for layer, (m, index) in enumerate(modules)]
    try:
        loaded.model(**forward_kwargs(loaded.model, input_ids, attention_mask))
    except LastLayerDone:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(range(len(modules))) - set(seen))
    if missing:
        raise AttnprobeError(
            f"model {loaded.spec} returned no attention map for layer(s) {missing}: "
            "it must run with eager attention (attn_implementation='eager')"
        )


def forward_kwargs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    if asks_for_attentions(model):
        kwargs["output_attentions"] = True  # its attention modules hand back their weights only then
    return kwargs


def _load_error(spec: str, source: str, local: bool, err: Exception) -> AttnprobeError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if local and "backend tokenizer" in first_line:  # tokenizer_config.json without the files it names
        return _no_tokenizer(spec, source)
    if local:
        return AttnprobeError(f"cannot load model from {source}: {first_line}")
    return AttnprobeError(
        f"cannot load model {spec!r} from the model hub (offline or unknown id): "
        "pass a local folder saved with save_pretrained, e.g. --model ./my-model"
    )


def _weights_error(spec: str, source: str, local: bool, origin: dict[str, Any], err: Exception) -> AttnprobeError:
    """A weights file that cannot be read: corrupt safetensors, or a pickle torch's safe loader refuses."""
    from pathlib import Path

    from safetensors import SafetensorError

    folder = Path(source) if local else None
    where = f"cannot load model from {source}" if local else f"cannot load model {spec!r}"
    if "gguf_file" in origin:
        fix = f"delete {source} and run again to convert {origin['gguf_file']} anew"
    elif not local:
        fix = "delete it from the Hugging Face cache and download it again"
    else:
        fix = None
    if isinstance(err, SafetensorError):
        name = (_unreadable_safetensors(folder) if folder else None) or "its safetensors weight file"
        return AttnprobeError(
            f"{where}: {name} is not a readable safetensors file (truncated or corrupt): "
            f"{fix or 're-save the model with save_pretrained'}"
        )
    pickles = sorted(p.name for p in folder.glob("*.bin")) if folder else []
    name = pickles[0] if len(pickles) == 1 else "its pickled .bin weights"
    return AttnprobeError(
        f"{where}: {name} is not loadable: it is truncated, corrupt, holds more than plain tensors, or was pickled "
        "with a protocol torch's safe loader does not read, and "
        "attnprobe reads pickled weights only with torch's safe loader (safetensors is the safe format): "
        f"convert {name} to safetensors (e.g. load it yourself with a trusted torch.load and "
        "save_pretrained(..., safe_serialization=True))"
    )


def _unreadable_safetensors(folder: Any) -> str | None:
    """The first .safetensors file in `folder` (a Path) whose header cannot be read, if any."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return path.name
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt", "*.model",
                   "*.tiktoken", "vocab.*")


def _has_tokenizer_files(folder: str) -> bool:
    from pathlib import Path

    return any(any(Path(folder).glob(pattern)) for pattern in TOKENIZER_FILES)


def _no_tokenizer(spec: str, source: str) -> AttnprobeError:
    return AttnprobeError(
        f"model {spec} has no tokenizer: {source} lacks its tokenizer files (tokenizer.json, vocab.json, "
        "tokenizer.model, ...); save them there with tokenizer.save_pretrained(folder)"
    )


def _empty_tokenizer(tokenizer: Any) -> bool:
    """A tokenizer transformers made up for a folder without tokenizer files: no vocabulary, so every text
    gives no tokens (or only special ones)."""
    if getattr(tokenizer, "vocab_size", None) == 0:
        return True
    try:
        vocabulary = set(tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot list its vocabulary is reported when it is used
        return False
    return not vocabulary - set(getattr(tokenizer, "all_special_tokens", ()))  # nothing but special tokens


def _is_encoder(config: Any) -> bool:
    return not getattr(config, "is_decoder", False) and config.model_type in {
        "bert", "roberta", "distilbert", "albert", "electra", "xlm-roberta", "mpnet", "deberta", "deberta-v2",
    }


def _max_length(config: Any, tokenizer: Any) -> int:
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    usable = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(usable) if usable else 1024


_REGISTERED_ATTENTION: set[str] = set()


@contextmanager
def using_attention(model: nn.Module, name: str, function: Callable[..., Any], mask: Callable[..., Any]) -> Any:
    """Run `model` with the attention function `function` (and the attention-mask function `mask`) for the
    duration, registered with transformers as `name` once per process; the implementation it had is put back."""
    if name not in _REGISTERED_ATTENTION:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, mask)
        _REGISTERED_ATTENTION.add(name)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
