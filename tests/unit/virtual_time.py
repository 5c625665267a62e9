"""The virtual-time epoch shared by the actor tests and their store fixture."""

# ``ironflow_now()`` of the inline store at virtual time 0 (MockClock starts at 0).
BASE = 1_800_000_000.0
