"""Text to token ids and back, the chat template, streaming detokenization and stop strings.

A checkpoint directory brings its tokenizer.json, loaded as it is. For a GGUF (which carries
no tokenizer.json) the tokenizer is rebuilt from the vocabulary and merges: byte-level BPE,
control tokens as special tokens, the split before BPE chosen by llama.cpp's pre-tokenizer name
(PRE_TOKENIZER_REGEXES); or, for a SentencePiece vocabulary (Llama 2, Mistral), BPE with merges
rebuilt from the tokens' scores and byte fallback, as transformers rebuilds it. The built
tokenizer is saved as tokenizer.json in the model's cache directory, so later starts load it in
milliseconds. No torch here: the gateway and the scheduler use this module.

SmolLM2's pre-tokenizer is llama.cpp's "smollm" (and the original SmolLM2 tokenizer.json):
every digit is split off on its own, then the GPT-2 byte-level regex.
transformers 5.x does not know "smollm" and skips the digit split, so it differs from us
(and from llama.cpp) exactly where whitespace precedes a digit: "x  1" is x|ĠĠ|1 here and
x|Ġ|Ġ|1 there. Everywhere else the ids are the same (tests/test_tokenizer.py).
"""

import codecs
import copy
import json
import os
from datetime import datetime
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shared.model_file import DEFAULT_MODEL, ModelMetadata, TokenizerData, load_metadata

TOKENIZER_FILE = "tokenizer.json"
CONTROL_TOKEN_TYPE = 3  # llama.cpp's token type for control tokens like <|im_end|>
UNKNOWN_TOKEN_TYPE = 2  # llama.cpp's token type of a SentencePiece vocabulary's <unk>
# End of an assistant turn; end of a document: SmolLM2's stop tokens, for metadata cached before
# TokenizerData.stop_token_ids existed.
DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
# The split before BPE of llama.cpp's pre-tokenizers other than "smollm" and "gpt2" (the regexes
# of the original tokenizer.json files: Llama 3 and Qwen2 split digits in runs of 3 and 1).
PRE_TOKENIZER_REGEXES = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


SENTENCEPIECE_SPACE = "\u2581"  # "▁": a space, in SentencePiece vocabularies


def _pre_tokenizer(name: str = "smollm", model: str = "gpt2") -> pre_tokenizers.PreTokenizer:
    if model == "llama":  # SentencePiece BPE: spaces as "▁", one in front of the text (transformers' LlamaTokenizer)
        return pre_tokenizers.Metaspace(replacement=SENTENCEPIECE_SPACE, prepend_scheme="first", split=False)
    if name in PRE_TOKENIZER_REGEXES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEXES[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if name == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _decoder(model: str = "gpt2") -> decoders.Decoder:
    if model == "llama":
        return decoders.Sequence([decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                  decoders.Strip(content=" ", left=1, right=0)])
    return decoders.ByteLevel()


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies (a GGUF stores scores, not merges): every
    split of a token into two tokens, best score first, as transformers' generate_merges derives them."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for merged, score in zip(tokens, scores, strict=True):
        pairs = [(merged[:cut], merged[cut:], score) for cut in range(1, len(merged))
                 if merged[:cut] in vocab and merged[cut:] in vocab]
        merges.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, in which byte-level vocabularies are written."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def build_backend(data: TokenizerData) -> BackendTokenizer:
    """A `tokenizers` BPE from the GGUF's vocabulary: byte-level with its merges (slow: about 0.4 s),
    or SentencePiece-style with merges from its scores and byte fallback (Llama 2, Mistral)."""
    if data.tokenizer_model == "llama":
        return _build_sentencepiece(data)
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    # As transformers does: a token already written in the byte alphabet stays; any other is respelled.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode()): index
        for index, token in enumerate(data.tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in data.merges]
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(data.pre_tokenizer)
    backend.decoder = _decoder()
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, token_type in zip(data.tokens, data.token_types, strict=True)
            if token_type == CONTROL_TOKEN_TYPE
        ]
    )
    return backend


def _build_sentencepiece(data: TokenizerData) -> BackendTokenizer:
    unknown = next((token for token, kind in zip(data.tokens, data.token_types, strict=True)
                    if kind == UNKNOWN_TOKEN_TYPE), None)
    backend = BackendTokenizer(models.BPE(
        vocab={token: index for index, token in enumerate(data.tokens)},
        merges=sentencepiece_merges(data.tokens, data.scores), unk_token=unknown, fuse_unk=True, byte_fallback=True,
        dropout=None))
    backend.pre_tokenizer = _pre_tokenizer(model="llama")
    backend.decoder = _decoder("llama")
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in zip(data.tokens, data.token_types, strict=True)
                                if kind == CONTROL_TOKEN_TYPE])
    return backend


def _is_current(backend: BackendTokenizer, data: TokenizerData) -> bool:
    """Whether a cached tokenizer.json was built the way this code builds it now."""
    expected_pre = _pre_tokenizer(data.pre_tokenizer, data.tokenizer_model)
    return (
        backend.pre_tokenizer is not None
        and backend.pre_tokenizer.__getstate__() == expected_pre.__getstate__()
        and backend.decoder is not None
        and backend.decoder.__getstate__() == _decoder(data.tokenizer_model).__getstate__()
        and backend.get_vocab_size(with_added_tokens=True) == len(data.tokens)
        and len(backend.get_added_tokens_decoder()) == data.token_types.count(CONTROL_TOKEN_TYPE)
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping, non-ASCII kept (jinja2's own escapes both).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def read_chat_template(value: str) -> str:
    """A chat template given as the template itself or as a file (ValueError when it is neither)."""
    if "{{" in value or "{%" in value:
        return value  # (looked at first: a template is no file name, and may be longer than one can be)
    try:
        if Path(value).is_file():
            return Path(value).read_text()
    except OSError as error:
        raise ValueError(f"--chat-template {value[:80]!r}: {error.strerror or error}") from None
    raise ValueError(f"--chat-template {value!r}: not a file, nor a template (no {{{{ or {{% in it)")


def compile_chat_template(source: str) -> jinja2.Template:
    """The chat template in the sandbox, whitespace settings and helpers transformers gives it."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _is_byte_level(backend: BackendTokenizer) -> bool:
    """Whether the vocabulary is written in GPT-2's byte alphabet (else SentencePiece style: "▁" for
    a space, "<0x0A>" for a byte without a token of its own)."""
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


# Bytes a detokenizer starts from (Tokenizer.text_context): more than an incomplete character holds.
TEXT_CONTEXT_BYTES = 4


class Tokenizer:
    """The model's tokenizer: encode, decode, and the chat template."""

    def __init__(self, backend: BackendTokenizer, data: TokenizerData, from_checkpoint: bool = False,
                 model_vocab_size: int = 0) -> None:
        self._backend = backend
        self._data = data
        self._from_checkpoint = from_checkpoint
        # A model's embedding may have rows past the tokenizer's last id (Qwen2.5: 151,936 rows for
        # 151,665 tokens): ids the model can sample, standing for no text.
        self.vocab_size: int = max(backend.get_vocab_size(with_added_tokens=True), model_vocab_size)
        self.bos_token: str = data.bos_token or (backend.id_to_token(data.bos_token_id) or "")
        self.eos_token: str = data.eos_token or (backend.id_to_token(data.eos_token_id) or "")
        if from_checkpoint:
            special = [index for index, token in backend.get_added_tokens_decoder().items() if token.special]
        else:
            special = [index for index, kind in enumerate(data.token_types) if kind == CONTROL_TOKEN_TYPE]
        self.special_token_ids: frozenset[int] = frozenset(special)
        if data.stop_token_ids:
            self.stop_token_ids: frozenset[int] = frozenset(data.stop_token_ids)
        else:
            stop_ids = [backend.token_to_id(token) for token in DEFAULT_STOP_TOKENS]
            if None in stop_ids:
                found = dict(zip(DEFAULT_STOP_TOKENS, stop_ids, strict=True))
                raise ValueError(f"vocabulary lacks a stop token: {found}")
            self.stop_token_ids = frozenset(stop_ids)
        self._byte_level = _is_byte_level(backend)
        self._chat_template = compile_chat_template(data.chat_template)
        self.chat_template_source = data.chat_template  # (which tool-call format it speaks: services/gateway/tools.py)

    @classmethod
    def from_metadata(cls, metadata: ModelMetadata) -> "Tokenizer":
        """A checkpoint's tokenizer.json; for a GGUF, tokenizer.json from the model's cache directory,
        built and saved on first use."""
        cached = Path(metadata.cache_dir) / TOKENIZER_FILE
        if metadata.format == "hf":
            return cls(BackendTokenizer.from_file(str(cached)), metadata.tokenizer, from_checkpoint=True,
                       model_vocab_size=metadata.config.vocab_size)
        if cached.is_file():
            backend = BackendTokenizer.from_file(str(cached))
            if _is_current(backend, metadata.tokenizer):
                return cls(backend, metadata.tokenizer, model_vocab_size=metadata.config.vocab_size)
        backend = build_backend(metadata.tokenizer)
        partial = cached.with_suffix(f".tmp{os.getpid()}")
        backend.save(str(partial))
        partial.replace(cached)  # atomic: concurrent starts never read half a file
        return cls(backend, metadata.tokenizer, model_vocab_size=metadata.config.vocab_size)

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL) -> "Tokenizer":
        """The tokenizer of a model name, GGUF path or checkpoint directory; one instance per process and model."""
        return _load(model)

    @classmethod
    def for_serving(cls, model: str, tokenizer: str = "", chat_template: str = "") -> "Tokenizer":
        """The tokenizer a served model's requests go through: the model's own, or another model's
        (Settings.tokenizer, vLLM's --tokenizer), with a chat template in place of its own when one
        is given (Settings.chat_template: a file, or the template itself). Every service of a model
        loads it alike, so the gateway's prompts, the scheduler's text and the workers' entries agree."""
        loaded = _load(tokenizer or model)
        if not chat_template:
            return loaded
        replaced = copy.copy(loaded)
        replaced.chat_template_source = read_chat_template(chat_template)
        replaced._chat_template = compile_chat_template(replaced.chat_template_source)
        return replaced

    def encode(self, text: str) -> list[int]:
        """Token ids of text; adds no BOS. Control tokens written in the text become their ids."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw (completion) prompt: with the BOS the model expects in front of text
        (a checkpoint's tokenizer.json post-processor adds it; a GGUF says add_bos_token)."""
        if self._from_checkpoint:
            return self._backend.encode(text, add_special_tokens=True).ids
        ids = self.encode(text)
        return [self._data.bos_token_id, *ids] if self._data.add_bos else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation, as transformers' apply_chat_template(tokenize=False) renders
        it (tools: the functions offered, as OpenAI's `tools` entries, for a template that renders them)."""
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **({"tools": tools} if tools is not None else {}),
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        # As transformers' apply_chat_template: the template writes any BOS itself, none is added.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def backend_json(self) -> str:
        """The tokenizer as tokenizers' JSON (the grammar engine builds its own copy from it)."""
        return self._backend.to_str()

    def vocabulary(self) -> dict[str, int]:
        """Every entry (added tokens too) and its id."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry as the vocabulary spells it (e.g. "<|im_end|>", "Ġthe")."""
        return self._backend.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """One token's text; special tokens as written; U+FFFD where it holds part of a character."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in decoded text; empty for special tokens."""
        return self._token_bytes[token_id]

    def text_context(self, *sequences: Sequence[int]) -> tuple[int, ...]:
        """The last tokens of the sequences joined that hold TEXT_CONTEXT_BYTES bytes (or all of
        them), those without bytes (special tokens) left out: at most TEXT_CONTEXT_BYTES tokens. A
        detokenizer started from them is in the state of one pushed every token: its state is the
        incomplete character at the end (at most 3 bytes), which such a tail holds whole after at
        least one byte of whatever came before; tokens without bytes change nothing."""
        token_bytes = self._token_bytes
        context: list[int] = []
        held = 0
        for sequence in reversed(sequences):
            for position in range(len(sequence) - 1, -1, -1):
                token_id = sequence[position]
                size = len(token_bytes[token_id])
                if size:
                    context.append(token_id)
                    held += size
                    if held >= TEXT_CONTEXT_BYTES:
                        return tuple(reversed(context))
        return tuple(reversed(context))

    @cached_property
    def _token_text(self) -> list[str | None]:
        """Each token's text when its bytes are whole UTF-8 characters on their own (None when not):
        a detokenizer holding no partial character emits it without decoding."""
        table: list[str | None] = []
        for data in self._token_bytes:
            try:
                table.append(data.decode())
            except UnicodeDecodeError:
                table.append(None)
        return table

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        # Built on first use (about 30 ms): only processes that stream text need it.
        byte_of = {char: byte for byte, char in byte_to_unicode().items()}
        table = []
        for index in range(self.vocab_size):
            token = self._backend.id_to_token(index)
            if index in self.special_token_ids or token is None:
                table.append(b"")
            elif self._byte_level:
                table.append(bytes(byte_of[char] for char in token))
            elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                table.append(bytes([int(token[3:5], 16)]))  # SentencePiece byte fallback
            else:
                table.append(token.replace("\u2581", " ").encode())
        return table


@lru_cache(maxsize=4)
def _load(model: str) -> Tokenizer:
    return Tokenizer.from_metadata(load_metadata(model))


class IncrementalDetokenizer:
    """Streaming detokenization: push one token id at a time, get the newly completed text.

    In a byte-level BPE each token stands for a fixed string of bytes, and decoding a sequence
    is decoding its bytes as UTF-8. So streaming is an incremental UTF-8 decoder over each
    token's bytes: a token that ends inside a character gives "" and the character comes with
    the token that completes it. This gives the same pieces as the prefix/read-offset window of
    TGI and vLLM on valid text, costs O(1) per token instead of two window decodes, and cannot
    stall on a run of tokens that each end mid-character. The pieces depend only on the tokens
    pushed, so a rebuilt detokenizer emits the same pieces.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self._token_bytes, self._token_text = tokenizer._token_bytes, tokenizer._token_text
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        self.length = 0  # characters of text so far (without joining the pieces)
        # A prompt encoded from text ends on a character boundary, so it changes nothing; a
        # prompt given as raw ids might not, and then the first output token completes its
        # last character. Feeding the prompt's last few tokens covers that (Tokenizer.text_context).
        if prompt_token_ids:
            self._utf8.decode(b"".join(self._token_bytes[token_id]
                                       for token_id in tokenizer.text_context(prompt_token_ids)))
        self._whole = not self._utf8.getstate()[0]  # no partial character held

    def push(self, token_id: int) -> str:
        """The text this token completes: "" while it ends inside a character, and for special tokens."""
        if self._whole:
            piece = self._token_text[token_id]  # most tokens: whole characters, after whole characters
            if piece is not None:
                if piece:
                    self._pieces.append(piece)
                    self.length += len(piece)
                return piece
        piece = self._utf8.decode(self._token_bytes[token_id])
        self._whole = not self._utf8.getstate()[0]
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
        return piece

    def flush(self) -> str:
        """Whatever is held back at the end: U+FFFD if the output ended inside a character."""
        piece = self._utf8.decode(b"", final=True)
        self._whole = True
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]  # joined on read, not on every push
        return self._pieces[0] if self._pieces else ""


def piece_after(tokenizer: Tokenizer, context: Sequence[int], token_id: int, last: bool) -> str:
    """The text token_id completes after the tokens `context` (Tokenizer.text_context of what came
    before it), with what is held back if it is a request's last token: the piece an
    IncrementalDetokenizer pushed the whole sequence gives. For a token whose detokenizer is
    elsewhere (a worker's)."""
    detokenizer = IncrementalDetokenizer(tokenizer, context)
    piece = detokenizer.push(token_id)
    return piece + detokenizer.flush() if last else piece


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in text that ends at or after `start`, or -1.

    Pass as `start` the length the text had before the latest piece: a stop string that ended
    before it was found by the previous call, so only a window of new text is searched.
    """
    earliest = -1
    for stop_string in stop:
        if not stop_string:
            continue
        found = text.find(stop_string, max(0, start - len(stop_string) + 1))
        if found != -1 and (earliest == -1 or found < earliest):
            earliest = found
    return earliest


def held_back_length(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of text could begin a stop string, so must not be streamed yet."""
    longest = 0
    for stop_string in stop:
        # (such a tail begins with the stop string's first character: most texts hold none near their end)
        if not stop_string or text.find(stop_string[0], max(0, len(text) - len(stop_string) + 1)) == -1:
            continue
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest
