"""The 8-layer CNN pattern classifier: training, checkpoints, batch classification of every head.

The class vocabulary it predicts lives at the ground floor, in analysis.patterns.
"""
