"""experiments.lab.prefill_launch: a synchronous prefill engine's launch time per step, fitted per
prompt and written into a front host profile (the tiny model on the CPU)."""
import pytest

from experiments.lab.prefill_launch import fit, main
from sim.fleet.front_host import FrontHostProfile

PROFILE = FrontHostProfile(1e-3, 7e-5, 4e-5, 9e-4, 1.5e-4, 8e-5, meta=(("model", "tiny-llama"),), hop_s=9e-4)


def test_the_fit_is_a_line_through_the_medians_never_below_zero():
    assert fit({2: 0.001, 4: 0.0014, 8: 0.0022}) == pytest.approx((0.0006, 0.0002))
    assert fit({1: 0.002, 2: 0.001}) == pytest.approx((0.003, 0.0))  # a falling line: no per-prompt cost
    assert fit({4: 0.001}) == pytest.approx((0.001, 0.0))


def test_the_units_go_into_the_profile_and_its_other_units_stay(tmp_path, capsys):
    path = tmp_path / "front.csv"
    PROFILE.write(path)
    main(["--model", "tiny-llama", "--device", "cpu", "--prompts", "1,2", "--steps", "2", "--profile", str(path)])
    out = capsys.readouterr().out
    assert "tiny-llama, 2 prompts a step: launch median" in out and f"-> {path}" in out
    back = FrontHostProfile.read(path)
    assert back.launch_s is not None and back.launch_prompt_s is not None and back.launch_s + back.launch_prompt_s > 0
    assert {k: v for k, v in back.as_dict().items() if not k.startswith("launch")} == pytest.approx(PROFILE.as_dict())
    assert "prefill_launch --model tiny-llama" in dict(back.meta)["launch_from"]


@pytest.mark.parametrize("prompts", ["0,2", "two", ""])
def test_bad_prompt_counts_are_refused_before_any_run(prompts, capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-llama", "--device", "cpu", "--prompts", prompts])
    assert "--prompts" in capsys.readouterr().err
