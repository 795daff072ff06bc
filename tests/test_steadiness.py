"""loadtest/steadiness.py: the machine-steadiness probe's summary of window counts, and the probe itself."""

from __future__ import annotations

import pytest

from loadtest.steadiness import Steadiness, measure, speed_counts, summarize


def test_a_steady_machine_has_no_slow_windows() -> None:
    s = summarize([100] * 100)
    assert (s.slow_share, s.spells, s.episodes, s.longest_ms, s.spacing_s) == (0.0, 0, 0, 0.0, None)
    assert s.windows == 100 and s.seconds == pytest.approx(1.0)


def test_slow_spells_are_counted_and_grouped_into_episodes() -> None:
    counts = [100] * 100
    counts[10:13] = [20, 20, 20]  # a 30 ms spell
    counts[15:17] = [30, 30]  # a second spell 50 ms after the first starts: the same episode
    counts[60:62] = [10, 10]  # a new episode 0.5 s after the first
    counts[80] = 40  # one slow window: slow, but no spell
    counts[90] = 60  # over half speed: not slow
    s = summarize(counts)
    assert s.slow_share == pytest.approx(8 / 100)
    assert s.spells == 3 and s.longest_ms == pytest.approx(30.0)
    assert s.episodes == 2 and s.spacing_s == pytest.approx(0.5)
    assert "8.0 % of 100 windows" in s.describe() and "about every 0.5 s" in s.describe()


def test_the_reference_is_the_usual_speed_not_the_fastest_window() -> None:
    counts = [100] * 100
    counts[0] = 1000  # one window far faster than the rest makes none of the others slow
    assert summarize(counts).slow_share == 0.0


def test_a_spell_at_the_end_counts() -> None:
    s = summarize([100] * 8 + [10, 10])
    assert s.spells == 1 and s.episodes == 1 and s.longest_ms == pytest.approx(20.0)
    assert "1 slow spell of 20 ms" in s.describe() and "in 1 episode (" in s.describe()


def test_the_probe_runs_for_the_time_asked() -> None:
    counts = speed_counts(0.05, window_s=0.01)
    assert len(counts) == 5 and sum(counts) > 0  # a window may be empty if the machine stalls through it
    s = measure(0.05)
    assert isinstance(s, Steadiness) and s.windows == 5 and 0.0 <= s.slow_share <= 1.0
    assert set(s.plain()) >= {"slow_share", "episodes", "spacing_s"}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        speed_counts(0)
    with pytest.raises(ValueError):
        summarize([])
