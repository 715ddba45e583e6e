"""The command shell: ``draftsmith``'s command table (:mod:`main`), the quickstart, the data-scaling curves,
the Medusa calibration command, and the GPU pipeline script. It sits on top of every other layer; each
layer's own commands (``data``, ``train``, ``inference``) define their arguments beside their code."""

from draftsmith.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
