"""Training the `mini` preset: batched differentiable model (model.py, layers.py), token shards
(data.py), the training script (train.py) and the checkpoint export (export.py)."""
