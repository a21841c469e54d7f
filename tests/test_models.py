"""Models users bring: Hugging Face checkpoint directories and GGUF files of Llama, Mistral,
Qwen2 and Qwen3, each against transformers on the same weights (tiny random models made here;
nothing can be downloaded). Also: each family's difference switched off breaks the match, and
every unservable input is a clear error at start."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from services.bench.logits import LogitsEngine
from services.worker.engine import Engine
from shared.config import Settings
from shared.model_file import ModelFileError, load_metadata
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.checkpoints import (
    VARIANTS,
    save_checkpoint,
    sentencepiece_vocabulary,
    transformers_model,
    write_gguf,
    write_sentencepiece_tokenizer,
)
from tests.engine_helpers import generate_alone
from tests.requirements import import_or_skip

STEPS = 32
PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [256, 7, 99, 200, 13, 250, 3, 3, 3, 91], list(range(40, 80))]
# float32 on both sides, different kernels and reduction orders: logits agree to about 1e-5.
F32_ATOL = 1e-4
# Against transformers holding the same dequantized weights the quantization error cancels; the
# serving dtype of the dequantized weights (float32) is the same, so the bound stays tight.
QUANTIZED_ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """GGUF metadata and converted weights go to a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ITERSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        load_metadata.cache_clear()
        yield
        load_metadata.cache_clear()


def engine_for(model: str) -> Engine:
    return LogitsEngine.from_settings(Settings(model=model, kv_blocks=64, kv_block_size=8, device="cpu", dtype="float32",
                                         max_batch_size=8))


def engine_greedy(engine: Engine, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens, one decode step at a time as the scheduler drives it, and every step's logits."""
    logits: list[torch.Tensor] = []
    tokens = generate_alone(engine, "oracle", prompt, steps, logits=logits)
    return tokens, torch.stack(logits)


def transformers_greedy(model, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy tokens, and its logits at the same positions (one forward over it all)."""
    with torch.inference_mode():
        sequence = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0]
        logits = model(sequence[None, :-1]).logits[0, len(prompt) - 1:]
    return sequence[len(prompt):].tolist(), logits


def assert_matches(engine: Engine, model, atol: float) -> None:
    for prompt in PROMPTS:
        expected_tokens, expected_logits = transformers_greedy(model, prompt)
        tokens, logits = engine_greedy(engine, prompt)
        assert tokens == expected_tokens, f"prompt {prompt[:5]}...: engine {tokens} != transformers {expected_tokens}"
        torch.testing.assert_close(logits, expected_logits, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each variant's transformers model and its saved checkpoint directory."""
    import_or_skip("transformers")
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for variant in VARIANTS:
        model = transformers_model(variant)
        made[variant] = (model, save_checkpoint(model, root / variant))
    return made


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_directory_greedy_tokens_and_logits_equal_transformers(checkpoints, variant):
    model, directory = checkpoints[variant]
    assert_matches(engine_for(str(directory)), model, F32_ATOL)


def test_a_checkpoint_in_several_shards_with_an_index_loads_the_same_model(checkpoints, tmp_path):
    model, _ = checkpoints["qwen2"]
    directory = save_checkpoint(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 2
    assert_matches(engine_for(str(directory)), model, F32_ATOL)


@pytest.mark.parametrize(("variant", "feature", "off"), [
    ("llama3.1-rope", "rope_scaling", ""),
    ("qwen2", "qkv_bias", False),
    ("qwen3", "qk_norm", False),
])
def test_each_family_difference_is_needed_to_match_transformers(checkpoints, variant, feature, off, monkeypatch):
    """The same checkpoint with one named difference switched off no longer matches: the tests
    above would catch a model that ignored it."""
    model, directory = checkpoints[variant]
    metadata = load_metadata(str(directory))
    broken = dataclasses.replace(metadata, config=dataclasses.replace(metadata.config, **{feature: off}))
    monkeypatch.setattr("shared.model_file.load_metadata", lambda model_name: broken)
    engine = engine_for(str(directory))
    expected_tokens, expected_logits = transformers_greedy(model, PROMPTS[2])
    tokens, logits = engine_greedy(engine, PROMPTS[2])
    assert (logits - expected_logits).abs().max() > 100 * F32_ATOL
    assert tokens != expected_tokens


def gguf_and_oracle(checkpoints, tmp_path, variant: str, architecture: str, tensor_type: str):
    """The variant written as a GGUF of the tensor type, and transformers holding the weights as
    that type rounds them."""
    model, _ = checkpoints[variant]
    path = tmp_path / f"{variant}-{tensor_type}.gguf"
    dequantized = write_gguf(model, path, tensor_type, architecture)
    oracle = transformers_model(variant)
    oracle.load_state_dict({name: torch.from_numpy(array.copy()) for name, array in dequantized.items()},
                           strict=False)
    if model.config.tie_word_embeddings:
        oracle.tie_weights()
    return path, oracle


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q4_0"])
@pytest.mark.parametrize(("variant", "architecture"), [("llama", "llama"), ("llama3.1-rope", "llama"),
                                                      ("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_greedy_tokens_and_logits_equal_transformers_on_the_dequantized_weights(checkpoints, tmp_path,
                                                                                        variant, architecture,
                                                                                        tensor_type):
    """A GGUF written as llama.cpp writes it (Llama's Q/K rows permuted); the oracle is
    transformers holding the weights as the file's tensor type rounds them."""
    path, oracle = gguf_and_oracle(checkpoints, tmp_path, variant, architecture, tensor_type)
    assert_matches(engine_for(str(path)), oracle, F32_ATOL if tensor_type == "F32" else QUANTIZED_ATOL)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize(("variant", "architecture"), [("llama", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"),
                                                      ("qwen3", "qwen3")])
def test_gguf_served_quantized_equals_transformers_on_the_dequantized_weights(checkpoints, tmp_path, variant,
                                                                              architecture, tensor_type):
    """--quantization gguf: the matrices stay packed (services/worker/quantized.py) and the engine,
    computing in float32, gives transformers' tokens and logits on the file's dequantized weights."""
    from services.worker.quantized import PackedLinear

    path, oracle = gguf_and_oracle(checkpoints, tmp_path, variant, architecture, tensor_type)
    engine = LogitsEngine.from_settings(Settings(model=str(path), kv_blocks=64, kv_block_size=8, device="cpu",
                                                 dtype="float32", max_batch_size=8, quantization="gguf"))
    layer = engine.model.layers[0]
    assert all(isinstance(weight, PackedLinear) for weight in (layer.qkv, layer.out, layer.gate_up, layer.down,
                                                                engine.model.lm_head))
    assert_matches(engine, oracle, QUANTIZED_ATOL)

# Tokenizers and chat templates of checkpoint directories

TOKENIZER_TEXTS = ["Hello world, the quick brown fox.", "Crème brûlée 🙂 and 中文 with\ttabs\n\nand 12345",
                   "  leading spaces and trailing  ", "The harbor town woke slowly on winter mornings."]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ? 🚆"}]


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece", "gguf-sentencepiece"])
def checkpoint_tokenizers(request, tmp_path_factory):
    """Our tokenizer and transformers' AutoTokenizer on the same checkpoint directory: byte-level
    BPE (Llama 3, Qwen, SmolLM2 style) or SentencePiece-style BPE with byte fallback (Llama 2, Mistral);
    or on the same GGUF with a SentencePiece vocabulary (scores, no merges: llama.cpp's Llama 2 files)."""
    transformers = import_or_skip("transformers")
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "gguf-sentencepiece":
        size = len(sentencepiece_vocabulary()[0])
        write_gguf(transformers_model("llama", vocab_size=size), directory / "spm.gguf", tokenizer="sentencepiece")
        return (Tokenizer.load(str(directory / "spm.gguf")),
                transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file="spm.gguf"))
    save_checkpoint(transformers_model("llama", vocab_size=512), directory)
    if request.param == "sentencepiece":
        write_sentencepiece_tokenizer(directory)
    return Tokenizer.load(str(directory)), transformers.AutoTokenizer.from_pretrained(str(directory))


def test_checkpoint_tokenizer_encodes_and_renders_chats_as_transformers(checkpoint_tokenizers):
    ours, theirs = checkpoint_tokenizers
    for text in TOKENIZER_TEXTS:
        assert ours.encode_prompt(text) == theirs(text).input_ids  # the BOS its post-processor adds, if any
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text, add_special_tokens=False).input_ids)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(MESSAGES) == rendered
    assert ours.encode_chat(MESSAGES) == theirs(rendered, add_special_tokens=False).input_ids


def test_checkpoint_tokenizer_streams_the_text_transformers_decodes(checkpoint_tokenizers):
    """Pushed one token at a time after a prompt, the pieces are what transformers' decode of the
    whole sequence adds to its decode of the prompt (byte-fallback tokens joined into characters)."""
    ours, theirs = checkpoint_tokenizers
    checked = 0
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        for cut in range(1, len(ids)):
            prompt_text, full_text = theirs.decode(ids[:cut]), theirs.decode(ids)
            if "\ufffd" in prompt_text or not full_text.startswith(prompt_text):
                continue  # a cut inside a character: the prompt's text is not a prefix
            detokenizer = IncrementalDetokenizer(ours, ids[:cut])
            streamed = "".join(detokenizer.push(token_id) for token_id in ids[cut:]) + detokenizer.flush()
            assert streamed == full_text[len(prompt_text):], (text, cut)
            checked += 1
    assert checked > 20


# Unservable inputs: clear errors at start


def start_error(model: str, tmp_path) -> str:
    """`iterserve worker --model ...`'s exit: non-zero, one line, no traceback."""
    completed = subprocess.run(
        [sys.executable, "-m", "services.cli", "worker", "--model", model, "--redis-url", "redis://127.0.0.1:1"],
        capture_output=True, text=True, timeout=120, env={"ITERSERVE_CACHE_DIR": str(tmp_path / "cache"),
                                                          "PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed.stderr


def test_a_gguf_with_an_unsupported_tensor_type_is_refused_at_start_naming_it(checkpoints, tmp_path):
    model, _ = checkpoints["llama"]
    path = tmp_path / "iq.gguf"
    write_gguf(model, path, "F32", "llama", raw_type_override={"blk.0.ffn_down.weight": "Q8_1"})
    with pytest.raises(ModelFileError, match="tensor type Q8_1 is not supported; supported: F32, F16"):
        load_metadata(str(path))
    assert "tensor type Q8_1 is not supported" in start_error(str(path), tmp_path)


def copy_checkpoint(directory, destination, leave_out: str = ""):
    destination.mkdir()
    for file in directory.iterdir():
        if file.name != leave_out:
            (destination / file.name).write_bytes(file.read_bytes())
    return destination


def test_a_directory_without_a_tokenizer_is_refused_at_start(checkpoints, tmp_path):
    partial = copy_checkpoint(checkpoints["llama"][1], tmp_path / "no-tokenizer", leave_out="tokenizer.json")
    assert "missing tokenizer.json" in start_error(str(partial), tmp_path)


def test_an_unknown_architecture_is_refused_at_start_listing_the_supported_ones(checkpoints, tmp_path):
    other = copy_checkpoint(checkpoints["llama"][1], tmp_path / "gpt2")
    config = json.loads((other / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (other / "config.json").write_text(json.dumps(config))
    message = start_error(str(other), tmp_path)
    assert "architecture GPT2LMHeadModel is not supported" in message
    assert "Qwen3ForCausalLM" in message


def test_a_missing_model_path_is_refused_at_start(tmp_path):
    assert "model file not found" in start_error(str(tmp_path / "nothing.gguf"), tmp_path)


# Through the whole system


@pytest.mark.slow
def test_a_checkpoint_directory_is_served_through_the_whole_system_as_transformers_generates(checkpoints):
    """`iterserve up --model DIR --served-model-name NAME`, two workers: concurrent chat requests
    each give transformers' greedy tokens (its chat template, its end-of-sequence id), and the
    API names the model and its context length."""
    import concurrent.futures

    import openai

    from shared.tokenizer import Tokenizer
    from tests.system import System

    model, directory = checkpoints["qwen2"]
    tokenizer = Tokenizer.load(str(directory))
    conversations = [[{"role": "user", "content": text}] for text in ("Hello there", "Why is the sky blue?",
                                                                      "Count: 1 2 3", "Ünïcödé 🙂")]

    def oracle(messages) -> tuple[list[bytes], str]:
        prompt = tokenizer.encode_chat(messages)
        with torch.inference_mode():
            output = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=sorted(tokenizer.stop_token_ids), pad_token_id=0)[0, len(prompt):]
        ids = output.tolist()
        if ids[-1] in tokenizer.stop_token_ids:
            return [tokenizer.token_bytes(token_id) for token_id in ids[:-1]], "stop"
        return [tokenizer.token_bytes(token_id) for token_id in ids], "length"

    with System("--model", str(directory), "--served-model-name", "tiny-qwen2", workers=2, kv_blocks=64) as system:
        client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
        listed = client.models.list().data
        assert [entry.id for entry in listed] == ["tiny-qwen2"]
        assert listed[0].model_extra["max_model_len"] == 256

        def ask(messages) -> tuple[list[bytes], str]:
            response = client.chat.completions.create(model="tiny-qwen2", messages=messages, max_tokens=24,
                                                      temperature=0, logprobs=True)
            choice = response.choices[0]
            return [bytes(entry.bytes) for entry in choice.logprobs.content], choice.finish_reason

        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            answers = list(pool.map(ask, conversations))
        for messages, answer in zip(conversations, answers, strict=True):
            assert answer == oracle(messages), messages
        with pytest.raises(openai.NotFoundError, match="smollm2-135m-instruct"):
            client.chat.completions.create(model="smollm2-135m-instruct", messages=conversations[0], max_tokens=2)
