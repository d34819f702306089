"""Plan files: read a plan from a JSON or CSV file, write one that a person can read and edit.

The formats are :meth:`Plan.to_json` / :meth:`Plan.to_csv`. Reading decides by the extension (``.json``,
``.csv``) and otherwise by the content (a JSON object, or a CSV plan's ``# plan-meta:`` first line).
Writing JSON puts the metadata on one line and every action on a line of its own, rank after rank, with
the fields that equal their defaults left out (``size`` 1, ``mb`` -1, ``batch`` none): the layout of
``examples/plans/``. Errors are one line naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, fields

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan.plan import Plan

FORMATS = ("json", "csv")


def plan_format(path: str, text: str = "") -> str:
    """``"json"`` or ``"csv"``: by the extension of ``path``, else by ``text``."""
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension in FORMATS:
        return extension
    return "csv" if text.lstrip().startswith("# plan-meta:") else "json"


def read_plan(path: str) -> Plan:
    """The plan in ``path``; FileNotFoundError or ValueError (one line naming the file) otherwise."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"plan file {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"plan file {path}: cannot be read ({exc})") from None
    kind = plan_format(path, text)
    try:
        return Plan.from_csv(text) if kind == "csv" else Plan.from_json(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan file {path}: not valid JSON ({exc})") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else " ".join(str(exc).split())
        raise ValueError(f"plan file {path}: not a {kind.upper()} plan as Plan.to_{kind} writes it: {what}") from None


def _compact(action) -> dict:
    """The action's fields, without those equal to their defaults."""
    d = A.action_to_dict(action)
    for f in fields(type(action)):
        if f.default is not MISSING and f.name in d and d[f.name] == f.default:
            del d[f.name]
    return d


def plan_to_text(plan: Plan, kind: str = "json") -> str:
    """The text of ``plan`` in ``kind`` (``"csv"``: :meth:`Plan.to_csv`; ``"json"``: one action per line)."""
    if kind == "csv":
        return plan.to_csv()
    lines = ["{", '"meta": ' + json.dumps(plan.meta()) + ",", '"actions": [']
    for rank, acts in enumerate(plan.actions):
        body = ",\n".join("    " + json.dumps(_compact(a)) for a in acts)
        lines += ["  [", body, "  ]" + ("," if rank < plan.num_ranks - 1 else "")]
    return "\n".join(lines + ["]}"]) + "\n"


def write_plan(plan: Plan, path: str) -> str:
    """Write ``plan`` to ``path`` (CSV for ``.csv``, JSON otherwise); returns the format written."""
    kind = plan_format(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(plan_to_text(plan, kind))
    return kind
