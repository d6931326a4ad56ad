"""Moving values between stages: the interface, the in-process and torch.distributed
transports, the wire format and its buffers."""
