"""Mamba-2 mixers (mamba2, bamba, granitemoehybrid, nemotron_h, ...): paged SSD states.

A Mamba-2 mixer is recognised by what its methods call, never by its name: the SSD chunked
scan (``mamba_chunk_scan_combined`` / ``mamba2_chunk_scan``) and the one-token
``selective_state_update``. transformers writes its cache use three ways across versions
(``cache_params.ssm_states[...]`` in a ``torch_forward``, ``cache.get_recurrent_state`` in one
``forward``, the ``HybridMambaAttentionDynamicCache`` of the hybrids), so the rewrite does not
edit those statements: it keeps the layer's modules and parameters (``in_proj``, ``conv1d``,
``act``, ``A_log``, ``dt_bias``, ``D``, ``norm``, ``out_proj``) and gives ``forward`` one paged
body over them (``templates/framework_mamba2_forward.py.j2``): the causal conv and the scan on
the request's state rows (gathered by ``block_table[:, 0]``, zeros without an initial state,
scattered back). Three falcon_h1 shapes are kept exactly where the source has them: a scalar
on the hidden states in the statement before ``in_proj``, a per-channel vector on the
projection (same or next statement), and an ``if self.<flag>:`` choosing the gated norm over a
plain ``silu(gate)``. A mixer whose methods read any other attribute that body does not use,
or one of those in another place, is refused with the attribute's name rather than converted
without it.

``__init__`` declares two ``MambaCacheEntry`` (conv and SSM state) under attn_type "Mamba";
the SSM state keeps the dtype the Plan pins for it (the config's ``mamba_ssm_cache_dtype``,
float32 in a bfloat16 nemotron_h), the conv state the layer's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import once_per_node
from kvskill.implementer._command import StateMixerCommand
from kvskill.implementer.facts import CACHE_ENTRIES_ASSIGN, _method, class_assigns
from kvskill.implementer.snippets import statements
from kvskill.implementer.state_entries import StateEntry, declare_states, with_pinned_dtypes


def _call_ending(*suffixes: str) -> m.Call:
    ends = m.MatchIfTrue(lambda value: value.endswith(suffixes))
    return m.Call(func=m.Name(value=ends) | m.Attribute(attr=m.Name(value=ends)))


SCAN_CALL = _call_ending("chunk_scan_combined", "mamba2_chunk_scan")
STATE_UPDATE_CALL = _call_ending("selective_state_update")


def _clamp_by(attr: str) -> m.Call:
    """``torch.clamp(dt, <expression reading self.ATTR>, ...)``"""
    reads = m.MatchIfTrue(lambda node: bool(m.findall(node, m.Attribute(attr=m.Name(attr)))))
    return m.Call(
        func=m.Attribute(attr=m.Name("clamp")) | m.Name("clamp"),
        args=[m.ZeroOrMore(), m.Arg(value=reads), m.ZeroOrMore()],
    )


#: ``torch.clamp(dt, self.time_step_limit[0], self.time_step_limit[1])``: once per branch when
#: decode clamps too
CLAMP_TIME_STEP = _clamp_by("time_step_limit")
#: ``torch.clamp(dt, self.time_step_min)``: the lower bound alone (transformers 4.46's mamba2
#: and 4.55's zamba2 ``torch_forward``, in prefill and in decode; their ``time_step_limit`` may
#: be None there and is read by the CUDA path only)
CLAMP_TIME_STEP_MIN = _clamp_by("time_step_min")
#: ``(decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=2)``: the naive SSD's
#: inter-chunk recurrence summed over the target chunk instead of the source one (the decay
#: matrix left untransposed), as transformers 4.46's mamba2 and 4.55's zamba2 ``torch_forward``
#: have it; later releases transpose the decay and sum over dim 1
MIS_SUMMED_RECURRENCE = m.Call(
    func=m.Attribute(
        value=m.BinaryOperation(
            left=m.Subscript(value=m.Name(m.MatchIfTrue(lambda name: name.startswith("decay")))),
            operator=m.Multiply(),
            right=m.Subscript(),
        ),
        attr=m.Name("sum"),
    ),
    args=[m.Arg(value=m.Integer("2"))],
)
#: the (lower, upper) bounds of dt after the softplus, as the paged forward spells them
LIMIT_BOUNDS = ("self.time_step_limit[0]", "self.time_step_limit[1]")
MIN_BOUNDS = ("self.time_step_min", 'float("inf")')

#: attributes the paged forward reads; the source ``__init__`` must set each one
USED_ATTRS = (
    "num_heads",
    "head_dim",
    "ssm_state_size",
    "n_groups",
    "intermediate_size",
    "conv_dim",
    "conv_kernel_size",
    "chunk_size",
    "time_step_limit",
    "in_proj",
    "conv1d",
    "act",
    "A_log",
    "dt_bias",
    "D",
    "norm",
    "out_proj",
)
#: attributes the source methods may read that change nothing the paged forward computes:
#: configuration echoes, the kernels' own spellings of the same values, cache bookkeeping
NEUTRAL_ATTRS = frozenset(
    {
        "activation",
        "layer_idx",
        "training",
        "use_conv_bias",
        "use_bias",
        "hidden_size",
        "time_step_rank",
        "layer_norm_epsilon",
        "rms_norm_eps",
        "config",
        "layer_type",
        "cuda_kernels_forward",
        "torch_forward",
        "init_mamba2_weights",
        "is_fast_path_available",
        "use_mem_eff_path",
    }
)
#: the cache entries, in the layer's dtype unless the Plan pins one (``with_pinned_dtypes``)
ENTRIES = [
    StateEntry(
        name="conv_state",
        shape=("self.conv_kernel_size - 1", "self.conv_dim"),
        comment="the last kernel-1 conv inputs, token-major; the conv operators read its transpose",
    ),
    StateEntry(
        name="ssm_state",
        shape=("self.num_heads", "self.head_dim", "self.ssm_state_size"),
        comment="[heads, head_dim, state_size]: the SSD state of every head",
    ),
]


@dataclass(kw_only=True)
class Mamba2Facts:
    name: str
    converted: bool
    #: the forward's first argument after self (the hidden states)
    hidden: str = "hidden_states"
    #: whether the source clamps dt in decode too (transformers 4's ``torch_forward`` does;
    #: transformers 5's forward clamps in the chunk scan only)
    clamp_decode: bool = False
    #: the bounds the source clamps dt to: ``time_step_limit``, or ``time_step_min`` alone
    dt_bounds: tuple[str, str] = LIMIT_BOUNDS
    #: a scalar the source multiplies the hidden states by right before ``in_proj``
    #: (falcon_h1's ``ssm_in_multiplier``), or None
    in_multiplier: str | None = None
    #: a per-channel vector the source multiplies ``in_proj``'s output by, in the same
    #: statement or the next one (falcon_h1's ``mup_vector``), or None
    projection_multiplier: str | None = None
    #: a flag the source branches on between the gated norm and a plain ``silu(gate)`` gate
    #: (falcon_h1's ``mamba_rms_norm``, where ``self.norm`` is an Identity when it is off)
    norm_flag: str | None = None
    problems: list[str] = field(default_factory=list)


@once_per_node
def is_mamba2_class(cls: cst.ClassDef) -> bool:
    """A class whose methods run the SSD chunk scan and the one-token state update."""
    return bool(m.findall(cls, SCAN_CALL)) and bool(m.findall(cls, STATE_UPDATE_CALL))


def _self_attrs_read(node: cst.CSTNode) -> set[str]:
    found = m.findall(node, m.Attribute(value=m.Name("self"), attr=m.Name()))
    return {cst.ensure_type(a, cst.Attribute).attr.value for a in found}


def _self_attrs_set(init: cst.FunctionDef) -> set[str]:
    found = m.findall(init, m.AssignTarget(target=m.Attribute(value=m.Name("self"))))
    return {
        cst.ensure_type(cst.ensure_type(t, cst.AssignTarget).target, cst.Attribute).attr.value
        for t in found
    }


def _self_attr(name: str | m.MatchIfTrue = m.DoNotCare()) -> m.Attribute:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


def _scaled_by_self(name: str, attr=m.DoNotCare()) -> m.Assign:
    """``NAME = NAME * self.<attr>``"""
    return m.Assign(
        targets=[m.AssignTarget(target=m.Name(name))],
        value=m.BinaryOperation(left=m.Name(name), operator=m.Multiply(), right=_self_attr(attr)),
    )


def _multiplier(stmt: cst.CSTNode, matcher: m.BaseMatcherNode) -> str | None:
    """The ``self.<attr>`` of STMT when STMT is one assignment matching MATCHER."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    if not m.matches(stmt.body[0], matcher):
        return None
    assign = cst.ensure_type(stmt.body[0], cst.Assign)
    scale = cst.ensure_type(assign.value, cst.BinaryOperation).right
    return cst.ensure_type(scale, cst.Attribute).attr.value


def _projection_multipliers(method: cst.FunctionDef) -> tuple[str | None, str | None]:
    """(input multiplier, output multiplier) around the one ``X = self.in_proj(H)`` statement
    of METHOD's body: ``H = H * self.a`` right before it, and ``X = X * self.b`` right after it
    or ``X = self.in_proj(H) * self.b`` in its place. Any other use of such attributes is left
    for the caller to refuse."""
    body = cst.ensure_type(method.body, cst.IndentedBlock).body
    projection = m.Call(func=_self_attr("in_proj"), args=[m.Arg(value=m.Name())])
    for index, stmt in enumerate(body):
        line = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
        if not m.matches(line, m.Assign(targets=[m.AssignTarget(target=m.Name())])):
            continue
        assign = cst.ensure_type(line, cst.Assign)
        target = cst.ensure_type(assign.targets[0].target, cst.Name).value
        if m.matches(assign.value, projection):
            call = cst.ensure_type(assign.value, cst.Call)
            out = (
                _multiplier(body[index + 1], _scaled_by_self(target))
                if index + 1 < len(body)
                else None
            )
        elif m.matches(
            assign.value,
            m.BinaryOperation(left=projection, operator=m.Multiply(), right=_self_attr()),
        ):
            scaled = cst.ensure_type(assign.value, cst.BinaryOperation)
            call = cst.ensure_type(scaled.left, cst.Call)
            out = cst.ensure_type(scaled.right, cst.Attribute).attr.value
        else:
            continue
        hidden = cst.ensure_type(call.args[0].value, cst.Name).value
        before = _multiplier(body[index - 1], _scaled_by_self(hidden)) if index else None
        return before, out
    return None, None


def _norm_flag(method: cst.FunctionDef) -> str | None:
    """The X of an ``if self.X:`` whose body calls ``self.norm`` and whose else gates by
    ``silu``: the source's choice between the gated norm and a plain silu gate."""
    silu = m.Call(func=m.Attribute(attr=m.Name("silu")) | m.Name("silu"))
    branch = m.If(
        test=_self_attr(),
        body=m.MatchIfTrue(lambda b: bool(m.findall(b, m.Call(func=_self_attr("norm"))))),
        orelse=m.Else(body=m.MatchIfTrue(lambda b: bool(m.findall(b, silu)))),
    )
    for node in m.findall(method, branch):
        test = cst.ensure_type(cst.ensure_type(node, cst.If).test, cst.Attribute)
        return test.attr.value
    return None


def mamba2_facts(cls: cst.ClassDef) -> Mamba2Facts:
    """What the rewrite needs; ``problems`` lists what blocks it."""
    facts = Mamba2Facts(name=cls.name.value, converted=class_assigns(cls, CACHE_ENTRIES_ASSIGN))
    if facts.converted:
        return facts
    init, forward = _method(cls, "__init__"), _method(cls, "forward")
    if init is None or forward is None:
        facts.problems.append(f"{facts.name} has no __init__ or no forward to rewrite")
        return facts
    params = [p.name.value for p in forward.params.params]
    if len(params) < 2:
        facts.problems.append(f"{facts.name}.forward takes no hidden states")
        return facts
    facts.hidden = params[1]
    slow = _method(cls, "torch_forward") or forward
    min_clamps = len(m.findall(slow, CLAMP_TIME_STEP_MIN))
    if min_clamps:
        facts.dt_bounds = MIN_BOUNDS
    facts.clamp_decode = max(min_clamps, len(m.findall(slow, CLAMP_TIME_STEP))) >= 2
    facts.in_multiplier, facts.projection_multiplier = _projection_multipliers(slow)
    facts.norm_flag = _norm_flag(slow)
    if m.findall(slow, MIS_SUMMED_RECURRENCE):
        facts.problems.append(
            f"{facts.name}.{slow.name.value} sums the chunked scan's inter-chunk recurrence over "
            "the target chunk (decay * states .sum(dim=2), a bug of this transformers release), "
            "so its prompts longer than chunk_size disagree with the Mamba-2 scan the paged "
            "forward (and the model's CUDA kernels) compute: nothing converted from it could "
            "verify; convert it under a transformers whose scan sums over the source chunk (5.x)"
        )
    applied = {facts.in_multiplier, facts.projection_multiplier, facts.norm_flag} - {None}
    used = USED_ATTRS
    if facts.dt_bounds == MIN_BOUNDS:
        applied.add("time_step_min")
        used = tuple(a for a in USED_ATTRS if a != "time_step_limit") + ("time_step_min",)
    missing = [a for a in used if a not in _self_attrs_set(init)]
    if missing:
        facts.problems.append(
            f"{facts.name}.__init__ sets none of {', '.join('self.' + a for a in missing)}, "
            "which the paged Mamba-2 forward reads"
        )
    body = cst.ensure_type(cls.body, cst.IndentedBlock)
    # weight initialisers (init_mamba2_weights) read init-only settings (time_step_max, ...)
    methods = [
        s
        for s in body.body
        if isinstance(s, cst.FunctionDef) and not s.name.value.lstrip("_").startswith("init")
    ]
    own = {s.name.value for s in methods}
    extra = set().union(*(_self_attrs_read(f) for f in methods)) - set(USED_ATTRS)
    extra -= NEUTRAL_ATTRS | own | applied
    if extra:
        facts.problems.append(
            f"{facts.name} reads {', '.join('self.' + a for a in sorted(extra))}, which the "
            "paged Mamba-2 forward does not apply (convert this mixer by hand: see SKILL.md, "
            "state caches)"
        )
    return facts


class Mamba2Command(StateMixerCommand):
    """Declare the conv and SSM state entries; the forward runs on the paged states."""

    DESCRIPTION = "Keep Mamba-2 mixer states in the paged runtime's Mamba group."
    KIND = "Mamba-2"
    is_kind = staticmethod(is_mamba2_class)
    gather = staticmethod(mamba2_facts)

    def convert(
        self, updated: cst.ClassDef, facts: Mamba2Facts, config: cst.PartialParserConfig
    ) -> cst.ClassDef:
        forward_body = statements(
            "framework_mamba2_forward.py.j2",
            config,
            hidden=facts.hidden,
            clamp_decode=facts.clamp_decode,
            dt_min=facts.dt_bounds[0],
            dt_max=facts.dt_bounds[1],
            in_multiplier=facts.in_multiplier,
            projection_multiplier=facts.projection_multiplier,
            norm_flag=facts.norm_flag,
        )

        def paged(forward: cst.FunctionDef) -> cst.FunctionDef:
            block = cst.ensure_type(forward.body, cst.IndentedBlock)
            return forward.with_changes(body=block.with_changes(body=forward_body))

        # the SSM state in the dtype the Plan reports for it (mamba_ssm_cache_dtype)
        entries = with_pinned_dtypes(ENTRIES, getattr(self.spec, "pinned_state_dtypes", {}))
        return declare_states(updated, self.KIND, entries, config, paged)


__all__ = ["Mamba2Command", "Mamba2Facts", "is_mamba2_class", "mamba2_facts"]
