"""Verify: prove a conversion. Build the original as the reference (shrunk, or on the real
weights), run it and the converted model on the same prompts through the driver of the
output kind, compare tokens and logits, and report the verdict.

The entry is ``kvskill.verify.flow.verify_directory``. This package file imports nothing, so
the CLI can read ``verdict.DRIFT_RATIO`` for its help text without loading torch.
"""
