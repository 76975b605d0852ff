"""Layout search: every layout it proposes is one the config validation accepts, the ranking
puts fitting plans first, each plan's overrides load and fit, and it is fast."""

from __future__ import annotations

import time

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.planner.model_shape import ModelShape
from gspo_megatron.planner.plan import hardware_from_config
from gspo_megatron.planner.search import learner_layouts, search
from tests.test_config import REPO


@pytest.mark.parametrize("config", ["qwen3_30b_a3b_gspo.yaml", "qwen3_235b_a22b_gspo.yaml"])
def test_every_enumerated_layout_validates(config):
    path = REPO / "configs" / config
    cfg = load_config(path)
    layouts = list(learner_layouts(ModelShape.from_model_config(cfg.model), 32, 8))
    assert len(layouts) > 10
    for layout in layouts[::7]:
        load_config(path, layout.overrides())


@pytest.mark.parametrize("config,nodes", [("qwen3_30b_a3b_gspo.yaml", 4),
                                          ("qwen3_235b_a22b_gspo.yaml", 8)])
def test_ranked_plans_fit_and_their_overrides_load(config, nodes):
    path = REPO / "configs" / config
    cfg = load_config(path)
    start = time.process_time()
    plans = search(cfg, hardware_from_config(cfg), nodes, top=3, search_optimizer=True)
    assert time.process_time() - start < 3.0
    assert plans and all(p.fits for p in plans)
    assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)
    for plan in plans:
        assert plan.layout.world_size + plan.num_servers * plan.server_tp <= nodes * 8
        load_config(path, plan.overrides())  # validates and passes the fit check


def test_nothing_fits_on_too_few_gpus():
    cfg = load_config(REPO / "configs" / "qwen3_235b_a22b_gspo.yaml")
    plans = search(cfg, hardware_from_config(cfg), 2, top=2)
    assert plans and not any(p.fits for p in plans)
