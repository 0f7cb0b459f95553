"""Every rewrite of the implementer, in the order it runs, with a stable code.

A conversion follows one path (the attention kind and where its cache lives); the pipeline
runs, in registry order, every rewrite that serves that path. Codes never change meaning or
get reused: SKILL.md, notes and error reports cite them. Adding a layer kind means one
codemod class and one line here.

Order matters only at the ends: imports are made absolute first, so every later rewrite sees
final module names; the runtime imports come last, once the rewrites that use them have run
(``AddImportsVisitor`` deduplicates, so running it again changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvskill.implementer._command import FrameworkCommand
from kvskill.implementer.attn_forward import AttentionForwardCommand
from kvskill.implementer.attn_init import AttentionInitCommand
from kvskill.implementer.compressed_attention import (
    CompressedAttentionForwardCommand,
    CompressedAttentionInitCommand,
)
from kvskill.implementer.contiguous import (
    ContiguousAttentionForwardCommand,
    ContiguousAttentionInitCommand,
)
from kvskill.implementer.framework_legacy_codemods import (
    FrameworkLegacyAttentionCommand,
    FrameworkLegacyModelCommand,
)
from kvskill.implementer.framework_legacy_state_codemods import FrameworkLegacyStatesCommand
from kvskill.implementer.gated_delta import GatedDeltaCommand
from kvskill.implementer.imports import AbsoluteImportsCommand, RuntimeImportsCommand
from kvskill.implementer.legacy_codemods import (
    LegacyAttentionForwardCommand,
    LegacyAttentionInitCommand,
)
from kvskill.implementer.mamba2 import Mamba2Command
from kvskill.implementer.mamba_mixer import Mamba1MixerCommand
from kvskill.implementer.masks import SkipDenseMasksCommand
from kvskill.implementer.mla.codemods import (
    MlaAttentionForwardCommand,
    MlaAttentionInitCommand,
    MlaCacheInfoCommand,
)
from kvskill.implementer.mla.indexer import IndexerCommand
from kvskill.implementer.mla.pooled_indexer import PooledIndexerCommand
from kvskill.implementer.model_class import CacheInfoCommand
from kvskill.implementer.short_conv import ShortConvCommand
from kvskill.implementer.standalone_legacy_codemods import (
    StandaloneLegacyAttentionCommand,
    StandaloneLegacyModelCommand,
)
from kvskill.implementer.standalone_legacy_mla_codemods import StandaloneLegacyMlaAttentionCommand
from kvskill.implementer.state_mixers import StateLayersCheck
from kvskill.implementer.text_model import LocalTextModelCommand


class ConversionPath(str, Enum):
    """Which attention rewrite a conversion takes (the other rewrites are shared)."""

    #: MHA / GQA / MQA attention on the paged TND seam (framework mode; standalone mode 2)
    PAGED = "paged"
    #: absorbed MLA over the latent caches, paged (framework mode; standalone mode 3)
    MLA = "mla"
    #: per-row contiguous BSH caches owned by the runner (standalone mode 1)
    CONTIGUOUS = "contiguous"
    #: Legacy: static rows per request, the model's own attention math (framework mode)
    LEGACY = "legacy"
    #: the framework's own Legacy model (cache_unit rows, BSH fused attention) converted in
    #: place to the executor's Paged contract; its imports stay the executor's
    FRAMEWORK_LEGACY = "framework_legacy"
    #: compressed attention (DeepSeek-V4): a K = V window, compressor entries and state rows,
    #: the framework's custom operators (framework mode)
    COMPRESSED = "compressed"
    #: the framework's standalone Legacy model (mode 1: rows from its own init_cache, BSH
    #: fused attention, its own runner) converted in place to standalone mode 2 (its MLA
    #: form, latent and rope caches, to mode 3); its imports stay the executor's
    STANDALONE_LEGACY = "standalone_legacy"


ALL_PATHS = frozenset(ConversionPath)


@dataclass(frozen=True)
class Rewrite:
    """One registered rewrite: its code, its codemod and the paths it serves."""

    code: str
    command: type[FrameworkCommand]
    paths: frozenset[ConversionPath]

    @property
    def summary(self) -> str:
        """The codemod's one-line description."""
        return self.command.DESCRIPTION


def _paths(*paths: ConversionPath) -> frozenset[ConversionPath]:
    return frozenset(paths)


PAGED, MLA, CONTIGUOUS = ConversionPath.PAGED, ConversionPath.MLA, ConversionPath.CONTIGUOUS
COMPRESSED = ConversionPath.COMPRESSED
LEGACY = ConversionPath.LEGACY
FRAMEWORK_LEGACY = ConversionPath.FRAMEWORK_LEGACY
STANDALONE_LEGACY = ConversionPath.STANDALONE_LEGACY
#: the paths whose output imports kvskill's runtime (a framework file keeps the executor's)
RUNTIME_PATHS = ALL_PATHS - {FRAMEWORK_LEGACY, STANDALONE_LEGACY}

REWRITES: tuple[Rewrite, ...] = (
    Rewrite("KVR001", AbsoluteImportsCommand, ALL_PATHS),
    Rewrite("KVR002", AttentionInitCommand, _paths(PAGED)),
    Rewrite("KVR003", AttentionForwardCommand, _paths(PAGED)),
    Rewrite("KVR004", MlaAttentionInitCommand, _paths(MLA)),
    Rewrite("KVR005", MlaAttentionForwardCommand, _paths(MLA)),
    Rewrite("KVR006", ContiguousAttentionInitCommand, _paths(CONTIGUOUS)),
    Rewrite("KVR007", ContiguousAttentionForwardCommand, _paths(CONTIGUOUS)),
    Rewrite("KVR008", GatedDeltaCommand, _paths(PAGED, MLA)),
    Rewrite("KVR009", CacheInfoCommand, _paths(PAGED, CONTIGUOUS, LEGACY, COMPRESSED)),
    Rewrite("KVR010", MlaCacheInfoCommand, _paths(MLA)),
    Rewrite("KVR011", SkipDenseMasksCommand, RUNTIME_PATHS),
    Rewrite("KVR012", LocalTextModelCommand, ALL_PATHS),
    Rewrite("KVR014", StateLayersCheck, _paths(PAGED, MLA)),
    Rewrite("KVR015", Mamba2Command, _paths(PAGED, MLA)),
    Rewrite("KVR016", Mamba1MixerCommand, _paths(PAGED, MLA)),
    Rewrite("KVR017", ShortConvCommand, _paths(PAGED, MLA)),
    Rewrite("KVR018", LegacyAttentionInitCommand, _paths(LEGACY)),
    Rewrite("KVR019", LegacyAttentionForwardCommand, _paths(LEGACY)),
    Rewrite("KVR020", FrameworkLegacyAttentionCommand, _paths(FRAMEWORK_LEGACY)),
    # NOTE: KVR022 reads the states' row shapes from init_cache, which KVR021 removes
    Rewrite("KVR022", FrameworkLegacyStatesCommand, _paths(FRAMEWORK_LEGACY)),
    Rewrite("KVR021", FrameworkLegacyModelCommand, _paths(FRAMEWORK_LEGACY)),
    # NOTE: KVR022 / KVR023 are kept for the framework's gated-delta Legacy states
    Rewrite("KVR024", StandaloneLegacyAttentionCommand, _paths(STANDALONE_LEGACY)),
    Rewrite("KVR025", StandaloneLegacyModelCommand, _paths(STANDALONE_LEGACY)),
    Rewrite("KVR026", StandaloneLegacyMlaAttentionCommand, _paths(STANDALONE_LEGACY)),
    Rewrite("KVR027", IndexerCommand, _paths(MLA)),
    Rewrite("KVR028", CompressedAttentionInitCommand, _paths(COMPRESSED)),
    Rewrite("KVR029", CompressedAttentionForwardCommand, _paths(COMPRESSED)),
    Rewrite("KVR030", PooledIndexerCommand, _paths(MLA)),
    # NOTE: the runtime imports stay last whatever the code: later layer kinds go before it
    Rewrite("KVR013", RuntimeImportsCommand, RUNTIME_PATHS),
)


def rewrites_for(path: ConversionPath) -> tuple[Rewrite, ...]:
    """The rewrites a conversion on PATH runs, in order."""
    return tuple(rewrite for rewrite in REWRITES if path in rewrite.paths)


def rewrite_by_code(code: str) -> Rewrite:
    """The rewrite registered as CODE (``KeyError`` for an unknown code)."""
    for rewrite in REWRITES:
        if rewrite.code == code:
            return rewrite
    raise KeyError(code)
