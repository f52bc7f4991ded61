"""Griffe extension for the API reference: docstrings as the project writes them, read as the site shows them.

* A docstring's ``Example:`` section is an examples section. The project's docstrings head their doctests
  ``Example:`` (Google style allows it); griffe's Google parser reads only ``Examples:`` as examples (doctest
  lines become highlighted code) and would show ``Example:`` as a note whose ``>>>`` lines render as block quotes.
* ``# doctest: +SKIP`` flags are for ``tests/test_docs.py``, not for readers: dropped everywhere (griffe trims them
  only inside examples sections), and a reST literal-block marker (``text::``) reads as ``text:``.

The docstrings themselves stay as they are.
"""
import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_FLAGS = re.compile(r"[ \t]*# doctest:[^\n]*")
_LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            text = _HEADING.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _LITERAL.sub(r"\1:", _FLAGS.sub("", text))
