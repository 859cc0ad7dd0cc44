"""The 8-layer CNN pattern classifier: training, checkpoints, batch classification of every head.

The class vocabulary it predicts lives at the ground floor, in analysis.patterns.
"""

# Synthetic maps per class that `attnpat train` adds to every training part of a labeled set (--synthetic-mix); here,
# not in classifier.train, so the CLI can name it without loading torch.
SYNTHETIC_MIX = 40
# Unlabeled maps a teacher labels for `attnpat train` (--pool) unless told otherwise; here for the same reason.
DEFAULT_POOL = 2000
