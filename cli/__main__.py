"""``python -m draftsmith.cli ...``: the ``draftsmith`` command, where its script is not on PATH."""

from draftsmith.cli.commands import main

main()
