"""one_step_off on Ray with separate placement (1 training + 1 rollout actor on CPU): the next
batch generates on the rollout actor while the step trains, and step k trains on version k - 1."""

from __future__ import annotations

import pytest
from test_async_loop import FAST
from test_trainer_loop import read_metrics, tiny_cfg

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.trainer.run import run  # noqa: E402


@pytest.mark.slow  # a Ray start: 30-90 s on 2 cores
def test_one_step_off_on_separate_ray_actors(tiny_checkpoint, tmp_path):
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        cfg = tiny_cfg(
            tiny_checkpoint,
            tmp_path / "r",
            *FAST,
            "trainer.total_steps=3",
            "trainer.mode=one_step_off",
            "cluster.mode=ray",
            "cluster.placement=separate",
            "cluster.rollout_workers=1",
        )
        run(cfg)
    finally:
        ray.shutdown()
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    for k, m in enumerate(records):
        assert m["async/version_min"] == m["async/version_max"] == max(k - 1, 0), (k, m)
        gap = m["is/mean_abs_logp_diff"]  # the behaviour policy is older than the trained one
        assert (gap > 1e-3) if k else (gap < 1e-4), (k, gap)
