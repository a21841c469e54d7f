"""Hardware profiles for the emulated executor: a model's shape and a device's published figures,
and the roofline that turns one step's items into the seconds that step would take there.

A profile is a plain JSON file (profiles/*.json, or any path): the model (layers, hidden size,
FFN size, heads, KV heads, head dim, vocabulary, context, bytes per parameter, tied embeddings,
gated FFN), the device (memory bandwidth, dense peak FLOP/s, memory, the datasheet it comes from)
and the efficiencies (of memory bandwidth and of compute, and a fixed per-step launch cost, each
with the published measurement it was calibrated from). A step takes

    max(bytes read and written / (bandwidth x memory efficiency),
        FLOPs / (peak x compute efficiency)) + launch

bytes: every weight once (the input embedding only for its rows: not counted), the KV each item
attends to (its context), the KV each new token writes; FLOPs: 2 x parameters per token for the
projections, the LM head for sampled rows only, and attention's 4 x heads x head_dim per (query,
key) pair of the causal step. Vidur (MLSys 2024) profiles operators one by one; one roofline per
step is coarser, but it is data, not code, and a profile can be written from a real run.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


class ProfileError(ValueError):
    """An unknown profile name or a malformed profile file: the worker stops at start with it."""


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    hidden_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    dtype_bytes: float  # bytes per parameter and per KV element (2 for bf16)
    tied_embeddings: bool
    gated_ffn: bool = True  # SwiGLU (gate, up, down) or a plain MLP (up, down)

    @property
    def layer_parameters(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        ffn_matrices = 3 if self.gated_ffn else 2
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size + ffn_matrices * self.hidden_size * self.ffn_size

    @property
    def weight_bytes(self) -> float:
        """Bytes a step reads from the weights: every layer, the LM head and the norms."""
        norms = (2 * self.n_layers + 1) * self.hidden_size
        lm_head = self.vocab_size * self.hidden_size
        return self.dtype_bytes * (self.n_layers * self.layer_parameters + lm_head + norms)

    @property
    def resident_bytes(self) -> float:
        """The weights in memory: what a step reads, and the input embedding when it is not tied."""
        return self.weight_bytes + (0 if self.tied_embeddings else self.dtype_bytes * self.vocab_size * self.hidden_size)

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    model: ModelShape
    device_name: str
    memory_bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s, dense, in the model's dtype
    memory_bytes: float
    memory_efficiency: float
    compute_efficiency: float
    launch_seconds: float
    source: str  # where the device's figures come from
    calibration: str  # where the efficiencies come from

    def step_seconds(self, items: Iterable[tuple[int, int, bool]]) -> float:
        """(start position, tokens fed, sampled) of each item of a step -> the step's seconds."""
        model = self.model
        tokens = sampled = 0
        attended = 0  # KV tokens read, over items
        pairs = 0.0  # (query, key) pairs of causal attention, over items
        for start, count, sample in items:
            tokens += count
            sampled += bool(sample)
            attended += start + count
            pairs += count * start + count * (count + 1) / 2
        bytes_moved = model.weight_bytes + (attended + tokens) * model.kv_bytes_per_token
        flops = (2 * model.n_layers * model.layer_parameters * tokens
                 + 2 * model.vocab_size * model.hidden_size * sampled
                 + 4 * model.n_layers * model.n_heads * model.head_dim * pairs)
        return max(bytes_moved / (self.memory_bandwidth * self.memory_efficiency),
                   flops / (self.peak_flops * self.compute_efficiency)) + self.launch_seconds

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """A decode step of `batch` requests, each with `context` tokens already in its KV."""
        return self.step_seconds([(context, 1, True)] * batch)

    def kv_blocks(self, block_size: int, memory_fraction: float) -> int:
        """KV blocks that fit in this fraction of the device's memory left after the weights."""
        free = self.memory_bytes - self.model.resident_bytes
        return max(1, int(free * memory_fraction // (self.model.kv_bytes_per_token * block_size)))

    def kv_blocks_in_share(self, block_size: int, utilization: float) -> int:
        """KV blocks in this share of the device's whole memory less the weights (vLLM's
        --gpu-memory-utilization); ProfileError when it leaves none."""
        room = self.memory_bytes * utilization - self.model.resident_bytes
        blocks = int(room // (self.model.kv_bytes_per_token * block_size))
        if blocks < 1:
            raise ProfileError(f"--gpu-memory-utilization {utilization:g} of {self.name}'s {self.memory_bytes} bytes "
                               f"leaves no room for a KV block after the weights ({self.model.resident_bytes} bytes)")
        return blocks


def known_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILES.glob("*.json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (profiles/<name>.json) or by path; ProfileError names what is known."""
    if not name_or_path:
        raise ProfileError(f"--hardware is needed with --executor emulated; known profiles: {', '.join(known_profiles())}")
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.exists()):
        path = PROFILES / f"{name_or_path}.json"
        if not path.exists():
            raise ProfileError(f"unknown hardware profile {name_or_path!r}; known profiles: "
                               f"{', '.join(known_profiles())} (or a path to a profile file)")
    try:
        return parse_profile(json.loads(path.read_text()), default_name=path.stem)
    except (ValueError, KeyError, TypeError) as error:
        raise ProfileError(f"malformed hardware profile {path}: {error}; known profiles: "
                           f"{', '.join(known_profiles())}") from None


def parse_profile(data: dict, default_name: str = "") -> HardwareProfile:
    def positive(section: dict, key: str, kind=float):
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key} must be a positive number, got {value!r}")
        if kind is int and value != int(value):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return kind(value)

    def fraction(section: dict, key: str) -> float:
        value = positive(section, key)
        if value > 1:
            raise ValueError(f"{key} must be in (0, 1], got {value!r}")
        return value

    if not isinstance(data, dict):
        raise ValueError("a profile is a JSON object")
    model, device, efficiency = data["model"], data["device"], data["efficiency"]
    shape = ModelShape(
        **{key: positive(model, key, int) for key in ("n_layers", "hidden_size", "ffn_size", "n_heads", "n_kv_heads",
                                                       "head_dim", "vocab_size", "context_length")},
        dtype_bytes=positive(model, "dtype_bytes"), tied_embeddings=bool(model.get("tied_embeddings", False)),
        gated_ffn=bool(model.get("gated_ffn", True)))
    launch = efficiency.get("launch_ms", 0.0)
    if isinstance(launch, bool) or not isinstance(launch, (int, float)) or not 0 <= launch < 1000:
        raise ValueError(f"launch_ms must be a number of milliseconds, got {launch!r}")
    return HardwareProfile(
        name=str(data.get("name") or default_name), description=str(data.get("description", "")), model=shape,
        device_name=str(device.get("name", "")), memory_bandwidth=positive(device, "memory_bandwidth_gb_s") * 1e9,
        peak_flops=positive(device, "peak_tflops") * 1e12, memory_bytes=positive(device, "memory_gb") * 1e9,
        memory_efficiency=fraction(efficiency, "memory"), compute_efficiency=fraction(efficiency, "compute"),
        launch_seconds=launch / 1000, source=str(device.get("source", "")),
        calibration=str(efficiency.get("calibration", "")))


def profile_from_measurement(name: str, model: dict, device: dict, context: int,
                             measured: dict[int, float], compute_efficiency: float = 0.6) -> dict:
    """A profile (as its JSON object) calibrated from decode steps measured on a real device:
    measured = {batch: seconds per decode step at `context`}, two batch sizes or more. Decode is
    memory-bound, so step = bytes / (bandwidth x efficiency) + launch: the smallest and largest
    batches give the two unknowns (with one point, or a fit that noise makes impossible, launch is 0).
    The compute efficiency is not measured by decode steps: it is the given assumption, and says so."""
    template = {"name": name, "model": model, "device": device,
                "efficiency": {"memory": 1.0, "compute": compute_efficiency, "launch_ms": 0.0}}
    ideal = parse_profile(template)  # efficiency 1, no launch: bytes over bandwidth
    small, large = min(measured), max(measured)
    seconds_per_ideal = (measured[large] - measured[small]) / (ideal.decode_step_seconds(large, context)
                                                                - ideal.decode_step_seconds(small, context) or 1)
    launch = measured[small] - seconds_per_ideal * ideal.decode_step_seconds(small, context)
    if large == small or not 1 <= seconds_per_ideal or launch < 0:
        seconds_per_ideal, launch = measured[small] / ideal.decode_step_seconds(small, context), 0.0
    memory = min(1.0, 1 / seconds_per_ideal)
    steps = ", ".join(f"batch {batch}: {1000 * seconds:.3f} ms" for batch, seconds in sorted(measured.items()))
    template["efficiency"] = {
        "memory": round(memory, 4), "compute": compute_efficiency, "launch_ms": round(1000 * launch, 4),
        "calibration": f"measured by benchmarks/gpu_check.py: decode steps at context {context} ({steps}); "
                       f"memory efficiency and launch fitted to them; compute efficiency assumed"}
    parse_profile(template)  # what is written loads
    return template
