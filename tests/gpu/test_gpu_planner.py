"""`ddplab plan --calibrate` on a GPU: the planner's efficiency and overhead fitted on this
GPU's own steps at two widths, then checked on steps it did not see.

On an H200 the reference is the table the H100/H200 presets were fitted on
(`ddplab.planning.steps`, measured 2026-11-28): a calibrated plan of each of those shapes
lands within 10 % of the step measured then. On any other GPU, a third width timed here.
"""

from __future__ import annotations

import pytest
import torch

from ddplab.planning import calibrate, steps

pytestmark = pytest.mark.gpu


def test_a_calibrated_plan_predicts_steps_it_did_not_see() -> None:
    found = calibrate.measure("cuda")
    print(found.table())
    assert 0.2 < found.cluster.efficiency <= 1 and found.cluster.overhead >= 0
    for hidden, seconds in found.steps.items():  # two widths, two unknowns: fitted
        assert found.predict(hidden) == pytest.approx(seconds, rel=0.05)
    if "H200" in torch.cuda.get_device_name():
        for row in steps.STEPS:
            ratio = row.predict(found.cluster).step / row.seconds
            print(f"{row.model.name} {row.mode}: planned ÷ measured on 2026-11-28 {ratio:.2f}")
            assert abs(ratio - 1) <= 0.10, (row.model.name, row.mode, ratio)
    else:
        got, planned = found.check(3072)
        print(found.table())
        assert abs(planned / got - 1) <= 0.10
