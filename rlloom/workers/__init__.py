"""Workers, one role per class: `TrainWorker` (one training rank) and `RolloutWorker` (one rank of a
rollout replica, whose generation across weight updates is `stream.py`'s `EngineStream`, with the
records of `flights.py`). The groups in `rlloom.cluster` place and call them."""
