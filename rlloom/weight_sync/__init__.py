"""Weight sync from the training layout to the rollout layout, one file per transport."""
