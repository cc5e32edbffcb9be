"""Deliberately broken variants of real runtime pieces, each mapped to the gate that must catch
it. `python -m negative_controls.run` (nox -s negative_controls) first checks that every mapped
gate passes unmutated, then runs each control and fails unless every control is caught."""
