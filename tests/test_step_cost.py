"""The llama.cpp scheduler's measure of a step's cost, which decides how many of an embedding's or a
score's prompt rows a step that also decodes may carry (`StepCost`)."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from localrt.backends.llamacpp.scheduler import StepCost  # noqa: E402


def decoded(cost: StepCost, *seconds: float) -> StepCost:
    for s in seconds:
        cost.record(decode_rows=1, prompt_rows=0, seconds=s)
    return cost


def test_one_row_until_the_costs_are_measured() -> None:
    cost = decoded(StepCost(share=1.0), 0.020)
    assert cost.rows_within(48) == 1


def test_first_guess_from_a_prompt_only_step() -> None:
    cost = decoded(StepCost(share=2.0), 0.020)
    cost.record(decode_rows=0, prompt_rows=100, seconds=0.500)  # 5 ms a row
    assert cost.rows_within(48) == 8


def test_a_step_under_its_target_gets_more_rows() -> None:
    cost = decoded(StepCost(share=1.0), 0.020)
    cost.record(decode_rows=1, prompt_rows=2, seconds=0.028)  # 4 ms a row; the target is 40 ms
    assert cost.rows_within(48) == 5


def test_a_step_over_its_target_gets_fewer_rows() -> None:
    cost = decoded(StepCost(share=1.0), 0.020)
    cost.record(decode_rows=1, prompt_rows=0, seconds=0.020)
    cost.record(decode_rows=1, prompt_rows=10, seconds=0.060)  # 4 ms a row; 20 ms over the target
    assert cost.rows_within(48) == 5


def test_at_least_one_row_however_slow_the_step() -> None:
    cost = decoded(StepCost(share=1.0), 0.020)
    cost.record(decode_rows=1, prompt_rows=1, seconds=1.0)
    assert cost.rows_within(48) == 1


def test_no_more_than_the_cap() -> None:
    cost = decoded(StepCost(share=1.0), 0.020)
    cost.record(decode_rows=1, prompt_rows=10, seconds=0.021)
    assert cost.rows_within(48) == 48


def test_one_slow_decode_does_not_move_the_decode_cost() -> None:
    cost = decoded(StepCost(), 0.020, 0.021, 0.019, 0.104)
    assert cost.decode_s == pytest.approx(0.0205)
