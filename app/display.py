"""Numbers as a person reads them in the app's tables: fractions as percentages with one decimal, other
values to 3 significant digits. Only the display changes; the CSV downloads keep full precision."""
from __future__ import annotations

import math
import numbers

import pandas as pd

# Columns whose values are shares of 1: attention weights, accuracies, F1 scores, class fractions.
FRACTION_COLUMNS = frozenset({
    "fraction", "fraction_pruned", "accuracy", "baseline_accuracy", "f1", "macro_f1", "macro_f1_agreed",
    "mean_attention", "to_cls", "to_sep", "ci_low", "ci_high", "adjusted",
})
# In long tables (layer, head, <key>, value) the key names what ``value`` is; these keys are shares of 1.
FRACTION_KEYS = FRACTION_COLUMNS | frozenset({
    "macro_f1_fold_std", "prev", "next", "self", "cls", "sep", "period", "comma", "sep_sep",
    "negation", "noun", "verb", "pronoun", "subject", "object",
})
KEY_COLUMNS = ("metric", "feature")


def readable(value, fraction: bool = False) -> str:
    """One number as shown in the app: ``fraction`` -> "68.0%"; otherwise 3 significant digits ("0.680",
    "12.3", "1,234" for values of a thousand or more); whole numbers as they are; NaN as an empty cell."""
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return "" if value is None else str(value)
    if isinstance(value, numbers.Integral):
        return f"{value * 100}%" if fraction else str(value)
    if math.isnan(value):
        return ""
    if fraction:
        return f"{value * 100:.1f}%"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:#.3g}".rstrip(".").replace(".e", "e")


def is_fraction_column(column: str) -> bool:
    return column in FRACTION_COLUMNS or column.startswith("p_")


def display_table(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """A copy of ``frame`` with every float cell formatted by :func:`readable` (integers and text unchanged).

    A long table's ``value`` column is a fraction in the rows whose metric/feature is one (FRACTION_KEYS).
    """
    if frame is None:
        return None
    shown = frame.copy()
    key = next((column for column in KEY_COLUMNS if column in frame.columns), None)
    for column in frame.columns:
        if not pd.api.types.is_float_dtype(frame[column]):
            continue
        if column == "value" and key is not None:
            fractions = frame[key].astype(str).isin(FRACTION_KEYS)
        else:
            fractions = pd.Series(is_fraction_column(str(column)), index=frame.index)
        shown[column] = [readable(value, bool(share)) for value, share in zip(frame[column], fractions)]
    return shown
