"""Training engines. Each builds from a `TrainEngineConfig` and a checkpoint and offers the same
small interface: `forward_logprobs`, `train_step`, `named_weights`, `save`/`load`,
`offload`/`onload`, and `version`. `native/` is the PyTorch engine (FSDP2)."""
