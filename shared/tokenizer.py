"""Text to token ids and back, the chat template, streaming detokenization and stop strings.

The tokenizer is rebuilt from the GGUF's vocabulary and merges (a GGUF carries no
tokenizer.json): byte-level BPE, control tokens as special tokens. The built tokenizer is
saved as tokenizer.json in the model's cache directory, so later starts load it in
milliseconds. No torch here: the gateway and the scheduler use this module.

The pre-tokenizer follows llama.cpp's "smollm" pre-tokenizer (and the original SmolLM2
tokenizer.json): every digit is split off on its own, then the GPT-2 byte-level regex.
transformers 5.x does not know "smollm" and skips the digit split, so it differs from us
(and from llama.cpp) exactly where whitespace precedes a digit: "x  1" is x|ĠĠ|1 here and
x|Ġ|Ġ|1 there. Everywhere else the ids are the same (tests/test_tokenizer.py).
"""

import codecs
import os
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shared.model_file import DEFAULT_MODEL, ModelMetadata, TokenizerData, load_metadata

TOKENIZER_FILE = "tokenizer.json"
CONTROL_TOKEN_TYPE = 3  # llama.cpp's token type for control tokens like <|im_end|>
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # end of an assistant turn; end of a document


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _decoder() -> decoders.Decoder:
    return decoders.ByteLevel()


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
    """A `tokenizers` byte-level BPE from the GGUF's vocabulary and merges (slow: about 0.4 s)."""
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
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = _decoder()
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, token_type in zip(data.tokens, data.token_types, strict=True)
            if token_type == CONTROL_TOKEN_TYPE
        ]
    )
    return backend


def _is_current(backend: BackendTokenizer, data: TokenizerData) -> bool:
    """Whether a cached tokenizer.json was built the way this code builds it now."""
    return (
        backend.pre_tokenizer is not None
        and backend.pre_tokenizer.__getstate__() == _pre_tokenizer().__getstate__()
        and backend.decoder is not None
        and backend.decoder.__getstate__() == _decoder().__getstate__()
        and backend.get_vocab_size(with_added_tokens=True) == len(data.tokens)
        and len(backend.get_added_tokens_decoder()) == data.token_types.count(CONTROL_TOKEN_TYPE)
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source: str) -> jinja2.Template:
    """The chat template in the same sandbox and whitespace settings transformers uses."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(source)


class Tokenizer:
    """The model's tokenizer: encode, decode, and the chat template."""

    def __init__(self, backend: BackendTokenizer, data: TokenizerData) -> None:
        self._backend = backend
        self._data = data
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token: str = data.tokens[data.bos_token_id]
        self.eos_token: str = data.tokens[data.eos_token_id]
        self.special_token_ids: frozenset[int] = frozenset(
            index for index, token_type in enumerate(data.token_types) if token_type == CONTROL_TOKEN_TYPE
        )
        stop_ids = [backend.token_to_id(token) for token in STOP_TOKENS]
        if None in stop_ids:
            raise ValueError(f"vocabulary lacks a stop token: {dict(zip(STOP_TOKENS, stop_ids, strict=True))}")
        self.stop_token_ids: frozenset[int] = frozenset(stop_ids)
        self._chat_template = compile_chat_template(data.chat_template)

    @classmethod
    def from_metadata(cls, metadata: ModelMetadata) -> "Tokenizer":
        """Load tokenizer.json from the model's cache directory, building and saving it on first use."""
        cached = Path(metadata.cache_dir) / TOKENIZER_FILE
        if cached.is_file():
            backend = BackendTokenizer.from_file(str(cached))
            if _is_current(backend, metadata.tokenizer):
                return cls(backend, metadata.tokenizer)
        backend = build_backend(metadata.tokenizer)
        partial = cached.with_suffix(f".tmp{os.getpid()}")
        backend.save(str(partial))
        partial.replace(cached)  # atomic: concurrent starts never read half a file
        return cls(backend, metadata.tokenizer)

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL) -> "Tokenizer":
        """The tokenizer of a model name or GGUF path; one instance per process and model."""
        return _load(model)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; adds no BOS. Control tokens written in the text become their ids."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, as transformers' apply_chat_template(tokenize=False) renders it."""
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes <|im_start|> itself: no BOS is added.
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry as the vocabulary spells it (e.g. "<|im_end|>", "Ġthe")."""
        return self._backend.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """One token's text; special tokens as written; U+FFFD where it holds part of a character."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in decoded text; empty for special tokens."""
        return self._token_bytes[token_id]

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        # Built on first use (about 30 ms): only processes that stream text need it.
        byte_of = {char: byte for byte, char in byte_to_unicode().items()}
        table = []
        for index in range(self.vocab_size):
            token = self._backend.id_to_token(index)
            if index in self.special_token_ids or token is None:
                table.append(b"")
            else:
                table.append(bytes(byte_of[char] for char in token))
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
        self._token_bytes = tokenizer._token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        # A prompt encoded from text ends on a character boundary, so it changes nothing; a
        # prompt given as raw ids might not, and then the first output token completes its
        # last character. Feeding the prompt's last few tokens covers that (a character is
        # at most 4 bytes).
        if prompt_token_ids:
            self._utf8.decode(b"".join(self._token_bytes[token_id] for token_id in prompt_token_ids[-4:]))

    def push(self, token_id: int) -> str:
        """The text this token completes: "" while it ends inside a character, and for special tokens."""
        piece = self._utf8.decode(self._token_bytes[token_id])
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """Whatever is held back at the end: U+FFFD if the output ended inside a character."""
        piece = self._utf8.decode(b"", final=True)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]  # joined on read, not on every push
        return self._pieces[0] if self._pieces else ""


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
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest
