"""Load BERT-family encoders and task data, stream attention maps, compute statistics and sweeps."""
