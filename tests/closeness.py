"""A comparator that collects mismatches on a rank instead of raising (the parent asserts on the list).

Example::

    close = Closeness(atol=1e-4, rtol=1e-4)
    close("loss", got, want)
    return close.errors, close.checked
"""
import torch


class Closeness:
    """``close(name, got, want)``: assert_close, counted; a failure is kept as ``name: message`` (first ``lines``)."""

    def __init__(self, atol: float, rtol: float, lines: int = 1):
        self.atol, self.rtol, self.lines = atol, rtol, lines
        self.errors, self.checked = [], 0

    def __call__(self, name, got, want) -> None:
        self.checked += 1
        try:
            torch.testing.assert_close(got.detach(), want.detach(), atol=self.atol, rtol=self.rtol)
        except AssertionError as e:
            self.errors.append(f"{name}: {' '.join(str(e).splitlines()[:self.lines])}")
