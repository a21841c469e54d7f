"""Loading a Hugging Face checkpoint directory: time and peak memory against the weights' size.

    .venv/bin/python benchmarks/checkpoint_load.py [--layers 12] [--hidden 1024] [--shard-size 200MB]

Makes a random Llama-shaped checkpoint with transformers (bfloat16, several safetensors shards
and an index) in a temporary directory, then, in a fresh process, loads it into an Engine in
float32 and prints the stored and served sizes, the load time and the peak RSS growth. The
safetensors are memory-mapped and read one tensor at a time (services/worker/weights.py), so the
peak is the served weights plus the mapped shards' file pages (page cache, reclaimable), not a
second full copy.
"""

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make(directory: Path, layers: int, hidden: int, shard_size: str) -> None:
    import torch
    import transformers

    from tests.checkpoints import write_byte_tokenizer

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                                      vocab_size=32000, max_position_embeddings=2048, eos_token_id=256,
                                      bos_token_id=256)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        str(directory), max_shard_size=shard_size)
    write_byte_tokenizer(directory)


def load(directory: Path) -> None:
    from services.worker.engine import Engine
    from shared.config import Settings

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    engine = Engine.from_settings(Settings(model=str(directory), kv_blocks=8, device="cpu", dtype="float32",
                                           decode_workspace_tokens=0))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = engine.model
    tensors = [model.embedding, model.lm_head, model.final_norm] + [
        tensor for layer in model.layers for tensor in (layer.attn_norm, layer.qkv, layer.out, layer.ffn_norm,
                                                        layer.gate_up, layer.down)]
    served = sum(tensor.numel() * tensor.element_size() for tensor in {id(t): t for t in tensors}.values())
    stored = sum(shard.stat().st_size for shard in directory.glob("*.safetensors"))
    print(f"stored {stored / 2**20:.0f} MiB in {len(list(directory.glob('*.safetensors')))} shards; served float32 "
          f"{served / 2**20:.0f} MiB; load {seconds:.1f} s; peak RSS growth {(peak - before) / 1024:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the measuring child process
    args = parser.parse_args()
    if args.load:
        load(Path(args.load))
        return
    with tempfile.TemporaryDirectory(prefix="iterserve-checkpoint-") as directory:
        make(Path(directory), args.layers, args.hidden, args.shard_size)
        subprocess.run([sys.executable, __file__, "--load", directory], check=True, timeout=600)


if __name__ == "__main__":
    main()
