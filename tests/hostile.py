"""Payloads for the tests of untrusted input (issue 28)."""

from __future__ import annotations

from pathlib import Path


class RunsCode:
    """Unpickling this calls `marker.touch()`: what a hostile pickle (`optimizer.pt`, `pytorch_model.bin`) could
    do to a loader that runs pickled code. A test saves one with `torch.save` and checks the marker stays absent."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))
