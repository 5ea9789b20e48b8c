"""klotski_sim.util.grouping: codes and per-group sums without pandas, and a run's summary without pandas."""

import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pandas as pd
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.util.grouping import factorize, group_sums


@given(
    st.lists(
        st.one_of(st.sampled_from(["compute", "h2d_kv", "host", "", "0,1"]), st.none(), st.integers(-3, 3)), max_size=40
    )
)
def test_codes_are_pandas_factorize_in_order_of_first_appearance(values):
    column = np.empty(len(values), dtype=object)
    column[:] = values
    codes, distinct = factorize(column)
    expected_codes, expected = pd.factorize(column, sort=False, use_na_sentinel=False)

    def nan_named(found):  # (NaN is not equal to itself)
        return ["NaN" if isinstance(v, float) and v != v else v for v in found]

    assert codes.tolist() == expected_codes.tolist() and nan_named(distinct) == nan_named(expected.tolist())
    if None not in values:
        assert distinct == list(dict.fromkeys(values)) and [distinct[k] for k in codes] == values


def test_every_missing_value_is_one_value_as_pandas_counts_it():
    """NaN objects are not equal to themselves (a dict tells them apart), and None is missing too:
    as pandas has it, one code, its value NaN."""
    column = np.array(["a", float("nan"), "b", float("nan"), None], dtype=object)
    codes, distinct = factorize(column)
    assert codes.tolist() == [0, 1, 2, 1, 1] and distinct[0] == "a" and math.isnan(distinct[1])


finite = st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False)


@given(st.lists(st.tuples(finite, st.integers(0, 3)), max_size=60), st.booleans())
def test_group_sums_are_the_exact_sums_correctly_rounded(rows, with_nan):
    """Each group's sum is its exact (rational) sum rounded once, whatever the order of its rows:
    a plain or pairwise float sum (pandas', numpy's) would differ in the last digits of some."""
    values = np.array([v for v, _ in rows] + ([math.nan] if with_nan else []), dtype=float)
    codes = np.array([g for _, g in rows] + ([0] if with_nan else []), dtype=np.intp)
    sums, counts = group_sums(values, codes, 4)
    for group in range(4):
        members = [v for v, g in rows if g == group]
        assert sums[group] == float(sum(map(Fraction, members), Fraction(0)))
        assert counts[group] == len(members)  # (the NaN left out)
    reversed_sums, _ = group_sums(values[::-1].copy(), codes[::-1].copy(), 4)
    assert reversed_sums == sums


def test_a_run_and_its_summary_import_no_pandas():
    """`klotski-sim simulate` prints a summary: with pandas imported for it, a tiny model's run took
    0.55 s, 0.2 s of it the import (`python -X importtime`); the run now never imports it."""
    probe = (
        "import sys; from klotski_sim.cli.main import main; "
        "code = main(['simulate', '--model', 'tiny-mixtral', '--policy', 'klotski', '--gen-len', '3']); "
        "print(code, 'pandas' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "makespan" in done.stdout and done.stderr.split()[-2:] == ["0", "False"]
