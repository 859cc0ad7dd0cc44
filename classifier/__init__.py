"""The 8-layer CNN pattern classifier: training, checkpoints, batch classification of every head."""

# The five pattern classes of Kovaleva et al. 2019, in this fixed order everywhere (labels, logits, tables).
CLASSES = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
