"""The first step's plan on this rank: the request, trace and partition, the stages placed."""
