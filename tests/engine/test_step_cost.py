"""StepCost (pdserve/step_cost.py): the time a worker predicts for its next step, from its own
recent steps; the gateway takes a step far past it for a stuck engine."""

from __future__ import annotations

import pytest

from pdserve.step_cost import UNMEASURED_S_PER_TOKEN, UNMEASURED_STEP_S, StepCost


def test_before_any_step_the_prediction_is_the_long_default():
    cost = StepCost()
    assert cost.predict(1) == UNMEASURED_STEP_S + UNMEASURED_S_PER_TOKEN
    assert cost.predict(1024) == UNMEASURED_STEP_S + 1024 * UNMEASURED_S_PER_TOKEN
    cost.observe(0, 5.0)  # a step of no tokens teaches nothing
    assert cost.predict(1) == UNMEASURED_STEP_S + UNMEASURED_S_PER_TOKEN


def test_the_tightest_bound_of_the_recent_steps():
    cost = StepCost()
    cost.observe(1, 0.1)  # a decode step: 0.1 s per token, or less in a bigger step
    assert cost.predict(1) == pytest.approx(0.1)
    assert cost.predict(1024) == pytest.approx(102.4)
    cost.observe(1024, 2.0)  # a prefill chunk: no step of at most 1,024 tokens takes longer
    assert cost.predict(1024) == pytest.approx(2.0)
    assert cost.predict(2048) == pytest.approx(4.0)  # its cost per token, twice the tokens
    assert cost.predict(1) == pytest.approx(0.1)  # the decode step's own bound is tighter
    assert cost.predict(512) == pytest.approx(2.0)


def test_only_the_recent_steps_count():
    cost = StepCost(window=2)
    cost.observe(100, 0.01)
    cost.observe(1, 0.5)
    cost.observe(1, 0.5)  # the fast 100-token step has left the window
    assert cost.predict(100) == pytest.approx(50.0)
