"""shardprop.ops: sharding rules, one module per op family.

Importing this package registers every built-in rule.
"""
import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
