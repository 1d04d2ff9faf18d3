"""``tpflow components`` lists the stages a settings section selects (kind ``stage``: the prompt policy, replay)
beside the registered components, each with its options, so that every method's part is found in one listing."""

from __future__ import annotations

from tests.cli_run import tpflow


def test_the_stages_are_listed_with_their_options():
    out = tpflow("components", "stage")
    assert out.returncode == 0, out.stderr
    assert "prompt-policy" in out.stdout and "'ability-matched'" in out.stdout and "prompt_candidates" in out.stdout
    assert "built-in tpflow/train/replay.py" in out.stdout and "capacity: int = 0" in out.stdout
    assert "cps" not in out.stdout  # only the kind asked for
    everything = tpflow("components", columns="100")
    assert "stage prompt-policy" in everything.stdout and "stage replay" in everything.stdout


def test_one_stage_and_an_unknown_one():
    one = tpflow("components", "stage", "replay")
    assert one.returncode == 0 and "min_advantage" in one.stdout and "prompt_policy" not in one.stdout, one.stdout
    unknown = tpflow("components", "stage", "replays")
    assert unknown.returncode == 2 and "the stages are prompt-policy, replay" in unknown.stderr, unknown.stderr
