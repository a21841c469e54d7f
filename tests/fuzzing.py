"""Hypothesis strategies for bad msgpack: what the fuzz tests throw at the services' inputs."""

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MSGPACK_LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
                  | st.floats() | st.text(max_size=12) | st.binary(max_size=12))  # fmt: skip
# Any msgpack value, maps with integer keys included (the decoder refuses those).
MSGPACK_VALUES = st.recursive(
    MSGPACK_LEAVES,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.integers(0, 9), children, max_size=4),
    max_leaves=10,
)


def bad_payloads(valid: dict) -> st.SearchStrategy[bytes]:
    """Random bytes, a truncated valid message, wrong-typed msgpack, or a valid message with one
    field replaced by a value of any type."""
    packed = msgpack.packb(valid, use_bin_type=True)
    return st.one_of(
        st.binary(max_size=96),
        st.integers(0, len(packed) - 1).map(lambda length: packed[:length]),
        MSGPACK_VALUES.map(lambda value: msgpack.packb(value, use_bin_type=True)),
        st.sampled_from(sorted(valid)).flatmap(
            lambda name: MSGPACK_VALUES.map(lambda value: msgpack.packb({**valid, name: value}, use_bin_type=True))
        ),
    )


def drawn(strategy: st.SearchStrategy, count: int) -> list:
    """`count` examples of a strategy, drawn by hypothesis (for a test that is itself async)."""
    examples = []

    @given(strategy)
    @settings(max_examples=count, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def collect(example) -> None:
        examples.append(example)

    collect()
    return examples
