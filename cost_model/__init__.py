"""What things cost: FLOPs, bytes, time, memory, schedules. Numbers in, numbers out.

Imports torch (and numpy) only; the error hierarchy lives here so every layer can raise it.
"""

from __future__ import annotations
