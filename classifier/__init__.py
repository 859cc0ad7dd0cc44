"""The 8-layer CNN pattern classifier: training, checkpoints, batch classification of every head."""

# The class vocabulary lives in analysis.patterns; re-exported here for code that still imports it from classifier.
from analysis.patterns import CLASSES  # noqa: F401
