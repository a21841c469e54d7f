"""A GGUF file's model config and tokenizer data (llama.cpp's metadata keys), checked at start.

Everything that makes a GGUF unservable (an architecture, a tensor type or a tokenizer this
project does not know) is found here, before a worker loads a byte of weights, and reported
naming what was found and what is supported.
"""

from pathlib import Path

from shared.model_file import ARCHITECTURES, ModelConfig, ModelFileError, TokenizerData, architecture

# Tensor types dequantized at load (gguf.quants.dequantize); llama.cpp's names.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's pre-tokenizer names this project rebuilds (shared/tokenizer.py PRE_TOKENIZER_REGEXES).
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt2", "llama-bpe", "qwen2")
# Token texts that end generation wherever a vocabulary has them (llama.cpp's end-of-generation list).
END_OF_GENERATION_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ModelFileError(f"GGUF metadata lacks {key}")
    return field.contents()


def read_gguf_metadata(path: Path) -> tuple[ModelConfig, TokenizerData]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as error:
        raise ModelFileError(f"{path}: not a readable GGUF file ({error})") from None
    arch = str(_field(reader, "general.architecture"))
    family = architecture(arch, str(path))
    unsupported = sorted({tensor.tensor_type.name for tensor in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if unsupported:
        raise ModelFileError(f"{path}: tensor type {', '.join(unsupported)} is not supported; supported: "
                             f"{', '.join(SUPPORTED_TENSOR_TYPES)}")
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden_size = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {tensor.name for tensor in reader.tensors}
    scaling_type = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if scaling_type not in ("none", "linear"):
        raise ModelFileError(f"{path}: rope scaling {scaling_type!r} is not supported; supported: none, linear, "
                             "and Llama 3's frequency factors (rope_freqs.weight)")
    config = ModelConfig(
        n_layers=int(_field(reader, f"{arch}.block_count")),
        hidden_size=hidden_size,
        ffn_size=int(_field(reader, f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden_size // n_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        context_length=int(_field(reader, f"{arch}.context_length")),
        tied_embeddings="output.weight" not in tensor_names,
        architecture=arch,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        rope_scaling="linear" if scaling_type == "linear" else "",
        rope_factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
    )
    return config, _tokenizer_data(reader, path)


def _tokenizer_data(reader, path: Path) -> TokenizerData:
    model = str(_field(reader, "tokenizer.ggml.model"))
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if model == "gpt2" and pre == "default":
        pre = "gpt2"
    if not (model == "llama" or model == "gpt2" and pre in SUPPORTED_PRE_TOKENIZERS):
        raise ModelFileError(f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported; supported: "
                             f"'gpt2' (byte-level BPE) with {', '.join(SUPPORTED_PRE_TOKENIZERS)}, and 'llama' "
                             "(SentencePiece BPE: Llama 2, Mistral)")
    if model == "llama" and not _field(reader, "tokenizer.ggml.add_space_prefix", True):
        raise ModelFileError(f"{path}: a SentencePiece tokenizer without add_space_prefix is not supported")
    tokens = [str(token) for token in _field(reader, "tokenizer.ggml.tokens")]
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    stop = {eos} | {index for index, token in enumerate(tokens) if token in END_OF_GENERATION_TOKENS}
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in reader.fields:
            stop.add(int(_field(reader, key)))
    return TokenizerData(
        tokens=tokens,
        merges=[str(merge) for merge in _field(reader, "tokenizer.ggml.merges", [])],
        token_types=[int(value) for value in _field(reader, "tokenizer.ggml.token_type")],
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", eos)),
        eos_token_id=eos,
        chat_template=str(_field(reader, "tokenizer.chat_template", "")),
        stop_token_ids=tuple(sorted(stop)),
        pre_tokenizer=pre,
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        tokenizer_model=model,
        scores=tuple(float(score) for score in _field(reader, "tokenizer.ggml.scores", [])) if model == "llama" else (),
    )


__all__ = ["ARCHITECTURES", "SUPPORTED_TENSOR_TYPES", "read_gguf_metadata"]
