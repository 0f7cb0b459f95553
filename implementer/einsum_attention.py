"""Attention computed by hand with ``torch.einsum``, read as scaled dot-product attention.

ChatGLM-style files keep their activations sequence-first and write the products out::

    scores = torch.einsum("sbhd,tbhd->bhst", query_layer, key_layer)   # [b, n, sq, sk]
    scores = scores / (self.head_dim**0.5)
    scores = scores.masked_fill(attention_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    b, heads, sq, sk = probs.shape
    values = value_layer.permute(1, 2, 0, 3).reshape(b * heads, sk, -1)   # [b * n, sk, d]
    context_layer = torch.bmm(probs.reshape(b * heads, sq, sk), values).view(b, heads, sq, -1)

The seam replaces these statements by the fused operator only when every step is proved to
be that operator's computation. Each axis gets a *role*: ``b`` batch, ``n`` head, ``q`` query
position, ``k`` key position, ``d`` the query/key channel, ``v`` the value channel. The roles
of query, key and value come from the cache write's layout (``facts.CacheLayout``), followed
through the statements up to the products; the einsum subscripts must then contract ``d``
alone and keep ``b`` and ``n`` paired, the softmax must run over ``k``, the output product
must contract ``k`` against the value's positions, and every reshape around a ``bmm`` must
merge or split adjacent axes in order (its sizes read from ``x.shape``). The output's role
order decides how the seam hands the fused output back. Anything not proved is a problem
naming the statement; a wrong conversion is worse than a refusal.

NOTE: between the cache write and the products a key or value may be expanded from its KV
heads to the query heads (``unsqueeze`` right after the heads, ``expand``, then ``view`` /
``reshape``; or ``repeat_interleave`` over the heads): that keeps the axis order and pairs
query head h with KV head h // G, as the fused operator does itself (:func:`_expanded`).
Copies put before the heads would pair h with h % KVN and are not read; ``.repeat`` tiles
heads that way too and is a fused limit of the seam checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    BMM_CALL,
    EINSUM_CALL,
    SOFTMAX_CALL,
    chain_start,
    dotted_name,
    einsum_scores,
)

#: the roles of a 4-d query, key and value at the cache write, by the write's layout
#: (``facts.CacheLayout`` value -> roles of query, key, value)
_WRITE_ROLES = {
    "bhsd": ("bnqd", "bnkd", "bnkv"),
    "bshd": ("bqnd", "bknd", "bknv"),
    "sbhd": ("qbnd", "kbnd", "kbnv"),
}
#: the order the fused output is handed back in before any permute (``[1, T, N, D]``)
HANDED_BACK = "bqnv"
#: calls that change neither the axis order nor the values' meaning
_CASTS = frozenset({"contiguous", "float", "half", "bfloat16", "to", "type", "type_as"})
#: calls that expand KV heads to the query heads without moving an axis (see the NOTE above)
_HEAD_EXPANSION = frozenset({"unsqueeze", "expand", "view", "reshape", "repeat_interleave"})


class Unread(Exception):
    """A step of the attention the reader cannot prove; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class EinsumReading:
    """What the hand-written attention computes, in the forward's names."""

    query: str
    #: the role order of the output the source computes (a permutation of ``bnqv``)
    output_roles: str
    #: the name the softmaxed weights are assigned to
    probs: str


def _calls(expr: cst.BaseExpression) -> tuple[str | None, list[cst.Call]]:
    """(root name, method calls innermost first) of ``x.a(...).b(...)``; (None, []) for any
    other expression than a name followed by method calls."""
    calls: list[cst.Call] = []
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        calls.append(expr)
        expr = expr.func.value
    if not isinstance(expr, cst.Name):
        return None, []
    return expr.value, calls[::-1]


def _method(call: cst.Call) -> str:
    return cst.ensure_type(call.func, cst.Attribute).attr.value


def _ints(call: cst.Call) -> list[int] | None:
    """The integer literals a call takes (``permute(1, 2, 0, 3)``, ``transpose(0, -1)``)."""
    found = [_int(a.value) if a.keyword is None else None for a in call.args]
    return None if None in found else [i for i in found if i is not None]


def _relaid(roles: str, call: cst.Call, where: str) -> str:
    """ROLES after a ``permute``/``transpose``/cast CALL."""
    name = _method(call)
    if name in _CASTS:
        return roles
    ints = _ints(call)
    if name == "permute" and ints is not None and sorted(i % 4 for i in ints) == [0, 1, 2, 3]:
        return "".join(roles[i % 4] for i in ints)
    if name == "transpose" and ints is not None and len(ints) == 2:
        i, j = (x % 4 for x in ints)
        swapped = list(roles)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        return "".join(swapped)
    raise Unread(f"{where}: `{_code(call)}` is not a permute, transpose or cast of literal axes")


def _code(node: cst.CSTNode) -> str:
    from kvskill.implementer.facts import code

    return code(node)


class _Tracker:
    """The role order of query, key and value (and names re-laid out from them), followed
    through the forward's top-level statements from the cache write on."""

    def __init__(self, names: dict[str, str], where: str) -> None:
        self.roles: dict[str, str | None] = dict(names)
        self.where = where
        #: ``unsqueeze`` calls on a tracked key or value that put the copies of its KV heads
        #: before the heads (query head h would read KV head h % KVN, :func:`_expanded`)
        self.misgrouped: list[cst.Call] = []

    def follow(self, stmt: cst.BaseStatement) -> None:
        """Update the roles for one statement: a rebinding of a tracked name from a tracked
        name by relayouts, casts or head expansion; any other assignment to a tracked name
        stops tracking it (reading it afterwards is then a problem)."""
        nested = not isinstance(stmt, cst.SimpleStatementLine)
        for node in m.findall(stmt, m.Assign() | m.AugAssign()):
            if isinstance(node, cst.AugAssign):
                for name in _names_in(node.target):
                    self.roles.pop(name, None)
                continue
            assign = cst.ensure_type(node, cst.Assign)
            targets = [t.target.value for t in assign.targets if isinstance(t.target, cst.Name)]
            for target in targets:
                # NOTE: a rebinding under an if or a loop holds on one path only
                self.roles[target] = None if nested else self._rebound(assign.value)
            others = [
                n
                for t in assign.targets
                if not isinstance(t.target, cst.Name)
                for n in _names_in(t.target)
            ]
            for name in others:
                self.roles.pop(name, None)

    def _rebound(self, value: cst.BaseExpression) -> str | None:
        """The roles of VALUE, a tracked name followed by relayouts, casts or the steps of a
        head expansion; None when it is anything else."""
        root, calls = _calls(value)
        roles = self.roles.get(root or "")
        if roles is None:
            return None
        try:
            for call in calls:
                if _method(call) in _CASTS:
                    continue
                if _method(call) in _HEAD_EXPANSION:
                    expanded = _expanded(roles, call)
                    if expanded is None and _copies_before_heads(roles, call):
                        self.misgrouped.append(call)
                    roles = expanded
                elif "g" not in roles:
                    roles = _relaid(roles, call, self.where)
                else:
                    return None
                if roles is None:
                    return None
        except Unread:
            return None
        return roles

    def operand(self, expr: cst.BaseExpression, what: str) -> tuple[str, str]:
        """(root name, roles) of an einsum operand: a tracked name, maybe re-laid out."""
        root, calls = _calls(expr)
        roles = self.roles.get(root or "")
        if roles is None or "g" in roles:
            raise Unread(
                f"{self.where}: the {what} `{_code(expr)}` is not read from the query, key and "
                "value of the cache write by relayouts, casts or head expansion"
            )
        for call in calls:
            roles = _relaid(roles, call, self.where)
        return root, roles


def _expanded(roles: str, call: cst.Call) -> str | None:
    """ROLES after one step of expanding KV heads to the query heads, with ``g`` the copies
    of a KV head while they have their own axis; None for a step that would not pair query
    head h with KV head h // G as the fused operator does.

    ``unsqueeze`` must put the copies right after the heads (``[s, b, n, d]`` ->
    ``unsqueeze(-2)`` -> ``[s, b, n, g, d]``): merged back, head h reads KV head h // G.
    Before the heads (``unsqueeze(2)``) the merge would read KV head h % KVN, as ``.repeat``
    does. ``expand`` sizes the copies; a ``view``/``reshape`` merges them into the heads;
    ``repeat_interleave(G, dim=<heads>)`` does both at once.
    """
    name = _method(call)
    ints = _ints(call)
    if name == "unsqueeze":
        if "g" in roles or ints is None or len(ints) != 1:
            return None
        at = ints[0] % (len(roles) + 1)
        return roles[:at] + "g" + roles[at:] if at > 0 and roles[at - 1] == "n" else None
    if name == "expand":
        return roles if "g" in roles else None
    if name in ("view", "reshape"):
        return roles.replace("g", "") if "g" in roles else None
    if name == "repeat_interleave":
        dims = [_int(a.value) for a in call.args[1:] if a.keyword is None] + [
            _int(a.value) for a in call.args if a.keyword and a.keyword.value == "dim"
        ]
        if "g" in roles or len(dims) != 1 or dims[0] is None:
            return None
        return roles if roles[dims[0] % len(roles)] == "n" else None
    return None


def _copies_before_heads(roles: str, call: cst.Call) -> bool:
    """CALL is ``unsqueeze`` putting a new axis right before the head axis of ROLES (the
    copies of each KV head, merged back, would read KV head h % KVN)."""
    ints = _ints(call)
    if _method(call) != "unsqueeze" or "g" in roles or ints is None or len(ints) != 1:
        return False
    at = ints[0] % (len(roles) + 1)
    return at < len(roles) and roles[at] == "n"


def misgrouped_kv_heads(
    stmts: list[cst.BaseStatement], layout: str, key: str, value: str
) -> list[str]:
    """The ``unsqueeze`` calls in STMTS (the seam, after a cache write of LAYOUT) that copy
    the KV heads of KEY or VALUE before the head axis: merged back, query head h reads KV
    head h % KVN, which the fused operator (h // G) does not; any kernel style."""
    _, key_roles, value_roles = _WRITE_ROLES[layout]
    tracker = _Tracker({key: key_roles, value: value_roles}, "")
    for stmt in stmts:
        tracker.follow(stmt)
    return [_code(call) for call in tracker.misgrouped]


def _names_in(node: cst.CSTNode) -> list[str]:
    return [cst.ensure_type(n, cst.Name).value for n in m.findall(node, m.Name())]


def _subscripts(call: cst.Call, where: str) -> tuple[str, str, str]:
    """``("sbhd", "tbhd", "bhst")`` of ``einsum("sbhd,tbhd->bhst", a, b)``."""
    spec = call.args[0].value
    text = spec.evaluated_value if isinstance(spec, cst.SimpleString) else None
    if not isinstance(text, str) or "->" not in text or "." in text:
        raise Unread(f"{where}: `{_code(call)}` has no literal explicit subscripts")
    inputs, output = text.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or not all(
        len(p) == 4 and p.isalpha() and len(set(p)) == 4 for p in (*parts, output)
    ):
        raise Unread(f"{where}: `{_code(call)}` is not a product of two 4-d operands into 4-d")
    return parts[0], parts[1], output


def _product_roles(
    subs: tuple[str, str, str], left: str, right: str, contracted: str, call: cst.Call, where: str
) -> str:
    """The output roles of an einsum whose operands have roles LEFT and RIGHT, when it is a
    batched matrix product contracting the role CONTRACTED (in both) and keeping every other
    role once; else Unread naming what it does instead."""
    letter_of: dict[str, str] = {}
    for sub, roles in ((subs[0], left), (subs[1], right)):
        for letter, role in zip(sub, roles, strict=True):
            if letter_of.setdefault(role, letter) != letter:
                raise Unread(
                    f"{where}: `{_code(call)}` gives the {_ROLE_NAMES[role]} axis two letters "
                    f"({letter_of[role]}, {letter}): the operands are not paired on it"
                )
    role_of = {letter: role for role, letter in letter_of.items()}
    if len(role_of) != len(letter_of):
        raise Unread(f"{where}: `{_code(call)}` gives one letter to two different axes")
    kept = sorted((set(left) | set(right)) - {contracted})
    out = subs[2]
    if letter_of[contracted] in out or sorted(role_of.get(x, "?") for x in out) != kept:
        raise Unread(
            f"{where}: `{_code(call)}` does not contract the {_ROLE_NAMES[contracted]} axis "
            "alone (the operands' layout at that point gives its subscripts other meanings)"
        )
    return "".join(role_of[x] for x in out)


_ROLE_NAMES = {
    "b": "batch",
    "n": "head",
    "q": "query-position",
    "k": "key-position",
    "d": "query/key channel",
    "v": "value channel",
}


def read_einsum_attention(
    facts,
    body: cst.IndentedBlock,
    scores_index: int,
    output_index: int,
    *,
    write_index: int,
    layout: str,
    qkv: tuple[str, str, str],
) -> EinsumReading | None:
    """Read the einsum attention of ``facts.name``'s forward; None with the reason in
    ``facts.problems`` when a step cannot be proved. QKV: the names the seam reads query,
    key and value by at the cache write (statement WRITE_INDEX), whose layout is LAYOUT."""
    where = f"{facts.name}.forward"
    query_roles, key_roles, value_roles = _WRITE_ROLES[layout]
    tracker = _Tracker({qkv[0]: query_roles, qkv[1]: key_roles, qkv[2]: value_roles}, where)
    try:
        for stmt in body.body[write_index + 1 : scores_index]:
            tracker.follow(stmt)
        return _read(tracker, body, scores_index, output_index, where)
    except Unread as exc:
        facts.problems.append(
            f"{exc}; the seam reads hand-written einsum attention only where it proves it is "
            "scaled dot-product attention"
        )
        return None


def _read(
    tracker: _Tracker, body: cst.IndentedBlock, scores_index: int, output_index: int, where: str
) -> EinsumReading:
    scores_line = cst.ensure_type(body.body[scores_index], cst.SimpleStatementLine)
    scores_assign = cst.ensure_type(scores_line.body[0], cst.Assign)
    weights = cst.ensure_type(scores_assign.targets[0].target, cst.Name).value
    product = einsum_scores(scores_assign.value)
    assert product is not None, "einsum_attention found these scores"
    query, q_roles = tracker.operand(product.args[1].value, "query operand")
    _, k_roles = tracker.operand(product.args[2].value, "key operand")
    if "q" not in q_roles or "k" not in k_roles:
        raise Unread(f"{where}: `{_code(product)}` does not take the query, then the key")
    scores = _product_roles(_subscripts(product, where), q_roles, k_roles, "d", product, where)
    between = list(body.body[scores_index + 1 : output_index])
    probs = _softmax_over_keys(between, weights, scores, where)
    sized = _Sizes({weights: scores, probs: scores, **tracker.roles})
    for stmt in between:
        sized.bind(stmt)
        tracker.follow(stmt)
    output_line = cst.ensure_type(body.body[output_index], cst.SimpleStatementLine)
    output = cst.ensure_type(output_line.body[0], cst.Assign).value
    start = chain_start(output)
    start_call = cst.ensure_type(start, cst.Call)
    if m.matches(start, EINSUM_CALL):
        roles = _einsum_output(tracker, start_call, probs, scores, where)
    else:
        assert m.matches(start, BMM_CALL), "einsum_attention found this output"
        roles = _bmm_output(tracker, sized, between, start_call, probs, scores, where)
    roles = _after_product(sized, output, start, roles, where)
    if sorted(roles) != sorted("bnqv"):
        raise Unread(f"{where}: the attention output `{_code(output)}` is not [b, n, s, d]")
    return EinsumReading(query=query, output_roles=roles, probs=probs)


def _softmax_over_keys(
    between: list[cst.BaseStatement], weights: str, scores: str, where: str
) -> str:
    """The name of the softmaxed scores; Unread unless one softmax of the scores runs over
    the key-position axis, the scores are only masked or cast before it, and the weights
    only cast or dropped out after it."""
    found = [
        (index, cst.ensure_type(a, cst.Assign))
        for index, stmt in enumerate(between)
        for a in m.findall(stmt, m.Assign())
        if m.matches(chain_start(cst.ensure_type(a, cst.Assign).value), SOFTMAX_CALL)
    ]
    if len(found) != 1 or sum(len(m.findall(s, SOFTMAX_CALL)) for s in between) != 1:
        raise Unread(f"{where}: its einsum attention does not assign exactly one softmax")
    at, holder = found[0]
    call = cst.ensure_type(chain_start(holder.value), cst.Call)
    cast = holder.value
    while cast is not call:
        cast_call = cst.ensure_type(cast, cst.Call)
        if _method(cast_call) not in _CASTS:
            raise Unread(f"{where}: `{_code(holder)}` changes the softmaxed weights")
        cast = cst.ensure_type(cast_call.func, cst.Attribute).value
    if isinstance(call.func, cst.Attribute) and dotted_name(call.func.value) not in _MODULES:
        operand, dim_at = call.func.value, 0  # scores.softmax(dim)
    else:
        operand, dim_at = (call.args[0].value if call.args else None), 1  # F.softmax(x, dim)
    positional = [a.value for a in call.args if a.keyword is None]
    keyword = [a.value for a in call.args if a.keyword and a.keyword.value == "dim"]
    dim = keyword[0] if keyword else positional[dim_at] if len(positional) > dim_at else None
    axis = _int(dim) if dim is not None else None
    root, calls = _calls(operand) if operand is not None else (None, [])
    if root != weights or any(_method(c) not in _CASTS for c in calls):
        raise Unread(f"{where}: `{_code(call)}` is not a softmax of the scores {weights}")
    if axis is None or scores[axis % 4] != "k":
        raise Unread(
            f"{where}: `{_code(call)}` does not run over the key-position axis of the scores "
            f"(their subscripts put it at dim {scores.index('k')})"
        )
    target = holder.targets[0].target
    if len(holder.targets) != 1 or not isinstance(target, cst.Name):
        raise Unread(f"{where}: the softmax's result is not assigned to one name")
    for stmt in between:
        _check_in_place(stmt, {weights, target.value}, where)
    for index, stmt in enumerate(between):
        for node in m.findall(stmt, m.Assign()):
            assign = cst.ensure_type(node, cst.Assign)
            if assign is holder:
                continue
            assigned = [n for t in assign.targets for n in _names_in(t.target)]
            if index <= at and weights in assigned:
                _check_score_update(assign, weights, where)
            elif index >= at and target.value in assigned:
                _check_weights_update(assign, target.value, where)
    return target.value


#: what a softmax may be called through as a function (``torch.softmax(x, -1)``)
_MODULES = frozenset({"torch", "F", "nn.functional", "torch.nn.functional", "functional"})


def _int(expr: cst.BaseExpression) -> int | None:
    """The value of an integer literal, maybe negative."""
    sign = 1
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        expr, sign = expr.expression, -1
    return sign * int(expr.value) if isinstance(expr, cst.Integer) else None


def _check_in_place(stmt: cst.BaseStatement, names: set[str], where: str) -> None:
    """An in-place method on the scores or weights (``scores.masked_fill_(mask, ...)``,
    ``scores.add_(bias)``) changes them without an assignment: only a mask is allowed."""
    in_place = m.Call(
        func=m.Attribute(
            value=m.Name(value=m.MatchIfTrue(lambda name: name in names)),
            attr=m.Name(value=m.MatchIfTrue(lambda attr: attr.endswith("_"))),
        )
    )
    for node in m.findall(stmt, in_place):
        call = cst.ensure_type(node, cst.Call)
        masked = _method(call) == "masked_fill_" and bool(call.args)
        if not (masked and any("mask" in n.lower() for n in _names_in(call.args[0].value))):
            raise Unread(f"{where}: `{_code(call)}` changes the scores in place beyond a mask")


def _check_weights_update(assign: cst.Assign, probs: str, where: str) -> None:
    """After the softmax the weights may only be cast or dropped out (a no-op in inference)."""
    value = assign.value
    if isinstance(value, cst.Call) and "dropout" in dotted_name(value.func).lower():
        args = [a.value for a in value.args if a.keyword is None]
        if args and m.matches(args[0], m.Name(probs)):
            return
    root, calls = _calls(value)
    if root == probs and all(_method(c) in _CASTS for c in calls):
        return
    raise Unread(f"{where}: `{_code(assign)}` changes the softmaxed weights beyond a cast")


def _check_score_update(assign: cst.Assign, weights: str, where: str) -> None:
    """An update of the scores before the softmax: a mask (``masked_fill`` of a mask, an
    added mask, which ``facts._score_changes`` reads) or a cast; the scale the product left
    out (``facts._later_scale``) is read there too. Anything else re-lays out or changes the
    scores beyond what the fused operator takes."""
    value = assign.value
    if isinstance(value, cst.BinaryOperation):
        return  # an added mask or the later scale: read by facts._score_changes
    root, calls = _calls(value)
    if root != weights:
        raise Unread(f"{where}: `{_code(assign)}` replaces the scores")
    for call in calls:
        name = _method(call)
        masked = name in ("masked_fill", "masked_fill_") and bool(call.args)
        if masked and any("mask" in n.lower() for n in _names_in(call.args[0].value)):
            continue
        if name in _CASTS:
            continue
        raise Unread(f"{where}: `{_code(assign)}` changes the scores beyond a mask or a cast")


def _einsum_output(tracker: _Tracker, call: cst.Call, probs: str, scores: str, where: str) -> str:
    """The roles of ``einsum("...", probs, value)``."""
    if len(call.args) != 3:
        raise Unread(f"{where}: `{_code(call)}` does not take two operands")
    root, calls = _calls(call.args[1].value)
    if root != probs or any(_method(c) not in _CASTS for c in calls):
        raise Unread(f"{where}: `{_code(call)}` does not weight by the softmaxed scores")
    _, v_roles = tracker.operand(call.args[2].value, "value operand")
    if "k" not in v_roles or "v" not in v_roles:
        raise Unread(f"{where}: `{_code(call)}` does not read the value")
    return _product_roles(_subscripts(call, where), scores, v_roles, "k", call, where)


class _Sizes:
    """Names bound to axis sizes (``b, heads, sq, sk = probs.shape``), by role."""

    def __init__(self, roles: dict[str, str | None]) -> None:
        self.roles = roles
        self.sizes: dict[str, str] = {}

    def bind(self, stmt: cst.BaseStatement) -> None:
        for node in m.findall(stmt, m.Assign()):
            assign = cst.ensure_type(node, cst.Assign)
            target = assign.targets[0].target
            roles = self._shape_of(assign.value)
            if isinstance(target, (cst.Tuple, cst.List)) and roles is not None:
                names = [e.value for e in target.elements]
                if len(names) == 4 and all(isinstance(n, cst.Name) for n in names):
                    for name, role in zip(names, roles, strict=True):
                        self.sizes[cst.ensure_type(name, cst.Name).value] = role
                    continue
            for name in _names_in(target):
                self.sizes.pop(name, None)
            if isinstance(target, cst.Name):
                role = self.role(assign.value)
                if role is not None:
                    self.sizes[target.value] = role

    def _shape_of(self, value: cst.BaseExpression) -> str | None:
        """The roles of ``x.shape`` / ``x.size()`` for a tensor of known roles."""
        if isinstance(value, cst.Call) and not value.args:
            value = value.func
        shape = isinstance(value, cst.Attribute) and value.attr.value in ("shape", "size")
        if shape and isinstance(value.value, cst.Name):
            return self.roles.get(value.value.value)
        return None

    def role(self, atom: cst.BaseExpression) -> str | None:
        """The role whose size ATOM is: a bound name, ``x.shape[i]``, ``x.size(i)``."""
        if isinstance(atom, cst.Name):
            return self.sizes.get(atom.value)
        if isinstance(atom, cst.Subscript) and len(atom.slice) == 1:
            roles = self._shape_of(atom.value)
            index = atom.slice[0].slice
            if roles is not None and isinstance(index, cst.Index):
                axis = _int(index.value)
                return roles[axis % 4] if axis is not None else None
        sized = m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("size")))
        if m.matches(atom, sized):
            call = cst.ensure_type(atom, cst.Call)
            tensor = cst.ensure_type(cst.ensure_type(call.func, cst.Attribute).value, cst.Name)
            roles = self.roles.get(tensor.value)
            ints = _ints(call)
            if roles is not None and ints and len(ints) == 1:
                return roles[ints[0] % 4]
        return None

    def groups(self, call: cst.Call, axes: list[str], where: str) -> list[str]:
        """AXES (each a run of roles) after ``.view(...)`` / ``.reshape(...)`` CALL, when
        its sizes merge or split adjacent axes in order; ``-1`` takes what is left."""
        flat = "".join(axes)
        sizes = []
        for arg in call.args:
            if arg.keyword is not None or arg.star:
                raise Unread(f"{where}: `{_code(call)}` takes its sizes in a form not read")
            sizes.append(arg.value)
        out: list[str] = []
        used = 0
        for position, size in enumerate(sizes):
            if m.matches(size, m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))):
                if position != len(sizes) - 1:
                    raise Unread(f"{where}: `{_code(call)}` infers an axis other than the last")
                out.append(flat[used:])
                used = len(flat)
                continue
            run = ""
            for factor in _factors(size):
                role = self.role(factor)
                if role is None:
                    raise Unread(
                        f"{where}: `{_code(call)}` sizes an axis by `{_code(factor)}`, not "
                        "read as the size of one of the attention's axes"
                    )
                run += role
            if flat[used : used + len(run)] != run:
                raise Unread(
                    f"{where}: `{_code(call)}` does not merge or split adjacent axes in order "
                    f"(axes {'/'.join(_ROLE_NAMES[r] for r in flat)})"
                )
            out.append(run)
            used += len(run)
        if used != len(flat) or not all(out):
            raise Unread(f"{where}: `{_code(call)}` does not cover the axes it reshapes")
        return out


def _factors(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
        return [*_factors(expr.left), *_factors(expr.right)]
    return [expr]


def _reshaped(
    sized: _Sizes, expr: cst.BaseExpression, axes: list[str], calls: list[cst.Call], where: str
) -> list[str]:
    """AXES (runs of roles) after CALLS, the method chain of EXPR: relayouts of whole axes
    while none is merged, reshapes that merge or split them, casts."""
    for call in calls:
        name = _method(call)
        if name in ("view", "reshape"):
            axes = sized.groups(call, axes, where)
        elif all(len(a) == 1 for a in axes):
            axes = list(_relaid("".join(axes), call, where))
        elif name not in _CASTS:
            raise Unread(f"{where}: `{_code(expr)}` re-lays out axes it has merged")
    return axes


def _bmm_output(
    tracker: _Tracker,
    sized: _Sizes,
    between: list[cst.BaseStatement],
    call: cst.Call,
    probs: str,
    scores: str,
    where: str,
) -> list[str]:
    """The axes of ``bmm(probs.reshape(G, sq, sk), values)`` with ``values`` the value's
    axes merged to ``[G, sk, d]``: G the same roles in the same order on both sides."""
    if len(call.args) != 2:
        raise Unread(f"{where}: `{_code(call)}` does not take two operands")
    left_expr = call.args[0].value
    root, calls = _calls(left_expr)
    if root != probs:
        raise Unread(f"{where}: `{_code(call)}` does not weight by the softmaxed scores")
    left = _reshaped(sized, left_expr, list(scores), calls, where)
    right_expr = _defined(call.args[1].value, between)
    root, calls = _calls(right_expr)
    roles = tracker.roles.get(root or "")
    if roles is None or "v" not in roles:
        raise Unread(f"{where}: `{_code(call)}` does not read the value")
    right = _reshaped(sized, right_expr, list(roles), calls, where)
    if len(left) != 3 or len(right) != 3 or left[2] != "k" or right[1] != "k":
        raise Unread(
            f"{where}: `{_code(call)}` does not multiply [batch, sq, sk] weights by [batch, "
            "sk, d] values"
        )
    if left[0] != right[0] or sorted(left[0] + left[1]) != sorted("bnq") or right[2] != "v":
        raise Unread(
            f"{where}: `{_code(call)}` pairs the weights' and the values' batch axes "
            f"differently ({left[0]} against {right[0]})"
        )
    return [left[0], left[1], right[2]]


def _defined(expr: cst.BaseExpression, between: list[cst.BaseStatement]) -> cst.BaseExpression:
    """EXPR, or the one value assigned to it in BETWEEN when it is a name assigned there."""
    if not isinstance(expr, cst.Name):
        return expr
    values = [
        cst.ensure_type(a, cst.Assign).value
        for stmt in between
        for a in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name(expr.value))]))
    ]
    return values[0] if len(values) == 1 else expr


def _after_product(
    sized: _Sizes,
    output: cst.BaseExpression,
    start: cst.BaseExpression,
    axes: list[str] | str,
    where: str,
) -> str:
    """The roles of OUTPUT, the product START followed by its method chain."""
    calls: list[cst.Call] = []
    node = output
    while node is not start:
        call = cst.ensure_type(node, cst.Call)
        calls.append(call)
        node = cst.ensure_type(call.func, cst.Attribute).value
    axes = _reshaped(sized, output, list(axes), calls[::-1], where)
    if not all(len(a) == 1 for a in axes):
        raise Unread(f"{where}: the attention output `{_code(output)}` keeps axes merged")
    return "".join(axes)


def hand_back(output: str, roles: str) -> list[cst.BaseStatement]:
    """The statements that bring the fused output (``[1, T, N, D]``) to the role order ROLES
    the source computed; [] when that is the order already."""
    if roles == HANDED_BACK:
        return []
    order = ", ".join(str(HANDED_BACK.index(r)) for r in roles)
    line = f"{output} = {output}.permute({order})  # as the source's einsum attention returns\n"
    return [cst.parse_statement(line)]


__all__ = ["EinsumReading", "hand_back", "misgrouped_kv_heads", "read_einsum_attention"]
