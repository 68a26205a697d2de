"""Metric names used by PromQL expressions (alerts, dashboard panels).

Owns: a small, conservative lexer that removes what is not a metric name (strings, label
matchers, ranges, grouping clauses, Grafana variables, function calls, keywords) and returns the
rest. Invariant: it may over-report (a test then names the odd token), never silently drop a metric
selector.
"""

from __future__ import annotations

import re

KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "inf",
        "nan",
        "atan2",
    }
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_GRAFANA_VAR = re.compile(r"\$\{?\w+\}?")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_NUMBER_SUFFIX = re.compile(r"(?<=[0-9])[eE][+-]?[0-9]+")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects, e.g. `rate(a_total{x="y"}[5m]) / b` → {a_total, b}."""
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VAR.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER_SUFFIX.sub("", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name in KEYWORDS:
            continue
        names.add(name)
    return names


def label_values_metric(query: str) -> set[str]:
    """Metric names of a Grafana `label_values(metric{...}, label)` variable query."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
    return metric_names(match.group(1)) if match else metric_names(query)
