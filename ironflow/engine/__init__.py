"""What only the engine node loads and every part of it shares (the store,
the actors and the API): today its Prometheus metrics (``metrics.py``).

Imports nothing of ours above ``protocol`` and ``config``: the store times
its calls with these metrics, so a module here that imported the store would
close a circle.
"""
