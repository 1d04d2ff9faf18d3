"""The combination matrix in the suite (tests/combinations.py): a pairwise covering design over the single-process
factors on the embedded backbone, each combination refused by the recipe check in one paragraph, or training with
the reference's first-step gradient and finite weights after one non-finite trajectory: GARDO's parts (grpo, nft),
the prompt policies and the replay buffer among the factors (their single refusals are their own tests':
test_gardo*.py, test_prompt_policy.py, test_replay.py). The benchmark
(benchmarks/combinations.py) runs the larger matrix (the tiny SD3 and FLUX twins, compiled blocks) and writes its
table to docs/testing.md."""

from __future__ import annotations

import itertools

import pytest

from tests.combinations import MUST_TRAIN, REFERENCE, SUITE_FACTORS, SUITE_ROWS, judge, recipe_text


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("matrix")
    path = folder / "tiny.toml"
    path.write_text(recipe_text(folder / "run"))
    return path


def test_the_suites_rows_cover_every_pair_of_levels():
    """A level added to a factor (a new option or mode) fails here until ``benchmarks/combinations.py --suite-rows``
    writes rows that cover it: a new option enters the matrix to land."""
    names = list(SUITE_FACTORS)
    rows = [dict(zip(names, row, strict=True)) for row in SUITE_ROWS]
    assert all(row[n] in SUITE_FACTORS[n] for row in rows for n in names)
    missing = [((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in SUITE_FACTORS[a]
               for y in SUITE_FACTORS[b] if not any(row[a] == x and row[b] == y for row in rows)]  # fmt: skip
    assert not missing, f"{len(missing)} pairs uncovered, e.g. {missing[:3]}"


def test_every_pair_of_options_is_right_or_refused(recipe, tiny_weights):
    """No combination of the design fails; a reference configuration (native, fp32) is accepted (a harness that
    refused everything would pass nothing), and so are most rows."""
    cache: dict = {}
    outcomes = [judge({**dict(zip(SUITE_FACTORS, row, strict=True)), "compile": "off"}, recipe, tiny_weights, cache)
                for row in SUITE_ROWS]  # fmt: skip
    failed = [f"{o.combo}: {o.detail}" for o in outcomes if o.status == "FAILED"]
    assert not failed, "\n".join(failed)
    assert any(o.status == "accepted" and all(o.combo[k] == v for k, v in REFERENCE.items()) for o in outcomes)
    assert sum(o.status == "accepted" for o in outcomes) >= 6, [(o.combo, o.detail) for o in outcomes]
    trained = [o.combo for o in outcomes if o.status == "accepted"]
    for levels in MUST_TRAIN:  # each trains in some accepted row, not only refused
        assert any(all(c[k] == v for k, v in levels.items()) for c in trained), levels
