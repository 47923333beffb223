"""Which model a run starts from (the launcher's `prepare_model`)."""

from __future__ import annotations

import pytest

from rollwire.services.app.launcher import LaunchError, prepare_model
from rollwire.services.core.config import RunConfig


def config(**sections) -> RunConfig:
    return RunConfig.model_validate(sections)


def test_trainer_model_path_is_the_runs_model(tiny_model_path, capsys) -> None:
    path = prepare_model(config(trainer={"model_path": str(tiny_model_path)}))
    assert path == tiny_model_path
    assert "warm-up skipped" in capsys.readouterr().out


def test_either_model_path_names_the_same_model(tiny_model_path) -> None:
    both = {"model_path": str(tiny_model_path)}
    assert prepare_model(config(rollout_server=both, trainer=both)) == tiny_model_path
    assert prepare_model(config(rollout_server=both), progress=False) == tiny_model_path


def test_two_different_models_are_a_clear_error(tiny_model_path, tmp_path) -> None:
    with pytest.raises(LaunchError, match="name different models"):
        prepare_model(
            config(
                rollout_server={"model_path": str(tiny_model_path)},
                trainer={"model_path": str(tmp_path)},
            )
        )


def test_a_folder_that_is_no_model_is_named(tmp_path) -> None:
    with pytest.raises(LaunchError, match=r"trainer.model_path .* \(no config.json\)"):
        prepare_model(config(trainer={"model_path": str(tmp_path)}))


def test_a_backend_the_trainer_cannot_run_yet_is_refused_before_anything_starts(
    tmp_path, capsys
) -> None:
    """A validated setting that the trainer would ignore is an error, not a silent `local`."""
    import signal

    from rollwire.services.app.run import run_train

    run = config(trainer={"backend": "fsdp2"}, run={"output_dir": str(tmp_path / "run")})
    handler = signal.getsignal(signal.SIGTERM)  # run_train turns SIGTERM into Ctrl-C
    try:
        assert run_train(run) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert "trainer.backend=fsdp2" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()
