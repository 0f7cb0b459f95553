"""Analyzer: read a model config and modeling code, decide its KV-cache design (the Plan)."""

from kvskill.analyzer.analyze import analyze_model
from kvskill.analyzer.plan import CacheEntryPlan, Evidence, LayerPlan, Plan

__all__ = ["CacheEntryPlan", "Evidence", "LayerPlan", "Plan", "analyze_model"]
