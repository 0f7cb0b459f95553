"""The original model verify compares against: built from the recorded source, driven by
``generate`` or its own tuple cache, and the failures of its own code reported as such."""
