"""Group privacy (sparta_tf.privacy.group_privacy): the closed form equals the chain of one-example steps it
comes from, k = 1 is the guarantee itself, and the dry run's sentence says when nothing is left."""

import math

import pytest

from sparta_tf.privacy.group_privacy import describe_group_guarantee, group_guarantee


def _chained(epsilon, delta, k):
    """The chain D_0 .. D_k one example apart, one step at a time: (e_1, d_1) = (epsilon, delta),
    (e_{j+1}, d_{j+1}) = (e_j + epsilon, e^epsilon d_j + delta)."""
    e, d = epsilon, delta
    for _ in range(k - 1):
        e, d = e + epsilon, math.exp(epsilon) * d + delta
    return e, d


@pytest.mark.parametrize("epsilon, delta, k", [(4.0, 1e-5, 10), (0.5, 1e-6, 3), (8.0, 1e-5, 2), (1.0, 0.0, 7),
                                               (0.0, 1e-5, 4)])
def test_the_closed_form_is_the_chain_of_one_example_steps(epsilon, delta, k):
    assert group_guarantee(epsilon, delta, k) == pytest.approx(_chained(epsilon, delta, k), rel=1e-12, abs=0)
    assert group_guarantee(epsilon, delta, 1) == (epsilon, delta)


def test_it_is_tighter_than_the_textbook_bound_and_overflows_to_inf():
    epsilon, delta, k = 2.0, 1e-6, 5
    assert group_guarantee(epsilon, delta, k)[1] <= k * math.exp((k - 1) * epsilon) * delta
    assert group_guarantee(8.0, 1e-5, 200) == (1600.0, math.inf)


def test_the_dry_run_sentence_says_what_is_left_for_a_person():
    line = describe_group_guarantee(4.0, 1e-5, 10)
    assert "a person with 10 examples only through group privacy, which says nothing about them" in line
    assert "leaves them (epsilon 2, delta 3.72e-06)" in describe_group_guarantee(1.0, 1e-6, 2)


@pytest.mark.parametrize("args, message", [((1.0, 1e-5, 0), "group_size=0"), ((1.0, 1e-5, 2.5), "group_size=2.5"),
                                           ((math.inf, 1e-5, 2), "finite epsilon"), ((1.0, 2.0, 2), "delta in")])
def test_bad_arguments_are_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        group_guarantee(*args)
