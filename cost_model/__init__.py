"""What things cost: FLOPs, bytes, time and memory. Pure numbers in, numbers out; imports torch only."""

from __future__ import annotations
