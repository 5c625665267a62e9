"""The deterministic simulator of a whole node.

``simulator.run_seed(seed)`` runs one seeded fault schedule and checks its
invariants; ``scripts/simulate.py`` is the command line; the tests are in
``test_simulator.py``.
"""
