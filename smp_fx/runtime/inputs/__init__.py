"""A step's inputs: microbatches, the first pipeline rank's data checked, varying shapes."""
