"""Every lint rule against its own VALID / INVALID examples, plus the registry contract."""

from __future__ import annotations

import re

import libcst as cst
import pytest
from kvskill.analyzer.lint import RULES, lint_source, select_rules
from kvskill.core.errors import BadInputError

VALID_CASES = [
    pytest.param(rule, code, id=f"{rule.id}-valid-{i}")
    for rule in RULES
    for i, code in enumerate(rule.VALID)
]
INVALID_CASES = [
    pytest.param(rule, code, id=f"{rule.id}-invalid-{i}")
    for rule in RULES
    for i, code in enumerate(rule.INVALID)
]


@pytest.mark.parametrize(("rule", "code"), VALID_CASES)
def test_valid_example_has_no_finding_from_any_rule(rule, code):
    # A VALID example is correct code: no rule at all may complain about it.
    assert lint_source(code) == []


@pytest.mark.parametrize(("rule", "code"), INVALID_CASES)
def test_invalid_example_is_reported_by_its_rule(rule, code):
    findings = lint_source(code, rules=[rule()])
    assert findings, f"{rule.id} missed its own INVALID example"
    lines = code.splitlines()
    for finding in findings:
        assert finding.rule == rule.id
        assert finding.name == rule.name
        assert 1 <= finding.line <= len(lines)
        assert finding.column >= 1
        assert finding.message and "\n" not in finding.message
        assert finding.fix and "\n" not in finding.fix


@pytest.mark.parametrize(("rule", "code"), INVALID_CASES)
def test_disabling_the_rule_silences_its_example(rule, code):
    others = select_rules([rule.id])
    assert all(f.rule != rule.id for f in lint_source(code, rules=others))


def test_rule_ids_names_and_docs_are_stable_and_unique():
    ids = [r.id for r in RULES]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"KV\d{3}", i) for i in ids)
    assert len({r.name for r in RULES}) == len(RULES)
    for rule in RULES:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name)
        summary = rule.summary()
        assert summary and summary.endswith(".")
        assert rule.VALID and rule.INVALID, f"{rule.id} needs examples both ways"


def test_every_example_is_valid_python():
    for rule in RULES:
        for code in (*rule.VALID, *rule.INVALID):
            cst.parse_module(code)


def test_disable_accepts_names_lists_and_any_case():
    ids = {r.id for r in select_rules(["kv001", "float-atten-mask,KV005"])}
    assert {"KV001", "KV003", "KV005"}.isdisjoint(ids)
    assert len(ids) == len(RULES) - 3


def test_disable_unknown_rule_is_bad_input():
    with pytest.raises(BadInputError, match="KV999"):
        select_rules(["KV999"])
