"""A Hugging Face checkpoint directory's model config and tokenizer data.

Reads config.json (the architecture and shape, both the older `rope_theta`/`rope_scaling`
keys and transformers 5's `rope_parameters`), tokenizer_config.json (chat template, BOS/EOS
strings) and generation_config.json (end-of-sequence ids, one or several). The weights are
mapped by the worker (services/worker/weights.py), the tokenizer.json loaded by
shared/tokenizer.py. Anything that cannot be served is reported here, at start.
"""

import json
from pathlib import Path

from shared.model_file import ModelConfig, ModelFileError, TokenizerData, architecture

# config.json's "architectures" entry -> the name in shared/model_file.py ARCHITECTURES.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
REQUIRED_FILES = ("config.json", "tokenizer.json")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelFileError(f"{path}: cannot be read as JSON ({error})") from None


def _token_string(value) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value) if value is not None else ""


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(item) for item in value] if isinstance(value, list) else [int(value)]


def _rope(raw: dict, source: str) -> dict:
    """The rotary fields of ModelConfig from either generation of config keys."""
    parameters = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or parameters
    theta = raw.get("rope_theta", parameters.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind == "linear":
        return {"rope_theta": float(theta), "rope_scaling": "linear", "rope_factor": float(scaling["factor"])}
    if kind == "llama3":
        return {
            "rope_theta": float(theta), "rope_scaling": "llama3", "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_context": int(scaling["original_max_position_embeddings"]),
        }
    raise ModelFileError(f"{source}: rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def model_config(raw: dict, source: str) -> ModelConfig:
    names = raw.get("architectures") or []
    arch_name = next((HF_ARCHITECTURES[name] for name in names if name in HF_ARCHITECTURES), None)
    if arch_name is None:
        found = ", ".join(names) or f"model_type {raw.get('model_type')!r}"
        raise ModelFileError(f"{source}: architecture {found} is not supported; supported: "
                             f"{', '.join(HF_ARCHITECTURES)}")
    family = architecture(arch_name, source)
    if raw.get("mlp_bias") or (arch_name != "qwen2" and raw.get("attention_bias")):
        raise ModelFileError(f"{source}: biases on the attention output or MLP projections are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"{source}: activation {raw.get('hidden_act')!r} is not supported; supported: silu")
    hidden, n_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    context = int(raw.get("max_position_embeddings", 4096))
    # Mistral 7B v0.1 attends over a sliding window of 4096 tokens; attention here is full, which is
    # the same thing as long as no sequence is longer than the window: the context is capped at it.
    window = raw.get("sliding_window")
    if window and (arch_name == "mistral" or raw.get("use_sliding_window")):
        context = min(context, int(window))
    return ModelConfig(
        n_layers=int(raw["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_size=int(raw["intermediate_size"]),
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=int(raw["vocab_size"]),
        context_length=context,
        tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=arch_name,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        **_rope(raw, source),
    )


def read_checkpoint_metadata(directory: Path) -> tuple[ModelConfig, TokenizerData, str]:
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if not any(directory.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelFileError(f"{directory}: not a servable checkpoint directory, missing {', '.join(missing)}")
    raw = _read_json(directory / "config.json")
    config = model_config(raw, str(directory / "config.json"))
    tokenizer_config = (_read_json(directory / "tokenizer_config.json")
                        if (directory / "tokenizer_config.json").is_file() else {})
    generation = (_read_json(directory / "generation_config.json")
                  if (directory / "generation_config.json").is_file() else {})
    vocabulary = _read_json(directory / "tokenizer.json")
    ids = dict(vocabulary.get("model", {}).get("vocab") or {})
    ids |= {token["content"]: token["id"] for token in vocabulary.get("added_tokens", [])}
    bos_token = _token_string(tokenizer_config.get("bos_token"))
    eos_token = _token_string(tokenizer_config.get("eos_token"))
    eos_ids = _ids(generation.get("eos_token_id")) or _ids(raw.get("eos_token_id"))
    if eos_token in ids:
        eos_ids.append(ids[eos_token])
    if not eos_ids:
        raise ModelFileError(f"{directory}: no end-of-sequence token (generation_config.json, config.json and "
                             "tokenizer_config.json name none)")
    bos_id = _ids(generation.get("bos_token_id")) or _ids(raw.get("bos_token_id")) or [ids.get(bos_token, eos_ids[0])]
    template = tokenizer_config.get("chat_template") or ""
    if not template and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if isinstance(template, list):  # several named templates: the default one
        template = next((item["template"] for item in template if item.get("name") == "default"), "")
    tokenizer = TokenizerData(
        tokens=[], merges=[], token_types=[],
        bos_token_id=bos_id[0],
        eos_token_id=eos_ids[0],
        chat_template=template,
        stop_token_ids=tuple(sorted(set(eos_ids))),
        add_bos=bool(tokenizer_config.get("add_bos_token", False)),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    stored_dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "")
    return config, tokenizer, stored_dtype
