"""The main commands' --json on a few configs equal the golden files in tests/golden/.

scripts/golden.py writes them and, with --check, compares bit for bit on the machine that wrote
them; here every number is held to 1e-12 of its array's scale, which holds on any CPU's BLAS,
and the numbers that are rounding by construction as NOISE says. Everything else is exact.
"""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import golden  # noqa: E402

CASES = dict(golden.cases())


def numbers(value):
    """Every number of a nested list, flattened, or None when it holds anything else."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, list):
        out = []
        for item in value:
            inner = numbers(item)
            if inner is None:
                return None
            out += inner
        return out
    return None


# Numbers that are rounding by construction, by their names' ends: how far two computations of
# one number lie apart, whose digits change with the CPU and its BLAS (1.2e-16 on one, 1.7e-16
# on another). Each is held, absolute, to what its rounding can reach; a mistake moves it to the
# size of the numbers compared (1e-3 and up).
NOISE = (
    ("_numeric_diff", 1e-8),   # central differences at step 1e-6: eps |f| / 1e-6 = 2e-10 |f|
    ("max_abs_err", 1e-8),     # gradcheck's, at step 1e-5
    ("rel_err", 1e-6),         # that over F, 1e-3 of the largest gradient (b_K's: 9e-8); 1e-6
                               # is gradcheck's own tolerance
    ("_diff", 1e-12),          # float64 computed twice (the model's, the cache's): eps |x|
)


def noise_bound(where: str):
    """The absolute bound of a number that is rounding (NOISE), else None."""
    key = where.rsplit(".", 1)[-1]
    return next((bound for end, bound in NOISE if key.endswith(end)), None)


def assert_close(actual, desired, where: str, rel: float = 1e-12, scale=None) -> None:
    """``actual`` equals ``desired``: numbers to ``rel`` of their array's scale (or of
    ``scale``, given), rounding to its NOISE bound, everything else exactly. In a list of
    summaries (one per tensor), each number's scale is its column's (:func:`column_scales`)."""
    flat_a, flat_d = numbers(actual), numbers(desired)
    if flat_a is not None and flat_d is not None and not (actual == [] or desired == []):
        assert json.dumps(_shape(actual)) == json.dumps(_shape(desired)), where
        finite = [abs(x) for x in flat_d if isinstance(x, (int, float)) and math.isfinite(x)]
        scale = scale or max(finite, default=0.0) or 1.0
        bound = noise_bound(where) or rel * scale
        for a, d in zip(flat_a, flat_d):
            if isinstance(a, int) and isinstance(d, int):
                assert a == d, where
            elif not (math.isfinite(a) and math.isfinite(d)):
                assert str(a) == str(d), where
            else:
                assert abs(a - d) <= bound, f"{where}: {a!r} != {d!r} (within {bound:g})"
    elif isinstance(desired, dict):
        assert isinstance(actual, dict) and list(actual) == list(desired), where
        scales = scale if isinstance(scale, dict) else {"mean": entries_scale(desired)}
        for key in desired:
            assert_close(actual[key], desired[key], f"{where}.{key}", rel, scales.get(key))
    elif isinstance(desired, list):
        assert isinstance(actual, list) and len(actual) == len(desired), where
        scales = column_scales(desired)
        for i, (a, d) in enumerate(zip(actual, desired)):
            assert_close(a, d, f"{where}[{i}]", rel, scales)
    else:
        assert actual == desired, f"{where}: {actual!r} != {desired!r}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def entries_scale(summary: dict):
    """The size of the entries a summary was taken over: its max_abs, or its min's and max's
    larger magnitude (None when it has neither)."""
    ends = [summary.get("max_abs")] if _number(summary.get("max_abs")) else \
        [summary.get("min"), summary.get("max")]
    return max(abs(end) for end in ends) or None if all(map(_number, ends)) else None


def column_scales(records: list):
    """A list of summaries' scales, one per key: the largest of its column, and for the mean
    the largest entry of any. The numbers of one pass share a size: b_K's gradient is rounding
    (l2 6e-17), held to 1e-12 of the largest gradient as helpers.assert_grads_match holds it,
    and the mean of a gradient that sums to 0 is its entries' rounding (8e-20 among entries of
    0.77). None when ``records`` are not summaries."""
    if not records or not all(isinstance(r, dict) for r in records):
        return None
    scales = {}
    for key in records[0]:
        column = [abs(r[key]) for r in records if _number(r.get(key))]
        scales[key] = max(column, default=0.0) or None
    entries = [entries_scale(r) or 0.0 for r in records]
    scales["mean"] = max([*entries, scales.get("mean") or 0.0]) or None
    return scales


def _shape(value):
    return [len(value), _shape(value[0])] if isinstance(value, list) and value else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    config = name.split("-")[0]
    for module in golden.NEEDS.get(config, ()):
        pytest.importorskip(module)
    stored = json.loads((golden.GOLDEN / f"{name}.json").read_text())
    assert stored["args"] == CASES[name]
    assert_close(golden.run(CASES[name]), stored["out"], name)


def test_every_golden_file_is_a_case():
    assert sorted(p.stem for p in golden.GOLDEN.glob("*.json")) == sorted(CASES)


def test_a_changed_number_fails():
    stored = json.loads((golden.GOLDEN / "toy-forward.json").read_text())["out"]
    changed = json.loads(json.dumps(stored))
    changed["loss"] = stored["loss"] * (1 + 1e-10)
    with pytest.raises(AssertionError, match="loss"):
        assert_close(changed, stored, "toy-forward")


def test_noise_is_held_to_its_bound_and_a_mistake_is_not_noise():
    """A *_diff that is rounding passes with other digits (the CPU's), one a mistake moves to
    the compared numbers' size fails; a mean that is its entries' rounding passes with other
    digits, a mean moved by 1e-10 of its entries fails."""
    stored = json.loads((golden.GOLDEN / "toy-ln.json").read_text())["out"]
    assert stored["dx_numeric_diff"] < 1e-9
    changed = json.loads(json.dumps(stored))
    changed["dx_numeric_diff"] = stored["dx_numeric_diff"] * 1.7
    assert_close(changed, stored, "toy-ln")
    changed["dx_numeric_diff"] = 1e-4
    with pytest.raises(AssertionError, match="dx_numeric_diff"):
        assert_close(changed, stored, "toy-ln")
    stored = json.loads((golden.GOLDEN / "toy-ffn.json").read_text())["out"]
    assert stored["forward_model_diff"] < 1e-15   # float64 computed twice: to 1e-12
    changed = json.loads(json.dumps(stored))
    changed["forward_model_diff"] = stored["forward_model_diff"] * 1.7
    assert_close(changed, stored, "toy-ffn")
    changed["forward_model_diff"] = 1e-10
    with pytest.raises(AssertionError, match="forward_model_diff"):
        assert_close(changed, stored, "toy-ffn")
    stored = json.loads((golden.GOLDEN / "folder-backward.json").read_text())["out"]
    summary = stored["gradients"][0]
    assert abs(summary["mean"]) < 1e-18 < 1e-2 < summary["max_abs"]
    changed = json.loads(json.dumps(stored))
    changed["gradients"][0]["mean"] = -summary["mean"] * 3
    assert_close(changed, stored, "folder-backward")
    changed["gradients"][0]["mean"] = summary["mean"] + 1e-10 * summary["max_abs"]
    with pytest.raises(AssertionError, match=r"gradients\[0\]\.mean"):
        assert_close(changed, stored, "folder-backward")
    # every mean of a list rounding (gradients that sum to 0): held to their entries' size
    noise = [{"name": "a", "max_abs": 0.77, "mean": 8e-20}, {"name": "b", "max_abs": 0.5,
                                                             "mean": -3e-19}]
    assert_close([{**noise[0], "mean": -2e-19}, {**noise[1], "mean": 1e-19}], noise, "g")
    with pytest.raises(AssertionError, match=r"g\[1\]\.mean"):
        assert_close([noise[0], {**noise[1], "mean": 1e-12}], noise, "g")
