"""Workers, one role per class: `TrainWorker` (one training rank) and `RolloutWorker` (one rank of a
rollout replica). The groups in `rlloom.cluster` place and call them."""
