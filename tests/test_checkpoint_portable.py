"""``gspo-reshard --portable-optimizer``: its bad inputs and its no-ops. The conversion itself
(a fast-form checkpoint rewritten, then resumed under EP2 x CP2 with the weights of an
unbroken run) is in tests/test_learner_learner.py, beside the checkpoints it converts."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.cli.reshard import main


def test_it_needs_the_runs_config(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--portable-optimizer", "--ckpt", "somewhere"])
    assert info.value.code == 2
    assert "--portable-optimizer needs --config" in capsys.readouterr().err


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("trainer:\n  num_steps: 3\n")
    code = main(["--portable-optimizer", "--ckpt", str(tmp_path / "nothing"),
                 "--config", str(tmp_path / "config.yaml")])
    assert code == 2
    assert f"{tmp_path}/nothing/gspo_meta.json: not a gspo-megatron checkpoint" in \
        capsys.readouterr().err


@pytest.mark.parametrize("meta", [{"has_optimizer": False}, {"has_optimizer": True},
                                  {"has_optimizer": True, "optimizer_form": "portable"}],
                         ids=["weights_only", "before_the_fast_form", "portable"])
def test_nothing_to_convert_is_a_no_op(tmp_path, meta, caplog):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "gspo_meta.json").write_text(json.dumps(
        {"format": "gspo-megatron-v1", "step": 3, "parallel": {"tp": 1, "pp": 1}, **meta}))
    (tmp_path / "config.yaml").write_text("trainer:\n  num_steps: 3\n")
    before = sorted(p.name for p in ckpt.iterdir())
    with caplog.at_level("INFO"):
        code = main(["--portable-optimizer", "--ckpt", str(ckpt),
                     "--config", str(tmp_path / "config.yaml")])
    assert code == 0 and sorted(p.name for p in ckpt.iterdir()) == before
    assert ("nothing to convert" in caplog.text) or ("portable form already" in caplog.text)
