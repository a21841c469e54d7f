"""A GGUF's quantized tensors served quantized (`--quantization gguf`, services/worker/quantized.py):
each kept type unpacks to exactly the file's dequantized values, the packed projection computes
x @ W.T of them, a row's result does not depend on the step's other rows, and the packaged SmolLM2
served so gives the dequantized float32 model's greedy tokens. Against transformers, per family and
type: tests/test_models.py."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from services.bench.logits import LogitsEngine
from services.worker import cpu_kernels
from services.worker.engine import weight_bytes
from services.worker.quantized import PackedLinear, QuantizedEmbedding, concatenated, unpack
from shared.config import Settings
from shared.model_file import load_metadata
from shared.tokenizer import Tokenizer
from tests.engine_helpers import GREEDY, decode_item, generate_alone, prefill_item

ROWS, COLUMNS = 48, 512


def quantized_by_gguf(type_name: str, seed: int = 0, rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    """A random [rows, COLUMNS] matrix in the type's raw blocks, and gguf's dequantization of them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    quant = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name in ("Q4_K", "Q5_K"):  # (gguf does not quantize to these: random blocks, d and dmin each a
        # block's own, 1e-4..2e-2, so a folded zero 8 d sc - dmin m rounds and only the file's formula is exact)
        blocks = rng.integers(0, 256, (rows * COLUMNS // 256, 144 if type_name == "Q4_K" else 176), dtype=np.uint8)
        blocks[:, 0:4] = rng.uniform(1e-4, 2e-2, (len(blocks), 2)).astype(np.float16).view(np.uint8)
        data = blocks.reshape(rows, -1)
    else:
        data = quantize(rng.standard_normal((rows, COLUMNS)).astype(np.float32), quant)
    return data, dequantize(data, quant).reshape(rows, COLUMNS)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K"])
def test_each_kept_type_unpacks_to_exactly_the_files_dequantized_values(type_name):
    data, expected = quantized_by_gguf(type_name)
    tensor = unpack(type_name, data, ROWS, COLUMNS)
    assert all(part.q.max() <= 15 for part in tensor.parts)
    np.testing.assert_array_equal(tensor.dequantized(), expected)  # (the file's formula)
    # the kernel's parts: the same values up to float32's rounding of a folded zero
    kernels = sum(part.dequantized() for part in tensor.parts)
    np.testing.assert_allclose(kernels, expected, rtol=0, atol=4e-7 * np.abs(expected).max())
    # and its rows looked up as an embedding, exactly: an odd count of rows too (its own copy's last pair)
    for rows in (ROWS, ROWS - 1):
        table = unpack(type_name, data[:rows], rows, COLUMNS)
        ids = torch.tensor([5, 0, rows - 1, 12])
        looked_up = QuantizedEmbedding(table, torch.float32).index_select(0, ids)
        np.testing.assert_array_equal(looked_up.numpy(), expected[ids.numpy()])


def looked_up_from_the_lm_heads_bytes(rows: int) -> dict:
    """Each kept type as a table of `rows` rows, tied: its rows looked up from the lm head's packed
    bytes (not a copy), against gguf's dequantization; in this process's torch CPU capability."""
    found = {}
    for type_name in ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K"):
        data, expected = quantized_by_gguf(type_name, rows=rows)
        tensor = unpack(type_name, data, rows, COLUMNS)
        for dtype in (torch.float32, torch.bfloat16):
            lm_head = PackedLinear(tensor, torch.device("cpu"), dtype, kernel="int4")
            embedding = QuantizedEmbedding(tensor, dtype, lm_head)
            ids = torch.randperm(rows)
            exact = torch.equal(embedding.index_select(0, ids).float(), torch.from_numpy(expected)[ids].to(dtype).float())
            found[f"{type_name} {dtype} {rows}"] = (exact, embedding.nibbles.own, embedding.nibbles.layout,
                                                    embedding.nbytes, sum(packed.nbytes for packed, _ in lm_head.parts))
    return found


@pytest.mark.parametrize("capability", ["", "avx2", "default"])
def test_a_tied_tables_rows_are_looked_up_from_the_lm_heads_packed_bytes_exactly(capability):
    """The table held once: its embedding rows come from the int4 kernel's packed lm head, in the
    layout the CPU capability's kernel packs (AVX-512, AVX2, none: ATEN_CPU_CAPABILITY), with whole
    blocks and a short last one (240 = 3 x 64 + 48; 48 alone), equal to the file's values; the
    lookup's own bytes are its scales and zeros and a few row tables, under the lm head's 4-bit values."""
    script = ("import json, sys; sys.path.insert(0, '.'); import torch; from tests.test_quantized import "
              "looked_up_from_the_lm_heads_bytes as f; print(json.dumps({'capability': "
              "torch.backends.cpu.get_cpu_capability(), **f(240), **f(48), **f(64)}))")
    environment = dict(os.environ)
    environment.pop("ATEN_CPU_CAPABILITY", None)
    if capability:  # ("": the host's own)
        environment["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    ran_on = found.pop("capability")
    assert not capability or ran_on == capability.upper()
    for case, (exact, own, layout, held, nibbles) in found.items():
        assert exact and not own, (case, layout)
        assert held < nibbles / 1.5, case  # (its scales and zeros, as narrow as exact, and 7 bytes a row)


def native_kernels():
    """The project's kernels built and loaded, on every host that has what they need (x86 with AVX2,
    FMA and F16C: every host class here); elsewhere the test is for torch's kernel only."""
    if not {"avx2", "fma", "f16c"} <= cpu_kernels._cpu_flags():
        pytest.skip("the project's packed kernels need an x86 CPU with AVX2, FMA and F16C")
    assert cpu_kernels.loaded(), "the project's packed kernels did not build: see the log"


@pytest.fixture
def native_form():
    """Sets the form of the project's kernels a test runs (256: the AVX2 form, everywhere they build;
    512: the AVX-512 form, which the process takes where the CPU has it); the process's restored after."""
    native_kernels()
    before = cpu_kernels.vector_bits()

    def use(bits: int) -> None:
        if bits == 512 and not {"avx512f", "avx512bw"} <= cpu_kernels._cpu_flags():
            pytest.skip("the AVX-512 form needs a CPU with AVX-512 (F and BW): this host runs the AVX2 form only")
        cpu_kernels.vector_bits(bits)

    yield use
    cpu_kernels.vector_bits(before)


FORMS = pytest.mark.parametrize("bits", [256, 512], ids=["avx2-form", "avx512-form"])


def test_the_native_kernels_run_their_widest_form_and_refuse_a_width_they_lack():
    native_kernels()
    widest = 512 if {"avx512f", "avx512bw"} <= cpu_kernels._cpu_flags() else 256
    assert cpu_kernels.vector_bits() == widest
    with pytest.raises(RuntimeError, match="vector_bits"):
        cpu_kernels.vector_bits(128)


@pytest.mark.parametrize("kernel, bits", [("int4", None), ("native", 256), ("native", 512)],
                         ids=["int4", "native-avx2-form", "native-avx512-form"])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q5_K"])
def test_the_packed_projection_is_x_times_the_dequantized_weight(type_name, kernel, bits, request):
    if kernel == "native":
        request.getfixturevalue("native_form")(bits)
    data, weight = quantized_by_gguf(type_name)
    x = torch.randn(5, COLUMNS)
    expected = x.double() @ torch.from_numpy(weight).double().T
    scale = expected.abs().max().item()
    for dtype, tolerance in ((torch.float32, 5e-6), (torch.bfloat16, 2e-2)):  # (float32: rounding only)
        projection = PackedLinear(unpack(type_name, data, ROWS, COLUMNS), torch.device("cpu"), dtype, kernel=kernel)
        # the project's kernel takes the types whose values it holds as the file's: the rest go to torch's
        assert (projection.native is not None) == (kernel == "native" and type_name in ("Q4_0", "Q4_1", "Q8_0"))
        got = projection(x)
        assert got.dtype == dtype and got.shape == (5, ROWS)
        assert (got.double() - expected).abs().max().item() < tolerance * scale, dtype


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_avx512_form_multiplies_by_gguf_s_dequantized_weights_bit_for_bit(type_name, native_form):
    """Its weights are gguf's dequantized float32 values themselves (d (q - 8), d q + m, d q), not a
    rearrangement of the sum: x of one-hot rows reads each column back exactly."""
    native_form(512)
    data, weight = quantized_by_gguf(type_name)
    projection = PackedLinear(unpack(type_name, data, ROWS, COLUMNS), torch.device("cpu"), torch.float32,
                              kernel="native")
    np.testing.assert_array_equal(projection(torch.eye(COLUMNS)).numpy(), weight.T)


@FORMS
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_native_kernel_gives_a_row_the_same_bits_in_every_batch_and_thread_count(type_name, bits, native_form):
    """Its threads split the weight's rows and a row of x is summed in one order in every block of
    rows: a request's projections do not depend on its batch or the worker's threads. 50 output
    rows (not a multiple of the 16 a thread takes), 1-9 and 33 rows of x (blocks of 4 and their rest)."""
    native_form(bits)
    data, _ = quantized_by_gguf(type_name, rows=50)
    projection = PackedLinear(unpack(type_name, data, 50, COLUMNS), torch.device("cpu"), torch.float32,
                              kernel="native")
    x = torch.randn(33, COLUMNS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([projection(x[index:index + 1]) for index in range(len(x))])
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33):
                assert torch.equal(projection(x[:rows]), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_tied_table_is_looked_up_from_the_native_kernels_bytes_exactly(type_name):
    """With the project's kernel the lm head holds the file's integers as the file does, and the
    embedding's rows are the file's values bit for bit from those bytes (the table held once)."""
    native_kernels()
    data, expected = quantized_by_gguf(type_name, rows=ROWS - 1)
    tensor = unpack(type_name, data, ROWS - 1, COLUMNS)
    lm_head = PackedLinear(tensor, torch.device("cpu"), torch.float32, kernel="native")
    embedding = QuantizedEmbedding(tensor, torch.float32, lm_head)
    assert embedding.shares_lm_head and embedding.nbytes < lm_head.nbytes / 4
    ids = torch.randperm(ROWS - 1)
    np.testing.assert_array_equal(embedding.index_select(0, ids).numpy(), expected[ids.numpy()])
    # held at the file's size: the blocks' bytes, less nothing, plus nothing
    assert lm_head.nbytes == data.nbytes


def test_fused_projections_concatenate_rows_and_mixed_forms_do_not():
    (q_data, q_weight), (k_data, k_weight) = quantized_by_gguf("Q4_1", 1), quantized_by_gguf("Q4_0", 2)
    q, k = unpack("Q4_1", q_data, ROWS, COLUMNS), unpack("Q4_0", k_data, ROWS, COLUMNS)
    np.testing.assert_array_equal(concatenated([q, k]).dequantized(), np.concatenate([q_weight, k_weight]))
    eight, _ = quantized_by_gguf("Q8_0", 3)
    assert concatenated([q, unpack("Q8_0", eight, ROWS, COLUMNS)]) is None  # (one part and two)


@pytest.mark.parametrize("kernel", ["int4", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows_of_the_step(dtype, kernel):
    """What makes packed serving batch-invariant in bfloat16 too (dense bfloat16 is not, here)."""
    if kernel == "native":
        native_kernels()
    data, _ = quantized_by_gguf("Q8_0")
    projection = PackedLinear(unpack("Q8_0", data, ROWS, COLUMNS), torch.device("cpu"), dtype, kernel=kernel)
    x = torch.randn(64, COLUMNS).to(dtype)
    whole = projection(x)
    for rows in (1, 2, 3, 4, 7, 16, 33):
        assert torch.equal(projection(x[:rows]), whole[:rows]), rows


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "List three colors:"]


@pytest.fixture(scope="module")
def packaged():
    torch.set_num_threads(1)
    tokenizer = Tokenizer.for_serving(Settings().model)
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("kernel", ["auto", "native"])
def test_the_packaged_model_served_quantized_gives_the_dequantized_float32_models_greedy_tokens(packaged, kernel,
                                                                                                 monkeypatch):
    """Q4_1 matrices and a Q8_0 embedding (tied to the lm head) packed: in float32 the same greedy
    tokens as every tensor dequantized to float32, in under a third of the memory. With the host's
    own choice of kernel (torch's int4 where torch runs AVX-512), and with the project's in the form
    this process runs (AVX-512 where the CPU has it). (Not torch's int4 kernel where `auto` does not
    take it: in float32 on AVX2 it takes minutes.)"""
    if kernel == "native":
        native_kernels()
    monkeypatch.setenv(cpu_kernels.CHOICE, kernel)
    dense = LogitsEngine.from_settings(Settings(kv_blocks=128, device="cpu", dtype="float32"))
    packed = LogitsEngine.from_settings(Settings(kv_blocks=128, device="cpu", dtype="float32", quantization="gguf"))
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert (packed.model.lm_head.native is not None) == (cpu_kernels.chosen_kernel() == "native")
    for prompt in packaged:
        dense_logits, packed_logits = [], []
        expected = generate_alone(dense, "r", prompt, 24, logits=dense_logits)
        assert generate_alone(packed, "r", prompt, 24, logits=packed_logits) == expected, prompt
        difference = (torch.stack(dense_logits) - torch.stack(packed_logits)).abs().max().item()
        assert difference < 1e-3, difference
    # 124 MB against 538 (the file: 98 MB; the kernel's scales and zeros in float32, 104 MB in
    # bfloat16); the tied Q8_0 table held once, its rows looked up from the lm head's packed bytes
    file_bytes = Path(load_metadata(Settings().model).path).stat().st_size
    assert packed.model.embedding.shares_lm_head
    assert weight_bytes(packed.model) < 1.3 * file_bytes < 0.3 * weight_bytes(dense.model)


def test_gpu_memory_utilization_counts_packed_weights_at_their_packed_size(monkeypatch):
    """vLLM's --gpu-memory-utilization share less the worker's own bytes: the weights as the loaded
    model holds them (packed: 104 MB), not as their shape would take in bfloat16 (269 MB)."""
    from services.worker import engine as engine_module
    from services.worker.engine import Engine, kv_block_bytes, own_bytes, shaped_weight_bytes

    gib = 1 << 30
    monkeypatch.setattr(engine_module, "memory_bytes", lambda device: (2 * gib, 2 * gib))
    settings = Settings(device="cpu", quantization="gguf", gpu_memory_utilization=0.25, kv_block_size=16)
    engine = Engine.from_settings(settings)
    config, dtype = engine.model.config, engine.model.dtype
    held = weight_bytes(engine.model)
    assert held < 0.45 * shaped_weight_bytes(config, dtype)
    block = kv_block_bytes(config, 16, dtype)
    assert engine.kv_cache.blocks_total == (gib // 2 - own_bytes(config, settings, dtype, held)) // block
    assert engine.kv_cache.blocks_total > (gib // 2 - own_bytes(config, settings, dtype)) // block + 100


def test_a_packed_engine_keeps_resident_little_beyond_its_weights():
    """Loading frees several times what it keeps (GGUF blocks, int32 copies to pack): given back to
    the system (engine.release_freed_heap), a packed SmolLM2's process grows by under twice its
    weights (155 MB for 104 on an AMD EPYC; 410 MB while glibc kept the freed pages)."""
    script = ("import json, sys; sys.path.insert(0, '.'); from services.worker.engine import Engine, resident_bytes, "
              "weight_bytes; from shared.config import Settings; import torch; before = resident_bytes(); "
              "engine = Engine.from_settings(Settings(kv_blocks=16, device='cpu', quantization='gguf')); "
              "print(json.dumps([resident_bytes() - before, weight_bytes(engine.model)]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    grown, weights = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < weights < grown < 2 * weights, (grown, weights)


@pytest.mark.parametrize("kernel", ["int4", "native"])
def test_served_quantized_in_bfloat16_a_requests_tokens_do_not_depend_on_its_batch(packaged, kernel, monkeypatch):
    """Each request alone, then all four in one batch, step by step: the same tokens. Without the
    decode workspace: its attention over the batch's keys padded to one length is not
    batch-invariant in bfloat16 (with it, two of these four requests come out otherwise)."""
    if kernel == "native":
        native_kernels()
    monkeypatch.setenv(cpu_kernels.CHOICE, kernel)
    engine = LogitsEngine.from_settings(Settings(kv_blocks=256, device="cpu", quantization="gguf", dtype="bfloat16",
                                                 decode_workspace_tokens=0))
    assert engine.model.dtype == torch.bfloat16
    assert (engine.model.lm_head.native is not None) == (kernel == "native")
    alone = [generate_alone(engine, f"alone-{index}", prompt, 20) for index, prompt in enumerate(packaged)]
    for index in range(len(packaged)):
        engine.add_request(f"r{index}", GREEDY)
    result = engine.step([prefill_item(f"r{index}", prompt) for index, prompt in enumerate(packaged)])
    outputs = {request_id: [token] for request_id, token in result.tokens.items()}
    while len(outputs["r0"]) < 20:
        items = [decode_item(f"r{index}", outputs[f"r{index}"][-1], len(prompt) + len(outputs[f"r{index}"]) - 1,
                             len(outputs[f"r{index}"])) for index, prompt in enumerate(packaged)]
        for request_id, token in engine.step(items).tokens.items():
            outputs[request_id].append(token)
    assert [outputs[f"r{index}"] for index in range(len(packaged))] == alone


@pytest.mark.parametrize(("arguments", "message"), [
    (["--quantization", "gguf", "--tensor-parallel", "2"], "one worker process"),
    (["--quantization", "gguf", "--compile"], "not with compile"),
    (["--quantization", "q4"], "quantization"),
])
def test_a_bad_quantization_setting_is_refused_at_start(arguments, message):
    result = subprocess.run([sys.executable, "-m", "services.cli", "worker", *arguments], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_quantization_gguf_of_a_checkpoint_directory_is_a_clear_error(tmp_path):
    from tests.checkpoints import save_checkpoint, transformers_model
    from tests.requirements import import_or_skip

    import_or_skip("transformers")
    directory = save_checkpoint(transformers_model("llama"), tmp_path / "llama")
    with pytest.raises(Exception, match="needs a GGUF model file"):
        LogitsEngine.from_settings(Settings(model=str(directory), kv_blocks=16, device="cpu", quantization="gguf"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_iterserve_up_served_quantized_gives_the_engine_alones_tokens_on_either_worker_alone_and_batched(packaged):
    """`iterserve up --quantization gguf` with two workers (bfloat16, packed): each chat request's greedy
    text equals the packed engine alone's, sent alone and eight at once (spread over both workers)."""
    import concurrent.futures

    from tests.system import System

    tokenizer = Tokenizer.load()
    engine = LogitsEngine.from_settings(Settings(kv_blocks=256, device="cpu", quantization="gguf",
                                                 decode_workspace_tokens=0))
    messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    expected = []
    for chat in messages:
        output = generate_alone(engine, "oracle", tokenizer.encode_chat(chat), 24, stop_ids=tokenizer.stop_token_ids)
        expected.append(tokenizer.decode([token for token in output if token not in tokenizer.stop_token_ids]))
    with System("--quantization", "gguf", "--decode-workspace-tokens", "0", workers=2) as system:
        def ask(chat) -> str:
            body = json.dumps({"model": "smollm2-135m-instruct", "messages": chat, "max_tokens": 24,
                               "temperature": 0}).encode()
            request = urllib.request.Request(f"{system.url}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["choices"][0]["message"]["content"]

        assert [ask(chat) for chat in messages] == expected
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, messages + messages)) == expected + expected


def test_the_packed_kernel_is_chosen_by_the_hosts_cpu_capability_or_the_environment(monkeypatch):
    """auto: the project's kernel where torch runs AVX2 kernels (its int4 kernel is slow there), torch's
    elsewhere; the environment can ask for either; anything else is refused."""
    monkeypatch.delenv(cpu_kernels.CHOICE, raising=False)
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert cpu_kernels.chosen_kernel() == ("native" if avx2 and cpu_kernels.loaded() else "int4")
    monkeypatch.setenv(cpu_kernels.CHOICE, "int4")
    assert cpu_kernels.chosen_kernel() == "int4"
    monkeypatch.setenv(cpu_kernels.CHOICE, "fast")
    with pytest.raises(ValueError, match="ITERSERVE_PACKED_KERNEL='fast': one of auto, native, int4"):
        cpu_kernels.chosen_kernel()


def test_a_build_cut_off_by_a_kill_does_not_keep_later_workers_waiting(tmp_path):
    """torch's extension builder waits for as long as its lock file is there, and a builder killed
    mid-build (a worker SIGKILLed while starting) leaves it: the next worker builds anyway."""
    native_kernels()
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    script = "import sys; sys.path.insert(0, '.'); from services.worker import cpu_kernels as c; print(c.{})"
    root = Path(__file__).resolve().parent.parent
    where = subprocess.run([sys.executable, "-c", script.format("build_directory()")], capture_output=True,
                           text=True, timeout=60, env=environment, cwd=root)
    directory = Path(where.stdout.strip().splitlines()[-1])
    assert directory.is_relative_to(tmp_path)
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # (as a killed builder leaves it)
    done = subprocess.run([sys.executable, "-c", script.format("loaded()")], capture_output=True, text=True,
                          timeout=240, env=environment, cwd=root)
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]
