"""Griffe extension for the API reference: a docstring's ``Example:`` section is an examples section.

The project's docstrings head their doctests ``Example:`` (Google style allows it); griffe's Google parser reads
only ``Examples:`` as examples (its doctest lines become highlighted code, ``# doctest:`` flags trimmed) and would
show ``Example:`` as a note whose ``>>>`` lines render as block quotes. Renaming the heading here keeps the
docstrings as they are.
"""
import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
