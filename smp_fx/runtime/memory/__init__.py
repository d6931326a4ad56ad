"""What a stage keeps for backward: saved-tensor hooks and offload, activation
checkpointing and the recompute the split backward shares."""
