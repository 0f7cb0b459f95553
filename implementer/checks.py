"""Checks before any rewrite: every class the conversion would touch has a shape it handles.

Facts are gathered and checked for every class before any codemod runs, so a model the
rewrite cannot handle fails with every reason at once and never yields a half-converted file.
"""

from __future__ import annotations

import libcst as cst
from kvskill.analyzer.gather import CACHE_WRITE, SOFTMAX_CALL, method
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.facts import (
    attention_facts,
    causal_lm_classes,
    is_attention_class,
    is_converted_attention,
    m,
    module_classes,
    partial_conversion,
)
from kvskill.implementer.framework_legacy_state_facts import gather_legacy_states
from kvskill.implementer.mla.facts import mla_attention_facts
from kvskill.implementer.mla.spec import CacheWrite, MlaSpec
from kvskill.implementer.spec import ConversionSpec


def check_attention_module(
    module: cst.Module,
    spec: ConversionSpec,
    filename: str,
    problems: list[str],
    *,
    serves_call_sites: bool = False,
) -> None:
    """Check every attention class and the model class; PROBLEMS are the other rewrites' own.
    SERVES_CALL_SITES: the path keeps one cache pair per call site of a shared block.

    Raises:
        UnsupportedModelError: with every reason found, before anything is rewritten.
    """
    classes = [c for c in m.findall(module, m.ClassDef()) if isinstance(c, cst.ClassDef)]
    attention = [c for c in classes if is_attention_class(c)]
    heads = causal_lm_classes(module, spec.causal_lm_class)
    problems = list(problems)
    # a model of state layers only (mamba2) is served by state groups alone
    if not attention and spec.has_attention_layers:
        # NOTE: a class that writes a cache is named with what stops it (its attention is
        # in a form the seam does not read); "no attention class" only when there is none
        writers = _writers_without_kernel(classes)
        problems.extend(
            writers
            or [
                "no attention class found (a module whose forward writes its KV cache, "
                "`<cache>.update(key, value, self.layer_idx, ...)` or a tuple grown with "
                "torch.cat, and then calls an attention interface or "
                "scaled_dot_product_attention)"
            ]
        )
    if not heads:
        problems.append(
            "no causal-LM class found (a class whose __init__ assigns self.lm_head or a Linear "
            "to the vocabulary, or the class auto_map's AutoModelForCausalLM names)"
        )
    in_file = module_classes(module)
    for cls in attention:
        partial = partial_conversion(cls)
        if partial is not None:
            problems.append(partial)
            continue
        facts = attention_facts(cls, in_file)
        problems.extend(facts.problems)
        if not spec.keeps_model_kernel:
            problems.extend(facts.seam_limits())
        if facts.seam is not None and facts.seam.site is not None and not serves_call_sites:
            problems.append(
                f"{facts.name}.forward indexes its cache by the calling layer "
                f"(`{facts.seam.site}`, a block several layers share); one cache per call site "
                "is converted on the paged framework path only"
            )
        if facts.converted:
            continue
        if spec.layer_type_to_attn_type and facts.layer_idx_param is None:
            problems.append(
                f"{facts.name}.__init__ takes no layer index, but the model mixes attention "
                "types per layer"
            )
        if spec.has_sinks and facts.seam is not None and facts.seam.sinks is None:
            problems.append(
                f"{facts.name}.forward passes no sinks (s_aux=/sinks=) to the attention "
                "kernel, but the Plan says the model has learnable sinks"
            )
    if problems:
        raise UnsupportedModelError(f"{filename}: cannot convert: " + "; ".join(problems))


def check_framework_legacy_module(
    module: cst.Module, spec: ConversionSpec, filename: str, problems: list[str]
) -> None:
    """The framework-Legacy path: PROBLEMS (the rewrites' own: every Legacy attention read,
    init_cache allocating only k/v rows) plus what the Paged contract needs of the model
    class (built from infer_config) and of the Plan (full attention only).

    Raises:
        UnsupportedModelError: with every reason found, before anything is rewritten.
    """
    problems = list(problems)
    heads = [
        c
        for c in m.findall(module, m.ClassDef())
        if isinstance(c, cst.ClassDef)
        and c.name.value in causal_lm_classes(module, spec.causal_lm_class)
    ]
    if not heads:
        problems.append("no causal-LM class found (a class whose __init__ assigns self.lm_head)")
    for head in heads:
        init = method(head, "__init__")
        params = [p.name.value for p in init.params.params] if init is not None else []
        if "infer_config" not in params:
            problems.append(
                f"{head.name.value}.__init__ takes no infer_config: not the executor's "
                "model-class contract, whose scheduler config gives the block size"
            )
    converted = {"FullAttention"}
    if gather_legacy_states(module).layers:
        converted.add("Mamba")  # the init_cache states KVR022 declares
    others = sorted(set(spec.attn_types) - converted)
    if others:
        problems.append(
            f"the Plan has {', '.join(others)} layers; the framework-Legacy rewrite converts "
            "full-attention layers and the per-request states init_cache allocates only"
        )
    if problems:
        raise UnsupportedModelError(f"{filename}: cannot convert: " + "; ".join(problems))


def _writers_without_kernel(classes: list[cst.ClassDef]) -> list[str]:
    """Classes that grow or update a KV cache but run attention elsewhere (ChatGLM3's
    ``self.core_attention(...)``, a method other than hand-written matmul attention, which
    ``facts._method_kernel`` follows): the seam from the cache write to the kernel would span
    two modules, which the rewrite does not do; or that compute attention by hand in a form
    the seam does not read (ChatGLM-6B's ``torch.baddbmm`` into an empty buffer)."""
    found = []
    for cls in classes:
        forward = method(cls, "forward")
        if forward is None or not m.findall(forward, CACHE_WRITE):
            continue
        by_hand = _unread_attention(forward)
        if by_hand:
            found.append(
                f"{cls.name.value}.forward writes the KV cache, then computes attention by "
                f"hand with {' and '.join(by_hand)} and a softmax, which the seam does not "
                "read: it reads hand-written attention as scores assigned in one statement "
                "from matmul(q, k.transpose(...)) or torch.einsum(q, k), a softmax, and an "
                "output assigned from matmul(w, v), torch.einsum or torch.bmm"
            )
            continue
        found.append(
            f"{cls.name.value}.forward writes the KV cache but calls no attention kernel "
            "itself (attention run in another method or module is not rewritten)"
            + _kernel_elsewhere(cls, forward)
        )
    return found


#: products hand-written attention may take its scores or output with
_PRODUCT_CALLS = {
    name: m.Call(func=m.Name(name) | m.Attribute(attr=m.Name(name)))
    for name in ("einsum", "bmm", "baddbmm")
}


def _unread_attention(forward: cst.FunctionDef) -> list[str]:
    """The products (``torch.einsum``, ``torch.bmm``, ...) of attention a forward computes by
    hand after its cache write in a form the seam does not read, as the file spells them;
    [] when it has no softmax after the write."""
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body
    start = next(i for i, stmt in enumerate(body) if m.findall(stmt, CACHE_WRITE))
    after = list(body[start + 1 :])
    if not any(m.findall(stmt, SOFTMAX_CALL) for stmt in after):
        return []
    spelled = []
    for matcher in _PRODUCT_CALLS.values():
        calls = [c for stmt in after for c in m.findall(stmt, matcher)]
        if calls:
            func = cst.ensure_type(calls[0], cst.Call).func
            spelled.append(_EMPTY.code_for_node(func))
    return spelled


def _kernel_elsewhere(cls: cst.ClassDef, forward: cst.FunctionDef) -> str:
    """``: it hands ... to self.core_attention (CoreAttention) ...`` naming the module or
    method the grown cache goes to, when one ``self.<x>(...)`` call after the write reads it."""
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body
    start = next(i for i, stmt in enumerate(body) if m.findall(stmt, CACHE_WRITE))
    built = {}
    init = method(cls, "__init__")
    for node in m.findall(init, m.Assign()) if init is not None else []:
        assign = cst.ensure_type(node, cst.Assign)
        target = assign.targets[0].target
        if m.matches(target, m.Attribute(value=m.Name("self"))) and isinstance(
            assign.value, cst.Call
        ):
            attr = cst.ensure_type(target, cst.Attribute).attr.value
            built[attr] = _EMPTY.code_for_node(assign.value.func)
    callees = []
    for stmt in body[start + 1 :]:
        for node in m.findall(stmt, m.Call(func=m.Attribute(value=m.Name("self")))):
            call = cst.ensure_type(node, cst.Call)
            attr = cst.ensure_type(call.func, cst.Attribute).attr.value
            if len(call.args) >= 3 and attr not in callees:
                callees.append(attr)
    if len(callees) != 1:
        return ""
    kind = (
        f"self.{callees[0]} ({built[callees[0]]})"
        if callees[0] in built
        else (f"self.{callees[0]}")
    )
    return (
        f": it hands query, key and value to {kind}, which runs the kernel; the seam (the "
        "cache write through the kernel) must lie in one forward, here it would span the "
        "call, with the kernel's output layout set by that module"
    )


_EMPTY = cst.Module(body=[])


def check_mla_module(
    module: cst.Module, spec: MlaSpec, filename: str, problems: list[str]
) -> list[str]:
    """Names of the MLA attention classes to convert; PROBLEMS are the other rewrites' own.

    Raises:
        UnsupportedModelError: with every reason found, before anything is rewritten.
    """
    classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}
    attention = [c for c in classes.values() if is_attention_class(c)]
    problems = list(problems)
    # a model of state layers only (mamba2) is served by state groups alone
    if not attention and spec.has_attention_layers:
        problems.append(
            "no attention class found (a module whose forward writes the latent with "
            "`<cache>.update(latent, rope_key, self.layer_idx, ...)` and then calls attention)"
        )
    if not causal_lm_classes(module):
        problems.append("no causal-LM class found (a class whose __init__ assigns self.lm_head)")
    for cls in attention:
        partial = partial_conversion(cls)
        if partial is not None:
            problems.append(partial)
            continue
        if is_converted_attention(cls):
            continue
        fused = spec.cache_write is CacheWrite.FUSED
        indexed = spec.indexer is not None
        shared = spec.indexer is not None and spec.indexer.shared_layers
        facts = mla_attention_facts(
            cls,
            classes,
            fused,
            indexed,
            shared_layers=shared,
            own_latent_only=spec.own_latent_only,
        )
        problems.extend(facts.problems)
    if problems:
        raise UnsupportedModelError(f"{filename}: cannot convert: " + "; ".join(problems))
    return [c.name.value for c in attention]
