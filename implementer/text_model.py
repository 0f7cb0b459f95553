"""Text model: a vision-language model builds the converted text decoder of its own file.

Some vision-language models define their text decoder in their own modeling file but build it
through the auto classes (qwen3_vl: ``self.language_model = AutoModel.from_config(
config.text_config)``). AutoModel resolves the text config's type to the *installed*
transformers class, so the converted attention of this file would never run. The call becomes
``<TextModel>._from_config(config.text_config)``, the classmethod AutoModel itself calls on the
class it picks, with the text model of this file.

The text model is found by structure: the class whose ``__init__`` builds a class whose
``__init__`` builds an attention class (the decoder layer).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import FrameworkCommand
from kvskill.implementer.facts import is_attention_class

#: ``AutoModel.from_config(<anything>.text_config, ...)``
AUTO_TEXT_MODEL = m.Call(
    func=m.Attribute(value=m.Name("AutoModel"), attr=m.Name("from_config")),
    args=[m.Arg(value=m.Attribute(attr=m.Name("text_config"))), m.ZeroOrMore()],
)


def _built_classes(cls: cst.ClassDef) -> set[str]:
    """Names called in ``cls.__init__`` (the classes it instantiates, and other calls)."""
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
            calls = m.findall(stmt, m.Call(func=m.Name()))
            return {
                cst.ensure_type(cst.ensure_type(c, cst.Call).func, cst.Name).value for c in calls
            }
    return set()


def text_model_classes(module: cst.Module) -> list[str]:
    """Classes that build a decoder layer (a class that builds an attention class)."""
    classes = [c for c in module.body if isinstance(c, cst.ClassDef)]
    attention = {c.name.value for c in classes if is_attention_class(c)}
    layers = {c.name.value for c in classes if _built_classes(c) & attention}
    return [c.name.value for c in classes if _built_classes(c) & layers]


def text_model_problems(module: cst.Module) -> list[str]:
    """Why an ``AutoModel.from_config(config.text_config)`` cannot be pointed at this file's
    text model (none, or more than one candidate); empty when there is no such call."""
    if not m.findall(module, AUTO_TEXT_MODEL):
        return []
    found = text_model_classes(module)
    if len(found) == 1:
        return []
    return [
        "the language model is built with AutoModel.from_config(config.text_config), which "
        "would load the installed transformers' class instead of the converted one, and the "
        f"file's own text model is not unique (found: {found or 'none'})"
    ]


class LocalTextModelCommand(FrameworkCommand):
    """Build the language model from this file's (converted) text model class."""

    DESCRIPTION = "Build the text decoder from the converted file, not through AutoModel."

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return text_model_problems(module)

    def visit_Module(self, node: cst.Module) -> bool:
        found = text_model_classes(node) if m.findall(node, AUTO_TEXT_MODEL) else []
        self.text_model = found[0] if len(found) == 1 else None
        return self.text_model is not None

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if self.text_model is None or not m.matches(original_node, AUTO_TEXT_MODEL):
            return updated_node
        func = cst.Attribute(value=cst.Name(self.text_model), attr=cst.Name("_from_config"))
        return updated_node.with_changes(func=func)
