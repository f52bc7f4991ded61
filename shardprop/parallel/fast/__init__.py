"""The eager fast paths (``FastPath`` subclasses and the coalesced gradient sync) and the optimizer foreach default."""
