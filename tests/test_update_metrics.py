"""How the update metrics of several processes become the epoch's one line (``combine_update_metrics``)."""

from __future__ import annotations

import pytest

from tpflow.train.epoch import combine_update_metrics


def test_means_weigh_each_process_by_the_rows_it_trained():
    """Process 1 trained 30 rows, process 0 trained 10: the clip fraction of the 40 rows is 0.4, not 0.3."""
    combined = combine_update_metrics([
        {"clip_fraction": 0.1, "rows_trained": 10.0, "optimizer_steps": 2.0, "nonfinite_losses": 0.0},
        {"clip_fraction": 0.5, "rows_trained": 30.0, "optimizer_steps": 2.0, "nonfinite_losses": 1.0},
    ])  # fmt: skip
    assert combined["clip_fraction"] == pytest.approx((0.1 * 10 + 0.5 * 30) / 40)
    assert combined["rows_trained"] == 40.0 and combined["nonfinite_losses"] == 1.0  # summed
    assert combined["optimizer_steps"] == 2.0  # the same steps on every process: the largest


def test_without_row_counts_each_process_counts_once():
    combined = combine_update_metrics([{"grad_norm": 1.0}, {"grad_norm": 3.0}])
    assert combined["grad_norm"] == 2.0
    idle = combine_update_metrics([{"loss": 0.2, "rows_trained": 0.0}, {"loss": 0.4, "rows_trained": 0.0}])
    assert idle["loss"] == pytest.approx(0.3)  # nothing trained anywhere: plain mean, no division by zero
