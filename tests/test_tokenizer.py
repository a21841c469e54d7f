"""shared/tokenizer.py against transformers loading the same GGUF, plus the stop-string helpers.

transformers 5.x builds its GGUF tokenizer without llama.cpp's "smollm" digit split (see the
module docstring of shared/tokenizer.py), so texts with whitespace before a digit are checked
against transformers' vocabulary and merges with that split put back.
"""

import dataclasses
import json
import random

import jinja2
import pytest
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shared.model_file import ModelFileError, load_metadata, locate_gguf
from shared.tokenizer import (
    TOKENIZER_FILE,
    IncrementalDetokenizer,
    Tokenizer,
    compile_chat_template,
    find_stop,
    held_back_length,
)
from tests.requirements import import_or_skip, skip_unless_ci

REPLACEMENT = "\ufffd"

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. Hello, world!",
    "contractions": "it's we're they've I'm you'll he'd DON'T",
    "accented": "Crème brûlée, naïve café, señor, Ångström, Øresund, Łódź",
    "greek": "Καλημέρα κόσμε, τι κάνεις; Ωραία!",
    "cyrillic": "Привет, мир! Как дела? Ёлка и щука.",
    "cjk": "你好，世界。今天天气很好。日本語のテキストと한국어 텍스트",
    "emoji": "Emoji: 🙂🚀👩‍💻 🇫🇷 ✨ done",
    "code": "def f(x):\n\tif x:\n\t\treturn [x,x]\n    else:\n        return None\n\n\n#end",
    "digits_without_leading_space": "3.14159;2024-01-01;x=42;v1.2.3;1234567890;٣٤",
    "whitespace_runs": "   leading   inner\t\t\ttabs  \n\n  trailing   ",
    "crlf": "windows\r\nline\r\nendings\r\n",
    "chat_markup": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "control_tokens_inline": "a <|im_start|>b<|im_end|>c<|endoftext|>d<file_sep>",
    "lookalike_markup": "<|im_star|> <|im_end <im_end|>",
}

# Whitespace right before a digit: where transformers' GGUF tokenizer and llama.cpp's "smollm" split differ.
WHITESPACE_BEFORE_DIGIT_TEXTS = {
    "two_spaces": "x  1",
    "tabs": "\t\t42",
    "indented_code": "for i in range(10):\n    x = [1,  2,   3]\n",
    "prose": "Total: 1,234 items on 2024-01-01 at 12:30",
    "newline_indent": "a\n  12",
}

STREAMED_TEXTS = {
    "emoji": "Emoji: 🙂🚀👩‍💻 🇫🇷 ✨ done",
    "cjk": "你好，世界。今天天气很好。日本語のテキストと한국어 텍스트",
    "mixed": "Ünïcödé 🙂 and 中文 with 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and Привет 🚀🚀",
    "rare_cjk": "龘靐齉齾爩鱻麤",
}

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?\nAnswer briefly."},
    ],
    "multi_turn_without_system": [
        {"role": "user", "content": "Write a haiku about 🙂."},
        {"role": "assistant", "content": "Smile in yellow light\n  quiet joy"},
        {"role": "user", "content": "Now in 中文, please."},
    ],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    try:
        return Tokenizer.load()
    except ModelFileError as error:
        skip_unless_ci(str(error))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer):
    transformers = import_or_skip("transformers")
    path = locate_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_backend_with_smollm_split(hf_tokenizer) -> BackendTokenizer:
    """transformers' vocabulary, merges and special tokens, pre-tokenized as llama.cpp's "smollm":
    the regex \\p{N} first, then the GPT-2 regex."""
    backend = BackendTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_encode_gives_the_same_ids_as_transformers(tokenizer, hf_tokenizer, text):
    expected = hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == expected, hf_tokenizer.convert_ids_to_tokens(expected)


@pytest.mark.parametrize("text", WHITESPACE_BEFORE_DIGIT_TEXTS.values(), ids=WHITESPACE_BEFORE_DIGIT_TEXTS.keys())
def test_encode_splits_digits_like_llama_cpp_smollm_over_transformers_vocab(
    tokenizer, hf_backend_with_smollm_split, text
):
    expected = hf_backend_with_smollm_split.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == expected.ids, expected.tokens


def test_encode_keeps_a_whitespace_run_whole_before_a_digit(tokenizer):
    ids = tokenizer.encode("x  1")
    assert ids == [tokenizer.token_to_id("x"), tokenizer.token_to_id("ĠĠ"), tokenizer.token_to_id("1")]


def test_encode_adds_no_bos_and_turns_written_control_tokens_into_their_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.encode("hello")[0] != 1


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_decode_gives_the_same_text_as_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", [t for t in TEXTS.values() if "<" not in t])
def test_decode_of_encode_round_trips_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_stop_token_ids_are_im_end_and_endoftext(tokenizer):
    assert tokenizer.stop_token_ids == {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")}
    assert tokenizer.stop_token_ids == {0, 2}
    assert tokenizer.vocab_size == 49152


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_equals_transformers_apply_chat_template(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


def test_render_chat_inserts_the_default_system_prompt_only_without_a_system_message(tokenizer):
    without = tokenizer.render_chat(CONVERSATIONS["user_only"])
    with_system = tokenizer.render_chat(CONVERSATIONS["with_system"])
    assert without.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert with_system.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert without.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_encode_chat_gives_transformers_ids_of_the_rendered_chat(tokenizer, hf_tokenizer, messages):
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode_chat(messages)
    assert ids == hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")  # from the template, not an added BOS
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == ids.count(tokenizer.token_to_id("<|im_end|>")) + 1


def test_chat_template_raise_exception_raises_template_error():
    template = compile_chat_template("{% if messages[0]['role'] != 'user' %}{{ raise_exception('bad role') }}{% endif %}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        template.render(messages=[{"role": "tool", "content": ""}])


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}", "{% set _ = messages.append(1) %}"])
def test_chat_template_runs_in_an_immutable_sandbox(source):
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template(source).render(messages=[])


def stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token_id) for token_id in ids]
    pieces.append(detokenizer.flush())
    return pieces, detokenizer


@pytest.mark.parametrize("text", STREAMED_TEXTS.values(), ids=STREAMED_TEXTS.keys())
def test_incremental_detokenizer_pieces_join_to_decode_without_replacement_chars(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, detokenizer = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detokenizer.text == text
    assert [piece for piece in pieces if REPLACEMENT in piece] == []


def test_incremental_detokenizer_holds_back_a_token_that_ends_inside_a_character(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1 and REPLACEMENT in tokenizer.decode(ids[:1])  # one token alone is half an emoji
    pieces, _ = stream(tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2:] == ["🙂", ""]


@pytest.mark.parametrize("text", STREAMED_TEXTS.values(), ids=STREAMED_TEXTS.keys())
def test_a_detokenizer_rebuilt_mid_stream_goes_on_with_identical_pieces(tokenizer, text):
    """As a restarted scheduler rebuilds it: from the prompt and the output so far, at every split
    point (many inside a character), then the rest of the output pushed one token at a time."""
    prompt = tokenizer.encode("Say it: ")
    ids = tokenizer.encode(text)
    original = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    expected = [original.push(token_id) for token_id in ids] + [original.flush()]
    mid_character = 0
    for split in range(1, len(ids)):
        rebuilt = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
        for token_id in ids[:split]:
            rebuilt.push(token_id)
        assert rebuilt.text == "".join(expected[:split]), f"split {split}: text so far differs"
        mid_character += REPLACEMENT in tokenizer.decode(ids[:split])
        pieces = [rebuilt.push(token_id) for token_id in ids[split:]] + [rebuilt.flush()]
        assert pieces == expected[split:], f"split {split}: pieces after the rebuild differ"
        assert rebuilt.text == text
    assert mid_character > 0 or text.isascii(), "no split fell inside a character: the test tests little"


def test_incremental_detokenizer_emits_no_text_for_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|><|endoftext|>")
    pieces, detokenizer = stream(tokenizer, ids)
    assert pieces == ["Hi", "", "", ""]
    assert detokenizer.text == "Hi"


def test_incremental_detokenizer_flush_gives_replacement_char_when_output_ends_mid_character(tokenizer):
    ids = tokenizer.encode("🙂")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(ids[0]) == ""
    assert detokenizer.flush() == REPLACEMENT


def test_incremental_detokenizer_completes_a_character_begun_in_the_prompt(tokenizer):
    ids = tokenizer.encode("ok:🙂")
    assert REPLACEMENT in tokenizer.decode(ids[:-1])  # the prompt ends inside the emoji
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=ids[:-1])
    assert detokenizer.push(ids[-1]) == "🙂"


def test_incremental_detokenizer_matches_decode_on_random_token_sequences(tokenizer):
    """Random ids include broken UTF-8: the pieces still join to what decode() gives."""
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
        pieces, _ = stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids), ids


def test_token_bytes_agree_with_decode_for_every_token(tokenizer):
    for token_id in range(tokenizer.vocab_size):
        expected = tokenizer.decode([token_id])
        assert tokenizer.token_bytes(token_id).decode("utf-8", errors="replace") == expected, token_id


def test_load_saves_tokenizer_json_that_later_loads_reuse(tokenizer, tmp_path):
    metadata = dataclasses.replace(load_metadata(), cache_dir=str(tmp_path))
    built = Tokenizer.from_metadata(metadata)
    assert (tmp_path / TOKENIZER_FILE).is_file()
    reloaded = Tokenizer.from_metadata(metadata)
    for text in TEXTS.values():
        assert reloaded.encode(text) == built.encode(text) == tokenizer.encode(text)


def test_stale_cached_tokenizer_json_is_rebuilt(tmp_path):
    metadata = dataclasses.replace(load_metadata(), cache_dir=str(tmp_path))
    Tokenizer.from_metadata(metadata)
    cached = tmp_path / TOKENIZER_FILE
    stale = json.loads(cached.read_text())
    stale["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    cached.write_text(json.dumps(stale))
    assert Tokenizer.from_metadata(metadata).encode("x  1") == Tokenizer.load().encode("x  1")
    assert json.loads(cached.read_text())["pre_tokenizer"]["type"] == "Sequence"


def test_find_stop_returns_the_earliest_occurrence_of_any_stop_string():
    assert find_stop("abc STOP xyz END", ["END", "STOP"]) == 4
    assert find_stop("hello world", ["wor"]) == 6
    assert find_stop("hello world", ["nope"]) == -1
    assert find_stop("hello world", []) == -1


def test_find_stop_ignores_empty_stop_strings():
    assert find_stop("hello", ["", "lo"]) == 3


def test_find_stop_finds_a_stop_string_straddling_the_start_of_new_text():
    # "foo ST" was seen before; "OP" is new: start is the old length.
    assert find_stop("foo STOP", ["STOP"], start=6) == 4


def test_find_stop_skips_stop_strings_that_ended_before_start():
    assert find_stop("aaSTOPbb", ["STOP"], start=5) == 2  # its last char is at 5: still in the window
    assert find_stop("aaSTOPbb", ["STOP"], start=6) == -1
    assert find_stop("aaSTOPbbSTOP", ["STOP"], start=6) == 8


def test_held_back_length_counts_the_longest_tail_that_begins_a_stop_string():
    assert held_back_length("Hello wor", ["world"]) == 3
    assert held_back_length("abc<|im", ["<|im_end|>"]) == 4
    assert held_back_length("xab", ["abz", "bq"]) == 2
    assert held_back_length("aaa", ["aab"]) == 2
    assert held_back_length("ab", ["abc"]) == 2


def test_held_back_length_is_zero_when_no_tail_can_begin_a_stop_string():
    assert held_back_length("Hello", ["world"]) == 0
    assert held_back_length("", ["world"]) == 0
    assert held_back_length("Hello", []) == 0
    assert held_back_length("Hello", [""]) == 0
    assert held_back_length("xSTOP", ["STOP"]) == 0  # a whole stop string is find_stop's business
