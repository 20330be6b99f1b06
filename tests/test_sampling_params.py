"""SamplingParams: validation errors and their normalization (docs/determinism.md)."""

import dataclasses

import pytest

import tpspec
from tpspec.keys import GREEDY_TEMPERATURE_THRESHOLD
from tpspec.sampling import GREEDY_SENTINEL_TEMPERATURE, TOP_K_DISABLED, SamplingParams


def test_exported_from_package():
    assert tpspec.SamplingParams is SamplingParams
    assert "SamplingParams" in tpspec.__all__


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e39}, "temperature"),  # finite as a double, inf as the kernels' float32
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": None}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1e-46}, "top_p"),  # positive as a double, 0 as float32
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5 exceeds"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_validation_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_vllm_defaults():
    """vLLM's defaults: one sample, temperature 1.0 (sampled, not greedy), no filters, 16 tokens."""
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert not p.is_greedy and p.is_temperature_only
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert SamplingParams(stop="###").stop == ("###",)  # one string is one stop string
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[7]) == SamplingParams(stop=("a", "b"), stop_token_ids=(7,))
    assert SamplingParams(temperature=0.8, top_k=-1).norm_top_k == TOP_K_DISABLED  # -1 disables, as 0 does


def test_greedy_normalization():
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=0.0, top_p=0.5),
              SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=1e-7)):
        assert p.is_greedy
        assert p.norm_temperature == GREEDY_SENTINEL_TEMPERATURE < GREEDY_TEMPERATURE_THRESHOLD
        assert p.normalized() == (GREEDY_SENTINEL_TEMPERATURE, TOP_K_DISABLED, 1.0, 0.0)
        assert p.is_temperature_only


def test_sampled_normalization():
    p = SamplingParams(temperature=0.8)
    assert not p.is_greedy and p.is_temperature_only
    assert p.normalized() == (0.8, TOP_K_DISABLED, 1.0, 0.0)
    assert SamplingParams(temperature=0.8, top_k=0).norm_top_k == TOP_K_DISABLED  # 0 disables
    q = SamplingParams(temperature=1.2, top_k=40, top_p=0.9, min_p=0.05, seed=2**64 - 1)
    assert q.normalized() == (1.2, 40, 0.9, 0.05)
    assert not q.is_temperature_only
    assert q.seed_int64 == -1 and q.is_seeded
    # Neutral filters keep a row temperature-only.
    assert SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0).is_temperature_only
    assert not SamplingParams(temperature=1.0, min_p=0.1).is_temperature_only


def test_hashable_and_immutable():
    p = SamplingParams(temperature=0.5, seed=3)
    assert hash(p) == hash(SamplingParams(temperature=0.5, seed=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    assert p.temperature == 0.5
