"""Attention-forward branches the model's config decides, replaced by the branch that runs.

Falcon's attention runs ``if alibi is None:`` (SDPA) or its ``else:`` (scores plus ALiBi);
``alibi`` is None exactly when ``config.alibi`` is false, which ``analyzer/config_branch.py``
proves from the file. Before any check or rewrite, each such ``if`` is replaced by the
statements of the branch that runs for the Plan's config, under a comment that says which
and why; the seam then reads one kernel as for any other model. Inside that branch, an
``if`` on ``config._attn_implementation`` that picks SDPA or the eager matmul is one
attention written twice (transformers' dispatch, as ``attention_interface`` is elsewhere):
its SDPA branch is kept.

A config under which the parameter is built (``config.alibi`` true) takes the branch that
adds it to the scores; the paged seam has no input for it, so that is refused with the
reason. The Legacy rewrite keeps the model's own math and is left to read the file as it is.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.config_branch import ConfigBranch, config_branches
from kvskill.analyzer.gather import SDPA_CALL, method
from kvskill.core.errors import UnsupportedModelError

#: ``<...>._attn_implementation`` in a test: transformers' choice of attention implementation
_IMPLEMENTATION = m.Attribute(attr=m.Name("_attn_implementation"))


def take_decided_branches(
    module: cst.Module, switches: dict[str, bool], *, replaces_kernel: bool, filename: str
) -> cst.Module:
    """MODULE with every config-decided branch of an attention forward replaced by the one
    that runs under SWITCHES (the config's boolean keys); unchanged when there is none.

    Raises:
        UnsupportedModelError: the config builds the tested parameter and REPLACES_KERNEL
            (the seam swaps the kernel for the fused operator, which cannot take it).
    """
    if not switches:
        return module  # no config key decides a branch: nothing to read
    branches = [b for b in config_branches(module) if b.key in switches]
    if not branches:
        return module
    if any(switches[b.key] for b in branches):
        built = next(b for b in branches if switches[b.key])
        reason = _built_reason(module, built, switches[built.key], replaces_kernel)
        if reason is None:
            return module  # the file is read as it is, and refused or converted by the seam
        raise UnsupportedModelError(f"{filename}: cannot convert: {reason}")
    by_class: dict[str, list[ConfigBranch]] = {}
    for branch in branches:
        by_class.setdefault(branch.cls, []).append(branch)
    body = []
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value in by_class:
            stmt = _with_taken_branches(stmt, by_class[stmt.name.value], switches)
        body.append(stmt)
    return module.with_changes(body=body)


def _built_reason(
    module: cst.Module, branch: ConfigBranch, value: bool, replaces_kernel: bool
) -> str | None:
    """Why a config that builds BRANCH's parameter cannot be converted: the paged seam
    (REPLACES_KERNEL) has no input for a bias added to the scores; the Legacy seam keeps
    the model's kernel but passes its own mask, which loses a bias the model folds into
    its mask. None when the file does neither (it is then read as it is)."""
    reads = _branch_reading(module, branch)
    folded = _folded_into_mask(module, branch)
    if replaces_kernel and (reads or folded):
        return (
            f"{branch.reason(value)}; there the model adds {branch.param} to the attention "
            "scores (an ALiBi bias): the fused operator takes no ALiBi slopes, and its "
            "pse_shift bias is not confirmed to be added before the scale as the model adds "
            "it (npu_ops §1.6), so the paged seam converts only configs under which "
            f"{branch.param} is None"
        )
    if not replaces_kernel and folded:
        return (
            f"{branch.reason(value)}; {branch.owner}.forward folds {branch.param} into the "
            "attention mask it passes to the layers, and the Legacy seam gives the kept "
            "kernel its own causal mask instead, which would drop that bias"
        )
    return None


def _folded_into_mask(module: cst.Module, branch: ConfigBranch) -> bool:
    """Whether BRANCH's owner (the class that builds the parameter) assigns a mask from it
    (Falcon: ``causal_mask = torch.masked_fill(alibi / ..., ...)``)."""
    owner = next(
        (c for c in module.body if isinstance(c, cst.ClassDef) and c.name.value == branch.owner),
        None,
    )
    if owner is None:
        return False
    for node in m.findall(owner, m.Assign()):
        assign = cst.ensure_type(node, cst.Assign)
        targets = [n for t in assign.targets for n in m.findall(t.target, m.Name())]
        masks = [t for t in targets if "mask" in cst.ensure_type(t, cst.Name).value.lower()]
        if masks and m.findall(assign.value, m.Name(branch.param)):
            return True
    return False


def _branch_reading(module: cst.Module, branch: ConfigBranch) -> bool:
    """Whether some config-decided ``if`` of BRANCH's class reads the parameter on its
    not-None side."""
    cls = next(c for c in module.body if isinstance(c, cst.ClassDef) and c.name.value == branch.cls)
    forward = method(cls, "forward")
    assert forward is not None, "config_branches reads forwards"
    for stmt in cst.ensure_type(forward.body, cst.IndentedBlock).body:
        if isinstance(stmt, cst.If) and _test(stmt) == branch.test:
            side = stmt.orelse if branch.true_when_none else stmt.body
            if side is not None and m.findall(side, m.Name(branch.param)):
                return True
    return False


def _test(stmt: cst.If) -> str:
    return cst.Module(body=[]).code_for_node(stmt.test)


def _with_taken_branches(
    cls: cst.ClassDef, branches: list[ConfigBranch], switches: dict[str, bool]
) -> cst.ClassDef:
    """CLS with its forward's decided ``if`` statements replaced by the branches that run."""
    tests = {b.test: b for b in branches}
    members = []
    for member in cls.body.body:
        if isinstance(member, cst.FunctionDef) and member.name.value == "forward":
            block = cst.ensure_type(member.body, cst.IndentedBlock)
            statements: list[cst.BaseStatement] = []
            for stmt in block.body:
                branch = tests.get(_test(stmt)) if isinstance(stmt, cst.If) else None
                if branch is None:
                    statements.append(stmt)
                    continue
                statements += _taken(stmt, branch, switches[branch.key])
            member = member.with_changes(
                body=block.with_changes(body=_sdpa_implementation(statements))
            )
        members.append(member)
    return cls.with_changes(body=cls.body.with_changes(body=members))


def _taken(stmt: cst.If, branch: ConfigBranch, value: bool) -> list[cst.BaseStatement]:
    """The statements of STMT's branch that runs for VALUE, led by a note saying why."""
    if isinstance(stmt.orelse, cst.If):
        return [stmt]  # an elif chain tests more than the parameter: left to the seam
    if branch.taken(value):
        taken = list(stmt.body.body)
    elif isinstance(stmt.orelse, cst.Else):
        taken = list(stmt.orelse.body.body)
    else:
        return []
    note = cst.EmptyLine(
        comment=cst.Comment(
            f"# config.{branch.key} is {value!r}, so {branch.param} is None: the branch of "
            f"`if {branch.test}:` that runs ({branch.owner}.__init__: self.{branch.flag} = "
            f"config.{branch.key})"
        )
    )
    first = taken[0]
    taken[0] = first.with_changes(leading_lines=[*stmt.leading_lines, note, *first.leading_lines])
    return taken


def _sdpa_implementation(statements: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """STATEMENTS with each ``if <..._attn_implementation ...>:`` whose body calls SDPA and
    whose ``else:`` assigns the same output replaced by its body."""
    kept = []
    for stmt in statements:
        if (
            isinstance(stmt, cst.If)
            and m.findall(stmt.test, _IMPLEMENTATION)
            and isinstance(stmt.orelse, cst.Else)
            and _sdpa_targets(stmt.body)
            and _sdpa_targets(stmt.body) <= _assigned(stmt.orelse.body)
        ):
            body = list(stmt.body.body)
            note = cst.EmptyLine(
                comment=cst.Comment(
                    "# the SDPA implementation of this attention (config._attn_implementation "
                    "picks it or the eager matmul, the same attention)"
                )
            )
            body[0] = body[0].with_changes(
                leading_lines=[*stmt.leading_lines, note, *body[0].leading_lines]
            )
            kept += body
            continue
        kept.append(stmt)
    return kept


def _sdpa_targets(block: cst.BaseSuite) -> set[str]:
    """Names assigned from an SDPA call directly in BLOCK."""
    return {
        cst.ensure_type(t.target, cst.Name).value
        for a in m.findall(block, m.Assign(value=SDPA_CALL))
        for t in cst.ensure_type(a, cst.Assign).targets
        if isinstance(t.target, cst.Name)
    }


def _assigned(block: cst.BaseSuite) -> set[str]:
    return {
        cst.ensure_type(n, cst.Name).value
        for a in m.findall(block, m.AssignTarget())
        for n in m.findall(cst.ensure_type(a, cst.AssignTarget).target, m.Name())
    }


__all__ = ["take_decided_branches"]
