"""draftsmith.core: what every other folder builds on, importing nothing of draftsmith itself.

Target loading and identity (``target``), draft trees and their masks (``tree``), KV-cache helpers
(``cache``), lossless verification (``verify``), the runtime drafter interface (``drafting``), atomic
writes (``io``) and the one error base class (``errors``). The layers above it: ``data`` imports
only ``core``; ``drafters`` imports ``core``; ``inference`` imports ``core``, ``data`` and ``drafters``;
``train`` imports all of them. ``tests/test_layers.py`` checks it.
"""
