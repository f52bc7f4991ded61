"""Tools for people: cache statistics, ``explain()``/``explicit()``, and the rule checker.

They observe the dispatcher through the hooks it calls; the engine never imports them.
"""
