"""Tiny random checkpoints of every supported architecture, made by transformers inside the
tests (no weights can be downloaded here): a Hugging Face directory, or a GGUF written the way
llama.cpp's converter writes one (Q/K rows permuted for Llama, tensor types chosen per test).
"""

import json
from pathlib import Path

import numpy as np
import torch

from shared.tokenizer import byte_to_unicode

END_OF_TEXT = "<|endoftext|>"
BYTE_VOCABULARY = 257  # the 256 bytes, then END_OF_TEXT
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, vocab_size=320)

# Named variants: architecture and the config fields that make it what it is.
VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3.1-rope": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


def transformers_model(variant: str, seed: int = 0, **overrides):
    """A seeded random model of the variant, in float32, eval mode."""
    import transformers

    class_name, fields = VARIANTS[variant]
    config = getattr(transformers, class_name)(**(SHAPE | {"eos_token_id": 256, "bos_token_id": 256} | fields
                                                  | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the default init is too small for random tokens to differ between variants
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.5 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.15)
    return model.eval()


def write_byte_tokenizer(directory: Path, vocab_size: int = BYTE_VOCABULARY) -> None:
    """A byte-level BPE of 256 byte tokens and one special end-of-text token, with a chat template;
    with a larger vocab_size, filler tokens after them ("w257", ...: text for every id a random model
    of that vocabulary samples)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocabulary = {char: byte for byte, char in byte_to_unicode().items()}
    if vocab_size > BYTE_VOCABULARY:
        vocabulary[END_OF_TEXT] = BYTE_VOCABULARY - 1
        vocabulary |= {f"w{index}": index for index in range(BYTE_VOCABULARY, vocab_size)}
    backend = Tokenizer(models.BPE(vocab=vocabulary, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": END_OF_TEXT, "bos_token": None, "chat_template": CHAT_TEMPLATE}))


def save_checkpoint(model, directory: Path, max_shard_size: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), safe_serialization=True, **options)
    write_byte_tokenizer(directory)
    return directory


def permute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K permutation (the inverse of services/worker/weights.py's)."""
    rows, columns = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, columns).swapaxes(1, 2).reshape(rows, columns)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(model, path: Path, tensor_type: str = "F32", architecture: str = "llama",
               raw_type_override: dict[str, str] | None = None, tokenizer: str = "bytes") -> dict[str, np.ndarray]:
    """The model as llama.cpp's converter writes it; matrices in tensor_type (norms and biases
    stay F32, as llama.cpp keeps them). Returns each HF tensor as the GGUF holds it after
    dequantization, to load into transformers as the oracle of a quantized file."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = model.config
    quant = gguf.GGMLQuantizationType[tensor_type]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if tokenizer == "sentencepiece":  # as llama.cpp writes Llama 2's: scores, no merges; model vocab = tokens
        tokens, _ = sentencepiece_vocabulary()
        assert config.vocab_size == len(tokens), f"make the model with vocab_size={len(tokens)}"
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 259 + [-float(index) for index in range(len(tokens) - 259)])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)
        writer.add_chat_template("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    else:
        spelling = byte_to_unicode()
        tokens = [spelling[byte] for byte in range(256)] + [END_OF_TEXT]
        tokens += [f"[PAD{index}]" for index in range(config.vocab_size - len(tokens))]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_merges([])
        writer.add_token_types([1] * 256 + [3] + [4] * (len(tokens) - 257))
        writer.add_eos_token_id(256)
        writer.add_bos_token_id(256)
        writer.add_chat_template(CHAT_TEMPLATE)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    dequantized: dict[str, np.ndarray] = {}
    permuted = architecture == "llama"
    for hf_name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
        stored = array
        if permuted and name.endswith("attn_q.weight"):
            stored = permute_rotary_rows(array, config.num_attention_heads)
        elif permuted and name.endswith("attn_k.weight"):
            stored = permute_rotary_rows(array, config.num_key_value_heads)
        kind = quant if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        if raw_type_override and name in raw_type_override:
            # A type gguf cannot quantize to (what the test wants refused): zero blocks of its size.
            kind = gguf.GGMLQuantizationType[raw_type_override[name]]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            writer.add_tensor(name, np.zeros((array.shape[0], array.shape[1] // block * size), np.uint8),
                              raw_dtype=kind)
            continue
        data = quantize(stored, kind) if kind != gguf.GGMLQuantizationType.F32 else stored
        writer.add_tensor(name, data, raw_dtype=kind)
        dequantized[hf_name] = dequantize(data, kind).reshape(array.shape) if kind != gguf.GGMLQuantizationType.F32 \
            else array
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")) and kind != gguf.GGMLQuantizationType.F32:
            heads = config.num_attention_heads if name.endswith("attn_q.weight") else config.num_key_value_heads
            dequantized[hf_name] = _unpermute(dequantize(data, kind).reshape(array.shape), heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1's rope scaling as llama.cpp's converter stores it: one divisor per frequency."""
    import math

    inverse = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for frequency in inverse:
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    rows, columns = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


SENTENCEPIECE_TRAINING_TEXT = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The harbor town woke slowly on winter mornings; gulls circled overhead.",
    "Numbers like 12, 345 and 6789 appear in text, and so do tabs\tand newlines\n.",
] * 20


def sentencepiece_vocabulary() -> tuple[list[str], list[tuple[str, str]]]:
    """A Llama-2-style BPE vocabulary trained here on a few sentences: <unk>, <s>, </s>, the 256
    <0xNN> byte tokens, then the learned pieces in the order learned; and the learned merges."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tokenizer.train_from_iterator(SENTENCEPIECE_TRAINING_TEXT, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    seen = set(tokens)
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        if token not in seen:
            tokens.append(token)
            seen.add(token)
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in trained["merges"]]
    return tokens, merges


def write_sentencepiece_tokenizer(directory: Path) -> None:
    """A Llama-2 / Mistral style tokenizer.json: BPE over "▁"-marked text with byte fallback
    (<0xNN> tokens for bytes without a piece), <s> added in front of prompts, a decoder that
    strips the leading space; trained here on a few sentences, so most of Unicode falls back to bytes.

    tokenizer_config.json names no tokenizer_class: given LlamaTokenizer(Fast), transformers 5
    replaces the file's normalizer with its own Metaspace split (no "▁" added before text that
    starts with a space); shared/tokenizer.py, like transformers for a file without a class,
    runs tokenizer.json as written."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    tokens, merges = sentencepiece_vocabulary()
    vocabulary = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocabulary, merges=merges, unk_token="<unk>", byte_fallback=True,
                                   fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in ("<unk>", "<s>", "</s>")])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for message in messages %}[INST] {{ message['content'] }} [/INST]"
                         "{% endfor %}"}))


def draft_checkpoint(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama with the packaged SmolLM2's vocabulary and tokenizer (its tokenizer.json,
    end-of-sequence and chat template): a draft model that may propose for it (and accepts about
    nothing: its weights are random)."""
    from shared.model_file import load_metadata
    from shared.tokenizer import Tokenizer

    smollm2 = Tokenizer.load()
    metadata = load_metadata()
    model = transformers_model("llama", seed, **({
        "vocab_size": metadata.config.vocab_size, "max_position_embeddings": metadata.config.context_length,
        "eos_token_id": smollm2.token_to_id(smollm2.eos_token),
        "bos_token_id": smollm2.token_to_id(smollm2.bos_token) or 0} | overrides))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    (directory / "tokenizer.json").write_text(smollm2.backend_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": smollm2.eos_token, "bos_token": smollm2.bos_token,
         "chat_template": smollm2.chat_template_source}))
    return directory
