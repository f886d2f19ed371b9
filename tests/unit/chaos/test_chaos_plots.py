"""Plots write non-empty PNG files for simulated and measured results."""

import pytest

from cfdist.chaos import Costs, Exponential, FixedK, compare, metrics_from_log
from cfdist.chaos.plots import plot_goodput, plot_lost_work, plot_progress, plot_recovery, plot_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results():
    costs = Costs(iter_s=0.5, stall_s=0.1, persist_s=2.0, restore_s=3.0, restart_s=5.0, detect_s=2.0)
    sims = compare(Exponential(200.0, seed=1, return_after_s=30.0), [FixedK(k=10), FixedK(k=500)], costs=costs,
                   nodes=2, horizon_s=3_000.0)
    quiet = metrics_from_log([{"t": 0.0, "event": "step", "step": 0}, {"t": 5.0, "event": "end", "step": 10}],
                             iter_s=0.5, label="no failures")
    return [*sims, quiet]


@pytest.mark.parametrize("plot", [plot_progress, plot_goodput, plot_lost_work, plot_recovery, plot_summary])
def test_plot_writes_a_png(plot, results, tmp_path):
    path = str(tmp_path / f"{plot.__name__}.png")
    assert plot(results, path) == path
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_goodput([], str(tmp_path / "x.png"))
