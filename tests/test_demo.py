"""`make demo`'s latency summary (examples/demo_check.py): the spread of both runtimes, a ratio that a busy
machine does not turn into nonsense, and a warning when the timings were disturbed. Synthetic timings: no torch."""
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import load_script
from kiln.runtime.cli import format_latency

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "demo_check.py"


@pytest.fixture(scope="module")
def demo():
    return load_script(SCRIPT, "demo_check")


def quiet(base_ms: float, runs: int = 200, seed: int = 0) -> np.ndarray:
    """An idle machine: every run within a few percent of the base, a rare small hiccup."""
    ms = base_ms * (1 + 0.05 * np.random.default_rng(seed).random(runs))
    ms[::50] *= 1.8
    return ms


def busy(base_ms: float, runs: int = 200, seed: int = 1) -> np.ndarray:
    """The issue's run: most calls preempted (median 60 ms), a few untouched (min 0.40 ms)."""
    rng = np.random.default_rng(seed)
    ms = base_ms * (1 + 0.05 * rng.random(runs))
    hit = rng.random(runs) < 0.7
    ms[hit] += rng.uniform(55, 90, hit.sum())
    return ms


def test_the_line_kiln_run_prints_parses_back(demo):
    ms = np.array([0.41, 0.5, 0.45, 60.0, 0.43, 12.5, 0.47, 0.44, 0.46, 0.42])
    got = demo.kiln_latency("wrote 1 output(s)\n" + format_latency(ms / 1e3, warmup=3) + "\n")
    want = demo.Latency.of(ms)
    assert got.runs == 10
    for field in ("min", "median", "p90", "max"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), abs=1e-4), field


def test_a_log_without_the_latency_line_says_what_to_run(demo):
    with pytest.raises(SystemExit, match=r"no latency line .* in run.txt: run `kiln run \.\.\. --repeat N`"):
        demo.kiln_latency("wrote 1 output(s) to out.npz: y\n", "run.txt")


def test_quiet_timings_give_the_ratio_and_no_warning(demo):
    kiln, eager = demo.Latency.of(quiet(0.40)), demo.Latency.of(quiet(0.50, seed=2))
    assert kiln.disturbance() is None and eager.disturbance() is None
    lines = demo.latency_report(kiln, eager)
    assert lines[0].split() == ["ms", "min", "median", "p90", "max"]
    assert lines[1].split()[:2] == ["kiln", "run"] and float(lines[1].split()[-1]) == pytest.approx(kiln.max, 1e-3)
    assert lines[2].split()[:2] == ["torch", "eager"]
    assert f"kiln / torch  {kiln.min / eager.min:.2f}x by the minimums" in lines[3]
    assert not any("warning" in line for line in lines)


def test_busy_timings_warn_and_the_headline_uses_the_minimums(demo):
    """The issue's case: kiln's median 60 ms against a minimum of 0.40 ms printed `kiln / torch 105x`."""
    kiln, eager = demo.Latency.of(busy(0.40)), demo.Latency.of(quiet(0.50))
    assert kiln.median > 50 and kiln.min < 0.45
    text = "\n".join(demo.latency_report(kiln, eager))
    assert "kiln / torch  0.80x by the minimums" in text
    assert f"by the medians {kiln.median / eager.median:.2f}x" in text  # shown, but not as the result
    assert "warning   the machine was busy, so timings vary: kiln's median is" in text
    assert "torch's" not in text.split("warning")[1].split("\n")[0]  # torch's own timings were fine
    assert "Compare the minimums" in text


def test_a_long_tail_alone_is_disturbance_too(demo):
    """Median close to the minimum but a fifth of the runs slowed 10x: the p90 gives it away."""
    ms = quiet(1.0)
    ms[::5] *= 10
    t = demo.Latency.of(ms)
    assert t.median < demo.BUSY_MEDIAN * t.min
    assert t.disturbance().startswith("p90 is ")
    assert "torch's p90 is" in "\n".join(demo.latency_report(demo.Latency.of(quiet(1.0)), t))


def test_a_minimum_printed_as_zero_does_not_crash(demo):
    t = demo.Latency(10, 0.0, 0.0001, 0.0001, 0.0002)
    assert "inf" in "\n".join(demo.latency_report(t, t))
