"""The main commands' --json on a few configs equal the golden files in tests/golden/.

scripts/golden.py writes them and, with --check, compares bit for bit on the machine that wrote
them; here every number is held to 1e-12 of its array's scale, which holds on any CPU's BLAS,
and the *_diff columns (rounding noise by construction) to 1e-9. Everything else is exact.
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


def assert_close(actual, desired, where: str, rel: float = 1e-12) -> None:
    if where.rsplit(".", 1)[-1].endswith("_diff"):
        rel = 1e-9
    flat_a, flat_d = numbers(actual), numbers(desired)
    if flat_a is not None and flat_d is not None and not (actual == [] or desired == []):
        assert json.dumps(_shape(actual)) == json.dumps(_shape(desired)), where
        finite = [abs(x) for x in flat_d if isinstance(x, (int, float)) and math.isfinite(x)]
        scale = max(finite, default=0.0) or 1.0
        for a, d in zip(flat_a, flat_d):
            if isinstance(a, int) and isinstance(d, int):
                assert a == d, where
            elif not (math.isfinite(a) and math.isfinite(d)):
                assert str(a) == str(d), where
            else:
                assert abs(a - d) <= rel * scale, f"{where}: {a!r} != {d!r} (scale {scale:g})"
    elif isinstance(desired, dict):
        assert isinstance(actual, dict) and list(actual) == list(desired), where
        for key in desired:
            assert_close(actual[key], desired[key], f"{where}.{key}", rel)
    elif isinstance(desired, list):
        assert isinstance(actual, list) and len(actual) == len(desired), where
        for i, (a, d) in enumerate(zip(actual, desired)):
            assert_close(a, d, f"{where}[{i}]", rel)
    else:
        assert actual == desired, f"{where}: {actual!r} != {desired!r}"


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
