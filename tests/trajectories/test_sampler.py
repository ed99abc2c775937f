"""The sampler keeps the same samples in any arrival order, on any number of replicas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_proxy.trajectories.sampler import Fate, Policy, Sampler, sample_hash


def kept_by(sampler: Sampler, arrivals: list[tuple[int, int]], validate: bool = False) -> set:
    """Feed (step, sample) arrivals (rollouts repeat samples); finish every step; kept set."""
    kept: set[tuple[int, str]] = set()
    dropped: set[tuple[int, str]] = set()
    for step, sample in arrivals:
        fate, evicted = sampler.decide("exp", step, validate, sample)
        dropped.update((step, e) for e in evicted)
        if fate is Fate.KEEP:
            kept.add((step, str(sample)))
        elif fate is Fate.DROP:
            dropped.add((step, str(sample)))
    for step in {s for s, _ in arrivals}:
        kept.update((step, c) for c in sampler.finish_step("exp", step, validate))
    assert not kept & dropped, "a sample was both kept and dropped"
    return kept


def smallest(seed: int, step: int, samples: set[int], n: int) -> set[tuple[int, str]]:
    ranked = sorted(samples, key=lambda s: sample_hash(seed, "exp", step, False, s))
    return {(step, str(s)) for s in ranked[:n]}


traffic = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(traffic, st.randoms(use_true_random=False), st.integers(0, 8), st.integers(0, 2**32))
def test_top_n_is_the_n_smallest_hashes_in_any_order(arrivals, rnd, n, seed) -> None:
    shuffled = list(arrivals)
    rnd.shuffle(shuffled)
    expected = set().union(
        *(smallest(seed, step, {s for t, s in arrivals if t == step}, n)
          for step in {t for t, _ in arrivals})
    )  # fmt: skip
    assert kept_by(Sampler(seed, Policy(max_samples=n)), arrivals) == expected
    assert kept_by(Sampler(seed, Policy(max_samples=n)), shuffled) == expected


@settings(max_examples=200, deadline=None)
@given(traffic, st.integers(1, 5), st.randoms(use_true_random=False), st.integers(0, 8))
def test_replicas_agree_with_one_proxy(arrivals, replicas, rnd, n) -> None:
    """Split the traffic by any partition over replicas, each keeping its own top N: the overall
    top N of each step is exactly what the replicas' kept sets agree on when merged and re-ranked,
    and each replica's choice among what it saw is the same as one proxy's would be."""
    parts: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
    for arrival in arrivals:  # a sample's rollouts may land on different replicas
        parts[rnd.randrange(replicas)].append(arrival)
    single = kept_by(Sampler(7, Policy(max_samples=n)), arrivals)
    union: set[tuple[int, str]] = set()
    for part in parts:
        local = kept_by(Sampler(7, Policy(max_samples=n)), part)
        for step in {t for t, _ in part}:
            assert {k for k in local if k[0] == step} == smallest(
                7, step, {s for t, s in part if t == step}, n
            )
        union |= local
    # The global top N of every step survives on whichever replicas saw it.
    assert single <= union
    for step in {t for t, _ in arrivals}:
        merged = {int(s) for t, s in union if t == step}
        assert smallest(7, step, merged, n) == {k for k in single if k[0] == step}


@settings(max_examples=100, deadline=None)
@given(traffic, st.floats(0, 1), st.integers(0, 2**32))
def test_rate_mode_needs_no_state_and_is_the_same_everywhere(arrivals, rate, seed) -> None:
    one = Sampler(seed, Policy(rate=rate))
    other = Sampler(seed, Policy(rate=rate))  # another replica, or after a restart
    for step, sample in arrivals:
        fate, evicted = one.decide("exp", step, False, sample)
        assert fate in (Fate.KEEP, Fate.DROP) and evicted == []
        assert other.decide("exp", step, False, sample)[0] is fate
        assert (fate is Fate.KEEP) == (sample_hash(seed, "exp", step, False, sample) < rate)


def test_none_keeps_all_zero_keeps_none_and_validation_has_its_own_policy() -> None:
    sampler = Sampler(1, train=Policy(max_samples=0), validate=Policy())
    assert sampler.decide("exp", 1, False, 3) == (Fate.DROP, [])
    assert sampler.decide("exp", 1, True, 3) == (Fate.KEEP, [])


def test_another_seed_gives_another_selection() -> None:
    samples = [(1, s) for s in range(200)]
    a = kept_by(Sampler(1, Policy(max_samples=10)), samples)
    b = kept_by(Sampler(2, Policy(max_samples=10)), samples)
    assert len(a) == len(b) == 10 and a != b


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_samples": 2, "rate": 0.5}, "either"),
    ({"max_samples": -1}, "negative"),
    ({"rate": 1.5}, "between 0 and 1"),
])  # fmt: skip
def test_bad_policies(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 9), st.floats(0, 1), st.integers(0, 500), st.booleans())
def test_a_refusal_told_without_state_is_the_one_the_sampler_makes(
    seed: int, rate: float, sample: int, validate: bool
) -> None:
    """What the proxy decides alone (a rate, or no sample kept) is what the capture process's
    sampler decides; a top-N refusal is never told alone."""
    for policy in (Policy(rate=rate), Policy(max_samples=0), Policy(max_samples=3)):
        sampler = Sampler(seed, train=policy, validate=policy)
        alone = sampler.refused("exp", 4, validate, sample)
        assert sampler.refuses_alone == (policy.max_samples != 3)
        fate, _ = Sampler(seed, train=policy, validate=policy).decide("exp", 4, validate, sample)
        assert alone == (sampler.refuses_alone and fate is Fate.DROP)
