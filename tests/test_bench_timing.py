"""`python -m bench timing`'s figures: how alike two timings of the same programs rank them."""
from __future__ import annotations

import numpy as np
import pytest

from bench.timing import main, protocol_row


def test_agreement_counts_the_pairs_two_timings_order_alike():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert protocol_row([a, a * 1.5])["agreement"] == 1.0
    assert protocol_row([a, a[::-1]])["agreement"] == 0.0
    assert protocol_row([a, np.array([1.0, 3.0, 2.0, 4.0])])["agreement"] == pytest.approx(5 / 6)   # 1 of 6 swapped


def test_protocol_row_reads_the_faster_half_and_the_spread_of_each_program():
    fast_swapped = [np.array([1.0, 1.1, 5.0, 6.0]), np.array([1.1, 1.0, 5.0, 6.0]), np.array([1.0, 1.1, 5.0, 6.0])]
    row = protocol_row(fast_swapped)
    assert row["agreement"] == pytest.approx((5 / 6 + 1 + 5 / 6) / 3)
    assert row["agreement_min"] == pytest.approx(5 / 6) and row["agreement_max"] == 1.0
    assert row["faster_half_agreement"] == pytest.approx(1 / 3)     # the two fast ones, swapped in 2 of 3
    assert row["log_sd"] > 0
    assert protocol_row([np.array([1.0, 2.0])] * 3)["log_sd"] == 0.0


@pytest.mark.parametrize("argv, says", [(["--programs", "1"], "--programs"), (["--timings", "1"], "--timings"),
                                        (["--trials", "8", "--programs", "16"], "--trials"),
                                        (["--workloads", "nope"], "--workloads nope")])
def test_bad_arguments_get_one_line_and_exit_2(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
