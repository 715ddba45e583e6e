"""The one base class of every error that is a user's mistake (a bad file, option, model or checkpoint).

The ``draftsmith`` command prints such an error as one line and exits with status 2; anything else is
a bug and keeps its traceback. Each module's error also keeps the built-in class it always had
(``ValueError``, ``RuntimeError``), so callers that caught those still do.
"""

from __future__ import annotations


class DraftsmithError(Exception):
    """A problem the user can fix; the message names the problem and the fix in one line."""
