"""Attention that a remote file takes from transformers instead of writing it.

Some vendor files import an attention or decoder-layer class from transformers and subclass it
(``class FooAttention(LlamaAttention)`` overriding ``__init__``, or nothing) or use it as it is
(``nn.ModuleList([LlamaDecoderLayer(config, i) ...])``). The cache write and the attention
kernel then run in transformers' own modeling file, which ``apply`` does not rewrite for a
model directory: the rewrite converts the code of the file it is given. When the file has no
attention class of its own, the refusal names those classes and where they come from, so the
user knows what to bring into the file (the inherited ``forward`` and ``__init__``).

When every such class comes from one modeling module of transformers
(``transformers.models.llama.modeling_llama``), that module is planned and converted in the
file's stead (:func:`inherited_module`): apply writes it converted into the output directory
and points the file's import at it, so the file's own additions stay as they are.
"""

from __future__ import annotations

from kvskill.analyzer.scan import ModuleFacts

#: suffixes of the class names that carry a KV cache write (directly or in a submodule)
_ATTENTION_SUFFIXES = ("Attention", "Attention2", "DecoderLayer", "Block")


def _transformers_origin(facts: ModuleFacts, name: str) -> str | None:
    """The transformers module NAME was imported from (``from transformers.x import NAME``)."""
    for dotted in facts.imported_names:
        module, _, imported = dotted.rpartition(".")
        if imported == name and (module == "transformers" or module.startswith("transformers.")):
            return module
    return None


def _carries_attention(name: str) -> bool:
    return any(name.endswith(suffix) for suffix in _ATTENTION_SUFFIXES)


def inherited_attention(facts: ModuleFacts) -> list[str]:
    """``"FooAttention subclasses LlamaAttention from transformers.models.llama.modeling_llama"``
    and ``"FooModel builds LlamaDecoderLayer from ..."`` for every attention-carrying class the
    file takes from transformers; [] when it takes none."""
    found: list[str] = []
    for cls in facts.classes.values():
        for base in cls.bases:
            origin = _transformers_origin(facts, base)
            if origin is not None and _carries_attention(base):
                found.append(f"{cls.name} subclasses {base} from {origin}")
        for built in sorted({n for names in cls.attr_classes.values() for n in names}):
            origin = _transformers_origin(facts, built)
            if origin is not None and _carries_attention(built):
                found.append(f"{cls.name} builds {built} from {origin}")
    return found


def _attention_origins(facts: ModuleFacts, origin_of) -> set[str]:
    """ORIGIN_OF (a class name -> its module, or None) over every attention-carrying class the
    file subclasses or builds."""
    return {
        origin
        for cls in facts.classes.values()
        for name in (*cls.bases, *(n for names in cls.attr_classes.values() for n in names))
        if _carries_attention(name)
        for origin in [origin_of(facts, name)]
        if origin is not None
    }


def _sibling_origin(facts: ModuleFacts, name: str) -> str | None:
    """The module beside the file NAME was imported from (``from .modeling_llama import
    NAME``), else None."""
    for dotted in facts.imported_names:
        module, _, imported = dotted.rpartition(".")
        if imported == name and module.startswith(".") and not module.startswith(".."):
            return module
    return None


def sibling_module(facts: ModuleFacts) -> str | None:
    """The one module beside the file (``.modeling_llama``) every attention-carrying class it
    subclasses or builds comes from, when it takes none from transformers, else None.

    That is the shape apply writes for an inherited attention (:func:`inherited_module`): the
    converted transformers module beside the file, imported relatively; re-applying to such
    an output plans it from that module."""
    if _attention_origins(facts, _transformers_origin):
        return None
    origins = _attention_origins(facts, _sibling_origin)
    if len(origins) != 1:
        return None
    (module,) = origins
    return module if "." not in module[1:] and module[1:].startswith("modeling_") else None


def inherited_module(facts: ModuleFacts) -> str | None:
    """The one transformers modeling module (``transformers.models.<x>.modeling_<x>``) every
    attention-carrying class the file subclasses or builds comes from, else None (none, or
    several modules: one converted module per output directory)."""
    origins = _attention_origins(facts, _transformers_origin)
    if len(origins) != 1:
        return None
    (module,) = origins
    parts = module.split(".")
    if len(parts) != 4 or parts[:2] != ["transformers", "models"]:
        return None
    if not parts[3].startswith("modeling_"):
        return None
    return module


def inherited_attention_reason(facts: ModuleFacts) -> str | None:
    """The one-line refusal for a file whose attention comes from transformers, else None."""
    found = inherited_attention(facts)
    if not found:
        return None
    return (
        f"{facts.file_name}: no attention class of the file writes a KV cache: "
        + "; ".join(found)
        + ": their cache write and attention run in transformers' own modeling file, which "
        "apply does not rewrite for a model directory; copy the inherited forward (and the "
        "__init__ it reads) into the file's class so the rewrite can convert it"
    )


__all__ = [
    "inherited_attention",
    "inherited_attention_reason",
    "inherited_module",
    "sibling_module",
]
