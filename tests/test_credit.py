"""Credit assigners against docs/algorithm.md §9 (worked examples, invariants) and §8 D3-D5."""

from __future__ import annotations

import re

import pytest
import torch

import tpflow
from tpflow.credit import ConsistentCredit, IncrementalCredit, OutcomeCredit, TurningPointCredit
from tpflow.credit.balance import balance
from tpflow.credit.trend import trend
from tpflow.errors import UserError
from tpflow.interfaces import CreditAssigner

NAMES = ["outcome", "incremental", "turning_point", "consistent"]
TURNING = ["turning_point", "consistent"]

EXAMPLE_1 = [[50, 46, 40, 47, 52, 55]]
EXAMPLE_2 = [[30, 50, 40, 48, 34, 36]]
EXAMPLE_3 = [
    [40, 37, 45, 48, 49, 50],  # A: Δ = +10
    [60, 62, 61, 63, 64, 64],  # B: Δ = +4
    [70, 72, 74, 71, 68, 66],  # C: Δ = −4
]


def _trace(rows: list[list[int]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def _check(credit, rewards: list[list[int]], turning_points: list[list[int]]) -> None:
    assert credit.step_rewards.tolist() == rewards
    assert torch.equal(credit.turning_points, _mask(turning_points))


# --- docs/algorithm.md §9 worked examples -------------------------------------------------------------------------


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("first_step", [True, False])
@pytest.mark.parametrize("name", TURNING)
def test_example_1_one_good_turning_point(name: str, balanced: bool, first_step: bool) -> None:
    # Published = w/o = Def4.1-paper; i = 0 fails both first-step rules, so first_step does not matter.
    credit = tpflow.build("credit", name, balanced=balanced, first_step=first_step)(_trace(EXAMPLE_1))
    _check(credit, [[-4, -6, 15, 5, 3]], [[0, 0, 1, 0, 0]])


def test_example_1_outcome_and_incremental() -> None:
    _check(tpflow.build("credit", "outcome")(_trace(EXAMPLE_1)), [[55] * 5], [[0] * 5])
    _check(tpflow.build("credit", "incremental")(_trace(EXAMPLE_1)), [[-4, -6, 7, 5, 3]], [[0] * 5])


@pytest.mark.parametrize("balanced", [True, False])
def test_example_2_def41_paper(balanced: bool) -> None:
    # "I Def4.1-paper" / "r Def4.1-paper": i = 2 is a code-mode turning point whose a_2 = −4 flips the sign of
    # d_2 = +8; Definition 4.1's third condition rejects it. One trajectory: balancing changes nothing.
    credit = tpflow.build("credit", "turning_point", balanced=balanced)(_trace(EXAMPLE_2))
    _check(credit, [[6, -10, 8, -14, 2]], [[1, 0, 0, 0, 1]])


@pytest.mark.parametrize("balanced", [True, False])
def test_example_2_def41_paper_without_first_step(balanced: bool) -> None:
    credit = tpflow.build("credit", "turning_point", balanced=balanced, first_step=False)(_trace(EXAMPLE_2))
    _check(credit, [[20, -10, 8, -14, 2]], [[0, 0, 0, 0, 1]])  # i = 0 keeps d_0 = 20


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("first_step", [True, False])
def test_example_2_published(balanced: bool, first_step: bool) -> None:
    credit = tpflow.build("credit", "consistent", balanced=balanced, first_step=first_step)(_trace(EXAMPLE_2))
    _check(credit, [[20, -10, 8, -14, 2]], [[0] * 5])


def test_example_2_outcome_and_incremental() -> None:
    _check(tpflow.build("credit", "outcome")(_trace(EXAMPLE_2)), [[36] * 5], [[0] * 5])
    _check(tpflow.build("credit", "incremental")(_trace(EXAMPLE_2)), [[20, -10, 8, -14, 2]], [[0] * 5])


@pytest.mark.parametrize("name", TURNING)
def test_example_3_balanced(name: str) -> None:
    # Candidates c = Δ_b at flat indices {1: +10, 5: +4, 7: +4, 12: −4}; m = 1 keeps flat 1 and flat 12.
    credit = tpflow.build("credit", name)(_trace(EXAMPLE_3))
    _check(
        credit,
        [[-3, 13, 3, 1, 1], [2, -1, 2, 1, 0], [2, 2, -8, -3, -2]],
        [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0]],
    )


@pytest.mark.parametrize("name", TURNING)
def test_example_3_balancing_off(name: str) -> None:
    credit = tpflow.build("credit", name, balanced=False)(_trace(EXAMPLE_3))
    _check(
        credit,
        [[-3, 13, 3, 1, 1], [4, -1, 3, 1, 0], [2, 2, -8, -3, -2]],
        [[0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 1, 0, 0]],
    )


@pytest.mark.parametrize("name", TURNING)
def test_example_3_without_first_step(name: str) -> None:
    unbalanced = tpflow.build("credit", name, balanced=False, first_step=False)(_trace(EXAMPLE_3))
    _check(
        unbalanced,
        [[-3, 13, 3, 1, 1], [2, -1, 3, 1, 0], [2, 2, -8, -3, -2]],
        [[0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 0, 0]],
    )
    balanced = tpflow.build("credit", name, first_step=False)(_trace(EXAMPLE_3))  # {1: +10, 7: +4, 12: −4}
    _check(
        balanced,
        [[-3, 13, 3, 1, 1], [2, -1, 2, 1, 0], [2, 2, -8, -3, -2]],
        [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0]],
    )


def test_example_3_outcome_and_incremental() -> None:
    _check(tpflow.build("credit", "outcome")(_trace(EXAMPLE_3)), [[50] * 5, [64] * 5, [66] * 5], [[0] * 5] * 3)
    _check(
        tpflow.build("credit", "incremental")(_trace(EXAMPLE_3)),
        [[-3, 8, 3, 1, 1], [2, -1, 2, 1, 0], [2, 2, -3, -3, -2]],
        [[0] * 5] * 3,
    )


def test_trend_of_example_2() -> None:
    t = trend(_trace(EXAMPLE_2))
    assert t.d.tolist() == [[20, -10, 8, -14, 2]]
    assert t.delta.tolist() == [6]
    assert t.g.tolist() == [[1, -1, 1, -1, 1]]
    assert t.a.tolist() == [[6, -14, -4, -12, 2, 0]]


# --- balancing: tie-breaking and edge cases ------------------------------------------------------------------------


@pytest.mark.parametrize("name", TURNING)
def test_ties_in_delta_go_to_the_lower_flat_index(name: str) -> None:
    # B from Example 3 alone has two turning points with c = +4 (flat 0 and 2); C has one with c = −4 (flat 7).
    credit = tpflow.build("credit", name)(_trace(EXAMPLE_3[1:]))
    _check(credit, [[4, -1, 2, 1, 0], [2, 2, -8, -3, -2]], [[1, 0, 0, 0, 0], [0, 0, 1, 0, 0]])
    # Across trajectories: two copies of Example 1 (Δ = +5, turning point at i = 2) and one mirrored copy (Δ = −5).
    # The copy in the lower row wins, whichever row the negative trajectory sits in.
    good, bad = EXAMPLE_1[0], [100 - r for r in EXAMPLE_1[0]]
    for rows, kept_row in [([good, good, bad], 0), ([bad, good, good], 1), ([good, bad, good], 0)]:
        selection = tpflow.build("credit", name)(_trace(rows)).turning_points
        expected = torch.zeros(3, 5, dtype=torch.bool)
        expected[kept_row, 2] = True
        expected[rows.index(bad), 2] = True
        assert torch.equal(selection, expected), rows


def test_balance_keeps_largest_magnitude_then_lowest_index() -> None:
    selected = _mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    c = torch.tensor([[5.0, -2.0, 9.0], [0.0, -2.0, 3.0], [-7.0, 0.0, 3.0]])
    # positives among selected: flat 0 (5), 5 (3), 8 (3); negatives: flat 1 (−2), 4 (−2), 6 (−7). m = 3: all kept.
    assert torch.equal(balance(selected, c), _mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]))
    c[2, 0] = 1.0  # now 4 positives (5, 3, 3, 1) and 2 negatives (−2, −2): keep 5 and the first 3 (flat 5)
    assert torch.equal(balance(selected, c), _mask([[1, 1, 0], [0, 1, 1], [0, 0, 0]]))
    c[1, 2] = -4.0  # positives 5, 3 (flat 8), 1; negatives −2, −2, −4: m = 3 keeps everything but c = 0
    selected[1, 0] = True  # a selected entry with c = 0 is always dropped
    assert torch.equal(balance(selected, c), _mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]))


def test_balance_leaves_one_sided_selections_alone() -> None:
    selected = _mask([[1, 0, 1], [0, 1, 0]])
    for c in (torch.tensor([3.0, 1.0]), torch.tensor([-3.0, 0.0]), torch.tensor([0.0, 0.0])):
        kept = balance(selected, c)
        assert torch.equal(kept, selected)
        assert kept is not selected
    empty = torch.zeros(0, 4, dtype=torch.bool)
    assert balance(empty, torch.zeros(0)).shape == (0, 4)


# --- docs/algorithm.md §9 invariants on random integer traces ------------------------------------------------------


def _random_traces(count: int = 500, n: int = 8, w: int = 5, high: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, high, (count, n, w + 1), generator=generator).to(torch.float64)


def _sgn(x: float) -> int:
    return (x > 0) - (x < 0)


def _reference_selection(rows: list[list[float]], consistent: bool, first_step: bool) -> list[list[bool]]:
    """docs/algorithm.md §4.1 / §4.4 written out scalar by scalar, as an independent oracle."""
    out = []
    for r in rows:
        w = len(r) - 1
        d = [r[i + 1] - r[i] for i in range(w)]
        a = [r[w] - r[j] for j in range(w + 1)]
        g = [_sgn(d[i]) * _sgn(r[w] - r[0]) for i in range(w)]
        sel = []
        for i in range(w):
            if i == 0:
                rule = _sgn(d[0]) * _sgn(a[1]) > 0 if consistent else g[0] > 0
                sel.append(first_step and rule)
            else:
                third = _sgn(d[i]) * _sgn(a[i + 1] if consistent else a[i]) > 0
                sel.append(g[i - 1] < 0 and g[i] > 0 and third)
        out.append(sel)
    return out


def _reference_balance(rows: list[list[float]], sel: list[list[bool]]) -> list[list[bool]]:
    w = len(sel[0])
    cands = [(b * w + i, r[-1] - r[0]) for b, r in enumerate(rows) for i in range(w) if sel[b][i]]
    pos = sorted([x for x in cands if x[1] > 0], key=lambda x: (-abs(x[1]), x[0]))
    neg = sorted([x for x in cands if x[1] < 0], key=lambda x: (-abs(x[1]), x[0]))
    if not pos or not neg:
        return sel
    m = min(len(pos), len(neg))
    keep = {flat for flat, _ in pos[:m] + neg[:m]}
    return [[b * w + i in keep for i in range(w)] for b in range(len(sel))]


@pytest.mark.parametrize("name", TURNING)
def test_random_traces_match_the_scalar_reference(name: str) -> None:
    traces = _random_traces(200)
    for first_step in (True, False):
        raw = tpflow.build("credit", name, balanced=False, first_step=first_step)
        bal = tpflow.build("credit", name, balanced=True, first_step=first_step)
        for trace in traces:
            rows = trace.tolist()
            expected = _reference_selection(rows, consistent=name == "consistent", first_step=first_step)
            assert raw(trace).turning_points.tolist() == expected
            assert bal(trace).turning_points.tolist() == _reference_balance(rows, expected)


@pytest.mark.parametrize("name", TURNING)
def test_random_traces_invariants(name: str) -> None:
    traces = _random_traces()
    raw = tpflow.build("credit", name, balanced=False)
    bal = tpflow.build("credit", name)
    totals = [0, 0]  # selected steps before balancing, batches where balancing dropped some
    for trace in traces:
        t = trend(trace)
        before, after = raw(trace), bal(trace)
        for credit in (before, after):
            r, sel = credit.step_rewards, credit.turning_points
            assert r.shape == (8, 5) and sel.shape == (8, 5)
            assert r.dtype == torch.float64 and sel.dtype == torch.bool
            assert torch.isfinite(r).all()
            assert torch.equal(r[~sel], t.d[~sel])  # non-selected steps keep d_i
            assert torch.equal(r[sel], t.a[:, :-1][sel])  # selected steps get a_i
            delta = t.delta[:, None].expand(8, 5)[sel]
            assert (torch.sign(r[sel]) == torch.sign(t.d[sel])).all()
            assert (torch.sign(r[sel]) == torch.sign(delta)).all()
            assert (torch.sign(delta) != 0).all()
            if name == "consistent":
                assert not sel[:, -1].any()  # I_{W−1} = 0 always
                assert (r[sel].abs() > t.d[sel].abs()).all()
        assert not (after.turning_points & ~before.turning_points).any()  # balanced ⊆ unbalanced
        sign = torch.sign(t.delta)[:, None].expand(8, 5)
        pos_before = int((before.turning_points & (sign > 0)).sum())
        neg_before = int((before.turning_points & (sign < 0)).sum())
        pos_after = int((after.turning_points & (sign > 0)).sum())
        neg_after = int((after.turning_points & (sign < 0)).sum())
        if pos_before and neg_before:
            assert pos_after == neg_after == min(pos_before, neg_before)
        else:
            assert torch.equal(after.turning_points, before.turning_points)
        totals[0] += int(before.turning_points.sum())
        totals[1] += int(not torch.equal(after.turning_points, before.turning_points))
    assert totals[0] > 500 and totals[1] > 50  # the random traces really exercise selection and balancing


def test_def41_turning_point_can_shrink_the_step_reward() -> None:
    # Definition 4.1 only asks sgn(a_i) = sgn(d_i); |a_i| > |d_i| is Definition 5.1's extra guarantee (Appendix C.2).
    # R = [0, −1, 3, 2]: Δ = 2, d = [−1, 4, −1], g = [−, +, −]; i = 1 is a Def 4.1 turning point, a_1 = 3 < d_1 = 4.
    trace = _trace([[0, -1, 3, 2]])
    _check(tpflow.build("credit", "turning_point")(trace), [[-1, 3, -1]], [[0, 1, 0]])
    _check(tpflow.build("credit", "consistent")(trace), [[-1, 4, -1]], [[0, 0, 0]])  # sgn(d_1)·sgn(a_2) < 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_preserved_and_results_exact(name: str, dtype: torch.dtype) -> None:
    assigner = tpflow.build("credit", name)
    for trace in _random_traces(50):
        reference = assigner(trace)
        credit = assigner(trace.to(dtype))  # small integers are exact in bfloat16
        assert credit.step_rewards.dtype == dtype
        assert credit.step_rewards.device == trace.device
        assert torch.equal(credit.step_rewards.double(), reference.step_rewards)
        assert torch.equal(credit.turning_points, reference.turning_points)
    example = assigner(_trace(EXAMPLE_3, dtype))
    assert example.step_rewards.dtype == dtype


def test_outcome_reads_only_the_final_column() -> None:
    trace = _trace(EXAMPLE_3)
    trace[:, :-1] = float("nan")
    credit = tpflow.build("credit", "outcome")(trace)
    _check(credit, [[50] * 5, [64] * 5, [66] * 5], [[0] * 5] * 3)
    assert credit.step_rewards.is_contiguous()


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_and_single_step_window(name: str) -> None:
    assigner = tpflow.build("credit", name)
    credit = assigner(torch.zeros(0, 6))
    assert credit.step_rewards.shape == (0, 5) and credit.turning_points.shape == (0, 5)
    credit = assigner(torch.tensor([[1.0, 3.0], [4.0, 2.0]]))  # W = 1: r_0 = a_0 = d_0 = Δ either way
    expected = [[3.0], [2.0]] if name == "outcome" else [[2.0], [-2.0]]
    assert credit.step_rewards.tolist() == expected


# --- validation, registry, protocol --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.zeros(6), "shape"),
        (torch.zeros(2, 3, 6), "shape"),
        (torch.zeros(4, 1), "shape"),
        (torch.zeros(4, 6, dtype=torch.int64), "trace.float()"),
        ([[1.0, 2.0]], "torch.Tensor"),
    ],
)
def test_bad_traces_raise_actionable_errors(name: str, bad, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        tpflow.build("credit", name)(bad)
    assert name in str(info.value)


def test_registry_options_and_protocol() -> None:
    for name, cls in [
        ("outcome", OutcomeCredit),
        ("incremental", IncrementalCredit),
        ("turning_point", TurningPointCredit),
        ("consistent", ConsistentCredit),
    ]:
        assigner = tpflow.build("credit", name)
        assert type(assigner) is cls
        assert isinstance(assigner, CreditAssigner)
        assert assigner.needs_completions is (name != "outcome")
        assert cls().options == assigner.options  # None means defaults
    tp = tpflow.build("credit", "turning_point", balanced=False)
    assert tp.options.balanced is False and tp.options.first_step is True
    cs = tpflow.build("credit", "consistent", first_step=False)
    assert cs.options.balanced is True and cs.options.first_step is False
    for name, options in [
        ("outcome", {"balanced": True}),
        ("incremental", {"first_step": False}),
        ("turning_point", {"balance": False}),
        ("consistent", {"balanced": "maybe"}),
    ]:
        with pytest.raises(UserError):
            tpflow.build("credit", name, **options)


@pytest.mark.parametrize("name", TURNING)
def test_option_fields_are_described(name: str) -> None:
    options = type(tpflow.build("credit", name).options)
    assert set(options.model_fields) == {"balanced", "first_step"}
    for field in options.model_fields.values():
        assert field.description and "docs/algorithm.md" in field.description
