"""bench/bench_timing.interleaved, the loop every Python benchmark times with: the order it
runs its functions in and what it returns (on a fake clock: no timing is asserted)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from bench_timing import interleaved  # noqa: E402


class FakeClock:
    """Time that advances only by what the functions it runs say they take."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def __call__(self):
        return self.now

    def fn(self, name, seconds):
        def run():
            self.calls.append(name)
            self.now += seconds
        return run


def test_each_function_goes_first_in_turn_and_its_median_comes_back():
    clock = FakeClock()
    fns = [clock.fn(n, s) for n, s in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    assert interleaved(fns, rounds=3, clock=clock) == [1.0, 2.0, 3.0]
    warm_up, rounds = clock.calls[:3], clock.calls[3:]
    assert warm_up == ["a", "b", "c"]
    assert rounds == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_the_probe_opens_every_round_and_precedes_each_function_equally_often():
    clock = FakeClock()
    fns = [clock.fn(n, s) for n, s in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    times = interleaved(fns, rounds=6, clock=clock, probe=clock.fn("probe", 0.5))
    assert times == [1.0, 2.0, 3.0, 0.5]  # the probe's median last
    rounds = clock.calls[3:]  # after the warm-up, which runs no probe
    assert len(rounds) == 6 * 4
    assert [rounds[i] for i in range(0, len(rounds), 4)] == ["probe"] * 6
    after_probe = [rounds[i + 1] for i in range(0, len(rounds), 4)]
    assert sorted(after_probe) == ["a", "a", "b", "b", "c", "c"]
    # and never between two functions of a round
    assert all(x != "probe" for i, x in enumerate(rounds) if i % 4)
