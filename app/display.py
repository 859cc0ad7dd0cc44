"""Numbers as a person reads them in the app's tables: fractions as percentages with one decimal, other
values to 3 significant digits, each interval beside the value it bounds. Only the display changes; the CSV
downloads keep full precision and their own layout."""
from __future__ import annotations

import math
import numbers

import pandas as pd

from analysis.patterns import CLASSES

# Columns whose values are shares of 1: attention weights, accuracies, F1 scores, class fractions, and the
# classifier's probabilities p_<class> (p_value, p_mcnemar, p_permutation, p_holm are p-values: 3 significant digits).
FRACTION_COLUMNS = frozenset({
    "fraction", "fraction_pruned", "accuracy", "baseline_accuracy", "f1", "macro_f1", "macro_f1_agreed",
    "mean_attention", "to_cls", "to_sep", "adjusted", *(f"p_{name}" for name in CLASSES),
    "in_sample_accuracy", "head_minus_baseline",  # probe-dep: accuracies, and a difference of two
})
# In long tables (layer, head, <key>, value) the key names what ``value`` is; these keys are shares of 1.
FRACTION_KEYS = FRACTION_COLUMNS | frozenset({
    "macro_f1_fold_std", "prev", "next", "self", "cls", "sep", "period", "comma", "sep_sep",
    "negation", "noun", "verb", "pronoun", "subject", "object",
})
KEY_COLUMNS = ("metric", "feature")
# An interval is shown like the value it bounds: ci_low, ci_high bound the column just before ci_low (fraction,
# delta, difference, accuracy; in a long table its value, as each row's key says); in a long table
# <key>_ci_low, <key>_ci_high bound <key>.
INTERVAL_COLUMNS = ("ci_low", "ci_high")


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
    return column in FRACTION_COLUMNS


def is_interval_column(column: str) -> bool:
    """ci_low, ci_high, or a named bound such as baseline_ci_low."""
    return any(column == suffix or column.endswith(f"_{suffix}") for suffix in INTERVAL_COLUMNS)


def bounded_columns(names: list[str]) -> dict[str, str]:
    """{interval column: the column it bounds}: the nearest column before it that is not a bound (the tables write
    each estimate right before its interval: accuracy, ci_low, ci_high, baseline_accuracy, baseline_ci_low, ...)."""
    bounded, estimate = {}, None
    for name in names:
        if is_interval_column(name):
            if estimate is not None:
                bounded[name] = estimate
        else:
            estimate = name
    return bounded


def is_fraction_key(key) -> bool:
    """Whether a long table's ``value`` is a share of 1 in the rows of metric/feature ``key`` (NaN: no)."""
    key = str(key)
    for suffix in INTERVAL_COLUMNS:
        key = key.removesuffix(f"_{suffix}")
    return key in FRACTION_KEYS


def fold_intervals(frame: pd.DataFrame) -> pd.DataFrame:
    """A long table (<other columns>, metric|feature, value) with its interval rows <key>_ci_low, <key>_ci_high
    moved into ci_low, ci_high columns of the row of <key>, so each interval sits beside its estimate (in the
    CSV they are rows of their own, a layer x head table's 2 x L x H rows below). Rows without an interval get
    empty bounds. ``frame`` is returned as it is when it has no interval rows, or when one bounds no row (a
    damaged table is shown as written, nothing hidden)."""
    key = next((column for column in KEY_COLUMNS if column in frame.columns), None)
    if key is None or "value" not in frame.columns or any(column in frame.columns for column in INTERVAL_COLUMNS):
        return frame
    keys = frame[key].astype(str)
    bounds = {suffix: keys.str.endswith(f"_{suffix}") for suffix in INTERVAL_COLUMNS}
    if not any(mask.any() for mask in bounds.values()):
        return frame
    others = [column for column in frame.columns if column not in (key, "value")]
    folded = frame[~(bounds["ci_low"] | bounds["ci_high"])].reset_index(drop=True)
    for suffix, mask in bounds.items():
        part = frame[mask].assign(**{key: keys[mask].str.removesuffix(f"_{suffix}")})
        part = part[[*others, key, "value"]].rename(columns={"value": suffix})
        if part.duplicated([*others, key]).any():
            return frame
        joined = folded.merge(part, on=[*others, key], how="left", indicator=True)
        if (joined["_merge"] == "both").sum() != len(part):  # an interval whose estimate is missing
            return frame
        folded = joined.drop(columns="_merge")
    return folded


def display_table(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """A copy of ``frame`` with its intervals folded beside their estimates (:func:`fold_intervals`) and every
    float cell formatted by :func:`readable` (integers and text unchanged; a missing text cell empty).

    A long table's ``value`` and its ci_low/ci_high are fractions in the rows whose metric/feature is one
    (FRACTION_KEYS); in other tables a ci_low/ci_high column is shown like the column it bounds (INTERVAL_COLUMNS).
    """
    if frame is None:
        return None
    frame = fold_intervals(frame)
    shown = frame.copy()
    key = next((column for column in KEY_COLUMNS if column in frame.columns), None)
    long = key is not None and "value" in frame.columns
    bounded = bounded_columns([str(column) for column in frame.columns])
    for column in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[column]):  # a row without this text reads as an empty cell
            shown[column] = frame[column].astype(object).map(lambda value: "" if value is None or value != value
                                                             else value)
        if not pd.api.types.is_float_dtype(frame[column]):
            continue
        if long and str(column) in ("value", *INTERVAL_COLUMNS):
            fractions = frame[key].map(is_fraction_key)
        else:
            fractions = pd.Series(is_fraction_column(bounded.get(str(column), str(column))), index=frame.index)
        shown[column] = [readable(value, bool(share)) for value, share in zip(frame[column], fractions)]
    return shown


def interval_text(value: float, low: float, high: float, *, spec: str = ".3f") -> str:
    """A mean with its interval as the CLI prints it: '0.123 [0.100, 0.150]'; ``spec`` formats all three numbers
    (".2e" for gradients: '1.23e-04 [1.01e-04, 1.45e-04]'). The bare value ('0.123') when a bound is missing (NaN:
    fewer than 2 examples to resample), as :func:`share_interval_text` shows a share without one."""
    if math.isnan(low) or math.isnan(high):
        return f"{value:{spec}}"
    return f"{value:{spec}} [{low:{spec}}, {high:{spec}}]"


def interval_table_lines(header: str, keys: list[str], rows: list[dict], titles: dict[str, str], *,
                         specs: dict[str, str] | None = None, separator: str = " ") -> list[str]:
    """A CLI table of estimates with their intervals: ``header`` then per row its key (``keys``, already padded)
    and each column's value [ci_low, ci_high] (:func:`interval_text`, ``specs`` {column: spec}, ".3f" by default)
    from ``rows`` (dicts with <column>, <column>_ci_low, <column>_ci_high). Each column is as wide as its title
    or its widest cell, so the columns stay aligned whatever the numbers' width."""
    specs = specs or {}
    cells = {column: [interval_text(row[column], row[f"{column}_ci_low"], row[f"{column}_ci_high"],
                                    spec=specs.get(column, ".3f")) for row in rows] for column in titles}
    widths = {column: max([len(title), *map(len, cells[column])]) for column, title in titles.items()}
    lines = [header + separator.join(title.ljust(widths[column]) for column, title in titles.items())]
    lines += [key + separator.join(cells[column][index].ljust(widths[column]) for column in titles)
              for index, key in enumerate(keys)]
    return [line.rstrip() for line in lines]


def layer_interval_lines(per_layer: pd.DataFrame, titles: dict[str, str], *, spec: str = ".3f") -> list[str]:
    """The CLI's per-layer table: a header of ``titles`` ({column: title}) and a line per layer (1-indexed) with each
    column's value [ci_low, ci_high] (:func:`interval_table_lines` with ``spec``), from ``per_layer`` (layer,
    <column>, <column>_ci_low, <column>_ci_high, as analysis.stats.per_layer_table makes it)."""
    rows = per_layer.to_dict("records")
    return interval_table_lines(f"{'layer':>5} ", [f"{int(row['layer']) + 1:>5} " for row in rows], rows, titles,
                                specs=dict.fromkeys(titles, spec))


def share_interval_text(value: float, low: float | None = None, high: float | None = None) -> str:
    """A share with its interval as the CLI prints it: '67.0% [65.1, 68.9]' (the bare share when it has none)."""
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return f"{value * 100:.1f}%"
    return f"{value * 100:.1f}% [{low * 100:.1f}, {high * 100:.1f}]"


def ratio_lines(ratios: pd.DataFrame) -> list[str]:
    """`classify`'s lines for one task's pattern ratios (class, fraction, ci_low, ci_high, adjusted,
    adjusted_ci_low, adjusted_ci_high; the intervals and adjusted shares where the table has them): a header and
    one line per class, as classified and adjusted for the classifier's confusion, each with its 95% interval."""
    adjusted = "adjusted" in ratios.columns
    lines = [f"    {'class':<18} {'as classified':<22}" + ("adjusted for the classifier's confusion" if adjusted
                                                          else "")]
    for row in ratios.to_dict("records"):
        classified = share_interval_text(row["fraction"], row.get("ci_low"), row.get("ci_high"))
        line = f"    {row['class']:<18} {classified:<22}"
        if adjusted:
            line += share_interval_text(row["adjusted"], row.get("adjusted_ci_low"), row.get("adjusted_ci_high"))
        lines.append(line.rstrip())
    return lines


def clipped_note(classes: list[str]) -> str:
    """What an adjusted share set to 0 by the simplex projection means (``classes``: those whose exact adjustment
    was negative, as the manifest's ratio_uncertainty.clipped names them)."""
    return (f"adjusted {', '.join(classes)} clipped to 0: observed below what the classifier's cross-validated "
            "error rates allow, so those rates do not hold on these maps; the adjusted interval assumes they do")


def ratio_notes(uncertainty: dict) -> list[str]:
    """The notes under a task's pattern ratios, from the manifest's ratio_uncertainty (classifier.classify): the
    classes whose adjusted share was clipped to 0, and why adjusted ratios are unavailable; [] when neither."""
    notes = []
    clipped = uncertainty.get("clipped")
    if isinstance(clipped, list) and clipped:
        notes.append(clipped_note([str(name) for name in clipped]))
    adjusted = uncertainty.get("adjusted")
    if isinstance(adjusted, str) and adjusted.startswith("unavailable"):
        notes.append(f"adjusted ratios {adjusted}")
    return notes
