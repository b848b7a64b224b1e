"""Weight sync from the training layout to the rollout layout, one file per transport.

- `inplace.py`: training and rollout engines in the same process (colocated placement).
- `broadcast.py`: separate GPU pools, over the sync group of `group.py` (process groups outside
  both worlds joining the training ranks that send and the rollout ranks that receive; NCCL on
  GPU, gloo on CPU), the sending side (`outbox.py` its plan and bucket packing); `receive.py` the
  rollout side; `wire.py` their messages.
- `reshard.py`: the pure plan saying which training rank sends which slice of each tensor to which
  rollout tensor-parallel rank, in buckets.
- `checksum.py`: the per-sync verification (every rollout tensor exactly once, right shape and
  version; content checksums sender vs receiver).
- `base.py`: the records and protocols every transport shares (`SyncReport`, `WeightSyncError`).
- `build.py`: which transport a run uses (`sync.transport`; `auto` by the placement).
"""
