"""When each request is sent: open-loop arrivals (Poisson, or gamma with a burstiness factor).

Open loop: a request is sent at its arrival time whether or not earlier ones have finished,
as independent users would; a closed loop (fixed concurrency) lives in the runner. Inter-arrival
times of a gamma process with shape `burstiness` and mean 1/rate: burstiness 1 is Poisson,
below 1 the arrivals come in bursts, above 1 they are more even (as vLLM's benchmark does).
"""

import math

import numpy as np

ARRIVALS_STREAM = 2  # sub-stream of the run's seed: lengths and arrivals do not disturb each other


def arrival_offsets(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each of `count` requests is sent (first at 0).

    rate is requests per second; math.inf sends everything at once.
    """
    if count <= 0:
        return []
    if rate <= 0:
        raise ValueError(f"rate must be > 0 (got {rate})")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng([seed, ARRIVALS_STREAM])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
